"""The model-file contract: what ``model.py`` must define, loaded and checked in one place.

A model file is ordinary PyTorch code plus a few named functions::

    def build_model() -> torch.nn.Module: ...            # required
    def get_batch(step: int, batch_size: int): ...        # required, deterministic in (step, batch_size)
        # returns (inputs, target): inputs a Tensor or a tuple of Tensors, target a Tensor
    def loss(output, target) -> torch.Tensor: ...        # optional; default: cross-entropy over the
                                                          # last dim of output (token/class logits)
    def make_optimizer(params) -> torch.optim.Optimizer   # optional; default: SGD(lr=0.01)
    def get_batch_shard(step, batch_size, start, stop):   # optional; rows start:stop of
        ...                                               # get_batch(step, batch_size), so a
                                                          # rank loads only the rows it uses
    BATCH_SIZE = 8                                        # optional; default batch size (default 8)
    INPUT_DIMS = (("batch", "seq"),)                      # optional; names of the flowing dims of
                                                          # each input tensor (default: dim 0 "batch")

Seeding is the caller's job: ``build_model`` is called after ``torch.manual_seed(seed)``, so two
calls with the same seed give the same parameters.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from ssdsl.errors import SsdslError
from ssdsl.source import Span, remember_source, source_text


class ModelFileError(SsdslError):
    """The model file is missing, does not import, or breaks the contract."""


class ModelFileSyntaxError(ModelFileError):
    """The model file is not valid Python."""

    default_hint = "fix the Python at the caret (python -m py_compile FILE reports the same)"


class ModelFileExit(ModelFileError):
    """The model file called ``sys.exit`` (or raised ``SystemExit``) while being imported."""


class ModelFileRaised(ModelFileError):
    """The model file's code raised an exception (at import, or in one of its functions)."""

    default_hint = ("the model file's own code raised this at the line shown; "
                    "ssdsl --debug shows the whole traceback")


class ModelFileContract(ModelFileError):
    """A contract function is missing, or returns something of the wrong kind."""

    default_hint = ("docs/model_file.md says what build_model, get_batch, loss and "
                    "make_optimizer must return")


class PlainModelRaised(ModelFileRaised):
    """The plain model, trained on one device as the reference of a check, raised an exception
    (a library kernel without float64, say) after it traced and planned."""

    default_hint = ("the check trains the plain model on one device in the run's dtype and "
                    "this model does not compute in it here: check in another --dtype")


def locate_in(path: str, exc: BaseException) -> Span | None:
    """The line of the model file where ``exc`` was raised (the deepest frame in that file)."""
    target = str(Path(path).resolve())
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        try:
            same = str(Path(frame.filename).resolve()) == target
        except OSError:  # pragma: no cover - a frame of a file that vanished
            same = False
        if same and frame.lineno:
            found = frame
    if found is None:
        return None
    return line_span(path, found.lineno, found.colno)


def def_span(path: str, fn: Any) -> Span | None:
    """The ``def`` line of function ``fn`` when it is defined in the model file at ``path``."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
    if code is None:
        return None
    try:
        same = Path(code.co_filename).resolve() == Path(path).resolve()
    except OSError:  # pragma: no cover
        same = False
    return line_span(path, code.co_firstlineno, None) if same else None


def binding_span(path: str, name: str) -> Span | None:
    """The module-level statement of the model file that last binds ``name`` (an assignment, a
    ``def``, a ``class``, an import; inside a top-level ``if``/``try`` too), or None."""
    text = source_text(path)
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    found: ast.stmt | None = None
    stack: list[ast.stmt] = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if name in _bound_names(node):
            found = node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            nested = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                nested.extend(handler.body)
            stack.extend(reversed(nested))
    if found is None:
        return None
    return line_span(path, found.lineno, found.col_offset)


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    names = set()
    for t in targets:
        for sub in ast.walk(t):
            if isinstance(sub, ast.Name):
                names.add(sub.id)
    return names


def line_span(path: str, line: int, column: int | None) -> Span:
    """A span on ``line`` of the model file (the column given 0-based, as Python's frames give
    it; else the first non-blank character), with the file's text remembered for the excerpt."""
    text = source_text(path)
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        remember_source(path, text)
    lines = text.splitlines()
    src = lines[line - 1] if 0 < line <= len(lines) else ""
    if column is None:
        column = len(src) - len(src.lstrip())
    width = max(1, len(src.rstrip()) - column)
    return Span.point(path, line, column + 1, width)


