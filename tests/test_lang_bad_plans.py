"""The corpus of wrong plans: each file in tests/plans/bad names, in its first line, the error
class and the position it must produce (``# expect: Class LINE:COL [in FILE]``).

The expectations were written by hand from the plan text, not produced by the code under test.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ssdsl.cli import main
from ssdsl.elaborate import elaborate, load_plan
from ssdsl.errors import ErrorGroup, SsdslError

BAD = Path(__file__).parent / "plans" / "bad"
FILES = sorted(BAD.glob("*.ssp"))
EXPECT = re.compile(r"# expect: (\w+) (\d+):(\d+)(?: in (\S+))?")


def _expectation(path: Path) -> tuple[str, int, int, str]:
    m = EXPECT.match(path.read_text().splitlines()[0])
    assert m, f"{path.name}: first line must be '# expect: Class LINE:COL'"
    return m.group(1), int(m.group(2)), int(m.group(3)), m.group(4) or path.name


def _first_error(path: Path) -> SsdslError:
    with pytest.raises(SsdslError) as info:
        elaborate(load_plan(str(path)), world=2)
    err = info.value
    return err.errors[0] if isinstance(err, ErrorGroup) else err


def test_corpus_is_large_enough():
    assert len(FILES) >= 30


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_bad_plan(path: Path):
    cls, line, column, file = _expectation(path)
    err = _first_error(path)
    assert type(err).__name__ == cls, err.render()
    assert err.span is not None, err.render()
    assert (err.span.line, err.span.column) == (line, column), err.render()
    assert Path(err.span.file).name == file
    rendered = err.render()
    assert rendered.startswith(f"{err.span.file}:{line}:{column}: ")
    assert "^" in rendered  # the source line with carets under the span


@pytest.mark.parametrize("path", FILES[:5], ids=[p.stem for p in FILES[:5]])
def test_cli_exit_status_two_without_traceback(path: Path, capsys):
    assert main(["check", str(path), "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    cls, line, column, _ = _expectation(path)
    assert f":{line}:{column}: " in err


def test_debug_shows_the_traceback():
    with pytest.raises(SsdslError):
        main(["--debug", "check", str(FILES[0]), "--world", "2"])


def test_independent_errors_are_all_reported_sorted(tmp_path: Path):
    plan = tmp_path / "many.ssp"
    plan.write_text("plan p(n: int = 2)\n"
                    "replicate all into m\n"            # unknown name
                    "let x = 1 // 0\n"                  # division by zero (at elaboration)
                    "assign all to device 7\n"          # out of range
                    "let y = lenn(x)\n")                # unknown function
    with pytest.raises(ErrorGroup) as info:
        elaborate(load_plan(str(plan)), world=2)
    # the static pass reports the names first; arithmetic needs values
    positions = [(e.span.line, e.span.column, type(e).__name__) for e in info.value.errors]
    assert positions == [(2, 20, "UnknownName"), (5, 9, "UnknownFunction")]
    plan.write_text("plan p(n: int = 2)\n"
                    "let x = 1 // 0\n"
                    "assign all to device 7\n"
                    "replicate all into x + 1\n"        # x is poisoned: no second error
                    "partition all along batch into -1\n")
    with pytest.raises(ErrorGroup) as info:
        elaborate(load_plan(str(plan)), world=2)
    positions = [(e.span.line, e.span.column, type(e).__name__) for e in info.value.errors]
    assert positions == [(2, 14, "DivisionByZero"), (3, 22, "DeviceOutOfRange"),
                         (5, 32, "WrongValue")]
