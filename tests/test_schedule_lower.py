"""Lowering schedule directives: stdlib plans equal the Python builders; faults point at lines."""

from __future__ import annotations

import pytest

from ssdsl.check import Deadlock, ForwardAfterBackward, MissingUnit, check_schedule
from ssdsl.elaborate import elaborate_text
from ssdsl.elaborate.directives import (All, Assign, Microbatch, OrderBefore, OrderSequence,
                                        StageRef, Stages, WorkUnit)
from ssdsl.resources import stdlib_dir
from ssdsl.schedule.builders import gpipe, interleaved_1f1b, one_f_one_b
from ssdsl.schedule.lower import (OrderConflict, StageAssignedTwice, UnassignedStage,
                                  UnsupportedOrderUnit, lower_schedule)


def _stdlib(name: str, world: int, **args):
    text = (stdlib_dir() / f"{name}.ssp").read_text()
    return elaborate_text(text, f"{name}.ssp", world=world, args=args).directives


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (3, 7), (1, 3)])
def test_stdlib_1f1b_and_gpipe_equal_builders(p, m):
    for name, oracle in (("1f1b", one_f_one_b(p, m)), ("gpipe", gpipe(p, m))):
        lowered = lower_schedule(_stdlib(name, p, stages=p, microbatches=m))
        assert lowered.schedule.text() == oracle.text()
        check_schedule(lowered.schedule)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (2, 4, 3), (2, 2, 2)])
def test_stdlib_interleaved_equals_builder(p, m, v):
    lowered = lower_schedule(_stdlib("interleaved_1f1b", p, stages=p, microbatches=m, chunks=v))
    assert lowered.schedule.text() == interleaved_1f1b(p, m, v).text()


def test_wide_stages_become_pipeline_ranks():
    lowered = lower_schedule(_stdlib("1f1b", 4, stages=2, microbatches=4, width=2))
    assert lowered.groups == ((0, 1), (2, 3))
    assert lowered.schedule.text() == one_f_one_b(2, 4).text()


def test_spans_point_at_the_order_statement():
    lowered = lower_schedule(_stdlib("1f1b", 2, stages=2, microbatches=2))
    span = lowered.schedule.programs[1].spans[0]
    assert (span.file, span.line) == ("1f1b.ssp", 18)


def sp(line: int, col: int = 1):
    from ssdsl.source import Span
    return Span.point("p.ssp", line, col, 5)


def F(s, m):  # noqa: N802
    return WorkUnit("forward", StageRef("st", s), m)


def B(s, m):  # noqa: N802
    return WorkUnit("backward", StageRef("st", s), m)


def _base(n=2, m=2):
    return [Microbatch("batch", m, sp(1)), Stages("st", n, (), sp(2))] + \
        [Assign(StageRef("st", s), (s,), sp(3 + s)) for s in range(n)]


def test_no_order_statements_default_to_gpipe():
    lowered = lower_schedule(_base(3, 4))
    assert lowered.schedule.text() == gpipe(3, 4).text()


def test_before_statements_shape_the_default_order():
    # Ask device 1 for 1F1B-like steady state: 1B0 before 1F1.
    ds = _base(2, 2) + [OrderBefore(B(1, 0), F(1, 1), sp(9, 5))]
    lowered = lower_schedule(ds)
    assert str(lowered.schedule.programs[1]) == "1F0 1B0 1F1 1B1"
    check_schedule(lowered.schedule)


def test_before_against_data_is_a_cycle_error_at_its_line():
    ds = _base(2, 2) + [OrderBefore(B(1, 0), F(1, 0), sp(9, 5))]
    with pytest.raises(OrderConflict) as info:
        lower_schedule(ds)
    assert (info.value.span.line, info.value.span.column) == (9, 5)
    assert "1F0 -> 1B0 -> 1F0" in info.value.message


def test_before_against_a_sequence():
    ds = _base(2, 1) + [OrderSequence((0,), (F(0, 0), B(0, 0)), sp(7)),
                        OrderSequence((1,), (F(1, 0), B(1, 0)), sp(8)),
                        OrderBefore(B(1, 0), F(1, 0), sp(9, 3))]
    with pytest.raises(OrderConflict) as info:
        lower_schedule(ds)
    assert (info.value.span.line, info.value.span.column) == (9, 3)


def test_unassigned_stage_points_at_stages_statement():
    ds = _base(3, 1)[:-1]
    with pytest.raises(UnassignedStage) as info:
        lower_schedule(ds)
    assert info.value.span.line == 2


def test_stage_assigned_twice():
    ds = _base(2, 1) + [Assign(StageRef("st", 0), (1,), sp(11))]
    with pytest.raises(StageAssignedTwice) as info:
        lower_schedule(ds)
    assert info.value.span.line == 11


def test_order_of_plain_operators_is_not_a_pipeline_unit():
    ds = _base(2, 1) + [OrderSequence((0,), (WorkUnit("op", All(), None),), sp(12))]
    with pytest.raises(UnsupportedOrderUnit) as info:
        lower_schedule(ds)
    assert info.value.span.line == 12


def test_no_stages_no_schedule():
    assert lower_schedule([Microbatch("batch", 2, sp(1))]) is None


PLAN = """plan broken(m: int = 3)
microbatch along batch into m
stages into 2 as st
assign st[0] to device 0
assign st[1] to device 1
order on device 0: forward st[0] mb 0..m, backward st[0] mb 0..m
order on device 1: forward st[1] mb 1, backward st[1] mb 1
order on device 1: forward st[1] mb 0, backward st[1] mb 0, forward st[1] mb 2
"""


def test_plan_text_to_checker_error_positions():
    """From .ssp text: a missing backward is reported at the stage's first order statement."""
    lowered = lower_schedule(elaborate_text(PLAN, "broken.ssp", world=2).directives)
    with pytest.raises(MissingUnit) as info:
        check_schedule(lowered.schedule)
    assert (info.value.span.file, info.value.span.line, info.value.span.column) == \
        ("broken.ssp", 7, 1)


def test_plan_text_backward_first_and_deadlock():
    text = PLAN.replace("forward st[1] mb 1, backward st[1] mb 1",
                        "backward st[1] mb 1, forward st[1] mb 1")
    text = text.replace("forward st[1] mb 2\n", "forward st[1] mb 2, backward st[1] mb 2\n")
    lowered = lower_schedule(elaborate_text(text, "b2.ssp", world=2).directives)
    with pytest.raises(ForwardAfterBackward) as info:
        check_schedule(lowered.schedule)
    assert info.value.span.line == 7
    fixed = PLAN.replace("forward st[1] mb 2\n", "forward st[1] mb 2, backward st[1] mb 2\n")
    fixed = fixed.replace("order on device 0: forward st[0] mb 0..m, backward st[0] mb 0..m",
                          "order on device 0: forward st[0] mb 0, backward st[0] mb 0, "
                          "forward st[0] mb 1..m, backward st[0] mb 1..m")
    lowered = lower_schedule(elaborate_text(fixed, "b3.ssp", world=2).directives)
    with pytest.raises(Deadlock) as info:  # device 0 waits for 1B0, device 1 for 0F1
        check_schedule(lowered.schedule)
    assert {s.line for s in info.value.spans} == {6, 7}
