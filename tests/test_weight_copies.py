"""A value that needs no batch is computed on every pipeline stage that reads it, instead of sent
there every micro-batch (``ssdsl.materialize.copies``): a tied weight is held on the first and
the last stage, and its gradient is summed over both once per step.

Oracles: the traced graph (the tracer's ``share_`` alias of the tied token embedding is read by
the embedding and by the LM head; the stage cuts put those on different devices, so without the
rule its value crosses devices in every micro-batch: checked with the rule off), and the plain
single-device model (loss and every gradient of one step in float64, every rank's lowered program
simulated in one process; in the slow test, three SGD steps of real ranks under ``--check``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.check.program import check_programs
from ssdsl.elaborate import elaborate_file
from ssdsl.ir.batchfree import batch_free
from ssdsl.ir.graph import Graph, Op, TensorInfo, TensorRef
from ssdsl.lower import lower_plan
from ssdsl.lower.instr import Comm
from ssdsl.materialize import copies
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan
from ssdsl.runtime.verify import compare_with_model, simulate_plan
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.trace.shared import SHARE_PREFIX
from tests.checked_run import assert_gloo_run_matches

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
HF_GPT2 = str(ROOT / "examples" / "hf_gpt2.py")

ONE_F_ONE_B = """plan p(mbs: int = 4)
microbatch along batch into mbs
stages h.0, h.1 as st
for s in 0..2:
    assign st[s] to device s
    let warm = min(1 - s, mbs)
    order on device s:
        forward st[s] mb 0..warm,
        interleave(forward st[s] mb warm..mbs, backward st[s] mb 0..mbs - warm),
        backward st[s] mb mbs - warm..mbs
