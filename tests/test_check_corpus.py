"""A corpus of wrong schedules: each must raise its error class at the line and column of the order
statement to blame. Programs are written as plan-like text (one ``order on device d: ...`` line per
statement) so spans are real positions and the rendered errors show the source line."""

from __future__ import annotations

import pytest

from ssdsl.check import (CommModel, Deadlock, DuplicateUnit, ForwardAfterBackward, MisplacedUnit,
                         MissingUnit, OrderAgainstData, UnknownUnit, check_schedule)
from ssdsl.errors import ErrorGroup
from ssdsl.schedule.units import Program, Schedule, StageGraph, Unit
from ssdsl.source import Span, remember_source

PREFIX = "order on device {d}: "


def plan(name: str, stages: StageGraph, m: int, statements: list[tuple[int, str]], *,
         split_backward: bool = False) -> Schedule:
    """Line i + 1 of ``name`` orders ``units`` on device d; each unit gets that line's span."""
    lines = ["plan corpus()"]
    units: dict[int, list[Unit]] = {d: [] for d in range(stages.num_devices)}
    spans: dict[int, list[Span]] = {d: [] for d in range(stages.num_devices)}
    for d, text in statements:
        lines.append(PREFIX.format(d=d) + text)
        col = len(PREFIX.format(d=d)) + 1
        span = Span.point(name, len(lines), col, len(text))
        for tok in text.split():
            units[d].append(Unit.parse(tok))
            spans[d].append(span)
    remember_source(name, "\n".join(lines) + "\n")
    progs = [Program(d, units[d], spans[d]) for d in range(stages.num_devices)]
    return Schedule(stages, m, progs, split_backward)


COL = len(PREFIX.format(d=0)) + 1  # where every statement's unit list starts
CHAIN2, CHAIN3 = StageGraph.chain([0, 1]), StageGraph.chain([0, 1, 2])
SKIP3 = StageGraph([0, 1, 2], [(0, 1), (1, 2), (0, 2)])  # stage 0 also feeds stage 2
INTERLEAVED = StageGraph.chain([0, 1, 0, 1])  # device 0 hosts stages 0 and 2
TWO_ON_ONE = StageGraph.chain([0, 1, 1])  # device 1 hosts stages 1 and 2

