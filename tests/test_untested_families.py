"""Families that stress rules the first family tests did not (tests/models/families/): GPT-NeoX
(fused qkv, partial rotary, parallel residual), BLOOM (ALiBi tiled over the batch by
``repeat``, fused qkv whose heads merge into the batch: its own plan), ALBERT (one layer's
weights used by every layer: across pipeline stages), Mistral (sliding-window mask from
``new_ones``), Gemma (multi-query attention under tensor parallelism), GPT-J, BART
(encoder-decoder), DistilBERT, HF ViT, Mixtral (MoE routing; its plain model has no float64
kernel on the CPU, so it is checked in float32), and timm MobileNetV3 (BatchNorm: refused
where the batch would be split, exact with running statistics where it is not).

Every run is ``--check --optimizer sgd`` (float64 unless said): the oracle is the plain model
trained on one device. Slow (processes, third-party models)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from ssdsl.cli import main

ROOT = Path(__file__).resolve().parent
HERE = ROOT / "models" / "families"
HF = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                        reason="transformers is not installed")
TIMM = pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed")


def _tp(blocks, attn, attn_out, mlp, mlp_out):
    return ["megatron_tp", "--set", f"blocks={blocks}", "--set", f"attn={attn}", "--set",
            f"attn_out={attn_out}", "--set", f"mlp={mlp}", "--set", f"mlp_out={mlp_out}"]


ONE_F_ONE_B = ["1f1b", "--set", "microbatches=4"]
# (family, plan and its arguments, ranks, dtype)
CASES = [
    ("hf_gptneox", _tp("lm.gpt_neox.layers.*", "attention", "attention.dense", "mlp",
                       "mlp.dense_4h_to_h"), 2, "float64"),
    ("hf_bloom", [str(HERE / "bloom_tp.ssp")], 2, "float64"),
    ("hf_bloom", ONE_F_ONE_B, 2, "float64"),
    ("hf_albert", ONE_F_ONE_B, 2, "float64"),
    ("hf_albert", _tp("lm.albert.encoder.albert_layer_groups.*.albert_layers.*", "attention",
                      "attention.dense", "ffn", "ffn_output"), 2, "float64"),
    ("hf_mistral", ["dp"], 2, "float64"),
    ("hf_mistral", ONE_F_ONE_B, 2, "float64"),
    ("hf_gemma", _tp("lm.model.layers.*", "self_attn", "self_attn.o_proj", "mlp",
                     "mlp.down_proj"), 2, "float64"),
    ("hf_gptj", _tp("lm.transformer.h.*", "attn", "attn.out_proj", "mlp", "mlp.fc_out"), 2,
     "float64"),
    ("hf_bart", ONE_F_ONE_B, 2, "float64"),
    ("hf_distilbert", _tp("lm.distilbert.transformer.layer.*", "attention",
                          "attention.out_lin", "ffn", "ffn.lin2"), 2, "float64"),
    ("hf_vit", _tp("vit.vit.layers.*", "attention", "attention.o_proj", "mlp", "mlp.fc2"), 2,
     "float64"),
    ("hf_mixtral", ["dp"], 2, "float32"),
]


def _run(capsys, model: Path, plan: list[str], world: int, dtype: str, *extra: str):
    code = main(["run", str(model), plan[0], "--nproc", str(world), *plan[1:], "--check",
                 "--dtype", dtype, "--optimizer", "sgd", "--steps", "2", "--json", *extra])
    captured = capsys.readouterr()
    return code, captured


@pytest.mark.slow
@pytest.mark.parametrize("family, plan, world, dtype", [
    pytest.param(*c, marks=HF, id=f"{c[0]}-{c[1][0].rsplit('/', 1)[-1]}") for c in CASES])
def test_family_matches_the_plain_model(capsys, family, plan, world, dtype):
    code, captured = _run(capsys, HERE / f"{family}.py", plan, world, dtype)
    out = json.loads(captured.out)
    assert out["check"]["ok"], out["check"]
    assert code == 0
    bound = 1e-9 if dtype == "float64" else 1e-4
    worst = {m["what"]: m["error"] for m in out["check"]["worst"]}
    assert worst["loss"] < bound and worst["param"] < bound


@pytest.mark.slow
@TIMM
@pytest.mark.parametrize("plan, line", [(["dp"], "dp.ssp:7:1"), (ONE_F_ONE_B, "1f1b.ssp:10:1")])
def test_batch_norm_is_refused_where_the_batch_is_split(capsys, plan, line):
    code = main(["check", str(HERE / "timm_mobilenet.py"), plan[0], "--world", "2", *plan[1:]])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert line in err and "batch normalization" in err


BN_PLANS = {
    # statistics per channel: BatchNorm split by channels, the rest replicated
    "channels": "partition kind(batch_norm) along d1 into n\nreplicate rest into n\n",
    # data parallelism with BatchNorm replicated: it gathers the batch (exact, as a synchronized
    # batch norm is)
    "dp": "partition all except kind(batch_norm) along batch into n\n"
          "replicate kind(batch_norm) into n\n",
}


@pytest.mark.slow
@TIMM
@pytest.mark.parametrize("layout", list(BN_PLANS))
def test_batch_norm_keeps_its_running_statistics(capsys, tmp_path, layout):
    """BatchNorm split by channels or replicated under data parallelism, the in-place
    hard-swish after it reading a gathered result: the training and the running statistics of
    the saved state equal the plain model's."""
    from ssdsl.runtime.reference import OptimizerSpec, run_reference
    from ssdsl.trace.model_file import load_model_file

    plan = tmp_path / "bn.ssp"
    plan.write_text(f"plan bn(n: int = world)\n{BN_PLANS[layout]}"
                    "assign each part i to device i\n")
    saved = tmp_path / "state.pt"
    model = HERE / "timm_mobilenet.py"
    code, captured = _run(capsys, model, [str(plan)], 2, "float64", "--save", str(saved))
    assert json.loads(captured.out)["check"]["ok"] and code == 0
    ref = run_reference(load_model_file(str(model)), steps=2, dtype=torch.float64,
                        optimizer=OptimizerSpec("sgd"))
    state = torch.load(saved)
    stats = [k for k in ref.final_state if k.endswith(("running_mean", "running_var",
                                                       "num_batches_tracked"))]
    assert stats
    for k in stats:
        assert torch.allclose(state[k].to(ref.final_state[k].dtype), ref.final_state[k],
                              rtol=1e-12, atol=1e-14), k


