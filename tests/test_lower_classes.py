"""Lowering once per rank class (``ssdsl.lower.classes``): every stamped program is the rank's
direct lowering, field by field, its text form byte by byte, and its generated module byte by
byte; the checker still checks every rank.

Oracle: ``lower_rank(m, r, direct=True)``, the rank's own lowering (no class, no stamping), and
``generate_rank(..., reuse=False)`` on it, which writes every line afresh.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import attrs
import pytest

from ssdsl.check import check_programs
from ssdsl.codegen import Provenance, generate_rank
from ssdsl.elaborate import elaborate_file
from ssdsl.lower import lower_plan, lower_rank, program_text
from ssdsl.lower.build import _passthrough, classes_of, rank_view
from ssdsl.lower.instr import Comm, Msg, P2P
from ssdsl.lower.walk import ProgramError
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
RECYCLE = ROOT / "examples" / "evoformer_recycle.py"

# (model, plan, world, sets, whether some rank must be stamped from another)
CASES = {
    "dp_tp_1f1b": (GPT, "dp_tp_1f1b", 16, {"dp": 2, "tp": 2, "pp": 4, "microbatches": 4}, True),
    "dp_tp_1f1b-mb1": (GPT, "dp_tp_1f1b", 8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 1},
                       True),
    "interleaved": (GPT, "interleaved_1f1b", 4, {"chunks": 2, "microbatches": 4}, False),
    "interlaced": (GPT, "interlaced_1f1b", 4, {"microbatches": 4}, False),
    "zb_v": (GPT, "zb_v", 2, {}, False),
    "dp": (GPT, "dp", 4, {}, True),
    "dp_tp": (GPT, "dp_tp", 8, {"dp": 2, "tp": 4}, True),
    "megatron_sp": (GPT, "megatron_sp", 4, {}, True),
    "megatron_tp": (GPT, "megatron_tp", 4, {}, True),  # every rank holds the loss: its own sum
    "zero1": (GPT, "dp_zero", 4, {"stage": 1}, True),
    "zero2": (GPT, "dp_zero", 4, {"stage": 2}, True),
    "zero3": (GPT, "dp_zero", 4, {"stage": 3}, True),
    "coshard": (GPT, "coshard", 2, {"colocate": 2}, False),  # stamped: plan_digest coshard-4
    "3f1b": (RECYCLE, "recycle_1f1b", 2, {"microbatches": 2}, False),
}


@cache
def _graph(model: Path):
    return trace(load_model_file(str(model)), device="meta")


def _plan(case: str):
    model, plan, world, sets, _ = CASES[case]
    p = elaborate_file(plan, world=world, sets={k: str(v) for k, v in sets.items()})
    t, low = schedule_plan(_graph(model), p)
    return p, materialize(t, schedule=low)


def _same(a, b) -> None:
    """Field by field, with the field named where they differ."""
    assert a.rank == b.rank and a.world == b.world and len(a) == len(b)
    for i, (x, y) in enumerate(zip(a.instructions, b.instructions)):
        assert type(x) is type(y), (a.rank, i)
        for f in attrs.fields(type(x)):
            assert getattr(x, f.name) == getattr(y, f.name), (a.rank, i, x.kind, f.name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_stamped_programs_are_the_direct_lowering(case):
    plan, m = _plan(case)
    world = m.transformed.world
    stamped = [lower_rank(m, r) for r in range(world)]
    classes = classes_of(m)
    if CASES[case][4]:
        assert len(classes.reps) < world  # some rank was stamped, not lowered
    prov = Provenance.of(GPT, plan)
    for r in range(world):
        direct = lower_rank(m, r, direct=True)
        _same(stamped[r], direct)
        assert program_text(stamped[r]) == program_text(direct)
        afresh = generate_rank(m, r, prov, direct, reuse=False)
        assert generate_rank(m, r, prov, stamped[r]) == afresh
        # a program that shares no instruction object with its class's template (lowered
        # directly) is written from the template as well, the slow way: the same text
        assert generate_rank(m, r, prov, direct) == afresh


@pytest.mark.parametrize("case", ["dp_tp_1f1b", "coshard", "zero3", "megatron_sp"])
def test_indexed_adapter_views_are_rank_views(case):
    """Each rank's share of each adapter, as the class key reads it (indexed by device), is
    what the lowering's ``rank_view`` scans the whole adapter for."""
    _, m = _plan(case)
    index = classes_of(m).index
    for edge in m.edges.values():
        for ad in (edge.adapter, edge.adapter.backward):
            if ad is None:
                continue
            at = index.adapter(ad)
            for r in range(m.transformed.world):
                assert at.view(r) == rank_view(ad, r)
                assert at.passthrough(r) == _passthrough(ad, r)


