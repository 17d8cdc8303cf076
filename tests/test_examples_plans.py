"""Every third-party example under every stdlib plan family, run with ``--check --dtype float64
--optimizer sgd`` (the oracle: the plain model trained on one device): dp, megatron_tp (with the
family's module names), 1f1b with 4 micro-batches, and the 3-D dp x tp x pp plan on 8 ranks.
Also: ``ssdsl check`` shows Megatron's minimum communication for each (one all-reduce per
row-parallel linear in forward, one per column-parallel group in backward).

Slow (processes, third-party models); skipped when transformers / timm are missing.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ssdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXACT = ["--check", "--dtype", "float64", "--optimizer", "sgd", "--steps", "2", "--json"]

HF = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                        reason="transformers is not installed")
TIMM = pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed")

# model -> (skip mark, megatron_tp's module names, transformer blocks)
MODELS = {
    "hf_gpt2": (HF, {"blocks": "lm.transformer.h.*"}, 2),
    "hf_llama": (HF, {"blocks": "lm.model.layers.*", "attn": "self_attn",
                      "attn_out": "self_attn.o_proj", "mlp": "mlp", "mlp_out": "mlp.down_proj"}, 2),
    "hf_bert": (HF, {"blocks": "lm.bert.encoder.layer.*", "attn": "attention",
                     "attn_out": "attention.output.dense", "mlp": "intermediate",
                     "mlp_out": "output.dense"}, 2),
    "timm_vit": (TIMM, {"blocks": "blocks.*", "attn": "attn", "attn_out": "attn.proj",
                        "mlp": "mlp", "mlp_out": "mlp.fc2"}, 2),
    "timm_swin": (TIMM, {"blocks": "layers.*.blocks.*", "attn": "attn", "attn_out": "attn.proj",
                         "mlp": "mlp", "mlp_out": "mlp.fc2"}, 4),
}


def _sets(values: dict) -> list[str]:
    return [x for k, v in values.items() for x in ("--set", f"{k}={v}")]


PLANS = {
    "dp": ("dp", 2, {}),
    "megatron_tp": ("megatron_tp", 2, None),
    "1f1b": ("1f1b", 2, {"microbatches": 4}),
    "3d": ("dp_tp_1f1b", 8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 4}),
}


def _cases():
    for model, (mark, names, _) in MODELS.items():
        for plan in PLANS:
            marks = [mark, pytest.mark.slow]
            yield pytest.param(model, plan, marks=marks, id=f"{model}-{plan}")


@pytest.mark.parametrize("model, plan", list(_cases()))
def test_example_matches_the_plain_model(capsys, model: str, plan: str) -> None:
    _, names, _ = MODELS[model]
    stdlib, nproc, sets = PLANS[plan]
    sets = dict(sets) if sets is not None else {}
    if plan in ("megatron_tp", "3d"):
        sets.update(names)
    code = main(["run", str(ROOT / "examples" / f"{model}.py"), stdlib, "--nproc", str(nproc),
                 *_sets(sets), *EXACT])
    out = json.loads(capsys.readouterr().out)
    assert out["check"]["ok"], out["check"]
    assert code == 0


@pytest.mark.slow
@pytest.mark.parametrize("model", [pytest.param(m, marks=v[0]) for m, v in MODELS.items()])
def test_check_shows_megatron_minimum(capsys, model: str) -> None:
    _, names, layers = MODELS[model]
    code = main(["check", str(ROOT / "examples" / f"{model}.py"), "megatron_tp", "--world", "2",
                 *_sets(names), "--json"])
    comm = json.loads(capsys.readouterr().out)["communication"]
    assert code == 0
    # 2 row-parallel linears per layer forward; 2 column-parallel groups per layer backward.
    # Integer and bool tensors (masks, positions) carry no gradient and are not counted.
    float_back = [e for e in comm["edges"] if "all_reduce" in e["backward"]
                  and not _integer_tensor(model, e["tensor"])]
    forward = comm["forward"]
    assert set(forward) - {"chunk"} == {"all_reduce"}
    assert forward["all_reduce"]["count"] == 2 * layers
    assert len(float_back) == 2 * layers
    assert "all_gather" not in comm["backward"]
    assert comm["gradients"] == {}


_DTYPES: dict = {}


def _integer_tensor(model: str, tensor: str) -> bool:
    if model not in _DTYPES:
        from ssdsl.trace import trace
        from ssdsl.trace.model_file import load_model_file
        graph = trace(load_model_file(ROOT / "examples" / f"{model}.py"), device="meta")
        _DTYPES[model] = {n: t.dtype for n, t in graph.tensors.items()}
    dtype = _DTYPES[model].get(tensor, "torch.float32")
    return "float" not in dtype