@pytest.mark.slow
def test_in_place_activations_on_gathered_values(capsys):
    """``hardswish_`` and ``relu_`` replicated after column-parallel linears write the
    gathered copy a rank received (autograd refuses an in-place write into that leaf)."""
    code, captured = _run(capsys, ROOT / "models" / "inplace_act.py",
                          [str(ROOT / "models" / "inplace_act_gathered.ssp")], 2, "float64")
    out = json.loads(captured.out)
    assert out["check"]["ok"], out["check"]
    assert code == 0


@pytest.mark.slow
@pytest.mark.parametrize("path", [
    pytest.param(HERE / f"{f}.py", marks=m, id=f)
    for f, m in [("hf_gptneox", HF), ("hf_bloom", HF), ("hf_albert", HF), ("hf_mistral", HF),
                 ("hf_gemma", HF), ("hf_gptj", HF), ("hf_bart", HF), ("hf_distilbert", HF),
                 ("hf_vit", HF), ("timm_mobilenet", TIMM)]])
def test_every_operator_is_annotated(path: Path) -> None:
    """BLOOM's ``repeat``, GPT-J's ``repeat_interleave``, MobileNet's ``hardswish_`` and
    ``hardsigmoid`` were not (Mixtral's routing still is not: its ``sort`` and ``topk`` are,
    ``histc``, ``index_put_`` and transformers' grouped matmul are not)."""
    from ssdsl.ops import NotAnnotated, annotate
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file

    graph = trace(load_model_file(path), device="meta")
    missing = [(op.name, op.target, a.reason) for op in graph.ops
               if isinstance(a := annotate(graph, op), NotAnnotated)]
    assert not missing