def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits ``(..., classes)`` against integer targets ``(...)``."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


@attrs.frozen
class ModelFile:
    """A loaded, checked model file."""

    path: str
    build_model: Callable[[], torch.nn.Module]
    get_batch_fn: Callable[[int, int], Any]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    make_optimizer: Callable[..., torch.optim.Optimizer]
    batch_size: int
    input_dims: tuple[tuple[str, ...], ...] | None
    has_optimizer: bool
    get_batch_shard_fn: Callable[[int, int, int, int], Any] | None = None

    def get_rows(self, step: int, batch_size: int | None, start: int, stop: int
                 ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Rows ``start:stop`` (dim 0) of batch ``step``: from ``get_batch_shard`` when the model
        file defines it (only those rows are loaded), else sliced out of ``get_batch``."""
        bs = self.batch_size if batch_size is None else batch_size
        if self.get_batch_shard_fn is None:
            inputs, target = self.get_batch(step, bs)
            return tuple(t[start:stop] for t in inputs), target[start:stop]
        call = f"get_batch_shard({step}, {bs}, {start}, {stop})"
        try:
            result = self.get_batch_shard_fn(step, bs, start, stop)
        except Exception as exc:
            raise ModelFileRaised(f"{call} raised {_describe(exc)}", locate_in(self.path, exc),
                                  file=self.path) from exc
        inputs, target = self._checked(result, call, stop - start, self.get_batch_shard_fn)
        return inputs, target

    def get_batch(self, step: int, batch_size: int | None = None
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """``(inputs, target)`` for ``step``, inputs always a tuple; checked against the contract."""
        bs = self.batch_size if batch_size is None else batch_size
        try:
            result = self.get_batch_fn(step, bs)
        except Exception as exc:
            raise ModelFileRaised(f"get_batch({step}, {bs}) raised {_describe(exc)}",
                                  locate_in(self.path, exc), file=self.path) from exc
        return self._checked(result, f"get_batch({step}, {bs})", bs, self.get_batch_fn)

    def _checked(self, result: Any, call: str, rows: int, fn: Callable
                 ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """``result`` of ``call`` checked against the contract: ``(inputs, target)``, every
        tensor with ``rows`` rows (dim 0)."""
        where = def_span(self.path, fn)
        name = call.split("(")[0]
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise ModelFileContract(f"{name} must return a pair (inputs, target); it returned "
                                    f"{_kind(result)}", where, file=self.path)
        inputs, target = result
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else \
            tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise ModelFileContract(f"{name}: inputs must be a Tensor or a tuple of Tensors; "
                                    f"got {_kind(result[0])}", where, file=self.path)
        if not isinstance(target, torch.Tensor):
            raise ModelFileContract(f"{name}: target must be a Tensor; got {_kind(target)}",
                                    where, file=self.path)
        if any(t.dim() == 0 for t in (*inputs, target)):
            raise ModelFileContract(f"{name}: every input and the target need a batch dim "
                                    "(dim 0); got a 0-dim tensor", where, file=self.path)
        if any(t.shape[0] != rows for t in (*inputs, target)):
            shapes = ", ".join(str(tuple(t.shape)) for t in (*inputs, target))
            what = "the batch size" if name == "get_batch" else "the number of rows asked for"
            raise ModelFileContract(f"{call}: dim 0 of every input and of the target must be "
                                    f"{what} {rows}; shapes: {shapes}", where, file=self.path)
        self._check_input_dims(inputs)
        return inputs, target

    def _check_input_dims(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """``INPUT_DIMS`` names at most the dims each input has, once each, for at most the
        inputs there are; an error at the line that binds it."""
        if self.input_dims is None:
            return
        fault = None
        if len(self.input_dims) > len(inputs):
            fault = (f"INPUT_DIMS names the dims of {len(self.input_dims)} inputs, but get_batch "
                     f"gives {len(inputs)}")
        for i, (names, t) in enumerate(zip(self.input_dims, inputs)):
            if fault is None and len(names) > t.dim():
                fault = (f"INPUT_DIMS names {len(names)} dims of input {i} ({', '.join(names)}), "
                         f"which has {t.dim()} (shape {tuple(t.shape)})")
            named = [n for n in names if n]
            if fault is None and len(set(named)) != len(named):
                fault = f"INPUT_DIMS names a dim of input {i} twice ({', '.join(names)})"
        if fault is not None:
            raise ModelFileContract(fault, binding_span(self.path, "INPUT_DIMS"), file=self.path,
                                    hint="one tuple per input, one name per leading dim, e.g. "
                                         "INPUT_DIMS = ((\"batch\", \"seq\"),) for (batch, seq) "
                                         "tokens")

    def build(self, *, seed: int = 0) -> torch.nn.Module:
        """The model built under ``torch.manual_seed(seed)``."""
        torch.manual_seed(seed)
        try:
            model = self.build_model()
        except Exception as exc:
            raise ModelFileRaised(f"build_model() raised {_describe(exc)}",
                                  locate_in(self.path, exc), file=self.path) from exc
        if not isinstance(model, torch.nn.Module):
            raise ModelFileContract("build_model() must return a torch.nn.Module; it returned "
                                    f"{_kind(model)}", def_span(self.path, self.build_model),
                                    file=self.path)
        return model


_OWN_DIR = str(Path(__file__).resolve().parent.parent)  # the ssdsl package


def _describe(exc: BaseException) -> str:
    # where it was raised, naming no frame of ssdsl itself (the user cannot act on those)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(_OWN_DIR)]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:300] + "..."
    return f"{type(exc).__name__}: {first}{where}"


def _kind(value: Any) -> str:
    """How a message names a returned value: its type, with what helps (shape, length, keys)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        keys = ", ".join(map(repr, list(value)[:5]))
        return f"a dict (keys {keys})"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else f"a {type(value).__name__}"


def _value(value: Any) -> str:
    """A module-level value as a message quotes it: its repr (cut) and its type."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


_CACHE: dict[Path, ModelFile] = {}


def load_model_file(path: str | Path) -> ModelFile:
    """Import ``path`` and check that it follows the contract (module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file not found: {path}", hint="pass the path of a .py file "
                             "that defines build_model() and get_batch(step, batch_size)")
    key = p.resolve()
    if key in _CACHE:
        return _CACHE[key]
    name = f"ssdsl_model_{abs(hash(str(key)))}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ModelFileError("cannot import this file as Python", file=str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # as ``python model.py`` would: the model file's folder first on the path, so that the
    # helper modules beside it (``from my_layers import Block``) import
    folder = str(key.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(name, None)
        raise _syntax_error(str(path), exc) from None
    except SystemExit as exc:
        sys.modules.pop(name, None)
        raise ModelFileExit(f"the model file exits while being imported (sys.exit({exc.code!r}))",
                            locate_in(str(path), exc), file=str(path),
                            hint="a model file is imported, not run: put script code under "
                                 "`if __name__ == \"__main__\":`") from None
    except Exception as exc:
        sys.modules.pop(name, None)
        raise ModelFileRaised(f"importing the model file raised {_describe(exc)}",
                              locate_in(str(path), exc), file=str(path)) from exc
    _CACHE[key] = mf = _check(module, str(path))
    return mf


def _syntax_error(path: str, exc: SyntaxError) -> ModelFileSyntaxError:
    """A Python syntax error of the model file at its line and column, with a caret."""
    line = exc.lineno or 1
    span = line_span(path, line, None)
    if exc.offset:
        end = exc.end_offset if exc.end_lineno == exc.lineno and exc.end_offset else exc.offset + 1
        span = Span.point(path, line, exc.offset, max(1, end - exc.offset))
    return ModelFileSyntaxError(f"Python syntax error: {exc.msg}", span, file=path)


def _check(module: Any, path: str) -> ModelFile:
    # A name the file binds to something else is located at the line that binds it; a name
    # the file does not define has no line.
    for fn in ("build_model", "get_batch", "loss", "make_optimizer", "get_batch_shard"):
        if hasattr(module, fn) and not callable(getattr(module, fn)):
            raise ModelFileContract(f"'{fn}' must be a function; here it is "
                                    f"{_value(getattr(module, fn))}", binding_span(path, fn),
                                    file=path, hint=f"define it with def {fn}(...): "
                                    "(docs/model_file.md)")
    missing = [n for n in ("build_model", "get_batch") if not hasattr(module, n)]
    if missing:
        raise ModelFileContract(f"missing function{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(missing)}", file=path,
                             hint="a model file defines build_model() -> nn.Module and "
                             "get_batch(step, batch_size) -> (inputs, target); see the README")
    for fn, params in _CALLED_AS.items():
        if hasattr(module, fn):
            _check_signature(getattr(module, fn), fn, params, path)
    batch_size = getattr(module, "BATCH_SIZE", 8)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ModelFileContract(f"BATCH_SIZE must be a positive int, not {_value(batch_size)}",
                                binding_span(path, "BATCH_SIZE"), file=path,
                                hint="e.g. BATCH_SIZE = 8 (the global batch of a step; "
                                     "--batch-size overrides it)")
    return ModelFile(
        path=path,
        build_model=module.build_model,
        get_batch_fn=module.get_batch,
        loss=getattr(module, "loss", default_loss),
        make_optimizer=getattr(module, "make_optimizer", default_optimizer),
        batch_size=batch_size,
        input_dims=_input_dims(getattr(module, "INPUT_DIMS", None), path),
        has_optimizer=hasattr(module, "make_optimizer"),
        get_batch_shard_fn=getattr(module, "get_batch_shard", None),
    )


# How ssdsl calls each function of the contract (positional arguments).
_CALLED_AS = {"build_model": (), "get_batch": ("step", "batch_size"), "loss": ("output", "target"),
              "make_optimizer": ("params",),
              "get_batch_shard": ("step", "batch_size", "start", "stop")}


def _check_signature(fn: Callable, name: str, params: tuple[str, ...], path: str) -> None:
    """A function of the contract that cannot be called as ssdsl calls it is an error at its
    ``def`` line, before anything calls it (rather than a TypeError raised by the call)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    try:
        sig.bind(*params)
    except TypeError:
        raise ModelFileContract(
            f"{name} is called as {name}({', '.join(params)}); it is defined as {name}{sig}",
            def_span(path, fn) or binding_span(path, name), file=path,
            hint=f"define it as def {name}({', '.join(params)}): (docs/model_file.md)") from None


def _input_dims(value: Any, path: str) -> tuple[tuple[str, ...], ...] | None:
    if value is None:
        return None
    ok = isinstance(value, Sequence) and all(
        isinstance(d, Sequence) and not isinstance(d, str) and all(isinstance(n, str) for n in d)
        for d in value)
    if not ok:
        raise ModelFileContract("INPUT_DIMS must be a tuple with, for each input, a tuple of "
                                f"dimension names; here it is {_value(value)}",
                                binding_span(path, "INPUT_DIMS"), file=path,
                                hint="e.g. INPUT_DIMS = ((\"batch\", \"seq\"),) for one "
                                     "input of shape (batch, seq)")
    return tuple(tuple(d) for d in value)
