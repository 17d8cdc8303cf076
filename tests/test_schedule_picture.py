"""Pictures: golden text timelines, and text and SVG read back against the simulated times."""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ssdsl.check import Deadlock, check_schedule
from ssdsl.schedule.builders import gpipe, interleaved_1f1b, one_f_one_b
from ssdsl.schedule.grid import program_grid
from ssdsl.schedule.picture import timeline_svg, timeline_text
from ssdsl.schedule.simulate import Costs, simulate
from ssdsl.schedule.units import Program, Schedule

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("SSDSL_UPDATE_GOLDEN") == "1"


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE or not path.exists():
        path.write_text(text)
        if not UPDATE:
            pytest.fail(f"wrote new golden file {path}; review it and run again")
    assert text == path.read_text()


def _deadlocked() -> Schedule:
    s = one_f_one_b(3, 4)
    progs = list(s.programs)
    progs[1] = Program.parse(1, "1F0 1F1 1F3 1B0 1F2 1B1 1B2 1B3")
    return Schedule(s.stages, 4, progs)


CASES = {
    "timeline_1f1b_p3_m4.txt": lambda: timeline_text(simulate(one_f_one_b(3, 4))).plain,
    "timeline_gpipe_p2_m3.txt": lambda: timeline_text(simulate(gpipe(2, 3))).plain,
    "timeline_interleaved_p2_m4_v2.txt":
        lambda: timeline_text(simulate(interleaved_1f1b(2, 4, 2), Costs(forward=0.5))).plain,
    "grid_1f1b_p4_m6.txt": lambda: program_grid(one_f_one_b(4, 6)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    _golden(name, CASES[name]() + "\n")


def test_golden_deadlock_report():
    with pytest.raises(Deadlock) as info:
        check_schedule(_deadlocked())
    _golden("deadlock_1f1b_p3_m4.txt", info.value.render() + "\n")


@pytest.mark.parametrize("schedule", [one_f_one_b(4, 8), gpipe(3, 5)], ids=["1f1b", "gpipe"])
def test_text_timeline_places_units_at_their_times(schedule):
    """Read each row back: a label starting at column c means the unit starts at slot c / width."""
    r = simulate(schedule)
    lines = timeline_text(r).plain.splitlines()[1:1 + r.num_devices]
    width = 3  # labels 'F7' / 'B7' plus one space
    offset = len("dev 0  ")
    for d, line in enumerate(lines):
        body = line[offset:]
        found = {m.group(0): m.start() / width for m in re.finditer(r"[FB]\d+", body)}
        expected = {f"{e.unit.kind.value}{e.unit.mb}": e.start for e in r.events[d]}
        assert found == expected


def test_svg_boxes_match_events():
    r = simulate(one_f_one_b(4, 8))
    svg = timeline_svg(r, title="1F1B <p=4>", width=1000)
    root = ET.fromstring(svg)  # well-formed XML, the title escaped
    ns = {"s": "http://www.w3.org/2000/svg"}
    boxes = [rect for rect in root.iter("{http://www.w3.org/2000/svg}rect")
             if rect.find("s:title", ns) is not None]
    assert len(boxes) == 4 * 8 * 2
    scale = (1000 - 64 - 20) / r.makespan
    by_unit = {e.unit: e for evs in r.events for e in evs}
    for rect in boxes:
        unit_text = rect.find("s:title", ns).text.split()[0]
        e = next(ev for u, ev in by_unit.items() if str(u) == unit_text)
        assert float(rect.get("x")) == pytest.approx(64 + e.start * scale, abs=0.01)
        assert float(rect.get("width")) == pytest.approx((e.end - e.start) * scale, abs=0.01)
    assert "1F1B &lt;p=4&gt;" in svg


def _labelled_boxes(svg: str) -> tuple[int, set[str]]:
    root = ET.fromstring(svg)
    texts = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")
             if t.get("class") == "lbl"}
    return int(root.get("width")), texts


@pytest.mark.parametrize("mbs", [8, 32])
def test_svg_width_grows_so_every_box_keeps_its_label(mbs):
    r = simulate(one_f_one_b(4, mbs))
    width, labels = _labelled_boxes(timeline_svg(r))
    assert {f"{p}{k}" for p in "FB" for k in range(mbs)} <= labels  # B31 too, not only B9
    assert width > 80 * mbs / 2  # grows with the micro-batches
    assert "hover" not in timeline_svg(r)  # a PNG cannot be hovered


def test_interleaved_chunks_have_their_own_colours_and_labels():
    from ssdsl.schedule.picture import colour
    from ssdsl.schedule.units import Pass, Unit
    r = simulate(interleaved_1f1b(2, 4, 2))
    svg = timeline_svg(r)
    _, labels = _labelled_boxes(svg)
    assert {"0F0", "2F0", "1B3", "3B3"} <= labels  # forward boxes keep their labels
    root = ET.fromstring(svg)
    fills = {rect.find("{http://www.w3.org/2000/svg}title").text.split()[0]: rect.get("fill")
             for rect in root.iter("{http://www.w3.org/2000/svg}rect")
             if rect.find("{http://www.w3.org/2000/svg}title") is not None}
    assert fills["0F1"] != fills["2F1"]  # same device, same micro-batch, other chunk
    assert fills["0F1"] == colour(Unit(0, Pass.F, 1), 4, 0)


def test_rows_are_named_by_the_devices_they_stand_for():
    from ssdsl.schedule.picture import row_names
    r = simulate(one_f_one_b(2, 4))
    names = row_names(r, [(0, 1, 2, 3), (4, 5, 6, 7)])
    assert names == ["devs 0..4", "devs 4..8"]  # half-open, as in plans
    assert "devs 4..8" in timeline_text(r, names=names).plain
    assert ">devs 0..4<" in timeline_svg(r, names=names)