# name, schedule, expected class, line, column (of the statement to blame), comm model
CASES = [
    ("missing_backward_mb", plan("c1.ssp", CHAIN2, 3, [
        (0, "0F0 0F1 0B0 0F2 0B1 0B2"),
        (1, "1F0 1B0 1F1 1B1"),
        (1, "1F2"),
    ]), MissingUnit, 3, COL, CommModel.ASYNC),
    ("duplicate_mb", plan("c2.ssp", CHAIN2, 2, [
        (0, "0F0 0F1"),
        (0, "0F1 0B0 0B1"),
        (1, "1F0 1B0 1F1 1B1"),
    ]), DuplicateUnit, 3, COL, CommModel.ASYNC),
    ("backward_before_forward", plan("c3.ssp", CHAIN2, 2, [
        (0, "0F0 0F1 0B0 0B1"),
        (1, "1B0"),
        (1, "1F0 1F1 1B1"),
    ]), ForwardAfterBackward, 3, COL, CommModel.ASYNC),
    ("interleaved_chunk_before_its_input", plan("c4.ssp", INTERLEAVED, 2, [
        (0, "2F0 0F0 0F1 2F1 2B0 2B1 0B0 0B1"),
        (1, "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1"),
    ]), Deadlock, 2, COL, CommModel.ASYNC),
    ("weight_grad_before_input_grad", plan("c5.ssp", CHAIN2, 1, [
        (0, "0F0 0I0 0W0"),
        (1, "1F0"),
        (1, "1W0 1I0"),
    ], split_backward=True), OrderAgainstData, 4, COL, CommModel.ASYNC),
    ("backward_before_successor_backward_same_device", plan("c6.ssp", TWO_ON_ONE, 1, [
        (0, "0F0 0B0"),
        (1, "1F0 2F0"),
        (1, "1B0 2B0"),
    ]), OrderAgainstData, 4, COL, CommModel.ASYNC),
    ("deadlock_two_devices", plan("c7.ssp", CHAIN2, 2, [
        (0, "0F0 0B0 0F1 0B1"),
        (1, "1F1 1B1"),
        (1, "1F0 1B0"),
    ]), Deadlock, 2, COL, CommModel.ASYNC),
    ("deadlock_over_skip_edge", plan("c8.ssp", SKIP3, 2, [
        (0, "0F0"),
        (0, "0B0 0F1 0B1"),
        (1, "1F0 1F1 1B0 1B1"),
        (2, "2F1 2F0 2B0 2B1"),
    ]), Deadlock, 3, COL, CommModel.ASYNC),
    ("one_f_one_b_with_blocking_sends", plan("c9.ssp", CHAIN3, 4, [
        (0, "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3"),
        (1, "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3"),
        (2, "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"),
    ]), Deadlock, 3, COL, CommModel.RENDEZVOUS),
    ("stage_on_wrong_device", plan("c10.ssp", CHAIN2, 1, [
        (0, "0F0 1F0 0B0"),
        (1, "1B0"),
    ]), MisplacedUnit, 2, COL, CommModel.ASYNC),
    ("microbatch_out_of_range", plan("c11.ssp", CHAIN2, 2, [
        (0, "0F0 0F1 0B0 0B1"),
        (1, "1F0 1B0 1F1 1B1"),
        (1, "1F2"),
    ]), UnknownUnit, 4, COL, CommModel.ASYNC),
    ("split_pass_in_whole_backward_plan", plan("c12.ssp", CHAIN2, 1, [
        (0, "0F0 0B0"),
        (1, "1F0 1I0"),
    ]), UnknownUnit, 3, COL, CommModel.ASYNC),
    ("second_chunk_never_ordered", plan("c13.ssp", INTERLEAVED, 1, [
        (0, "0F0 0B0"),
        (1, "1F0 3F0 3B0 1B0"),
    ]), MissingUnit, 2, COL, CommModel.ASYNC),
]


@pytest.mark.parametrize("name,schedule,cls,line,col,comm", CASES, ids=[c[0] for c in CASES])
def test_corpus_error_class_line_column(name, schedule, cls, line, col, comm):
    with pytest.raises(cls) as info:
        check_schedule(schedule, comm=comm)
    err = info.value
    assert type(err) is cls
    assert (err.span.line, err.span.column) == (line, col)
    text = err.render()
    assert text.startswith(f"{err.span.file}:{line}:{col}: ")
    assert "^" in text  # the source line is shown with carets


def test_corpus_is_large_enough():
    assert len(CASES) >= 10


def test_deadlock_prints_grid_with_stuck_units():
    schedule = CASES[6][1]
    with pytest.raises(Deadlock) as info:
        check_schedule(schedule)
    text = info.value.render()
    # Device 0 waits before 0B0 for 1B0; device 1 waits before 1F1 for 0F1.
    assert "[0B0]" in text and "[1F1]" in text
    assert "dev 0" in text and "dev 1" in text
    assert "devices 0, 1 wait for each other" in text


def test_independent_errors_reported_together_in_source_order():
    schedule = plan("c14.ssp", CHAIN2, 2, [
        (0, "0F0 0F1 0B0 0B1"),
        (1, "1F0 1B0 1F1 1B1 7F0"),
        (0, "0F9"),
    ])
    with pytest.raises(ErrorGroup) as info:
        check_schedule(schedule)
    errs = info.value.errors
    assert [type(e) for e in errs] == [UnknownUnit, UnknownUnit]
    assert [e.span.line for e in errs] == [3, 4]


def test_order_error_names_both_statements():
    with pytest.raises(ForwardAfterBackward) as info:
        check_schedule(CASES[2][1])
    err = info.value
    assert [s.line for s in err.spans] == [3, 4]
    assert "line 4" in err.render()
