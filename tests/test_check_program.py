"""The program checker refuses lowered programs that cannot run, at a plan line.

Fault injection: programs lowered from accepted plans (GPT under 1F1B on 2 ranks: point-to-point
between stages; under Megatron TP on 2 ranks: collectives in forward and backward) pass the
checker; each mutation below (a dropped send, a swapped collective, a changed tag...) makes a
program set that would hang, mismatch messages or compute with missing data, and must be
refused before launch with an error that names a line of the plan file. The oracle of "cannot
run" is the mutation itself (each breaks one rule by construction), not the checker's code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from ssdsl.check import (BadStepTail, BadUnitStructure, CollectiveMismatch, MessageMismatch,
                         OrderNotFollowed, ProgramDeadlock, ProgramError,
                         RecomputeCommunicates, UndefinedValue, UnmatchedSend, check_programs)
from ssdsl.elaborate import elaborate_file
from ssdsl.lower import Program, lower_plan, parse_program, program_text
from ssdsl.lower.instr import MAX_TAG, Coll, Comm, LossSum, P2P, RecomputeBegin, RecomputeEnd
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"


@pytest.fixture(scope="module")
def graph():
    return trace(load_model_file(str(GPT)), device="meta")


def _lower(graph, plan: str, world: int, **sets):
    t, low = schedule_plan(graph, elaborate_file(plan, world=world,
                                                 sets={k: str(v) for k, v in sets.items()}))
    m = materialize(t, schedule=low)
    return m, lower_plan(m).programs


@pytest.fixture(scope="module")
def pipe(graph):
    return _lower(graph, "1f1b", 2, microbatches=4)


@pytest.fixture(scope="module")
def tp(graph):
    return _lower(graph, "megatron_tp", 2)


@pytest.fixture(scope="module")
def dp(graph):
    # gradient buckets: gpt.py's tied lm_head is one parameter read through one alias op, so the
    # pipeline sends it between its stages instead of reducing two copies
    return _lower(graph, "dp", 2)


def _with(programs, rank: int, instructions) -> tuple[Program, ...]:
    out = list(programs)
    out[rank] = attrs.evolve(out[rank], instructions=tuple(instructions))
    return tuple(out)


def _find(p: Program, pred: Callable) -> int:
    return next(i for i, ins in enumerate(p.instructions) if pred(ins))


def _msgs(ins, kind):
    return [s for s in ins.steps if isinstance(s, P2P) and any(m.kind == kind for m in s.msgs)]


def _edit_msgs(ins, kind: str, f: Callable):
    """``ins`` with function ``f`` applied to the message list of its first step that has a
    message of ``kind``."""
    steps = list(ins.steps)
    j = next(j for j, s in enumerate(steps)
             if isinstance(s, P2P) and any(m.kind == kind for m in s.msgs))
    steps[j] = attrs.evolve(steps[j], msgs=tuple(f(list(steps[j].msgs))))
    return attrs.evolve(ins, steps=tuple(steps))


def _colls(ins):
    return [s for s in ins.steps if isinstance(s, Coll) and s.meets]


# -- the mutations ----------------------------------------------------------------------------------


def drop_forward_send(m, progs):
    p = progs[0]
    i = _find(p, lambda x: isinstance(x, Comm) and not x.backward and _msgs(x, "send"))
    ins = _edit_msgs(p.instructions[i], "send", lambda ms: [x for x in ms if x.kind != "send"])
    return _with(progs, 0, (*p.instructions[:i], ins, *p.instructions[i + 1:]))


def drop_backward_receive(m, progs):
    p = progs[0]
    i = _find(p, lambda x: isinstance(x, Comm) and x.backward and _msgs(x, "recv"))
    ins = _edit_msgs(p.instructions[i], "recv", lambda ms: [x for x in ms if x.kind != "recv"])
    return _with(progs, 0, (*p.instructions[:i], ins, *p.instructions[i + 1:]))


def change_tag(m, progs):
    p = progs[1]
    i = _find(p, lambda x: isinstance(x, Comm) and not x.backward and _msgs(x, "recv"))
    ins = _edit_msgs(p.instructions[i], "recv",
                     lambda ms: [attrs.evolve(x, tag=x.tag + 1) if x.kind == "recv" else x
                                 for x in ms])
    return _with(progs, 1, (*p.instructions[:i], ins, *p.instructions[i + 1:]))


def tag_of_the_runtime(m, progs):
    """A forward send and its receive both moved to the tag above ``MAX_TAG`` (the all-reduce
    by exchanges uses it): they would still pair, so only the range check refuses them."""
    out = list(progs)
    for r, kind in ((0, "send"), (1, "recv")):
        p = out[r]
        i = _find(p, lambda x, k=kind: isinstance(x, Comm) and not x.backward and _msgs(x, k))
        ins = _edit_msgs(p.instructions[i], kind,
                         lambda ms, k=kind: [attrs.evolve(x, tag=MAX_TAG + 1)
                                             if x.kind == k else x for x in ms])
        out = _with(out, r, (*p.instructions[:i], ins, *p.instructions[i + 1:]))
    return out


def change_received_shape(m, progs):
    p = progs[1]
    i = _find(p, lambda x: isinstance(x, Comm) and not x.backward and _msgs(x, "recv"))

    def shrink(ms):
        out = []
        for x in ms:
            if x.kind == "recv":
                r = x.region
                first = r.intervals[0][0]
                ivs = ((first[0], first[1] - 1),), *r.intervals[1:]
                x = attrs.evolve(x, region=attrs.evolve(r, intervals=ivs))
            out.append(x)
        return out
    ins = _edit_msgs(p.instructions[i], "recv", shrink)
    return _with(progs, 1, (*p.instructions[:i], ins, *p.instructions[i + 1:]))


def swap_collectives(m, progs):
    p = progs[0]
    idx = [i for i, x in enumerate(p.instructions)
           if isinstance(x, Comm) and x.backward and _colls(x)]
    a, b = idx[0], idx[1]
    ins = list(p.instructions)
    ins[a], ins[b] = ins[b], ins[a]
    return _with(progs, 0, ins)


def change_group(m, progs):
    p = progs[0]
    i = _find(p, lambda x: isinstance(x, Comm) and _colls(x))
    ins = p.instructions[i]
    steps = tuple(attrs.evolve(s, group=tuple(reversed(s.group))) if isinstance(s, Coll) and s.meets
                  else s for s in ins.steps)
    return _with(progs, 0, (*p.instructions[:i], attrs.evolve(ins, steps=steps),
                            *p.instructions[i + 1:]))


def collective_outside_its_group(m, progs):
    """Rank 0 issues a collective of a group that it is not in (the others of its group)."""
    p = progs[0]
    i = _find(p, lambda x: isinstance(x, Comm) and _colls(x))
    ins = p.instructions[i]
    steps = tuple(attrs.evolve(s, group=tuple(r for r in s.group if r != p.rank))
                  if isinstance(s, Coll) and s.meets else s for s in ins.steps)
    return _with(progs, 0, (*p.instructions[:i], attrs.evolve(ins, steps=steps),
                            *p.instructions[i + 1:]))


def drop_collective(m, progs):
    p = progs[1]
    i = _find(p, lambda x: isinstance(x, Comm) and not x.backward and _colls(x))
    ins = p.instructions[i]
    steps = tuple(s for s in ins.steps if not (isinstance(s, Coll) and s.meets))
    return _with(progs, 1, (*p.instructions[:i], attrs.evolve(ins, steps=steps),
                            *p.instructions[i + 1:]))


def _unit_block(p: Program, unit: str) -> tuple[int, int]:
    a = _find(p, lambda x: x.kind == "begin" and x.unit == unit)
    b = _find(p, lambda x: x.kind == "end" and x.unit == unit)
    return a, b + 1


def backward_before_forward(m, progs):
    p = progs[1]
    fa, fb = _unit_block(p, "1F0")
    ba, bb = _unit_block(p, "1B0")
    ins = list(p.instructions)
    block = ins[ba:bb]
    del ins[ba:bb]
    ins[fa:fa] = block
    return _with(progs, 1, ins)


def call_before_its_input(m, progs):
    p = progs[0]
    i = _find(p, lambda x: x.kind == "call" and x.op == "add")
    j = max(k for k in range(i) if p.instructions[k].kind == "call")
    ins = list(p.instructions)
    ins[i], ins[j] = ins[j], ins[i]
    return _with(progs, 0, ins)


def duplicate_microbatch(m, progs):
    p = progs[0]
    a, b = _unit_block(p, "0F1")
    ins = list(p.instructions)
    ins[b:b] = ins[a:b]
    return _with(progs, 0, ins)


def units_against_order(m, progs):
    p = progs[0]
    a0, b0 = _unit_block(p, "0F0")
    a1, b1 = _unit_block(p, "0F1")
    ins = list(p.instructions)
    ins[a0:b1] = ins[a1:b1] + ins[a0:b0]
    return _with(progs, 0, ins)


def recompute_across_receive(m, progs):
    p = progs[1]
    i = _find(p, lambda x: isinstance(x, Comm) and not x.backward and _msgs(x, "recv"))
    span = p.instructions[i].span
    ins = list(p.instructions)
    ins[i:i + 1] = [RecomputeBegin((), (), span=span), ins[i], RecomputeEnd(span=span)]
    return _with(progs, 1, ins)


def drop_optimizer_step(m, progs):
    p = progs[1]
    return _with(progs, 1, [x for x in p.instructions if x.kind != "step"])


def drop_reduce_bucket(m, progs):
    p = progs[0]
    i = _find(p, lambda x: x.kind == "reduce")
    return _with(progs, 0, (*p.instructions[:i], *p.instructions[i + 1:]))


def drop_loss_sum(m, progs):
    p = progs[0]
    return _with(progs, 0, [x for x in p.instructions if x.kind != "loss_sum"])


def loss_carried_by_one_rank_only(m, progs):
    """Rank 0 sums its loss on its own while rank 1 still carries it in the bucket: both are
    well formed alone, but the two ranks' bucket all-reduces no longer agree."""
    p = progs[0]
    i = _find(p, lambda x: x.kind == "reduce" and x.loss)
    solo = LossSum(p.instructions[i].group, span=p.instructions[i].span)
    return _with(progs, 0, (*p.instructions[:i], attrs.evolve(p.instructions[i], loss=False),
                            solo, *p.instructions[i + 1:]))


