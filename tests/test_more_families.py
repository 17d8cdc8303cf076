"""Third-party families that no example names, built from tiny configs and wrapped unchanged
(tests/models/families/): HF OPT, Qwen2, GPT-Neo, RoBERTa (masked-LM loss with ignore_index),
T5 (decoder inputs shifted from the labels), timm ConvNeXt, MLP-Mixer, ResNet (GroupNorm),
DeiT. Each runs under dp (2 ranks), tensor parallelism (2 ranks: megatron_tp with the family's
names, or the family's own plan beside it where megatron_tp's shape does not fit) and 1f1b
(2 ranks, 4 micro-batches), ``--check --dtype float64 --optimizer sgd``: the oracle is the plain
model trained on one device. Slow (processes, third-party models)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ssdsl.cli import main

HERE = Path(__file__).resolve().parent / "models" / "families"
EXACT = ["--check", "--dtype", "float64", "--optimizer", "sgd", "--steps", "2", "--json"]
HF = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                        reason="transformers is not installed")
TIMM = pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed")


def _names(blocks, attn, attn_out, mlp, mlp_out):
    return ["--set", f"blocks={blocks}", "--set", f"attn={attn}", "--set", f"attn_out={attn_out}",
            "--set", f"mlp={mlp}", "--set", f"mlp_out={mlp_out}"]


# family -> (mark, tensor-parallel plan and its arguments)
FAMILIES = {
    "hf_opt": (HF, [str(HERE / "opt_tp.ssp")]),
    "hf_qwen2": (HF, ["megatron_tp", *_names("lm.model.layers.*", "self_attn", "self_attn.o_proj",
                                             "mlp", "mlp.down_proj")]),
    "hf_gptneo": (HF, ["megatron_tp", *_names("lm.transformer.h.*", "attn.attention",
                                              "attn.attention.out_proj", "mlp", "mlp.c_proj")]),
    "hf_roberta": (HF, ["megatron_tp", *_names("lm.roberta.encoder.layer.*", "attention",
                                               "attention.output.dense", "intermediate",
                                               "output.dense")]),
    "hf_t5": (HF, ["megatron_tp", *_names("lm.*.block.*", "layer.0.SelfAttention",
                                          "layer.0.SelfAttention.o", "layer.*.DenseReluDense",
                                          "layer.*.DenseReluDense.wo")]),
    "timm_deit": (TIMM, ["megatron_tp", *_names("blocks.*", "attn", "attn.proj", "mlp",
                                                "mlp.fc2")]),
    "timm_convnext": (TIMM, [str(HERE / "convnext_tp.ssp")]),
    "timm_mixer": (TIMM, [str(HERE / "mixer_tp.ssp")]),
    "timm_resnet": (TIMM, [str(HERE / "resnet_tp.ssp")]),
}
PLANS = {"dp": ["dp"], "tp": None, "1f1b": ["1f1b", "--set", "microbatches=4"]}


def _cases():
    for family, (mark, _) in FAMILIES.items():
        for plan in PLANS:
            yield pytest.param(family, plan, marks=[mark, pytest.mark.slow],
                               id=f"{family}-{plan}")


@pytest.mark.parametrize("family, plan", list(_cases()))
def test_family_matches_the_plain_model(capsys, family: str, plan: str) -> None:
    args = PLANS[plan] if PLANS[plan] is not None else FAMILIES[family][1]
    code = main(["run", str(HERE / f"{family}.py"), args[0], "--nproc", "2", *args[1:], *EXACT])
    out = json.loads(capsys.readouterr().out)
    assert out["check"]["ok"], out["check"]
    assert code == 0
    worst = {m["what"]: m["error"] for m in out["check"]["worst"]}
    assert worst["loss"] < 1e-9 and worst["param"] < 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(f, marks=v[0]) for f, v in FAMILIES.items()])
def test_tensor_parallel_is_the_megatron_minimum(capsys, family: str) -> None:
    """Two transformer layers (or four ResNet / two ConvNeXt-MLP ... blocks): one forward
    all-reduce per row-parallel linear or convolution, one backward all-reduce per
    column-parallel group, nothing else."""
    args = FAMILIES[family][1]
    code = main(["check", str(HERE / f"{family}.py"), args[0], "--world", "2", *args[1:],
                 "--json"])
    comm = json.loads(capsys.readouterr().out)["communication"]
    assert code == 0
    forward = {k: v["count"] for k, v in comm["forward"].items() if k != "chunk"}
    backward = {k: v["count"] for k, v in comm["backward"].items() if k != "chunk"}
    assert forward == {"all_reduce": ROW_PARALLEL[family]}
    assert backward == {"all_reduce": ROW_PARALLEL[family]}
    assert comm["gradients"] == {}


# row-parallel ops under each family's tensor-parallel plan: 2 per layer, T5 2 per block of
# its 2 + 2 blocks, ConvNeXt's one MLP in each of 4 stages, ResNet's one per basic block of 4,
# Mixer's two MLPs in each of 2 blocks
ROW_PARALLEL = {"hf_opt": 4, "hf_qwen2": 4, "hf_gptneo": 4, "hf_roberta": 4, "hf_t5": 8,
                "timm_deit": 4, "timm_convnext": 4, "timm_mixer": 4, "timm_resnet": 4}


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TRACED = [pytest.param(HERE / f"{f}.py", marks=v[0], id=f) for f, v in FAMILIES.items()] + [
    pytest.param(EXAMPLES / f"{e}.py", marks=m, id=e)
    for e, m in [("hf_gpt2", HF), ("hf_llama", HF), ("hf_bert", HF), ("timm_vit", TIMM),
                 ("timm_swin", TIMM)]]


@pytest.mark.slow
@pytest.mark.parametrize("path", TRACED)
def test_every_operator_is_annotated(path: Path) -> None:
    """Issue 16: every ATen operator these models trace to has an annotation (none is left
    replicate-only; GPT-Neo's in-place ``detach_`` was the last one)."""
    from ssdsl.ops import NotAnnotated, annotate
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file

    mf = load_model_file(path)
    graph = trace(mf, device="meta")
    missing = [(op.name, op.target, a.reason) for op in graph.ops
               if isinstance(a := annotate(graph, op), NotAnnotated)]
    assert not missing
