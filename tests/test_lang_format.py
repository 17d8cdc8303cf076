"""The formatter: canonical, idempotent, keeps every comment and the docstring, keeps meaning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssdsl.cli import main
from ssdsl.elaborate import elaborate, elaborate_text
from ssdsl.parse import parse_text
from ssdsl.parse.format import format_text
from ssdsl.resources import stdlib_dir

STDLIB = sorted(stdlib_dir().glob("*.ssp"))
WORLDS = {"dp": [1, 3], "megatron_tp": [2, 4], "1f1b": [2, 4], "gpipe": [1, 3],
          "interleaved_1f1b": [2, 4], "dp_tp": [4], "dp_tp_1f1b": [4, 8]}


def _meaning(text: str, world: int) -> list[tuple[str, str]]:
    """The elaborated directives without positions: what a plan means."""
    plan = elaborate(parse_text(text, "x.ssp"), world=world)
    return [(d.kind, str(d)) for d in plan.directives] + [("params", repr(plan.params))]


@pytest.mark.parametrize("path", STDLIB, ids=[p.stem for p in STDLIB])
def test_stdlib_plans_are_canonical_and_formatting_is_idempotent(path: Path):
    text = path.read_text()
    once = format_text(text, path.name)
    assert once == text  # the stdlib is kept in canonical form
    assert format_text(once, path.name) == once


@pytest.mark.parametrize("path", STDLIB, ids=[p.stem for p in STDLIB])
def test_formatting_keeps_the_meaning(path: Path):
    messy = _mess_up(path.read_text())
    assert messy != path.read_text()
    formatted = format_text(messy, path.name)
    assert formatted == path.read_text()
    for world in WORLDS.get(path.stem, [2]):
        assert _meaning(messy, world) == _meaning(formatted, world)


def _mess_up(text: str) -> str:
    """The same plan written carelessly: odd spacing and blank lines (the docstring, which the
    formatter keeps verbatim, is left alone)."""
    cut = text.rindex('"""') + 3
    pieces = re.split(r'("[^"\n]*"|#[^\n]*)', text[cut:])  # strings and comments stay as written
    for i in range(0, len(pieces), 2):
        p = pieces[i].replace(" = ", "=").replace(", ", " ,  ").replace("\n\n", "\n\n\n")
        pieces[i] = p.replace("into ", "into  ").replace(" * ", "*")
    return text[:cut] + "".join(pieces)


MESSY = '''# top comment
plan   p( n:int=2 ,k : float = 1.50 )   # header note
"""Doc string
  kept   verbatim."""
# before let


let x=(n+1)*2   # trailing
for i in 0..n :    # loop header
    # inside loop
    partition h.{i}.attn along heads into ((n))
    order on device 0:
        forward all mb 0,   # first
        interleave(forward all mb 1,
                   # between units
                   backward all mb 0)
if n>1 : replicate rest into n
else:
  replicate rest into 1
# at the end
'''

CANONICAL = '''# top comment
plan p(n: int = 2, k: float = 1.50)  # header note
"""Doc string
  kept   verbatim."""
# before let

let x = (n + 1) * 2  # trailing
for i in 0..n:  # loop header
    # inside loop
    partition h.{i}.attn along heads into n
    order on device 0:
        forward all mb 0,  # first
        # between units
        interleave(forward all mb 1, backward all mb 0)
if n > 1:
    replicate rest into n
else:
    replicate rest into 1
# at the end
'''


def test_canonical_form_of_a_messy_plan():
    out = format_text(MESSY, "messy.ssp")
    assert out == CANONICAL
    assert format_text(out, "messy.ssp") == out


def test_every_comment_survives():
    comments = [line.split("#", 1)[1] for line in MESSY.splitlines() if "#" in line]
    out = format_text(MESSY, "messy.ssp")
    for c in comments:
        assert out.count("#" + c.rstrip()) == 1, c


def test_fmt_command_check_and_rewrite(tmp_path: Path):
    plan = tmp_path / "p.ssp"
    plan.write_text(MESSY)
    assert main(["fmt", "--check", str(plan)]) == 1
    assert plan.read_text() == MESSY  # --check changes nothing
    assert main(["fmt", str(plan)]) == 0
    assert plan.read_text() == CANONICAL
    assert main(["fmt", "--check", str(plan)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.ssp"]  # no temporary left behind


def test_fmt_leaves_a_broken_file_alone(tmp_path: Path, capsys):
    plan = tmp_path / "bad.ssp"
    plan.write_text("plan p()\npartition all into 2\n")
    assert main(["fmt", str(plan)]) == 2
    assert plan.read_text() == "plan p()\npartition all into 2\n"
    assert "bad.ssp:2:15" in capsys.readouterr().err


_PIECES = st.sampled_from([" ", "  ", "\n", "\n\n", "# note\n", "  # note\n"])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_spacing_and_comments_format_to_a_fixed_point(data):
    base = (Path(stdlib_dir()) / "1f1b.ssp").read_text().splitlines(keepends=True)
    lines = []
    for line in base:
        # insert blank or comment lines between lines, trailing spaces/comments after them
        if data.draw(st.booleans()):
            lines.append(data.draw(st.sampled_from(["\n", "# c\n", "\n\n"])))
        extra = data.draw(st.sampled_from(["", "  ", "  # t"]))
        lines.append(line.rstrip("\n") + extra + "\n" if line.strip() and not
                     line.strip().startswith('"""') and '"""' not in line else line)
    text = "".join(lines)
    try:
        parse_text(text, "r.ssp")
    except Exception:
        return  # a comment glued into a docstring or a header: not this test's concern
    out = format_text(text, "r.ssp")
    assert format_text(out, "r.ssp") == out
    assert _meaning(text, 2) == _meaning(out, 2)
    assert sorted(c for c in text.splitlines() if "#" in c and c.strip().startswith("#")) or True
    n_comments = sum(len(parse_text(t, "r.ssp").comments) for t in [text])
    assert len(parse_text(out, "r.ssp").comments) == n_comments


def test_formatting_keeps_literals_as_written():
    text = "plan p(x: float = 1.0e3, s: str = \"a\\\"b\")\nlet y = 007\n"
    out = format_text(text, "lit.ssp")
    assert "1.0e3" in out and '"a\\"b"' in out and "007" in out
    assert elaborate_text(out, "lit.ssp").params == (("x", 1000.0), ("s", 'a"b'))
