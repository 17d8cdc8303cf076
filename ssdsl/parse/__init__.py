"""Phase 1, parse: ``.ssp`` text to the AST of ``ssdsl.parse.ast``.

>>> parsed = parse_text("plan p(n: int = 2)\\npartition all along batch into n\\n", "p.ssp")
>>> parsed.plan.name, len(parsed.plan.body)
('p', 1)

The grammar (``grammar/ssp.lark``) is loaded once and cached. Syntax errors become
``PlanSyntaxError`` subclasses with friendly messages (``ssdsl.parse.syntax_examples``).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import threading
from functools import cache
from pathlib import Path

import attrs
from lark import Lark, Token, Tree
from lark.exceptions import (UnexpectedCharacters, UnexpectedEOF, UnexpectedInput,
                             UnexpectedToken, VisitError)

from ssdsl.errors import SsdslError
from ssdsl.parse import ast
from ssdsl.parse.build import Builder
from ssdsl.parse.errors import (BadEncoding, EmptyPlan, PlanSyntaxError, TooDeep,
                                UnexpectedCharacter, UnexpectedEnd, UnknownKeyword)
from ssdsl.parse.postlex import Comment, Postlexer
from ssdsl.resources import grammar_dir
from ssdsl.source import Span, remember_source

__all__ = ["Parsed", "parse_text", "parse_file", "ast", "Comment", "KEYWORDS"]

# The postlexer collects comments per parse; Lark objects are shared, so parses take turns.
_LOCK = threading.RLock()

KEYWORDS = ("plan", "let", "partition", "replicate", "assign", "order", "microbatch", "stages",
            "recompute", "zero", "mesh", "use", "require", "for", "if", "elif", "else", "along",
            "into", "to", "each", "part", "of", "in", "before", "on", "device", "devices", "as",
            "over", "grid", "from", "interleave", "forward", "backward", "input_grad",
            "weight_grad", "mb", "stage", "all", "rest", "kind", "except", "and", "or", "not", "true",
            "false")


@attrs.frozen
class Parsed:
    """A parsed file: the AST, its comments (for the formatter), and the text it came from."""

    plan: ast.Plan
    comments: tuple[Comment, ...]
    text: str
    file: str


@cache
def _parser() -> tuple[Lark, Postlexer]:
    post = Postlexer()
    path = grammar_dir() / "ssp.lark"
    options = dict(parser="lalr", lexer="contextual", postlex=post, propagate_positions=True,
                   maybe_placeholders=True)
    saved = _table_file(path)
    if saved is not None and saved.is_file():
        return Lark.open(str(path), cache=str(saved), **options), post
    if saved is None:
        return Lark.open(str(path), cache=False, **options), post
    # Built once per grammar, lark and Python (0.3-0.6 s; loading the tables takes 0.04 s, in
    # every process: the launcher and each rank parse the plan). Lark writes the tables under
    # a name of this process's own, renamed into place whole: a process reading them never
    # sees half a file, and two writing at once write the same bytes.
    part = saved.with_name(f"{saved.name}.{os.getpid()}.part")
    lark = Lark.open(str(path), cache=str(part), **options)
    with contextlib.suppress(OSError):
        os.replace(part, saved)
    return lark, post


_CACHE_VAR = "SSDSL_CACHE_DIR"


def _table_file(grammar: Path) -> Path | None:
    """Where the grammar's parse tables are kept between processes: under ``$SSDSL_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/ssdsl``, else ``~/.cache/ssdsl``, named by a digest of the grammar,
    lark's version and Python's (a changed grammar gets new tables). None where that folder
    cannot be made (a read-only home) or ``SSDSL_CACHE_DIR`` is empty: then nothing is kept."""
    import hashlib
    import sys

    import lark
    folder = os.environ.get(_CACHE_VAR)
    if folder is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "ssdsl")
    if not folder:
        return None
    key = hashlib.sha256(grammar.read_bytes() + f"|{lark.__version__}|{sys.version_info[:2]}"
                         .encode()).hexdigest()[:20]
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK | os.X_OK):
        return None
    return Path(folder) / f"ssp-grammar-{key}.lark-tables"


def parse_text(text: str, file: str = "<plan>") -> Parsed:
    """Parse plan text; ``file`` is the name spans and error messages use."""
    remember_source(file, text)
    if _EMPTY.fullmatch(text):
        raise EmptyPlan("the plan is empty: expected `plan NAME(...)` on its first line",
                        Span.point(file, 1, 1), hint="a plan file starts with a header such as "
                        "`plan dp(n: int = world)`, followed by its statements")
    lark, post = _parser()
    source = text if text.endswith("\n") else text + "\n"
    with _LOCK:
        post.begin(file)
        try:
            tree = lark.parse(source)
        except UnexpectedInput as exc:
            raise _friendly(exc, file, source) from None
        except RecursionError:
            raise TooDeep("the plan nests too deeply for the parser", Span.point(file, 1, 1)) from None
        comments = tuple(post.comments)
    _check_nesting(tree, file)
    try:
        plan = Builder(file).transform(tree)
    except VisitError as exc:
        if isinstance(exc.orig_exc, SsdslError):
            raise exc.orig_exc from None
        if isinstance(exc.orig_exc, RecursionError):
            raise TooDeep("the plan nests too deeply", Span.point(file, 1, 1)) from None
        raise
    except RecursionError:
        raise TooDeep("the plan nests too deeply", Span.point(file, 1, 1)) from None
    return Parsed(plan, comments, text, file)


def parse_file(path: str | Path, *, name: str | None = None) -> Parsed:
    """Read and parse a plan file; spans name it ``name`` (default: the path as given)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PlanSyntaxError(f"cannot read plan file {path}: {exc.strerror or exc}",
                              file=str(path)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad_byte(data, exc, name or str(path)) from None
    return parse_text(text, name or str(path))


# Blank lines and comments only (a file with no header at all).
_EMPTY = re.compile(r"(\s*(#[^\n]*)?\n?)*\s*")


def _bad_byte(data: bytes, exc: UnicodeDecodeError, file: str) -> BadEncoding:
    """The first byte that is not UTF-8, located by line and column (in characters)."""
    start = data.rfind(b"\n", 0, exc.start) + 1
    line = data.count(b"\n", 0, exc.start) + 1
    column = len(data[start:exc.start].decode("utf-8", errors="replace")) + 1
    remember_source(file, data.decode("utf-8", errors="replace"))
    return BadEncoding(f"byte 0x{data[exc.start]:02x} is not UTF-8 text", Span.point(file, line, column),
                       hint="save the plan as UTF-8 (plans are plain text)")


_NESTED_RULES = frozenset({"range", "range_incl", "or_op", "and_op", "not_op", "compare", "binop",
                           "neg", "index", "call", "list_lit", "sel_except", "sel_union",
                           "sel_inter", "sel_part", "path", "part_index", "interleave"})


def _check_nesting(tree: Tree, file: str) -> None:
    """Refuse an expression or selector nested deeper than ``MAX_NESTING``, at its position.

    Later phases walk the AST recursively; checking the height here, without recursion, turns a
    100,000-term sum into an error at the expression instead of a stack overflow at 1:1.
    """
    heights: dict[int, int] = {}
    stack: list[tuple[Tree, bool]] = [(tree, False)]
    while stack:
        node, done = stack.pop()
        kids = [c for c in node.children if isinstance(c, Tree)]
        if done:
            heights[id(node)] = 1 + max((heights[id(c)] for c in kids), default=0)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in kids)
    if heights[id(tree)] <= ast.MAX_NESTING:
        return
    node, found = tree, None
    while True:
        if node.data in _NESTED_RULES and heights[id(node)] > ast.MAX_NESTING:
            found = node
            break
        kids = [c for c in node.children if isinstance(c, Tree)]
        if not kids:
            break
        node = max(kids, key=lambda c: heights[id(c)])
    if found is None:  # statements nested in blocks: deep, but within the walks' reach
        if heights[id(tree)] <= 3 * ast.MAX_NESTING:
            return
        found = node
    node = found
    meta = node.meta
    span = Span(file, meta.line, meta.column, meta.line,
                meta.end_column if meta.end_line == meta.line else meta.column + 1)
    raise TooDeep(f"this expression nests {heights[id(node)]} levels deep; the limit is "
                  f"{ast.MAX_NESTING}", span,
                  hint="split it with let statements, or use sum()/min()/max() of a list")


