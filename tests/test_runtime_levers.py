"""The executor's speed levers change no result: receives posted a unit ahead
(``ssdsl.runtime.early``), buckets reduced in parts during the last backward
(``ssdsl.runtime.overlap``), the loss summed while the step runs (``ssdsl.runtime.early_loss``),
sends issued by a thread of their own (``ssdsl.runtime.sender``), messages through shared memory
(``ssdsl.runtime.shm``) and prebuilt handlers (``ssdsl.runtime.prebuilt``).

The oracle is the plain model trained in this process (float64, SGD) on the same batches; the
ranks run ``ssdsl.parallelize`` with the levers set as given, so that a bucket of the tiny GPT
splits into many parts and every pipeline receive is posted early.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.lower.instr import Program, ReduceBucket
from ssdsl.runtime.early import early_receives
from ssdsl.runtime.launch import launch
from ssdsl.runtime.overlap import overlap_plan
from ssdsl.trace.model_file import load_model_file
from tests.plain_reference import plain_sgd

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
LR, STEPS = 0.05, 3


def lever_worker(plan: str, sets: dict, levers: dict) -> tuple[list[float], dict, dict]:
    """One rank: ``levers`` ("module:ATTR" -> value) set, then ``STEPS`` steps of ``plan``;
    the losses, the full parameters and how often each lever acted."""
    import importlib

    import ssdsl

    for where, value in levers.items():
        module, attr = where.split(":")
        setattr(importlib.import_module(module), attr, value)
    mf = load_model_file(GPT)
    pm = ssdsl.parallelize(GPT, plan, sets=sets, optimizer="sgd", lr=LR, dtype="float64",
                           verify=False)
    losses = [pm.train_step(*mf.get_batch(s, mf.batch_size)) for s in range(STEPS)]
    return losses, pm.full_state_dict(), dict(pm._program.runner.counts)


def reference() -> tuple[list[float], dict]:
    return plain_sgd(GPT, STEPS, LR)


def assert_matches(got: tuple, want: tuple[list[float], dict]) -> None:
    assert got[0] == pytest.approx(want[0], rel=1e-10)
    for name, w in want[1].items():
        g = got[1][name].to(torch.float64)
        assert (g - w).norm() <= 1e-10 * max(1.0, float(w.norm())), name


@pytest.mark.slow
@pytest.mark.parametrize("plan, nproc, sets, acts", [
    ("dp", 2, {}, "parts_overlapped"), ("dp", 4, {}, "parts_overlapped"),
    ("megatron_tp", 2, {}, None),  # no bucket: the replicated weights' gradients agree
    ("dp_tp", 4, {"dp": "2", "tp": "2"}, "parts_overlapped"),
    ("1f1b", 2, {"microbatches": "4"}, "posted_early"),
    # the reported losses come from the all-reduce started early
    # (on 2 ranks the tied embedding's gradient bucket spans both stages and the loss rides in
    # it, with no all-reduce of its own: the embedding is sent instead, as before that rule)
    ("1f1b", 2, {"microbatches": "4", "no_copies": True}, "loss_early"),
    ("gpipe", 4, {"microbatches": "4"}, "loss_early"),
    ("interleaved_1f1b", 2, {"microbatches": "4", "no_copies": True}, "loss_early"),
    # 4 ranks fill 2 cores: the sender thread is forced (``ALWAYS``) so that it is tested; it
    # carries the sends that do not go through shared memory (turned off for these)
    ("1f1b", 4, {"microbatches": "4", "always_send_thread": True, "no_shm": True},
     "sends_threaded"),
    ("zb_h1", 2, {"microbatches": "4", "no_shm": True}, "sends_threaded"),
    # the pipelines' messages through shared memory (``ssdsl.runtime.shm``)
    ("1f1b", 4, {"microbatches": "4"}, "sends_shm"),
    ("interleaved_1f1b", 2, {"microbatches": "4"}, "sends_shm"),
    ("dp_tp_1f1b", 8, {"dp": "2", "tp": "2", "microbatches": "4"}, "posted_early"),
    ("dp_zero", 2, {}, None),  # sharded buckets reduce after the backward, as before
])
def test_levers_on_match_the_single_device_model(plan, nproc, sets, acts):
    # parts of 2 KiB: the tiny GPT's bucket becomes dozens of all-reduces started in backward
    levers = {"ssdsl.lower.overlap:PART_BYTES": 2048,
              "ssdsl.lower.overlap:REST_PART_BYTES": 2048, "ssdsl.runtime.early:LOOKAHEAD": 2}
    sets = dict(sets)
    if sets.pop("always_send_thread", False):
        levers["ssdsl.runtime.sender:ALWAYS"] = True
    if sets.pop("no_copies", False):
        levers["ssdsl.materialize.copies:ENABLED"] = False
    if sets.pop("no_shm", False):
        levers["ssdsl.runtime.shm:ENABLED"] = False
    per_rank = launch(lever_worker, nproc=nproc, args=(plan, sets, levers), timeout_s=600)
    want = reference()
    for got in per_rank:
        assert_matches(got, want)
    if acts is not None:  # the lever did act (else this would test nothing)
        assert sum(counts[acts] for _, _, counts in per_rank) >= STEPS * 2


# -- the plans the levers make, without running (fast) ---------------------------------------


def _bucket(entries: int) -> ReduceBucket:
    from ssdsl.ir.region import Region
    return ReduceBucket(0, (0, 1), tuple((f"w{i}", Region.full((4,))) for i in range(entries)))


def test_overlap_parts_start_from_the_bucket_end_and_stop_at_a_meeting():
    from ssdsl.lower.instr import Backward, End, LossSum, OptimizerStep
    b = _bucket(5)
    sizes = {e: 16 for e in b.entries}
    prog = Program(0, 2, (Backward((), (), ()), End("0B0"), b, OptimizerStep()))
    plan = overlap_plan(prog, sizes, part_bytes=32, rest_bytes=None)
    # entries 4,3 first (autograd reaches the model's end first), each part about 32 bytes
    assert plan.parts == {0: ((4, 3), (2, 1), (0,))}
    assert plan.last == 0
    # the first part about 32 bytes, the later ones about 48 (DDP's 1 MiB, then 25 MiB)
    assert overlap_plan(prog, sizes, part_bytes=32, rest_bytes=48).parts == {0: ((4, 3),
                                                                               (2, 1, 0))}
    blocked = Program(0, 2, (Backward((), (), ()), LossSum((0, 1)), b, OptimizerStep()))
    assert overlap_plan(blocked, sizes, part_bytes=32) is None  # a collective stands between
    assert overlap_plan(prog, sizes, part_bytes=0) is None
    assert overlap_plan(prog, sizes, part_bytes=1 << 20) is None  # one part: left in place


def test_the_loss_starts_after_the_last_unit_with_a_loss_call_unless_its_group_meets():
    """``loss_plan``'s positions, written out by hand: the last stage's share is final at the
    end of its last unit with a loss call, a rank without one starts at once, and another
    collective on the loss's group before ``LossSum`` keeps the all-reduce in place."""
    from ssdsl.lower.instr import Begin, Call, Coll, Comm, End, LossSum, OptimizerStep
    from ssdsl.ops.core import LocalCall
    from ssdsl.runtime import early_loss

    def loss_call(mb: int) -> Call:
        return Call("loss", (), (f"l@{mb}",), ("x",), LocalCall("aten.sum.default", ()),
                    False, True, True)
    tail = (LossSum((0, 1)), OptimizerStep())
    last = Program(1, 2, (Begin("1F0"), loss_call(0), End("1F0"), Begin("1B0"), End("1B0"),
                          Begin("1F1"), loss_call(1), End("1F1"), Begin("1B1"), End("1B1"))
                   + tail)
    assert early_loss.loss_plan(last) == early_loss.LossPlan(2, (0, 1))  # the third End
    first = Program(0, 2, (Begin("0F0"), End("0F0"), Begin("0B0"), End("0B0")) + tail)
    assert early_loss.loss_plan(first) == early_loss.LossPlan(-1, (0, 1))
    meets = Comm(0, 0, False, ("x",), ("y",), ((2,),), "float", (Coll("all_reduce", (1, 0)),))
    blocked = Program(0, 2, (Begin("0F0"), meets, End("0F0")) + tail)
    assert early_loss.loss_plan(blocked) is None
    other = Comm(0, 0, False, ("x",), ("y",), ((2,),), "float", (Coll("all_reduce", (0, 2)),))
    assert early_loss.loss_plan(Program(0, 3, (Begin("0F0"), other, End("0F0"), LossSum(
        (0, 1, 2)), OptimizerStep()))) == early_loss.LossPlan(-1, (0, 1, 2))
    assert early_loss.loss_plan(Program(0, 2, tail[1:])) is None  # no LossSum
    early_loss.ENABLED = False
    try:
        assert early_loss.loss_plan(last) is None
    finally:
        early_loss.ENABLED = True


