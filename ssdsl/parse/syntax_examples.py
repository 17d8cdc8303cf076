"""The table of common syntax mistakes: each entry is an error class, a message, a hint, and
example texts that make the parser fail in the same state (Lark's ``match_examples``).

``tests/test_lang_syntax.py`` checks that every example produces its own entry, so the table
cannot rot when the grammar changes.
"""

from __future__ import annotations

from functools import cache

from lark.exceptions import UnexpectedInput

from ssdsl.parse import errors as E

H = "plan p(n: int = 2)\n"

# (class, message, hint, examples)
TABLE: tuple[tuple[type[E.PlanSyntaxError], str, str, tuple[str, ...]], ...] = (
    (E.MissingPlanHeader, "a plan file starts with 'plan NAME(PARAMS)'",
     "add a header such as: plan my_plan(n: int = world)",
     ("partition all along batch into 2\n", "let x = 1\n", "for i in 0..2:\n  let x = i\n",
      "# a comment\npartition all along batch into 2\n", "# a comment\nlet x = 1\n")),
    (E.MissingParamType, "a plan parameter needs a type",
     "write NAME: TYPE = DEFAULT, with TYPE one of int, float, bool, str, list",
     ("plan p(n)\n", "plan p(n = 2)\n", "plan p(a: int, n = 2)\n", "plan p(a: int, n)\n")),
    (E.MissingAlong, "partition needs 'along DIM' before 'into N'",
     "write: partition SELECTOR along DIM into N",
     (H + "partition all into 2\n", H + "partition h.*.attn into n\n")),
    (E.MissingInto, "missing 'into N' (how many parts)",
     "write: ... into N",
     (H + "partition all along batch\n", H + "replicate all\n", H + "microbatch along batch\n",
      H + "partition all along batch 2\n", H + "replicate all 2\n", H + "stages as st\n")),
    (E.MissingTo, "assign needs 'to PLACE'",
     "write: assign SELECTOR to device N (or devices LIST, or MESH[axis=i])",
     (H + "assign all\n", H + "assign all device 0\n", H + "assign each part i device i\n")),
    (E.BadPlace, "a place is 'device N', 'devices LIST', 'MESH[axis=i, ...]' or 'mesh MESH'",
     "for example: to device 0, to devices 0..4, to m[dp=0, tp=1]",
     (H + "assign all to 0\n", H + "assign all to [0, 1]\n", H + "zero over 0..2\n",
      H + "order on 0: forward all\n")),
    (E.MissingColon, "a block header ends with ':'",
     "add ':' at the end of the line and indent the block below it",
     (H + "for i in 0..2\n  let x = i\n", H + "if n > 1\n  let x = 1\n",
      H + "order on device 0\n  forward all\n", H + "if n > 1:\n  let x = 1\nelse\n  let x = 2\n")),
    (E.AssignmentNotStatement, "a binding needs 'let'",
     "write: let NAME = VALUE",
     (H + "x = 1\n", H + "n = 3\n")),
    (E.IndentationError_, "a block must be indented under its header",
     "indent the lines of the block (4 spaces)",
     (H + "for i in 0..2:\nlet x = i\n", H + "if n > 1:\nlet x = 1\n")),
    (E.IndentationError_, "unexpected indentation",
     "a statement that is not inside a block starts at the same column as the one before",
     (H + "let x = 1\n    let y = 2\n", H + "  let x = 1\n")),
)


@cache
def _examples() -> dict[int, list[str]]:
    return {i: list(entry[3]) for i, entry in enumerate(TABLE)}


def match_example(exc: UnexpectedInput, source: str
                  ) -> tuple[type[E.PlanSyntaxError], str, str] | None:
    """The table entry whose examples fail like ``exc`` did, or ``None``."""
    from ssdsl.parse import _parser

    lark, post = _parser()

    def parse(text: str):
        post.begin("<example>")
        return lark.parse(text)

    want = _position(exc)
    fallback = None
    for label, examples in _examples().items():
        for text in examples:
            try:
                parse(text)
            except UnexpectedInput as ut:
                if _position(ut) != want:
                    continue
                if getattr(ut, "token", None) == getattr(exc, "token", None):
                    return TABLE[label][:3]
                fallback = fallback if fallback is not None else label
            except E.PlanSyntaxError:  # an example that trips the postlexer; a test catches it
                continue
    return TABLE[fallback][:3] if fallback is not None else None


def _position(exc: UnexpectedInput) -> object:
    """The parser state an error happened in, independent of how deep the stack is (Lark's own
    ``match_examples`` also compares the depth, so a mistake inside a block would not match an
    example written at the top level)."""
    state = getattr(exc, "state", None)
    return getattr(state, "position", state)
