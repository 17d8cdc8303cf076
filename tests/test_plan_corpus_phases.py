"""Wrong plans found after the front end: by the graph (transform), the schedule (stages,
micro-batches, order) or materialization, each against examples/gpt.py unless it names another
model.

Each file in tests/plans/phase_bad starts with a header written by hand from the plan text::

    # world: 2
    # expect: ErrorClass LINE:COL [in FILE]
    # model: examples/evoformer_recycle.py      (optional; default examples/gpt.py)

The plan goes through every static phase `ssdsl check` runs; the first error must be of that
class at that position, and `ssdsl check` must print it with exit status 2, no traceback and
fewer than 40 lines.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from ssdsl.cli import main
from ssdsl.elaborate import elaborate_file
from ssdsl.errors import ErrorGroup, SsdslError
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file

BAD = Path(__file__).parent / "plans" / "phase_bad"
FILES = sorted(BAD.glob("*.ssp"))
ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
HEADER = re.compile(r"# (world|expect|model): (.*)")
EXPECT = re.compile(r"(\w+) (\d+):(\d+)(?: in (\S+))?$")


def _header(path: Path) -> tuple[int, str, int, int, str]:
    lines = path.read_text().splitlines()[:3]
    head = dict(HEADER.match(line).groups() for line in lines if HEADER.match(line))
    m = EXPECT.match(head["expect"])
    assert m, f"{path.name}: bad header"
    return int(head["world"]), m.group(1), int(m.group(2)), int(m.group(3)), m.group(4) or path.name


def _model(path: Path) -> Path:
    head = dict(HEADER.match(line).groups() for line in path.read_text().splitlines()[:3]
                if HEADER.match(line))
    return ROOT / head["model"] if "model" in head else GPT


@cache
def _graph(model: Path = GPT):
    return trace(load_model_file(model), device="meta")


def _param(path: Path):
    """A file against a third-party family (tests/models/families) is slow: it traces one."""
    slow = "families" in _model(path).parts
    return pytest.param(path, id=path.stem, marks=[pytest.mark.slow] if slow else [])


def test_corpus_size():
    assert len(FILES) >= 12


@pytest.mark.parametrize("path", [_param(p) for p in FILES])
def test_wrong_plan_after_the_front_end(path: Path):
    world, cls, line, column, file = _header(path)
    with pytest.raises(SsdslError) as info:
        t, lowered = schedule_plan(_graph(_model(path)), elaborate_file(path, world=world))
        materialize(t, schedule=lowered)
    err = info.value
    first = err.errors[0] if isinstance(err, ErrorGroup) else err
    assert type(first).__name__ == cls, err.render()
    assert (first.span.line, first.span.column) == (line, column), err.render()
    assert Path(first.span.file).name == file, err.render()


@pytest.mark.parametrize("path", [_param(p) for p in FILES[::3]])
def test_check_prints_it_briefly(path: Path, capsys):
    world, _, line, column, _ = _header(path)
    assert main(["check", str(_model(path)), str(path), "--world", str(world)]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    assert len(text.splitlines()) < 40, text
    assert f":{line}:{column}: " in text


@pytest.mark.slow
@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_check_prints_every_one_briefly(path: Path, capsys):
    """The fast lane runs every third file through `ssdsl check`; this runs them all, and
    each error has a hint."""
    world, _, line, column, _ = _header(path)
    assert main(["check", str(_model(path)), str(path), "--world", str(world)]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    assert len(text.splitlines()) < 40, text
    assert f":{line}:{column}: " in text and "\nhint: " in text, text
