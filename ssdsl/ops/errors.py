"""Errors of the operator annotation registry, one class per rule.

They carry no source position: the transform phase knows the plan statement that asked for the
split and re-raises them with its span (``err.at(span)``).
"""

from __future__ import annotations

from ssdsl.errors import SsdslError
from ssdsl.source import Span


class OpsError(SsdslError):
    """Root of the registry's errors; ``at(span)`` gives a copy located in the plan."""

    def at(self, span: Span | None) -> OpsError:
        err = type(self)(self.message, span, hint=self.hint, file=self.file)
        err.__cause__ = self
        return err


class NotAnnotatedError(OpsError):
    """Asked to partition an operator that has no annotation (it can only be replicated)."""


class UnknownDimError(OpsError):
    """The dimension named in a split is not a dimension of the operator."""


class FrozenDimError(OpsError):
    """The dimension exists but splitting it would change the operator's result."""


class IndivisibleError(OpsError):
    """The dimension's size is not a multiple of the number of parts."""