def loss_summed_twice(m, progs):
    p = progs[0]
    i = _find(p, lambda x: x.kind == "reduce" and x.loss)
    extra = LossSum(p.instructions[i].group, span=p.instructions[i].span)
    return _with(progs, 0, (*p.instructions[:i + 1], extra, *p.instructions[i + 1:]))


def free_too_early(m, progs):
    p = progs[0]
    i = _find(p, lambda x: x.kind == "free")
    ins = list(p.instructions)
    free = ins.pop(i)
    j = _find(p, lambda x: x.kind == "backward")
    ins.insert(j, free)
    return _with(progs, 0, ins)


MUTATIONS = {
    "drop a forward send": ("pipe", drop_forward_send, ProgramDeadlock),
    "drop a backward receive": ("pipe", drop_backward_receive, UnmatchedSend),
    "change a tag": ("pipe", change_tag, (ProgramDeadlock, UnmatchedSend)),
    "send under the runtime's tag": ("pipe", tag_of_the_runtime, UnmatchedSend),
    "receive another shape": ("pipe", change_received_shape, MessageMismatch),
    "swap two collectives on one rank": ("tp", swap_collectives, CollectiveMismatch),
    "change a collective's group": ("tp", change_group, CollectiveMismatch),
    "issue a collective outside its group": ("tp", collective_outside_its_group,
                                             CollectiveMismatch),
    "drop a collective on one rank": ("tp", drop_collective, (ProgramDeadlock,
                                                              CollectiveMismatch)),
    "move a unit before its data": ("pipe", backward_before_forward, BadUnitStructure),
    "move a call before its input": ("tp", call_before_its_input, UndefinedValue),
    "duplicate a micro-batch": ("pipe", duplicate_microbatch, BadUnitStructure),
    "units against the plan's order": ("pipe", units_against_order, OrderNotFollowed),
    "recompute across a receive": ("pipe", recompute_across_receive, RecomputeCommunicates),
    "drop an optimizer step": ("pipe", drop_optimizer_step, BadStepTail),
    "drop a gradient bucket": ("dp", drop_reduce_bucket, BadStepTail),
    "drop the loss sum": ("tp", drop_loss_sum, BadStepTail),
    "free before backward": ("tp", free_too_early, UndefinedValue),
    "carry the loss in the bucket on one rank only": ("dp", loss_carried_by_one_rank_only,
                                                      (CollectiveMismatch, ProgramDeadlock)),
    "sum the loss twice": ("dp", loss_summed_twice, BadStepTail),
}


