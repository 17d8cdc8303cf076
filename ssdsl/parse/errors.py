"""Errors of the parse phase: one class per kind of syntax fault.

The friendly messages for common mistakes come from the example table in
``ssdsl.parse.syntax_examples``; each entry names one of these classes.
"""

from __future__ import annotations

from ssdsl.errors import SsdslError


class PlanSyntaxError(SsdslError):
    """The text is not a plan: the parser could not go on at this position."""

    default_hint = "docs/language.md shows the form of each statement"


class UnknownKeyword(PlanSyntaxError):
    """A word where a statement keyword belongs, close to a real keyword (a typo)."""


class UnexpectedCharacter(PlanSyntaxError):
    """A character that starts no token of the language."""


class UnexpectedEnd(PlanSyntaxError):
    """The file ends in the middle of a statement or an open bracket."""


class IndentationError_(PlanSyntaxError):
    """A line is indented to a level no enclosing block uses, or a block is missing."""


class MissingPlanHeader(PlanSyntaxError):
    """The file does not start with ``plan NAME(...)``."""


class MissingInto(PlanSyntaxError):
    """``partition``/``replicate``/``microbatch`` without ``into N``."""


class MissingAlong(PlanSyntaxError):
    """``partition`` without ``along DIM``."""


class MissingColon(PlanSyntaxError):
    """A ``for``/``if``/``order on`` header without the ``:`` that opens its block."""


class MissingTo(PlanSyntaxError):
    """``assign`` without ``to PLACE``."""


class BadPlace(PlanSyntaxError):
    """A place that is neither ``device E``, ``devices E``, ``M[...]`` nor ``mesh M``."""


class MissingParamType(PlanSyntaxError):
    """A plan parameter without ``: TYPE``."""


class AssignmentNotStatement(PlanSyntaxError):
    """``x = 1`` without ``let``."""


class UnclosedBracket(PlanSyntaxError):
    """An opening bracket that is never closed."""


class TooDeep(PlanSyntaxError):
    """Nesting deeper than the parser supports."""

    default_hint = "split the expression with `let` (docs/language.md, Limits)"


class BadLiteral(PlanSyntaxError):
    """A number or string literal that cannot be read."""

    default_hint = "integers are at most 2**63 - 1 and floats finite (docs/language.md, Limits)"


class EmptyPlan(MissingPlanHeader):
    """A file with nothing but blank lines and comments."""

    default_hint = "a plan starts with its header: plan NAME(PARAMS)"


class BadEncoding(PlanSyntaxError):
    """A byte that is not UTF-8."""

    default_hint = "save the file as UTF-8"
