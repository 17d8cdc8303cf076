"""Random and mutated plan text: the front end raises only the project's own errors, never
another exception, and never hangs (elaboration runs under a small step limit)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssdsl.elaborate import elaborate
from ssdsl.errors import SsdslError
from ssdsl.parse import KEYWORDS, parse_text
from ssdsl.parse.format import FormatterBug, format_text
from ssdsl.resources import stdlib_dir

SOURCES = [p.read_text() for p in sorted(stdlib_dir().glob("*.ssp"))]
TOKENS = list(KEYWORDS) + ["(", ")", "[", "]", "{", "}", ",", ":", "=", "..", "..=", ".", "*",
                           "**", "+", "-", "//", "/", "%", "==", "<", "|", "&", "\n", "\n    ",
                           "    ", "0", "1", "7", "2.5", "x", "h", "st", "m", "world", "n",
                           '"s"', '"""d"""', "#c\n", "\t", "\\\n", "min", "len", "@", "'"]


def _front_end(text: str) -> None:
    """Everything a user's text goes through before a model is involved."""
    try:
        parsed = parse_text(text, "fuzz.ssp")
        try:
            out = format_text(text, "fuzz.ssp")
        except FormatterBug:  # pragma: no cover - this is what the test hunts
            raise AssertionError(f"the formatter would change the meaning of:\n{text}")
        assert format_text(out, "fuzz.ssp") == out
        elaborate(parsed, world=4, max_steps=20_000)
    except SsdslError as err:
        assert err.render()  # renders without raising


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(TOKENS), max_size=40).map(" ".join))
def test_random_token_soup(text):
    _front_end("plan p(n: int = 2)\n" + text)


@settings(max_examples=200, deadline=2000)
@given(st.text(max_size=80))
def test_random_characters(text):
    _front_end(text)


@st.composite
def _mutated(draw):
    text = draw(st.sampled_from(SOURCES))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        j = min(len(text), i + draw(st.integers(0, 6)))
        kind = draw(st.sampled_from(["delete", "insert", "replace", "duplicate"]))
        if kind == "delete":
            text = text[:i] + text[j:]
        elif kind == "insert":
            text = text[:i] + draw(st.sampled_from(TOKENS)) + text[i:]
        elif kind == "replace":
            text = text[:i] + draw(st.sampled_from(TOKENS)) + text[j:]
        else:
            text = text[:j] + text[i:j] + text[j:]
    return text


@settings(max_examples=400, deadline=3000, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated())
def test_mutated_stdlib_plans(text):
    _front_end(text)


@pytest.mark.parametrize("text", [
    "plan p()\nfor i in 0..100000000:\n    for j in 0..100000000:\n        replicate all into 1\n",
    "plan p()\nlet x = list(0..100000000000)\n",
    "plan p()\nlet x = str(" + " * ".join(["1" + "0" * 40] * 3) + ")\n",
    "plan p(x: float = 1e308 * 10)\nreplicate all into int(x)\n",
    "plan p()\nlet a = [1] + [2]\nlet b = a + a\nlet c = b[100]\n",
])
def test_resource_hungry_plans_end_with_an_error(text):
    with pytest.raises(SsdslError):
        elaborate(parse_text(text, "big.ssp"), max_steps=10_000)
