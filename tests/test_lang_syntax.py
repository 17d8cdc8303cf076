"""Syntax errors: the example table drives the friendly messages, and a typo in a keyword is
reported at the misspelled word with a suggestion."""

from __future__ import annotations

import pytest

from ssdsl.elaborate import elaborate_text
from ssdsl.errors import SsdslError
from ssdsl.parse import parse_text
from ssdsl.parse import errors as E
from ssdsl.parse.syntax_examples import TABLE

CASES = [(cls, message, text) for cls, message, _, examples in TABLE for text in examples]


@pytest.mark.parametrize("cls,message,text", CASES)
def test_every_example_gives_its_own_entry(cls, message, text):
    with pytest.raises(E.PlanSyntaxError) as info:
        parse_text(text, "ex.ssp")
    assert type(info.value) is cls
    assert info.value.message == message


@pytest.mark.parametrize("text,line,column,word,suggestion", [
    ("plan p()\npartiton all along batch into 2\n", 2, 1, "partiton", "partition"),
    ("plan p()\nfor i in 0..2:\n    asign all to device 0\n", 3, 5, "asign", "assign"),
    ("plan p()\nreplicate all into 2\nmicrobach along batch into 2\n", 3, 1, "microbach",
     "microbatch"),
    ("plan p()\npartition all alng batch into 2\n", 2, 15, "alng", "along"),
    ("plan p()\nreplicate all intoo 2\n", 2, 15, "intoo", "into"),
    ("plan p()\nassign all to devic 0\n", 2, 15, "devic", "device"),
    ("plan p()\nmesh m = gird(a=2)\n", 2, 10, "gird", "grid"),
])
def test_misspelled_keyword(text, line, column, word, suggestion):
    with pytest.raises(E.UnknownKeyword) as info:
        parse_text(text, "typo.ssp")
    err = info.value
    assert (err.span.line, err.span.column) == (line, column)
    assert err.span.end_column - err.span.column == len(word)
    assert f"did you mean '{suggestion}'" in err.message
    assert err.render().splitlines()[2].strip() == "^" * len(word)


def test_message_for_an_unlisted_mistake_names_what_was_expected():
    with pytest.raises(E.PlanSyntaxError) as info:
        parse_text("plan p()\nreplicate all into 2 3\n", "x.ssp")
    assert "unexpected '3'" in info.value.message
    assert (info.value.span.line, info.value.span.column) == (2, 22)


def test_example_matching_works_inside_blocks():
    # the same mistake two blocks deep gets the same friendly message as at the top level
    text = "plan p()\nfor i in 0..2:\n    for j in 0..2:\n        partition all into 2\n"
    with pytest.raises(E.MissingAlong) as info:
        parse_text(text, "x.ssp")
    assert (info.value.span.line, info.value.span.column) == (4, 23)


@pytest.mark.parametrize("depth", [50, 5000])
def test_deep_nesting_is_a_value_or_an_error_never_a_crash(depth):
    text = "plan p()\nlet x = " + "(" * depth + "1" + ")" * depth + "\nreplicate all into x\n"
    try:
        plan = elaborate_text(text, "deep.ssp")
    except SsdslError as err:
        assert depth > 50 and "deeply" in err.message
    else:
        assert [str(d) for d in plan.directives] == ["replicate all into 1"]
