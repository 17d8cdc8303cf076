"""Errors of elaboration: everything about a plan that can be checked without a model."""

from __future__ import annotations

from ssdsl.errors import SsdslError


class ElaborationError(SsdslError):
    """Root of the elaboration errors."""


class UnknownName(ElaborationError):
    """A name that no parameter, ``let``, loop or built-in defines."""


class UnknownFunction(ElaborationError):
    """A call to a function that is not a built-in."""


class UnknownType(ElaborationError):
    """A parameter type other than int, float, bool, str, list."""


class UnknownStageGroup(ElaborationError):
    """``st[i]`` where no ``stages ... as st`` came before."""


class UnknownMesh(ElaborationError):
    """``m[...]`` where no ``mesh m = grid(...)`` came before."""


class UnknownMeshAxis(ElaborationError):
    """A mesh coordinate names an axis the mesh does not have."""


class UnknownPlan(ElaborationError):
    """``use`` of a plan that is neither a file nor a stdlib plan."""


class DuplicateName(ElaborationError):
    """A name bound twice in one block, or a stage group or mesh declared twice."""


class ReservedName(ElaborationError):
    """A parameter or ``let`` that would hide the built-in ``world`` or a built-in function."""


class WrongType(ElaborationError):
    """A value of the wrong type for an operator, a function, a parameter or a statement."""


class WrongArity(ElaborationError):
    """A call with the wrong number of arguments, or a tuple of the wrong length."""


class WrongValue(ElaborationError):
    """A value of the right type that is out of the allowed range (a count below 1, ...)."""


class DivisionByZero(ElaborationError):
    """``/``, ``//`` or ``%`` by zero."""


class ArithmeticFault(ElaborationError):
    """Arithmetic that overflows or cannot be represented."""


class EmptyRange(ElaborationError):
    """A range that contains nothing where something must be selected."""


class ReversedRange(ElaborationError):
    """A range whose end is before its start."""


class IndexOutOfRange(ElaborationError):
    """An index past the end of a list, range or string."""


class MissingParameter(ElaborationError):
    """A plan parameter without default that was not given."""


class UnknownParameter(ElaborationError):
    """An argument for a parameter the plan does not declare."""


class DuplicateParameter(ElaborationError):
    """A parameter declared twice, or an argument given twice."""


class RecursiveUse(ElaborationError):
    """A plan that uses itself, directly or through other plans."""


class DeviceOutOfRange(ElaborationError):
    """A device id outside ``0..world``."""


class DuplicateDevice(ElaborationError):
    """The same device twice in one device list."""


class StageOutOfRange(ElaborationError):
    """A stage index outside the stage group."""


class MicrobatchOutOfRange(ElaborationError):
    """A micro-batch index outside ``0..count`` of the ``microbatch`` directive."""


class AmbiguousPartSpace(ElaborationError):
    """``assign each part`` whose index space cannot be inferred; give it with ``in``."""


class OrderUnitArity(ElaborationError):
    """``order a before b`` where a side denotes more than one unit of work."""


class RequirementFailed(ElaborationError):
    """A ``require`` statement whose condition is false."""


class TooManyDirectives(ElaborationError):
    """Loops that make more directives (or steps) than the limit."""


class BadSetValue(ElaborationError):
    """A ``--set name=value`` whose value cannot be read as the parameter's type."""


class CountTooLarge(WrongValue):
    """A count above its bound: the world (copies), or the stated limit of counts."""


class DuplicateStatement(ElaborationError):
    """A statement a plan may make once (``microbatch``) made a second time."""
