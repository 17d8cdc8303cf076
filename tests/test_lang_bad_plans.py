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
    m = EXPECT.match(path.read_bytes().decode("utf-8", errors="replace").splitlines()[0])
    assert m, f"{path.name}: first line must be '# expect: Class LINE:COL'"
    return m.group(1), int(m.group(2)), int(m.group(3)), m.group(4) or path.name


def _first_error(path: Path) -> SsdslError:
    with pytest.raises(SsdslError) as info:
        elaborate(load_plan(str(path)), world=2)
    err = info.value
    assert len(err.render().splitlines()) < 40, err.render()  # everything reported, not just one
    return err.errors[0] if isinstance(err, ErrorGroup) else err


def test_corpus_is_large_enough():
    assert len(FILES) >= 140


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
    assert "\nhint: " in rendered  # and what to do about it
    if file != path.name:  # a fault inside a used plan names the user's `use` line too
        site = err.span.via
        while site is not None and site.via is not None:  # the outermost `use`: the user's
            site = site.via
        assert site is not None and Path(site.file).name == path.name, rendered
        assert f"note: in the plan used at {site.file}:" in rendered, rendered


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_cli_exit_status_two_without_traceback(path: Path, capsys):
    """What `ssdsl check` prints for each wrong plan: exit status 2, the position, no traceback,
    under 40 lines."""
    assert main(["check", str(path), "--world", "2"]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    assert len(text.splitlines()) < 40, text
    cls, line, column, _ = _expectation(path)
    assert f":{line}:{column}: " in text


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


def _errors(text: str, tmp_path: Path, world: int = 2) -> list[SsdslError]:
    plan = tmp_path / "user.ssp"
    plan.write_text(text)
    with pytest.raises(SsdslError) as info:
        elaborate(load_plan(str(plan)), world=world)
    err = info.value
    return list(err.errors) if isinstance(err, ErrorGroup) else [err]


@pytest.mark.parametrize("text", [
    # a failed count: the `assign each part` that infers its indices from it is not blamed too
    "plan p()\npartition all along batch into 1000000000\nassign each part i to device i\n",
    # a failed microbatch: the order lines that name micro-batches are not blamed too
    "plan p()\nmicrobatch along batch into 0\nstages into 2 as st\n"
    "order on device 0: forward st[0] mb 0, forward st[0] mb 1\n"
    "order forward st[0] mb 1 before forward st[1] mb 1\n",
    # a failed mesh: its uses are not blamed too
    "plan p()\nmesh m = grid(a=0)\nassign all to m[0]\nzero all over m[0]\n",
    # a failed stage group: its uses are not blamed too
    "plan p()\nstages into 0 as st\nassign st[0] to device 0\nrecompute st[1]\n",
])
def test_a_first_error_is_not_followed_by_its_consequences(text: str, tmp_path: Path):
    errors = _errors(text, tmp_path)
    assert [(e.span.line, e.span.column) for e in errors][:1] == [(2, errors[0].span.column)]
    assert len(errors) == 1, "\n\n".join(e.render() for e in errors)


def test_a_used_plan_stops_at_its_first_error(tmp_path: Path):
    lib = tmp_path / "lib.ssp"
    lib.write_text("plan lib()\nrequire world >= 4, \"lib needs 4\"\nassign all to q[0]\n"
                   "assign all to device 7\n")
    errors = _errors('plan p()\nreplicate all into 2\nuse "lib.ssp"\n', tmp_path)
    assert [type(e).__name__ for e in errors] == ["RequirementFailed"]
    rendered = errors[0].render()
    assert rendered.startswith(f"{lib}:2:1: lib needs 4")
    assert f"note: in the plan used at {tmp_path / 'user.ssp'}:3:1" in rendered
    assert len(rendered.splitlines()) < 12


def test_second_assign_of_a_stage_group_in_used_plans_names_both(tmp_path: Path):
    errors = _errors('plan p()\nuse "../plans/lib/pipe_stages.ssp"\n'
                     'use "../plans/lib/pipe_stages.ssp"\n'.replace("../plans/", str(BAD.parent) + "/"),
                     tmp_path)
    assert [type(e).__name__ for e in errors] == ["DuplicateName"]
    text = errors[0].render()
    assert "in the plan used at" in text and "user.ssp:2:1" in text and "user.ssp:3:1" in text


def test_assign_each_part_with_one_name_and_a_range(tmp_path: Path):
    """`assign each part i in 0..2` is the one-name form of `(i, j) in [0..a, 0..b]`: it makes
    exactly the assigns written out by hand."""
    plan = tmp_path / "each.ssp"
    plan.write_text("plan p()\npartition all along batch into 3\n"
                    "assign each part i in 0..3 to device 2 - i\n")
    got = [str(d) for d in elaborate(load_plan(str(plan)), world=3).directives]
    assert got == ["partition all along batch into 3", "assign part 0 of all to device 2",
                   "assign part 1 of all to device 1", "assign part 2 of all to device 0"]
    plan.write_text("plan p()\npartition all along batch into 2\n"
                    "assign each part i in [1, 0] to device i\n")
    got = [str(d) for d in elaborate(load_plan(str(plan)), world=2).directives]
    assert got[1:] == ["assign part 1 of all to device 1", "assign part 0 of all to device 0"]


def test_every_statement_kind_has_a_wrong_plan():
    """The corpus covers every statement of the language (by its first keyword)."""
    words = set()
    for path in FILES:
        text = path.read_bytes().decode("utf-8", errors="replace")
        for line in text.splitlines()[1:]:
            if line.strip() and not line.lstrip().startswith("#"):
                words.add(line.split()[0])
    assert {"let", "partition", "replicate", "assign", "order", "microbatch", "stages",
            "recompute", "zero", "mesh", "use", "require", "for", "if"} <= words


@pytest.mark.parametrize("value, length", [
    ('"' + "a" * 100_000 + '"', "100,000 characters"),
    ("[" + ", ".join(["7"] * 3_000) + "]", "3,000 items"),
])
def test_a_huge_value_is_quoted_short(value: str, length: str, tmp_path: Path):
    """A message that quotes a value the user made (a 100 KB string, a list of 3,000 items)
    quotes its start and says its length: one short line, not the value."""
    errors = _errors(f"plan p()\n\nlet x = {value} + 1\n", tmp_path)
    assert [(type(e).__name__, e.span.line, e.span.column) for e in errors] == \
        [("WrongType", 3, 9)]
    rendered = errors[0].render()
    assert length in rendered, rendered
    assert len(rendered) < 1500 and len(rendered.splitlines()) < 10, rendered[:3000]


def test_a_message_of_any_length_is_cut(tmp_path: Path):
    """A name of 100,000 characters in an `unknown name` message: the message is cut, and says
    how long it was."""
    name = "q" * 100_000
    errors = _errors(f"plan p()\nreplicate all into {name}\n", tmp_path)
    assert [(type(e).__name__, e.span.line, e.span.column) for e in errors] == \
        [("UnknownName", 2, 20)]
    rendered = errors[0].render()
    assert len(rendered) < 2500 and "characters)" in rendered, rendered[:3000]


@pytest.mark.slow
def test_huge_inputs_are_refused_at_their_line_in_few_lines(tmp_path: Path):
    """A 100,000-term expression on line 4 is TooDeep at 4:9 (not 1:1); an error at the end of
    a 400 KB line shows a cut excerpt; neither takes long or prints much."""
    import time
    errors = _errors("plan p()\n# a comment\n\nlet x = " + "+".join(["1"] * 100_000) + "\n",
                     tmp_path)
    assert [(type(e).__name__, e.span.line, e.span.column) for e in errors] == \
        [("TooDeep", 4, 9)]
    start = time.process_time()
    errors = _errors("plan p()\nlet x = 1" + " " * 400_000 + "@\n", tmp_path)
    assert [(type(e).__name__, e.span.line, e.span.column) for e in errors] == \
        [("UnexpectedCharacter", 2, 400_010)]
    rendered = errors[0].render()
    assert max(len(line) for line in rendered.splitlines()) < 200, rendered[:2000]
    assert len(rendered.splitlines()) < 10
    assert time.process_time() - start < 10


@pytest.mark.parametrize("text", ["", "\n\n", "   \n"])
def test_an_empty_file_is_an_empty_plan(text: str, tmp_path: Path):
    """A file with nothing in it cannot carry the corpus's `# expect` line; it is EmptyPlan at
    1:1 with a hint, like the comments-only file of the corpus."""
    errors = _errors(text, tmp_path)
    assert [(type(e).__name__, e.span.line, e.span.column) for e in errors] == \
        [("EmptyPlan", 1, 1)]
    assert "\nhint: " in errors[0].render()