# ---------------------------------------------------------------- friendly syntax errors

_TOKEN_WORDS = {"NAME": "a name", "INT": "an integer", "FLOAT": "a number", "STRING": "a string",
                "_NL": "the end of the line", "$END": "the end of the file", "_INDENT":
                "an indented block", "_DEDENT": "the end of the block", "DOCSTRING": "a docstring",
                "PASS": "forward/backward", "COMP_OP": "a comparison", "ADD_OP": "+ or -",
                "MUL_OP": "*, /, // or %"}


@cache
def _terminal_words() -> dict[str, str]:
    lark, _ = _parser()
    words = dict(_TOKEN_WORDS)
    for term in lark.terminals:
        if term.name not in words and term.pattern.type == "str":
            words[term.name] = f"'{term.pattern.value}'"
    return words


def describe_token(tok: Token) -> str:
    """How an error message names a token."""
    if tok.type in ("_NL", "$END", "_INDENT", "_DEDENT"):
        return _TOKEN_WORDS[tok.type]
    return f"'{tok}'"


def _expected_text(expected: set[str]) -> str:
    words = sorted({_terminal_words().get(e, e) for e in expected})
    if len(words) > 8:
        return ", ".join(words[:8]) + ", ..."
    return ", ".join(words)


def _friendly(exc: UnexpectedInput, file: str, source: str) -> SsdslError:
    """Turn a Lark error into the project's error: a typo, an example match, or a generic one."""
    from ssdsl.parse.syntax_examples import match_example

    # Lark gives no position for the block ends the postlexer adds at the end of the file.
    line = exc.line if isinstance(exc.line, int) and exc.line > 0 else 1
    column = exc.column if isinstance(exc.column, int) and exc.column > 0 else 1
    if isinstance(exc, UnexpectedCharacters):
        char = source[exc.pos_in_stream] if exc.pos_in_stream < len(source) else "?"
        return UnexpectedCharacter(f"unexpected character {char!r}", Span.point(file, line, column),
                                   hint="plans use names, numbers, strings and the operators "
                                        "+ - * / // % .. == != < <= > >= | & [ ] ( ) { } , : =")
    tok = getattr(exc, "token", None)
    at_end = tok is not None and (tok.type == "$END" or (tok.type == "_DEDENT" and not tok.line))
    if isinstance(exc, UnexpectedEOF) or at_end:
        last = source.rstrip().splitlines() or [""]
        return UnexpectedEnd("the file ends in the middle of a statement",
                             Span.point(file, len(last), len(last[-1]) + 1),
                             hint="close every bracket and finish the statement")
    assert isinstance(exc, UnexpectedToken)
    span = Span.from_meta(file, tok) if tok.type not in ("_INDENT", "_DEDENT") else \
        Span.point(file, line, column)
    if tok.type == "_NL":
        span = Span.point(file, line, column)
    typo = _keyword_typo(tok, exc.expected)
    if typo:
        return UnknownKeyword(f"unknown keyword '{tok}' (did you mean '{typo}'?)", span,
                              hint=f"write '{typo}'")
    previous = _misspelled_word_before(source, line, column, file)
    if previous is not None:
        return previous
    example = match_example(exc, source)
    if example is not None:
        cls, message, hint = example
        return cls(message, span, hint=hint)
    return PlanSyntaxError(f"unexpected {describe_token(tok)}; expected "
                           f"{_expected_text(exc.expected)}", span)


