"""The postlexer: indentation blocks and comments.

Lark hands every ``_NL`` token (a newline plus any blank and comment lines after it, see the
grammar) to ``Postlexer.process``, which emits ``_INDENT``/``_DEDENT`` from the indentation of the
last line, drops newlines inside brackets, and keeps every comment with its position, so that the
formatter can write them back (a formatter must never lose what a user wrote).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import attrs
from lark import Token

from ssdsl.parse.errors import IndentationError_
from ssdsl.source import Span

_COMMENT = re.compile(r"#[^\n]*")
_OPEN = {"LPAR", "LSQB", "LBRACE"}
_CLOSE = {"RPAR", "RSQB", "RBRACE"}
TAB_WIDTH = 8


@attrs.frozen
class Comment:
    """A ``# ...`` comment: its text (with the ``#``, trailing blanks removed) and position."""

    text: str
    line: int
    column: int


class Postlexer:
    """Lark postlexer; ``begin(file)`` resets it before each parse (the caller holds a lock)."""

    # NAME everywhere: a misspelled keyword ("intoo") is then one NAME token, reported with a
    # suggestion, instead of the keyword "into" followed by a stray "o".
    always_accept = ("_NL", "NAME")

    def __init__(self) -> None:
        self.file = "<plan>"
        self.comments: list[Comment] = []

    def begin(self, file: str) -> None:
        self.file = file
        self.comments = []

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        levels = [0]
        depth = 0
        for tok in stream:
            if tok.type == "_NL":
                self._record_comments(tok)
                # A rule that ends with a newline (the header) should end where its line does,
                # not after the blank and comment lines the newline token swallowed.
                tok.end_line, tok.end_column, tok.end_pos = tok.line, tok.column, tok.start_pos
                if depth > 0:
                    continue
                yield tok
                yield from self._indent(tok, levels)
                continue
            if tok.type in _OPEN:
                depth += 1
            elif tok.type in _CLOSE:
                depth = max(0, depth - 1)
            yield tok
        while len(levels) > 1:
            levels.pop()
            yield Token("_DEDENT", "")

    def _record_comments(self, tok: Token) -> None:
        text = str(tok)
        for m in _COMMENT.finditer(text):
            before = text[:m.start()]
            nl = before.count("\n")
            line = tok.line + nl
            column = (tok.column + len(before)) if nl == 0 else len(before) - before.rfind("\n")
            self.comments.append(Comment(m.group().rstrip(), line, column))

    def _indent(self, tok: Token, levels: list[int]) -> Iterator[Token]:
        last = str(tok).rsplit("\n", 1)[-1]
        width = len(last.expandtabs(TAB_WIDTH))
        if width > levels[-1]:
            levels.append(width)
            yield Token.new_borrow_pos("_INDENT", last, tok)
            return
        while width < levels[-1]:
            levels.pop()
            yield Token.new_borrow_pos("_DEDENT", "", tok)
        if width != levels[-1]:
            line = tok.line + str(tok).count("\n")
            raise IndentationError_(
                f"this line is indented by {width}, which matches no enclosing block",
                Span.point(self.file, line, 1, max(1, width)),
                hint=f"indent it like an enclosing block ({', '.join(map(str, levels))} columns)")
