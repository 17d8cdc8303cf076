"""Errors of the transform phase: each points at the plan statement that caused it."""

from __future__ import annotations

from ssdsl.errors import SsdslError


class TransformError(SsdslError):
    """Root of the errors raised while applying a plan to a traced graph."""


class EmptySelection(TransformError):
    """A selector matched no operator of the graph."""


class NoSuchParts(EmptySelection):
    """``part i of X`` (an ``assign each part i``): X's operators have no part of that index."""


class MissingDim(TransformError):
    """No selected operator has the dimension a partition asks for."""


class PartCountMismatch(TransformError):
    """An assign spreads parts over a number of devices that differs from the number of parts."""


class UnplacedPart(TransformError):
    """A part of an operator was never assigned to a device."""


class BadDevice(TransformError):
    """A device id outside ``0..world``."""


class UnsupportedSelector(TransformError):
    """A selector form the transform phase cannot resolve here (stages before they exist)."""


class UnsupportedDirective(TransformError):
    """A statement the language accepts but this version cannot apply to a model yet."""


class PartReassigned(TransformError):
    """A part assigned to one device and later to another."""