def test_a_stamped_rank_that_is_broken_is_still_caught():
    """The checker reads every rank's program, stamped ones included: one message tag changed
    in one stamped rank leaves its receive unmatched."""
    _, m = _plan("dp_tp_1f1b")
    programs = list(lower_plan(m).programs)
    check_programs(programs, m=m)
    reps = {rep.rank for rep in classes_of(m).reps.values()}
    r, i, ins = next((r, i, ins) for r in range(len(programs)) if r not in reps
                     for i, ins in enumerate(programs[r].instructions)
                     if isinstance(ins, Comm) and any(
                         isinstance(s, P2P) and any(x.kind == "send" for x in s.msgs)
                         for s in ins.steps))
    k, step = next((k, s) for k, s in enumerate(ins.steps) if isinstance(s, P2P))
    j = next(j for j, x in enumerate(step.msgs) if x.kind == "send")
    msgs = list(step.msgs)
    msgs[j] = attrs.evolve(msgs[j], tag=msgs[j].tag + 1)
    steps = list(ins.steps)
    steps[k] = attrs.evolve(step, msgs=tuple(msgs))
    broken = list(programs[r].instructions)
    broken[i] = attrs.evolve(ins, steps=tuple(steps))
    programs[r] = attrs.evolve(programs[r], instructions=tuple(broken))
    assert isinstance(msgs[j], Msg)
    with pytest.raises(ProgramError):
        check_programs(programs, m=m)


@pytest.mark.parametrize("texts_max", [1 << 16, 1])
def test_a_full_call_cache_keeps_stamped_modules_on_the_template(monkeypatch, texts_max):
    """The cache of call objects fills and is cleared many times in a 1,024-rank compile (each
    part holds calls of its own). The stamped modules stay byte for byte the direct ones; and
    while the call texts are kept, a stamped rank's calls are written from its class's template
    (no call written afresh): clearing the texts with the calls sent every call of every later
    rank down the slow path (a 1,024-rank compile took 20 ms a rank instead of 17)."""
    from ssdsl.codegen import emit

    plan, m = _plan("dp_tp_1f1b")
    prov = Provenance.of(GPT, plan)
    monkeypatch.setattr(emit, "_CALL_PIECES_MAX", 4)
    monkeypatch.setattr(emit, "_PIECES_MAX", texts_max)
    afresh = [0]
    on_call = emit._Emitter.on_call

    def counted(self, ins):
        afresh[0] += 1
        return on_call(self, ins)

    monkeypatch.setattr(emit._Emitter, "on_call", counted)
    world = m.transformed.world
    texts = {r: generate_rank(m, r, prov) for r in range(world)}  # the class firsts walk whole
    afresh[0] = 0
    reps = {rep.rank for rep in classes_of(m).reps.values()}
    stamped = [r for r in range(world) if r not in reps]
    assert stamped
    for r in stamped:
        assert generate_rank(m, r, prov) == texts[r]
    if texts_max > 1:
        assert afresh[0] == 0
    for r in stamped:
        assert texts[r] == generate_rank(m, r, prov, lower_rank(m, r, direct=True), reuse=False)