def test_lowered_programs_pass_and_read_back(pipe, tp):
    for m, progs in (pipe, tp):
        check_programs(progs, m=m)
        for p in progs:
            assert parse_program(program_text(p)) == p


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutation_is_refused_at_a_plan_line(pipe, tp, dp, name):
    which, mutate, expected = MUTATIONS[name]
    m, progs = {"pipe": pipe, "tp": tp, "dp": dp}[which]
    bad = mutate(m, progs)
    assert bad != progs
    with pytest.raises(ProgramError) as info:
        check_programs(bad, m=m)
    assert isinstance(info.value, expected), (name, type(info.value), info.value)
    span = info.value.span
    assert span is not None and span.file.endswith(".ssp") and span.line >= 1, name
    # the mutated text reads back to the same (still refused) programs
    assert tuple(parse_program(program_text(p)) for p in bad) == tuple(bad)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_checked_in_forked_processes_the_same_fault_is_refused(pipe, tp, dp, name,
                                                               monkeypatch):
    """Large plans check each program in forked processes while the parent walks their
    communication: the fault raised is the one the checks in one process raise (the oracle:
    the same checker run sequentially)."""
    import ssdsl.check.program as checker

    which, mutate, _ = MUTATIONS[name]
    m, progs = {"pipe": pipe, "tp": tp, "dp": dp}[which]
    bad = mutate(m, progs)
    with pytest.raises(ProgramError) as alone:
        check_programs(bad, m=m, jobs=1)
    monkeypatch.setattr(checker, "FORK_INSTRUCTIONS", 0)
    with pytest.raises(ProgramError) as forked:
        check_programs(bad, m=m, jobs=2)
    assert type(forked.value) is type(alone.value), name
    assert (forked.value.message, forked.value.span, forked.value.hint) == \
        (alone.value.message, alone.value.span, alone.value.hint), name
    check_programs(progs, m=m, jobs=2)  # and the programs as lowered pass there too


