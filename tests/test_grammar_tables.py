"""The grammar's parse tables are kept between processes (``ssdsl.parse._table_file``): a parser
loaded from them parses every plan and words every syntax error exactly as one built from the
grammar, and a folder that cannot be written to only means nothing is kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssdsl.parse import _parser, _table_file, _terminal_words, parse_text
from ssdsl.parse import errors as E
from ssdsl.parse.syntax_examples import TABLE
from ssdsl.resources import grammar_dir, stdlib_dir

PLANS = sorted(stdlib_dir().glob("*.ssp"))
BROKEN = [examples[0] for _, _, _, examples in TABLE]  # one per table entry


def _fresh_parser() -> None:
    _parser.cache_clear()
    _terminal_words.cache_clear()


@pytest.fixture(autouse=True)
def _restore():
    yield
    _fresh_parser()  # later tests build the parser again under the default folder


def _outcomes() -> list:
    """What parsing every stdlib plan and every syntax-error example gives."""
    out = []
    for path in PLANS:
        out.append(parse_text(path.read_text(), path.name))  # the AST and the comments
    for text in BROKEN:
        with pytest.raises(E.PlanSyntaxError) as info:
            parse_text(text, "ex.ssp")
        out.append((type(info.value).__name__, info.value.render()))
    return out


def test_tables_loaded_from_the_folder_parse_like_the_grammar(tmp_path, monkeypatch):
    monkeypatch.setenv("SSDSL_CACHE_DIR", "")  # nothing kept: built from the grammar
    _fresh_parser()
    assert _table_file(grammar_dir() / "ssp.lark") is None
    built = _outcomes()

    monkeypatch.setenv("SSDSL_CACHE_DIR", str(tmp_path))
    _fresh_parser()
    first = _outcomes()  # builds, and writes the tables
    kept = list(tmp_path.iterdir())
    assert [p.suffix for p in kept] == [".lark-tables"], kept  # no half-written file left
    _fresh_parser()
    loaded = _outcomes()  # from the tables
    assert first == built
    assert loaded == built
    assert len(PLANS) >= 10 and len(BROKEN) >= 10


def test_a_changed_grammar_gets_tables_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("SSDSL_CACHE_DIR", str(tmp_path / "tables"))
    real = grammar_dir() / "ssp.lark"
    edited = tmp_path / "ssp.lark"
    edited.write_text(real.read_text() + "\n// a comment\n")
    assert _table_file(real) != _table_file(edited)
    assert _table_file(real) == _table_file(real)


def test_an_unwritable_folder_keeps_nothing_and_parsing_works(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SSDSL_CACHE_DIR", str(blocker / "ssdsl"))
    assert _table_file(grammar_dir() / "ssp.lark") is None
    _fresh_parser()
    plan = parse_text("plan p(n: int = 2)\npartition all along batch into n\n", "p.ssp").plan
    assert plan.name == "p"
    assert not (blocker / "ssdsl").exists()
    assert Path(blocker).read_text() == "not a folder"
