"""Errors of elaboration: everything about a plan that can be checked without a model."""

from __future__ import annotations

from ssdsl.errors import SsdslError


class ElaborationError(SsdslError):
    """Root of the elaboration errors."""


class UnknownName(ElaborationError):
    """A name that no parameter, ``let``, loop or built-in defines."""

    default_hint = ("names come from the plan's parameters, `let`, `for` and the built-in "
                    "`world`; a name is known only after the line that binds it")


class UnknownFunction(ElaborationError):
    """A call to a function that is not a built-in."""

    default_hint = "the built-ins are min, max, sum, len, abs, int, float, str, list, ceil_div"


class UnknownType(ElaborationError):
    """A parameter type other than int, float, bool, str, list."""

    default_hint = "types are int, float, bool, str, list"


class UnknownStageGroup(ElaborationError):
    """``st[i]`` where no ``stages ... as st`` came before."""

    default_hint = "declare it first: stages into N as NAME"


class UnknownMesh(ElaborationError):
    """``m[...]`` where no ``mesh m = grid(...)`` came before."""

    default_hint = "declare it first: mesh NAME = grid(axis=N, ...)"


class UnknownMeshAxis(ElaborationError):
    """A mesh coordinate names an axis the mesh does not have."""

    default_hint = "use one of the axes of the mesh's grid(...)"


class UnknownPlan(ElaborationError):
    """``use`` of a plan that is neither a file nor a stdlib plan."""

    default_hint = ("`ssdsl plans` lists the stdlib plans; a file is written as a string: use "
                    "\"path.ssp\"")


class DuplicateName(ElaborationError):
    """A name bound twice in one block, or a stage group or mesh declared twice."""

    default_hint = "bindings and declarations cannot change; give the second one another name"


class ReservedName(ElaborationError):
    """A parameter or ``let`` that would hide the built-in ``world`` or a built-in function."""

    default_hint = "choose another name"


class WrongType(ElaborationError):
    """A value of the wrong type for an operator, a function, a parameter or a statement."""

    default_hint = ("docs/language.md (Expressions, Statements) says which types each operator "
                    "and statement takes")


class WrongArity(ElaborationError):
    """A call with the wrong number of arguments, or a tuple of the wrong length."""

    default_hint = "count the arguments against the parameters of the function or plan"


class WrongValue(ElaborationError):
    """A value of the right type that is out of the allowed range (a count below 1, ...)."""

    default_hint = "docs/language.md says which values this statement takes"


class DivisionByZero(ElaborationError):
    """``/``, ``//`` or ``%`` by zero."""

    default_hint = "the divisor is 0 here; guard it with `if`, or use max(1, ...)"


class ArithmeticFault(ElaborationError):
    """Arithmetic that overflows or cannot be represented."""

    default_hint = ("integers are 64-bit and floats finite (docs/language.md, Limits); check the "
                    "values this expression is computed from")


class EmptyRange(ElaborationError):
    """A range that contains nothing where something must be selected."""

    default_hint = "a..b stops before b; a..=b includes b"


class ReversedRange(ElaborationError):
    """A range whose end is before its start."""

    default_hint = "write the smaller bound first"


class IndexOutOfRange(ElaborationError):
    """An index past the end of a list, range or string."""

    default_hint = "indices start at 0: a list of n items has the indices 0..n"


class MissingParameter(ElaborationError):
    """A plan parameter without default that was not given."""

    default_hint = "give it with --set NAME=VALUE, or as an argument of `use`"


class UnknownParameter(ElaborationError):
    """An argument for a parameter the plan does not declare."""

    default_hint = "`ssdsl plans` shows each stdlib plan's parameters"


class DuplicateParameter(ElaborationError):
    """A parameter declared twice, or an argument given twice."""

    default_hint = "give each parameter once"


class RecursiveUse(ElaborationError):
    """A plan that uses itself, directly or through other plans."""

    default_hint = "remove the use that closes the cycle"


class DeviceOutOfRange(ElaborationError):
    """A device id outside ``0..world``."""

    default_hint = "devices are 0..world; run with more devices (--world N) or use fewer"


class DuplicateDevice(ElaborationError):
    """The same device twice in one device list."""

    default_hint = "name each device once"


class StageOutOfRange(ElaborationError):
    """A stage index outside the stage group."""

    default_hint = "the stages of a group of N are st[0] to st[N - 1]"


class MicrobatchOutOfRange(ElaborationError):
    """A micro-batch index outside ``0..count`` of the ``microbatch`` directive."""

    default_hint = "the plan's 'microbatch ... into N' sets the count: micro-batches are 0..N"


class AmbiguousPartSpace(ElaborationError):
    """``assign each part`` whose index space cannot be inferred; give it with ``in``."""

    default_hint = "say them: assign each part (i, j) in [0..a, 0..b] to ..."


class OrderUnitArity(ElaborationError):
    """``order a before b`` where a side denotes more than one unit of work."""

    default_hint = "give one micro-batch (mb N), or use 'order on device'"


class RequirementFailed(ElaborationError):
    """A ``require`` statement whose condition is false."""

    default_hint = ("the plan states this requirement; change --world, --set or the arguments of "
                    "its `use`")


class TooManyDirectives(ElaborationError):
    """Loops that make more directives (or steps) than the limit."""

    default_hint = "check the bounds of the loops"


class BadSetValue(ElaborationError):
    """A ``--set name=value`` whose value cannot be read as the parameter's type."""

    default_hint = "write --set NAME=VALUE with a value of the parameter's type"


class CountTooLarge(WrongValue):
    """A count above its bound: the world (copies), or the stated limit of counts."""

    default_hint = "use a smaller count (docs/language.md, Limits)"


class DuplicateStatement(ElaborationError):
    """A statement a plan may make once (``microbatch``) made a second time."""

    default_hint = "a plan makes this statement once; remove one of them"