def test_reads_and_writes_by_class_agree_with_the_instruction_rules(pipe, tp, dp):
    """``reads``/``writes`` look an instruction's rule up by its class; the rules written out
    by field here (from the instruction set's definitions) are the oracle."""
    from ssdsl.lower import instr as I

    def want_reads(x):
        if isinstance(x, I.Call):
            return tuple(v for v in x.ins if v is not None)
        if isinstance(x, I.LocalAdapter) or (isinstance(x, I.Comm) and not x.backward):
            return tuple(x.ins)
        if isinstance(x, I.Cut):
            return (x.src,)
        if isinstance(x, (I.Backward, I.BackwardInput, I.BackwardWeight)):
            extra = (tuple(x.inputs) + tuple(leaf for leaf, _ in x.collect) + tuple(x.keep)
                     if isinstance(x, I.BackwardInput) else
                     tuple(v for outs, cuts in x.mixes for v in (*outs, *(c for cut in cuts
                                                                          for c in cut)))
                     + tuple(x.inputs) if isinstance(x, I.BackwardWeight) else
                     tuple(leaf for leaf, _ in x.collect))
            return tuple(x.seeds) + tuple(x.roots) + extra
        if isinstance(x, I.RecomputeBegin):
            return tuple(x.ins)
        return ()

    def want_writes(x):
        if isinstance(x, (I.TakeInput, I.TakeParam, I.TakeBuffer, I.Cut)):
            return (x.out,)
        if isinstance(x, (I.Call, I.LocalAdapter)) or (isinstance(x, I.Comm) and not x.backward):
            return tuple(x.outs)
        return ()

    kinds = set()
    for _, progs in (pipe, tp, dp):
        for p in progs:
            for x in p.instructions:
                kinds.add(x.kind)
                assert tuple(I.reads(x)) == want_reads(x), x
                assert tuple(I.writes(x)) == want_writes(x), x
    assert {"call", "comm", "cut", "backward", "param", "input"} <= kinds
