"""Forward values dropped from the executor's ``env`` before a backward
(``ssdsl.runtime.liveness``).

The oracles: a scan of the lowered program by hand (what is read at or after each backward), the
plain model trained in this process (float64, SGD) for what the ranks compute, and the logits,
which eager PyTorch no longer holds once the loss has read them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ssdsl.lower.instr import Backward, Free, reads, writes
from ssdsl.runtime.launch import launch
from tests.plain_reference import assert_trains_like, plain_sgd
from ssdsl.runtime.liveness import dead_before_backwards
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
LR, STEPS = 0.05, 3


def _materialized(plan: str, world: int, sets: dict):
    from ssdsl.runtime.job import JobSpec, plan_job

    return plan_job(JobSpec(GPT, plan, sets=tuple(sets.items())), world)[1]


def _program(plan: str, world: int, rank: int):
    from ssdsl.lower import lower_rank

    return lower_rank(_materialized(plan, world, {}), rank)


def _read_from(instructions, i: int) -> set[str]:
    return {v for ins in instructions[i:] for v in reads(ins)}


# the last stage of 1F1B splits every backward (``build.DEFER_W``): its whole backwards, with
# the lever off
@pytest.mark.parametrize("plan, world, rank, defer", [("dp", 1, 0, True), ("1f1b", 2, 0, True),
                                                      ("1f1b", 2, 1, False)])
def test_a_dropped_value_is_never_read_again_and_nothing_read_again_is_dropped(
        monkeypatch, plan, world, rank, defer):
    import ssdsl.lower.build as build
    monkeypatch.setattr(build, "DEFER_W", defer)
    program = _program(plan, world, rank)
    dead = dead_before_backwards(program)
    ins = program.instructions
    whole = [i for i, x in enumerate(ins) if isinstance(x, Backward) and x.part != "rest"]
    assert whole and dead  # the rule acts on these programs (else this tests nothing)
    dropped_before: set[str] = set()
    for i in whole:
        defined = set()
        for x in ins[:i]:
            defined.update(writes(x))
            if isinstance(x, Free):
                defined.difference_update(x.values)
        defined -= dropped_before
        later = _read_from(ins, i)
        got = set(dead.get(id(ins[i]), (None, ()))[1])
        assert got == defined - later, (plan, rank, i)
        dropped_before |= got


@pytest.mark.parametrize("plan, world", [("1f1b", 2), ("zb_h1", 2)])
def test_a_split_backward_holds_only_graph_places_of_what_its_weight_half_starts_from(plan,
                                                                                       world):
    """``held_as_edges``: the kept outputs of each input half that no later instruction reads,
    save a weight half as a mixing call's first output (where its autograd may start), and
    that the input half reads in no other role; on the last stage of 1F1B (split by the
    lowering) the logits are among them."""
    from ssdsl.lower.instr import BackwardInput, BackwardWeight
    from ssdsl.runtime.liveness import held_as_edges

    logits = _logits(plan, world, {})
    found = set()
    for rank in range(world):
        program = _program(plan, world, rank)
        held = held_as_edges(program)
        ins = program.instructions
        for i, x in enumerate(ins):
            if not isinstance(x, BackwardInput):
                continue
            later: set[str] = set()
            for y in ins[i + 1:]:
                if isinstance(y, BackwardWeight):
                    later |= {*y.seeds, *y.roots, *y.inputs}
                    for outs, cuts in y.mixes:
                        later |= {*outs[1:], *(v for pair in cuts for v in pair)}
                else:
                    later |= set(reads(y))
            other = {*x.seeds, *x.roots, *x.inputs, *(leaf for leaf, _ in x.collect)}
            want = {v for v in x.keep if v not in later and v not in other}
            got = held.get(id(x), (None, ()))[1]
            assert set(got) == want and len(got) == len(want), (plan, rank, i)
            found |= set(got)
    assert found & logits, (plan, sorted(found)[:8])


def drop_worker(plan: str, sets: dict, on: bool) -> tuple[list[float], dict, list[set]]:
    import ssdsl
    from ssdsl.runtime import executor, liveness

    liveness.ENABLED = on
    seen: list[set] = []
    starts = executor.Runner._starts

    def spy(self, seeds, roots, take=True):
        seen.append(set(self.env))
        return starts(self, seeds, roots, take)
    executor.Runner._starts = spy
    mf = load_model_file(GPT)
    pm = ssdsl.parallelize(GPT, plan, sets=sets, optimizer="sgd", lr=LR, dtype="float64",
                           verify=False)
    losses = [pm.train_step(*mf.get_batch(s, mf.batch_size)) for s in range(STEPS)]
    return losses, pm.full_state_dict(), seen


def _logits(plan: str, world: int, sets: dict) -> set[str]:
    """The lm head's outputs in every rank's program: what the loss reads the logits from."""
    from ssdsl.lower import lower_rank
    from ssdsl.lower.instr import Call

    m = _materialized(plan, world, sets)
    names = set()
    for r in range(world):
        for ins in lower_rank(m, r).instructions:
            if isinstance(ins, Call) and ins.call.target == "aten.reshape.default" \
                    and ins.op == "reshape":  # the logits viewed as (tokens, vocabulary)
                names.update(ins.ins)
                names.update(ins.outs)
    return names


@pytest.mark.slow
@pytest.mark.parametrize("plan, nproc, sets", [
    ("dp", 1, {}), ("dp", 2, {}), ("1f1b", 2, {"microbatches": "4"}),
])
def test_dropping_trains_like_the_plain_model_and_the_logits_are_gone_in_backward(plan, nproc,
                                                                                 sets):
    want = plain_sgd(GPT, STEPS, LR)
    logits = _logits(plan, nproc, sets)
    assert logits
    for on in (True, False):
        held = set()
        for losses, state, seen in launch(drop_worker, nproc=nproc, args=(plan, sets, on),
                                          timeout_s=600):
            assert_trains_like(losses, state, want)
            assert seen  # every rank runs a backward
            held |= set().union(*seen) & logits
        # on: no backward starts with the logits held; off: the last stage's do (so the spy
        # sees them where they are)
        assert not held if on else held, (on, sorted(held)[:8], sorted(logits)[:8])
