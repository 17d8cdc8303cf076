"""Units, programs and stage graphs: text forms round-trip, dependencies match hand-written ones."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ssdsl.schedule.deps import data_deps, messages, required_units
from ssdsl.schedule.builders import gpipe, one_f_one_b
from ssdsl.schedule.units import B, F, Pass, Program, Schedule, StageGraph, Unit

units = st.builds(Unit, st.integers(0, 999), st.sampled_from(list(Pass)), st.integers(0, 9999))


@given(units)
def test_unit_text_round_trips(unit):
    assert Unit.parse(str(unit)) == unit


@given(st.lists(units, max_size=20))
def test_program_text_round_trips(us):
    prog = Program.of(3, us)
    assert Program.parse(3, str(prog)) == prog


def test_unit_text_is_stage_pass_microbatch():
    assert str(F(2, 3)) == "2F3"
    assert Unit.parse("12B40") == Unit(12, Pass.B, 40)
    assert Unit.parse("0W1").kind is Pass.W


@pytest.mark.parametrize("bad", ["F2.3", "2X3", "2F", "F3", "", "2f3"])
def test_unit_parse_rejects(bad):
    with pytest.raises(ValueError):
        Unit.parse(bad)


def test_schedule_text_round_trips():
    s = one_f_one_b(3, 5)
    assert Schedule.parse(s.stages, 5, s.text()) == s
    assert s.text().splitlines()[2] == "2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4"


def test_program_needs_one_span_per_unit():
    with pytest.raises(ValueError):
        Program(0, [F(0, 0), B(0, 0)], [None])


def test_stage_edges_must_go_forward():
    with pytest.raises(ValueError):
        StageGraph([0, 1], [(1, 0)])
    with pytest.raises(ValueError):
        StageGraph([0, 1], [(0, 2)])


SKIP3 = StageGraph([0, 1, 2], [(0, 1), (1, 2), (0, 2)])


def test_dependencies_with_a_skip_edge():
    text = lambda u: [str(d) for d in data_deps(Unit.parse(u), SKIP3)]  # noqa: E731
    assert text("0F4") == []
    assert text("2F4") == ["0F4", "1F4"]
    assert text("0B4") == ["0F4", "1B4", "2B4"]
    assert text("2B4") == ["2F4"]


def test_dependencies_of_split_backward():
    g = StageGraph.chain([0, 1, 2])
    text = lambda u: [str(d) for d in data_deps(Unit.parse(u), g, split_backward=True)]  # noqa: E731
    assert text("1I0") == ["1F0", "2I0"]
    assert text("1W0") == ["1I0"]
    assert text("2I0") == ["2F0"]


def test_required_units_counts():
    assert len(list(required_units(SKIP3, 4))) == 3 * 2 * 4
    assert len(set(required_units(SKIP3, 4, split_backward=True))) == 3 * 3 * 4


def test_messages_cross_devices_only():
    # Stages 0 and 1 share device 0: only edges into and out of stage 2 are messages.
    g = StageGraph([0, 0, 1], [(0, 1), (1, 2), (0, 2)])
    msgs = sorted(str(m) for m in messages(gpipe(2, 1, stages=g)))
    assert msgs == ["0F0->2F0", "1F0->2F0", "2B0->0B0", "2B0->1B0"]