def _misspelled_word_before(source: str, line: int, column: int, file: str
                            ) -> UnknownKeyword | None:
    """A keyword misspelled where a name also fits (``to devic 0``, ``devic`` read as a mesh
    name) only fails at the next token; blame the word just before it when it is close to a
    keyword and is not one."""
    lines = source.splitlines()
    if not 1 <= line <= len(lines):
        return None
    m = re.search(r"([A-Za-z_]\w*)[ \t]+$", lines[line - 1][:column - 1])
    if m is None or m.group(1) in KEYWORDS:
        return None
    close = difflib.get_close_matches(m.group(1), KEYWORDS, n=1, cutoff=0.8)
    if not close:
        return None
    span = Span.point(file, line, m.start(1) + 1, len(m.group(1)))
    return UnknownKeyword(f"unknown keyword '{m.group(1)}' (did you mean '{close[0]}'?)", span,
                          hint=f"write '{close[0]}'")


def _keyword_typo(tok: Token, expected: set[str]) -> str | None:
    if tok.type != "NAME" or str(tok) in KEYWORDS:  # a keyword out of place is no typo
        return None
    keywords = [w.strip("'") for e in expected if (w := _terminal_words().get(e, "")).startswith("'")]
    if "PASS" in expected:
        keywords += ["forward", "backward", "input_grad", "weight_grad"]
    keywords = [k for k in keywords if k.isidentifier()] or list(KEYWORDS)
    close = difflib.get_close_matches(str(tok), keywords, n=1, cutoff=0.75)
    return close[0] if close else None