"""
# (model, plan text or stdlib name, world, --set values)
CASES = {
    "1f1b": (GPT, ONE_F_ONE_B, 2, {}),
    "gpipe": (GPT, "gpipe", 2, {}),
    "dp_pp": (GPT, "dp_tp_1f1b", 4, {"dp": 2, "pp": 2}),
    "tp_pp": (GPT, "dp_tp_1f1b", 4, {"tp": 2, "pp": 2}),
    "interleaved": (GPT, "interleaved_1f1b", 2, {}),
    "zero_pp": (GPT, "dp_zero", 2, {}),  # no stages: the rule does not apply
}


def _plan(name: str, world: int, sets: dict, tmp: Path):
    if "\n" in name:
        path = tmp / "p.ssp"
        path.write_text(name)
        return elaborate_file(str(path), world=world, args=sets)
    path = ROOT / "stdlib_plans" / f"{name}.ssp"
    return elaborate_file(str(path), world=world, args=sets)


def _materialize(model: str, plan: str, world: int, sets: dict, tmp: Path, *, enabled: bool):
    mf = load_model_file(model)
    graph = trace(mf, device="cpu", model=mf.build(seed=0).to(torch.float64))
    t, low = schedule_plan(graph, _plan(plan, world, sets, tmp))
    old = copies.ENABLED
    copies.ENABLED = enabled
    try:
        return mf, graph, materialize(t, dtype=torch.float64, schedule=low)
    finally:
        copies.ENABLED = old


def _tied(graph) -> str:
    """The output of the tracer's alias of the tied embedding (the traced graph's)."""
    found = [op for op in graph.ops if op.name.startswith(SHARE_PREFIX)]
    assert len(found) == 1, [op.name for op in found]  # gpt.py ties lm_head to wte
    return found[0].outputs[0]


def _moved(m, programs, tensor: str) -> int:
    """Messages and collective calls that carry ``tensor`` or its gradient, over all ranks."""
    keys = list(m.edges)
    n = 0
    for p in programs:
        for x in p.instructions:
            if isinstance(x, Comm) and keys[x.edge][0] == tensor:
                n += sum(max(1, len(getattr(step, "msgs", ()))) for step in x.steps)
    return n


def _holders(m, param: str) -> set[int]:
    return {d for b in m.reducer.buckets for name, _ in b.entries if name == param
            for d in b.devices}


@pytest.mark.parametrize("case", sorted(c for c in CASES if c != "zero_pp"))
def test_a_tied_weight_stays_on_each_stage_and_trains_like_one_device(case, tmp_path):
    model, plan, world, sets = CASES[case]
    mf, graph, before = _materialize(model, plan, world, sets, tmp_path, enabled=False)
    tied = _tied(graph)
    param = graph.op(next(op.name for op in graph.ops if tied in op.outputs)).inputs[0]
    assert _moved(before, lower_plan(before).programs, tied) > 0  # the precondition

    _, _, m = _materialize(model, plan, world, sets, tmp_path, enabled=True)
    programs = lower_plan(m).programs
    check_programs(programs, m=m)
    t = m.transformed
    moved = _moved(m, programs, tied)
    stage_devices = {s: {p.device for op in t.graph.ops if t.stage(op.name) == s
                         for p in t.parts[op.name]} for s in range(t.num_stages)}
    readers = {t.stage(op.name) for op in graph.ops if tied in op.inputs}
    if any(stage_devices[a] & stage_devices[b] for a in readers for b in readers if a != b):
        assert moved <= _moved(before, lower_plan(before).programs, tied)
    else:
        assert moved == 0
        # every device that reads the embedding sums its gradient with the others' copies
        readers_devices = set().union(*(stage_devices[s] for s in readers))
        assert _holders(m, param) >= readers_devices
    assert m.accounting()["total_bytes"] < before.accounting()["total_bytes"]
    sim = simulate_plan(m, mf)
    problems, _, _ = compare_with_model(m, mf, sim)
    assert not problems, problems


def test_without_stages_nothing_is_copied(tmp_path):
    model, plan, world, sets = CASES["zero_pp"]
    _, _, off = _materialize(model, plan, world, sets, tmp_path, enabled=False)
    _, _, on = _materialize(model, plan, world, sets, tmp_path, enabled=True)
    assert [op.name for op in on.transformed.graph.ops] == \
        [op.name for op in off.transformed.graph.ops]


def test_hf_gpt2_sends_its_tied_embedding_no_more(tmp_path):
    pytest.importorskip("transformers")
    mf, graph, before = _materialize(HF_GPT2, "1f1b", 2, {}, tmp_path, enabled=False)
    _, _, m = _materialize(HF_GPT2, "1f1b", 2, {}, tmp_path, enabled=True)
    tied = _tied(graph)
    assert _moved(before, lower_plan(before).programs, tied) > 0
    assert _moved(m, lower_plan(m).programs, tied) == 0
    # the forward carries activations only: a micro-batch's hidden states (and nothing of
    # the 64 x 32 table), each way once per micro-batch
    table = graph.tensors[tied].numel * 8
    saved = before.accounting()["total_bytes"] - m.accounting()["total_bytes"]
    mbs = m.transformed.microbatches
    # sent forward and back per micro-batch before; summed once per step (both ranks) now
    assert saved == 2 * mbs * table - 2 * table
    problems, _, _ = compare_with_model(m, mf, simulate_plan(m, mf))
    assert not problems, problems


# -- which operators count as needing no batch --------------------------------------------------


def _info(name: str, shape=(4, 4), dtype="torch.float32") -> TensorInfo:
    return TensorInfo(name, shape, dtype)


def _op(name: str, target: str, inputs: tuple[str, ...], out: str) -> Op:
    return Op(name=name, target=target, kind=target.split(".")[1], module="",
              args=tuple(TensorRef(x) for x in inputs), inputs=inputs, outputs=(out,))


def test_batch_free_operators_exclude_the_batch_randomness_and_in_place_writes():
    ops = (
        _op("alias", "aten.alias.default", ("w",), "a"),
        _op("t", "aten.t.default", ("a",), "at"),
        _op("arange", "aten.arange.default", (), "pos"),
        _op("mask", "aten.triu.default", ("pos",), "m"),
        _op("drop", "aten.dropout.default", ("w",), "d"),
        _op("after_drop", "aten.t.default", ("d",), "dt"),
        _op("rand", "aten.rand.default", (), "r"),
        _op("inplace", "aten.add_.Tensor", ("buf",), "b2"),
        _op("mm", "aten.mm.default", ("x", "at"), "y"),
        _op("loss", "aten.sum.default", ("y",), "l"),
    )
    names = ["w", "a", "at", "pos", "m", "d", "dt", "r", "buf", "b2", "x", "y", "l"]
    g = Graph(ops=ops, tensors={n: _info(n) for n in names}, params={"w": "w"},
              buffers={"buf": "buf"}, inputs=("x",), output="l")
    found = batch_free(g)
    assert found == {"alias", "t", "arange", "mask"}


# -- real ranks --------------------------------------------------------------------------------


@pytest.mark.slow
def test_tied_pipeline_trains_like_one_device_on_two_ranks(tmp_path, capsys):
    """Two gloo ranks, three SGD steps in float64 under ``--check``: every step's loss and the
    merged weights (the embedding held by both stages among them) against the plain model."""
    (tmp_path / "p.ssp").write_text(ONE_F_ONE_B)
    out = assert_gloo_run_matches(capsys, GPT, str(tmp_path / "p.ssp"), 2, steps=3)
    assert out["communication"]["gradients"]["all_reduce"]["count"] == 1  # the embedding's


def test_rotary_tables_are_made_on_each_stage_not_sent(tmp_path):
    """LLaMA-style tables built from a buffer and the positions, read by every block: each
    stage computes them, and one step still matches the plain model."""
    model = str(ROOT / "tests" / "models" / "no_grad_crossing.py")
    mf, graph, before = _materialize(model, "1f1b", 2, {"microbatches": 2}, tmp_path,
                                     enabled=False)
    _, _, m = _materialize(model, "1f1b", 2, {"microbatches": 2}, tmp_path, enabled=True)
    cos = next(op for op in graph.ops if op.kind == "cos").outputs[0]
    assert _moved(before, lower_plan(before).programs, cos) > 0
    assert _moved(m, lower_plan(m).programs, cos) == 0
    problems, _, _ = compare_with_model(m, mf, simulate_plan(m, mf))
    assert not problems, problems