def test_early_receives_skip_a_tag_used_twice():
    from ssdsl.ir.region import Region
    from ssdsl.lower.instr import P2P, Begin, Comm, End, Msg
    r = Region.full((2,))

    def recv(tag: int) -> Comm:
        step = P2P((), (r,), (Msg("recv", 1, tag, 0, 0, r),))
        return Comm(0, 0, False, (), ("x",), (), "float", (step,))
    prog = Program(0, 2, (Begin("a"), recv(7), End("a"), Begin("b"), recv(8), recv(9), End("b"),
                          Begin("c"), recv(9), End("c")))
    plan = early_receives(prog, lookahead=1)
    assert [[x.tag for x in unit] for unit in plan] == [[7, 8], [], []]


def test_overlap_parts_start_in_order_once_their_gradients_are_final():
    """The persistent hooks of ``Parts``: nothing starts outside the last backward; inside it a
    part starts when all its weights' gradients are final and every part before it started; a
    weight that gradients reach twice counts once; what the backward did not reach starts at
    its end. The oracle is the order written out by hand for this little graph."""
    from ssdsl.runtime.overlap import OverlapPlan, Parts
    leaves = {f"w{i}": torch.ones(2, requires_grad=True) for i in range(4)}
    started: list[int] = []
    plan = OverlapPlan(0, {0: ((3,), (2, 1), (0,))})
    parts = Parts(plan, {0: tuple(leaves)}, leaves, started.append, carrier=0)
    assert parts.carrier == 2  # the loss rides in the bucket's last part
    (leaves["w3"] * 2).sum().backward()
    assert started == []  # not the last backward: the hooks do nothing
    parts.begin()
    (leaves["w1"] * 3).sum().backward()  # part 1 lacks w2, and part 0 has not started
    assert started == []
    (leaves["w3"] + leaves["w2"]).sum().backward()  # parts 0 and 1 complete, in order
    assert started == [0, 1]
    (leaves["w3"] * 5).sum().backward()  # w3 again: counted once, nothing new
    assert started == [0, 1]
    parts.finish()  # w0 was never reached: its part starts at the end
    assert started == [0, 1, 2]


def test_the_sender_thread_is_used_where_the_host_has_a_core_for_it(monkeypatch):
    from ssdsl.runtime import sender
    monkeypatch.setattr(sender.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(sender.torch, "get_num_threads", lambda: 1)
    for local, want in (("1", True), ("2", True), ("4", False)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert sender.wanted() is want, local
    monkeypatch.setattr(sender.torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert sender.wanted() is False  # 2 ranks of 2 threads fill 2 cores
    # pinned by the launcher to one core of 2: the host's cores count (the thread runs on any)
    monkeypatch.setattr(sender.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(sender.torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("SSDSL_RANK_CPUS", "0")
    monkeypatch.setenv("SSDSL_HOST_CPUS", "0,1")
    assert sender.wanted() is True
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert sender.wanted() is False
    monkeypatch.delenv("SSDSL_RANK_CPUS")
    monkeypatch.delenv("SSDSL_HOST_CPUS")
    assert sender.wanted() is False  # unpinned on one core: 4 ranks fill it
    monkeypatch.setattr(sender, "ALWAYS", True)
    assert sender.wanted() is True
    monkeypatch.setattr(sender, "ENABLED", False)
    assert sender.wanted() is False
