"""Sequence parallelism (issue 12): the stdlib ``megatron_sp`` plan, whose communication the
adapters derive from the layouts alone.

The oracles are the plain model (one simulated step of all ranks in float64, and a gloo run with
``--check``) and Megatron-SP's analytic communication for ``examples/gpt.py`` (L blocks, a
(B, T, C) residual stream): per block an all-gather along the sequence before each of its two
column-parallel regions and a reduce-scatter after each of its two row-parallel linears, the same
counts again in backward (their duals), plus one all-gather where the last block's output leaves
the blocks (and its dual where the embeddings enter them); every call moves (tp - 1) times the
activation's B * T * C elements, summed over the devices of the group. Activation bytes outside the tensor-parallel regions are counted from the
sub-tensors each device computes, against the full tensors of the plain graph.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ssdsl.cli import main
from ssdsl.elaborate import elaborate_file
from ssdsl.materialize.program import materialize
from ssdsl.runtime.verify import verify_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
L, B, T, C = 2, 8, 16, 32  # examples/gpt.py: N_LAYER, BATCH_SIZE, BLOCK_SIZE, N_EMBD
ACTIVATION = B * T * C * 8  # float64


@pytest.fixture(scope="module")
def gpt():
    mf = load_model_file(GPT)
    return mf, trace(mf, device="cpu", model=mf.build(seed=0).to(torch.float64))


def _plan(gpt, plan: str, tp: int):
    mf, graph = gpt
    return materialize(transform(graph, elaborate_file(plan, world=tp)), dtype=torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_sp_trains_like_the_plain_model(gpt, tp):
    m = _plan(gpt, "megatron_sp", tp)
    verdict = verify_plan(m, model_file=gpt[0])
    assert verdict.ok, verdict.problems[:5]


@pytest.mark.parametrize("tp", [2, 4])
def test_communication_is_megatron_sp(gpt, tp):
    acc = _plan(gpt, "megatron_sp", tp).accounting()
    for section in ("forward", "backward"):
        moved = {k: v for k, v in acc[section].items() if v["count"]}
        call = (tp - 1) * ACTIVATION  # summed over the group: each device sends (tp-1)/tp of it
        assert moved == {"all_gather": {"count": 2 * L + 1, "bytes": (2 * L + 1) * call},
                         "reduce_scatter": {"count": 2 * L, "bytes": 2 * L * call}}, section
    # the blocks' layer norms are used on different sequence parts: their gradients are summed
    assert set(acc["gradients"]) == {"all_reduce"}
    # megatron_tp moves the same activation bytes as all-reduces (a ring all-reduce is a
    # reduce-scatter and an all-gather): sequence parallelism adds only the exit all-gather
    tp_acc = _plan(gpt, "megatron_tp", tp).accounting()
    assert tp_acc["forward"]["all_reduce"]["count"] == 2 * L


def _outside_tp(op) -> bool:
    """A block's operator outside the tensor-parallel regions (layer norms, residual adds)."""
    return op.module.startswith("h.") and ".attn" not in op.module and ".mlp" not in op.module


def _elements_on(m, device: int) -> int:
    """Elements of the outputs that ``device`` computes for those operators."""
    t = m.transformed
    return sum(math.prod(sum(b - a for a, b in ivs) for ivs in region)
               for op in t.graph.ops if _outside_tp(op)
               for p in t.parts[op.name] if p.device == device
               for region in p.sub.outputs)


@pytest.mark.parametrize("tp", [2, 4])
def test_activations_outside_the_tensor_parallel_regions_shrink_by_tp(gpt, tp):
    _, graph = gpt
    # the oracle: the plain graph's whole tensors, which megatron_tp keeps on every device
    plain = sum(math.prod(graph.tensors[x].shape) for op in graph.ops if _outside_tp(op)
                for x in op.outputs)
    assert plain >= 4 * L * B * T * C  # two layer norms and two residual adds per block
    tp_plan, sp_plan = _plan(gpt, "megatron_tp", tp), _plan(gpt, "megatron_sp", tp)
    for d in range(tp):
        assert _elements_on(tp_plan, d) == plain
        assert _elements_on(sp_plan, d) * tp == plain


@pytest.mark.slow
def test_megatron_sp_runs_on_gloo_like_the_plain_model(capsys):
    code = main(["run", str(GPT), "megatron_sp", "--world", "2", "--steps", "2", "--check",
                 "--dtype", "float64", "--optimizer", "sgd", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["check"]["ok"], out["check"]


@pytest.mark.slow
def test_megatron_sp_with_llama_names_trains_like_the_plain_model():
    mf = load_model_file(ROOT / "tests" / "models" / "llama_like.py")
    graph = trace(mf, device="cpu", model=mf.build(seed=0).to(torch.float64))
    plan = elaborate_file("megatron_sp", world=2, sets={
        "blocks": "layers.*", "attn": "self_attn", "attn_out": "self_attn.o_proj",
        "mlp": "mlp", "mlp_out": "mlp.down_proj"})
    m = materialize(transform(graph, plan), dtype=torch.float64)
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]
