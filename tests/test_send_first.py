"""A rank's last backward sends its gradients before computing the weights'.

In a pipeline's cool-down each stage's last backward is what the stage before waits for, and
nothing waits on the stage itself afterwards. The lowering splits that backward in halves
(``_split_last``): a ``BackwardInput`` computes only the gradients the unit sends on, the sends
go out, and a ``BackwardWeight`` computes the weights' gradients from the gradients the input half
kept, one walk's work in all. Where it cannot split (ZeRO stage 3, or ``SPLIT_LAST`` off), it
walks that backward in two (``Backward.part``): the second walk whole, on hosts whose ranks have
cores of their own. Oracles: the plain single-device model (loss and every gradient of step 0 in
float64, every rank's lowered program simulated in one process, which runs the very handlers the
ranks run), and the plans' own shape (which rank sends what to whom, read from the programs'
communication, not from the rule under test).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ssdsl.lower.build as build
from ssdsl.lower.text import parse_program, program_text
from ssdsl.runtime.simulate import simulate_model_file
from ssdsl.runtime.verify import compare_with_model

from tests.test_boundary_reads import RECOMPUTED  # 1F1B on 2 devices, stage 1 recomputed
from tests.test_own_loss import _plan



def _lower(tmp: Path, plan: str, world: int, **sets):
    """Every rank's checked program of ``plan`` (a stdlib name or a plan's text) on the GPT."""
    if "\n" in plan:
        (tmp / "p.ssp").write_text(plan)
        plan = str(tmp / "p.ssp")
    return _plan(plan, world, **sets)


def _parts(p) -> list[tuple[int, str]]:
    return [(i, x.part) for i, x in enumerate(p.instructions)
            if x.kind == "backward" and x.part != "whole"]


def _halves(p) -> list[tuple[int, str]]:
    """The split backward halves inside ``B`` units (not ``I``/``W`` units of the plan's own)."""
    out, unit = [], ""
    for i, x in enumerate(p.instructions):
        if x.kind == "begin":
            unit = x.unit
        elif x.kind in ("backward_input", "backward_weight") and "B" in unit:
            out.append((i, x.kind))
    return out


def _split_b_units(p) -> list[str]:
    """The ``B`` units that hold an input half (split by the lowering)."""
    out, unit = [], ""
    for x in p.instructions:
        if x.kind == "begin":
            unit = x.unit
        elif x.kind == "backward_input" and "B" in unit:
            out.append(unit)
    return out


def _last_backward_sends(p) -> bool:
    """Whether the rank's last backward unit sends another rank a gradient (a backward comm
    with a send)."""
    units = [i for i, x in enumerate(p.instructions) if x.kind == "begin" and "B" in x.unit]
    return any(x.kind == "comm" and x.backward and any(
        getattr(s, "msgs", None) and any(m.kind == "send" for m in s.msgs) for s in x.steps)
        for x in p.instructions[units[-1]:])


PIPELINES = [("1f1b", 2, {}), ("1f1b", 4, {}), ("gpipe", 2, {}), ("interleaved_1f1b", 2, {}),
             ("dp_tp_1f1b", 8, {"dp": 2, "tp": 2, "microbatches": 2})]


@pytest.mark.parametrize("plan, world, sets", PIPELINES,
                         ids=[f"{p}-{w}" for p, w, _ in PIPELINES])
def test_the_last_backward_is_split_sends_between_its_halves_and_trains_like_the_model(
        tmp_path, monkeypatch, plan, world, sets):
    """``DEFER_W`` off: only the rank's last backward is split."""
    monkeypatch.setattr(build, "DEFER_W", False)
    mf, m, programs = _lower(tmp_path, plan, world, **sets)
    for p in programs:
        assert _parts(p) == []  # no backward walked twice
        halves = _halves(p)
        if not _last_backward_sends(p):  # the first stage: nobody waits for its gradients
            assert halves == []
            continue
        kinds = [k for _, k in halves]
        assert kinds[0] == "backward_input" and kinds[-1] == "backward_weight", kinds
        i = halves[0][0]
        j = next(k for k, kind in halves if kind == "backward_weight")
        # all in the rank's last backward unit: no unit begins after the input half
        assert not any(x.kind == "begin" for x in p.instructions[i:])
        between = p.instructions[i + 1:j]
        sends = [x for x in between if x.kind == "comm"]
        assert sends and all(x.backward for x in sends)
        assert all(x.kind in ("comm", "backward_input") for x in between)
        # the forward of that unit reads its mixing calls' weights through weight cuts
        assert any(x.kind == "cut" and "|w" in x.out for x in p.instructions)
        assert not any(x.kind.startswith("backward") for x in p.instructions[halves[-1][0] + 1:])
        assert parse_program(program_text(p)) == p
    problems, _, _ = compare_with_model(m, mf, simulate_model_file(m, programs, mf))
    assert not problems, problems


def _freed_mb(x) -> int:
    """The micro-batch whose forward values a ``Free`` frees (``name@mb``)."""
    mbs = {int(re.search(r"@(\d+)", v).group(1)) for v in x.values if "@" in v}
    assert len(mbs) == 1, x.values
    return mbs.pop()


@pytest.mark.parametrize("plan, world, sets", PIPELINES,
                         ids=[f"{p}-{w}" for p, w, _ in PIPELINES])
def test_stage_k_defers_the_weight_halves_of_its_first_k_backwards_to_its_last(
        tmp_path, plan, world, sets):
    """``DEFER_W`` (the default, ranks with cores of their own): the rank whose first stage is
    k > 0 splits its first k backward units that send gradients back and its last one; the
    first ones hold their input halves alone, and their weight halves (with the ``Free`` of
    their forwards' values) run in the last backward unit, after its own input half and sends.
    Every other backward stays whole. Oracles: the plain model (every rank's program simulated)
    and the programs' own units and sends."""
    mf, m, programs = _lower(tmp_path, plan, world, **sets)
    deferring = 0
    for p in programs:
        assert _parts(p) == []
        units = []  # per B unit: its name and what runs in it (kinds, sends, weight halves)
        last_kind, unit = None, None
        for x in p.instructions:
            if x.kind == "begin":
                unit = (x.unit, []) if "B" in x.unit else None
                if unit is not None:
                    units.append(unit)
            elif unit is not None:
                sends = x.kind == "comm" and x.backward and any(
                    m.kind == "send" for st in x.steps for m in getattr(st, "msgs", ()))
                if x.kind == "free" and last_kind == "backward_weight":
                    unit[1].append(("W", _freed_mb(x)))
                elif sends or x.kind in ("backward_input", "backward"):
                    unit[1].append("send" if sends else x.kind)
            if x.kind.startswith("backward"):
                last_kind = x.kind
        if not units:
            continue
        first_stage = min(int(u.split("B")[0]) for u, _ in units)
        sending = [k for k, (_, ks) in enumerate(units) if "send" in ks]
        want = set(sending[:first_stage]) | ({len(units) - 1} if len(units) - 1 in sending
                                             else set())
        split = {k for k, (_, ks) in enumerate(units) if "backward_input" in ks}
        assert split == want, (first_stage, units)
        for k, (u, ks) in enumerate(units):
            weights = [w for w in ks if isinstance(w, tuple)]
            if k in split and k != len(units) - 1:
                assert weights == [] and "backward" not in ks, (u, ks)  # its half waits
            elif k == len(units) - 1 and k in split:
                deferred = [int(units[j][0].split("B")[1]) for j in sorted(split - {k})]
                assert [mb for _, mb in weights] == [int(u.split("B")[1])] + deferred, ks
                first_w = next(i for i, w in enumerate(ks) if isinstance(w, tuple))
                assert "send" in ks[:first_w] and "backward_input" in ks[:first_w], ks
                deferring += bool(deferred)
            else:
                assert "backward_input" not in ks, (u, ks)
    assert deferring  # some rank defers a weight half (else this tests nothing)
    problems, _, _ = compare_with_model(m, mf, simulate_model_file(m, programs, mf))
    assert not problems, problems


@pytest.mark.parametrize("plan, world, sets", PIPELINES,
                         ids=[f"{p}-{w}" for p, w, _ in PIPELINES])
def test_without_the_split_the_last_backward_is_walked_twice_and_trains_like_the_model(
        tmp_path, monkeypatch, plan, world, sets):
    monkeypatch.setattr(build, "SPLIT_LAST", False)
    mf, m, programs = _lower(tmp_path, plan, world, **sets)
    for p in programs:
        parts = _parts(p)
        assert _halves(p) == []
        if not _last_backward_sends(p):  # the first stage: nobody waits for its gradients
            assert parts == []
            continue
        (i, first), (j, second) = parts
        assert (first, second) == ("sent", "rest")
        a, b = p.instructions[i], p.instructions[j]
        assert (a.seeds, a.roots, a.collect) == (b.seeds, b.roots, b.collect)
        between = p.instructions[i + 1:j]
        assert between and all(x.kind == "comm" and x.backward for x in between)
        # in the rank's last backward unit: no backward of any unit runs after the second walk
        assert not any(x.kind.startswith("backward") for x in p.instructions[j + 1:])
        assert parse_program(program_text(p)) == p
    problems, _, _ = compare_with_model(m, mf, simulate_model_file(m, programs, mf))
    assert not problems, problems


def test_without_the_rule_every_backward_is_one_walk(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "SEND_FIRST", False)
    mf, m, programs = _lower(tmp_path, "1f1b", 2)
    assert all(_parts(p) == [] and _halves(p) == [] for p in programs)
    problems, _, _ = compare_with_model(m, mf, simulate_model_file(m, programs, mf))
    assert not problems, problems


def test_a_recomputed_stage_is_walked_once(tmp_path):
    """A second walk would run the recomputed calls again, and a split backward refuses
    recompute: the stage keeps one walk."""
    mf, m, programs = _lower(tmp_path, RECOMPUTED, 2)
    assert any(x.kind == "recompute" for x in programs[1].instructions)
    assert all(_parts(p) == [] and _halves(p) == [] for p in programs)
    problems, _, _ = compare_with_model(m, mf, simulate_model_file(m, programs, mf))
    assert not problems, problems


@pytest.mark.parametrize("plan, world, sets", [("megatron_tp", 2, {}), ("dp", 2, {}),
                                               ("zb_h1", 2, {})])
def test_plans_that_send_no_stage_gradients_or_split_already_are_unchanged(
        tmp_path, plan, world, sets):
    """Tensor and data parallelism send no gradient to a waiting stage; a zero-bubble plan's
    backwards are split by the plan itself."""
    _, _, programs = _lower(tmp_path, plan, world, **sets)
    assert all(_parts(p) == [] and _halves(p) == [] for p in programs)


@pytest.mark.parametrize("split", [True, False])
def test_a_job_whose_ranks_share_cores_plans_every_backward_in_one_walk(tmp_path, monkeypatch,
                                                                       split):
    """The job decides once, before planning (``JobSpec.send_first``): on CPU ranks that share
    cores the second walk would take a core another rank needs. Without the split the programs
    then have no parts; the split of the last backward adds no work and stays, the split of
    every other one (``DEFER_W``) costs CPU and goes. All train like the model."""
    import attrs

    from ssdsl.runtime.job import JobSpec, for_host, plan_from_graph
    from tests.test_own_loss import GPT

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("SSDSL_RANK_CPUS", raising=False)
    monkeypatch.setattr(build, "SPLIT_LAST", split)
    spec = JobSpec(str(GPT), "1f1b", dtype="float64")
    assert for_host(spec, local=4, threads=1).send_first is False   # 4 ranks on 2 cores
    assert for_host(spec, local=2, threads=1).send_first is True    # a core each
    assert for_host(spec, local=2, threads=2).send_first is False   # 4 threads on 2 cores
    assert for_host(spec, local=4, threads=1, device="cuda").send_first is True  # a GPU each
    decided = attrs.evolve(spec, send_first=True)
    assert for_host(decided, local=4, threads=1) is decided           # decided once
    compiled = attrs.evolve(spec, compiled="out")  # the files keep what they were written with
    assert for_host(compiled, local=4, threads=1).send_first is None

    mf, _, _ = _lower(tmp_path, "1f1b", 2)  # the shared float64 trace
    from tests.test_own_loss import _GRAPH
    for shared in (True, False):
        job = for_host(spec, local=4 if shared else 2, threads=1)
        m = plan_from_graph(job, 2, _GRAPH[0])
        assert m.send_first is not shared
        programs = build.lower_plan(m).programs
        assert any(_parts(p) for p in programs) is (not shared and not split)
        assert any(_halves(p) for p in programs) is split
        split_units = max(len({u for u in _split_b_units(p)}) for p in programs)
        # stage 1's last backward, and with DEFER_W its first one too
        assert split_units == (0 if not split else 1 if shared else 2)
        problems, _, _ = compare_with_model(m, mf, simulate_model_file(m, programs, mf))
        assert not problems, problems


def test_the_launcher_gives_its_ranks_the_threads_it_decides_with(monkeypatch):
    from ssdsl.runtime.launch import rank_threads
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert rank_threads(4, {}) == 1 and rank_threads(2, {}) == 1 and rank_threads(1, {}) == 2
    assert rank_threads(4, {"OMP_NUM_THREADS": "3"}) == 3
    assert rank_threads(2, {"OMP_NUM_THREADS": "x"}) == 1  # unreadable: the cores shared out
