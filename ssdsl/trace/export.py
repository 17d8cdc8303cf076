"""Trace a model file's training forward (model, then loss) with ``torch.export`` into a ``Graph``.

``torch.export.export(..., strict=False)`` gives the training IR: ATen ops such as ``linear``,
``layer_norm`` and ``scaled_dot_product_attention`` stay whole, every op carries the module path
that called it (``nn_module_stack``) and fake-tensor shapes. On the ``meta`` device no parameter is
allocated, so a model far larger than memory can be planned.
"""

from __future__ import annotations

import contextlib
import io
import operator
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.fx

from ssdsl.errors import SsdslError
from ssdsl.source import Span, file_line, shown_path
from ssdsl.ir.grad import grad_tensors, loss_grad_tensors
from ssdsl.ir.graph import Graph, Op, TensorInfo, TensorRef, kind_of
from ssdsl.trace.aligned import align_arange_indices
from ssdsl.trace.dims import flow_names
from ssdsl.trace.model_file import ModelFile
from ssdsl.trace.shared import share_parameters
from ssdsl.trace.trial import (check_batch_deterministic, loss_fault, quiet_torch_logs,
                               refuse_random_operators, try_training_step)



class TraceError(SsdslError):
    """torch.export could not trace the model file's forward and loss."""


class _TrainingForward(torch.nn.Module):
    """The traced unit: the model's forward followed by the loss, ending in a scalar."""

    def __init__(self, model: torch.nn.Module, loss) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        *inputs, target = batch
        return self.loss_fn(self.model(*inputs), target)


def trace(model_file: ModelFile, *, device: str = "meta", batch_size: int | None = None,
          model: torch.nn.Module | None = None, seed: int = 0) -> Graph:
    """The ``Graph`` of ``model_file``'s training forward.

    ``device="meta"`` builds the model without memory (planning); ``"cpu"`` builds it for real
    (the graph's lifted constants are then real too, so ``run_graph`` can use them). A ``model``
    passed in is traced as it is.
    """
    inputs, target = model_file.get_batch(0, batch_size)
    if model is None:
        with torch.device(device):
            model = model_file.build(seed=seed)
    # What a rank would hit, reported here at the model file's line: one step on meta (a model
    # built on meta is used as it is; otherwise a meta twin is built, which allocates nothing).
    if model is not None and _device_of(model, device).type == "meta":
        # in the model's floating dtype, as the trace below gives it (``--dtype float64``)
        dtype = _float_dtype_of(model)
        cast = [t.to(dtype) if dtype is not None and t.is_floating_point() else t
                for t in (*inputs, target)]
        try_training_step(model_file, model, (tuple(cast[:-1]), cast[-1]))
    else:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the caller's RNG kept
            twin = model_file.build(seed=seed)
        try_training_step(model_file, twin, (inputs, target))
    # every rank calls get_batch and must get the same batch (checked after the step, whose
    # faults are at a line of the forward or the loss)
    check_batch_deterministic(model_file, batch_size)
    dev = _device_of(model, device)
    # a model cast to another floating dtype (``--dtype float64``) gets its floating inputs in
    # that dtype, as the runtime and the reference give them (``to_dtype``); integer tokens stay
    dtype = _float_dtype_of(model)
    batch = tuple(t.to(dev, dtype) if dtype is not None and t.is_floating_point() else t.to(dev)
                  for t in (*inputs, target))
    # torch.export prints the partial graph of a failed trace to stderr (hundreds of lines for
    # a transformer): held back, and written out only when the trace succeeds (its warnings)
    held = io.StringIO()
    try:
        with quiet_torch_logs(), contextlib.redirect_stderr(held):
            ep = torch.export.export(_TrainingForward(model, model_file.loss), batch,
                                     strict=False)
    except SsdslError:
        raise
    except Exception as exc:
        fault = loss_fault(model_file, exc)
        if fault is not None:
            raise fault from exc
        at = _stopped_at(getattr(exc, "partial_fx_graph", None)) or _raised_at(exc)
        raise TraceError(f"torch.export failed on the model's forward and loss: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                         + (" (the trace stopped at this line)" if at is not None else ""), at,
                         file=None if at is not None else model_file.path,
                         hint="run with --debug for the full traceback; "
                         "data-dependent control flow and unsupported ops are common causes") from exc
    if held.getvalue():
        sys.stderr.write(held.getvalue())
    seeds = _input_seeds(model_file, ep, len(inputs))
    graph = graph_from_export(ep, seeds=seeds, model=model)
    graph = _loss_sources(graph, model_file.loss)
    refuse_random_operators(graph, model_file.path, _model_file_lines(ep, model_file.path))
    return graph


def _stopped_at(partial_graph: Any) -> Span | None:
    """The last source line in a failed export's partial graph (``# File: PATH:LINE in f,
    code: ...``): the statement the trace could not go past (a loop over a data-dependent
    tensor), or None."""
    import re
    found = re.findall(r"# File: (\S+):(\d+) in \w+, code: ", str(partial_graph or ""))
    if not found:
        return None
    path, line = found[-1]
    return file_line(path, int(line), shown_path(path)) if Path(path).exists() else None


def _raised_at(exc: BaseException) -> Span | None:
    """The innermost frame of ``exc``'s traceback outside torch and ssdsl: the line of the
    model's code (the model file's, or a library's such as HF's ``modeling_*.py``) whose call
    failed under the trace (a shape that does not broadcast there), or None."""
    import traceback
    skip = (str(Path(torch.__file__).resolve().parent), str(Path(__file__).resolve().parents[1]))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(skip)
              and Path(f.filename).exists()]
    if not frames:
        return None
    last = frames[-1]
    return file_line(last.filename, last.lineno, shown_path(last.filename))


def _model_file_lines(ep: torch.export.ExportedProgram, path: str) -> dict[str, int]:
    """For each exported operator, the innermost line of the model file in its stack trace."""
    import re
    pattern = re.compile(r'File "([^"]+)", line (\d+)')
    target = str(Path(path).resolve())
    out = {}
    for node in ep.graph.nodes:
        found = [int(n) for f, n in pattern.findall(node.meta.get("stack_trace") or "")
                 if str(Path(f).resolve()) == target]
        if found:
            out[node.name] = found[-1]
    return out


def _device_of(model: torch.nn.Module, default: str) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device(default)


def _float_dtype_of(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's floating parameters (buffers when it has none), or None."""
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def _input_seeds(model_file: ModelFile, ep, n_inputs: int) -> dict[tuple[str, int], str]:
    user = [s.arg.name for s in ep.graph_signature.input_specs
            if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    dims = model_file.input_dims or tuple(("batch",) for _ in range(n_inputs))
    seeds = {}
    for name, names in zip(user[:n_inputs], dims):
        for d, n in enumerate(names):
            if n:
                seeds[(name, d)] = n
    if len(user) > n_inputs:  # the target's first dim is the batch
        seeds[(user[n_inputs], 0)] = "batch"
    return seeds


def graph_from_export(ep: torch.export.ExportedProgram,
                      seeds: Mapping[tuple[str, int], str] | None = None, *,
                      model: torch.nn.Module | None = None) -> Graph:
    """Convert an exported training forward into a ``Graph`` with flowing names."""
    InputKind = torch.export.graph_signature.InputKind
    params, buffers, constants, inputs = {}, {}, {}, []
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER and _frozen_parameter(ep, spec.target):
            # requires_grad=False (Whisper's sinusoidal positions): state that training reads
            # and never updates, as a buffer is; as a parameter it would get a gradient and an
            # optimizer step the plain model never takes
            buffers[name] = _strip(spec.target)
        elif spec.kind == InputKind.PARAMETER:
            params[name] = _strip(spec.target)
        elif spec.kind == InputKind.BUFFER:
            buffers[name] = _strip(spec.target)
        elif spec.kind in (InputKind.CONSTANT_TENSOR,):
            constants[name] = _constant(ep, spec.target)
        elif spec.kind == InputKind.USER_INPUT:
            inputs.append(name)
    tensors: dict[str, TensorInfo] = {}
    ops: list[Op] = []
    alias: dict[str, str] = {}  # getitem node -> tensor name
    output = None
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            _add_tensor(tensors, node.name, node.meta.get("val"))
        elif node.op == "call_function":
            _refuse_unsupported(ep, node)
            op = _convert(node, alias, tensors)
            if op is not None:
                ops.append(op)
        elif node.op == "output":
            output = _user_output(ep, node, alias)
    ops = align_arange_indices(ops, tensors)
    ops = share_parameters(ops, tensors, params, _aliases(model, params),
                           frozen=_frozen_ops(ops, tensors, params, buffers, inputs, output,
                                              constants))
    tensors = flow_names(tuple(ops), tensors, seeds or {})
    # tied names of frozen parameters too: a saved state has every name the model's has
    return Graph(ops=tuple(ops), tensors=tensors, params=params, buffers=buffers,
                 inputs=tuple(inputs), output=output,
                 aliases=_aliases(model, {**params, **buffers}), constants=constants,
                 sources=_source_lines(ep))


def _loss_sources(graph: Graph, loss: Any) -> Graph:
    """The operators without a line of their own (torch keeps the frames of modules' forwards
    only, so the loss's operators have none) placed at the user's loss function."""
    import inspect
    try:
        path = inspect.getsourcefile(loss)
        line = inspect.getsourcelines(loss)[1]
    except (TypeError, OSError):
        return graph
    if path is None or Path(path).resolve().is_relative_to(Path(__file__).resolve().parents[1]):
        return graph  # ssdsl's default loss: no line of the user's to show
    missing = {op.name: (path, line) for op in graph.ops if op.name not in graph.sources}
    if not missing:
        return graph
    import attrs
    return attrs.evolve(graph, sources={**graph.sources, **missing})


def _source_lines(ep: torch.export.ExportedProgram) -> dict[str, tuple[str, int]]:
    """For each exported operator, the innermost frame of its stack trace in the user's code:
    outside torch, ssdsl and Python's own library (the model file, or HF's modeling file)."""
    import re
    import sysconfig
    pattern = re.compile(r'File "([^"]+)", line (\d+)')
    skip = tuple(str(Path(p).resolve()) for p in (
        Path(torch.__file__).parent, Path(__file__).resolve().parents[1],
        sysconfig.get_paths()["stdlib"]))
    keep: dict[str, bool] = {}

    def ours(f: str) -> bool:
        if f not in keep:
            keep[f] = not f.startswith("<") and not str(Path(f).resolve()).startswith(skip)
        return keep[f]

    out: dict[str, tuple[str, int]] = {}
    for node in ep.graph.nodes:
        found = [(f, int(n)) for f, n in pattern.findall(node.meta.get("stack_trace") or "")
                 if ours(f)]
        if found:
            out[node.name] = found[-1]
    return out


def _frozen_parameter(ep: torch.export.ExportedProgram, target: str) -> bool:
    """Whether the model's parameter ``target`` has ``requires_grad=False``."""
    value = ep.state_dict.get(target)
    return isinstance(value, torch.Tensor) and not value.requires_grad


def _frozen_ops(ops, tensors, params, buffers, inputs, output, constants) -> frozenset[str]:
    """Operators with a floating output that the loss does not differentiate (before a
    ``.detach()``): ``share_parameters`` leaves their parameter reads alone."""
    if not any(op.kind == "detach" for op in ops):  # the common case: nothing to find
        return frozenset()
    g = Graph(ops=tuple(ops), tensors=dict(tensors), params=params, buffers=buffers,
              inputs=tuple(inputs), output=output, constants=constants)
    needs, reached = grad_tensors(g), loss_grad_tensors(g)
    return frozenset(op.name for op in ops
                     if any(x in needs for x in op.outputs)
                     and not any(x in reached for x in op.outputs))


def _strip(qualname: str) -> str:
    return qualname[len("model."):] if qualname.startswith("model.") else qualname


def _constant(ep, target: str) -> Any:
    return ep.constants.get(target)


def _aliases(model: torch.nn.Module | None, params: Mapping[str, str]) -> dict:
    """Tied parameters: the exported qualified name, with the model's other names for it."""
    if model is None:
        return {}
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    exported = set(params.values())
    out = {}
    for names in groups.values():
        for main in names:
            if main in exported and len(names) > 1:
                out[main] = tuple(n for n in names if n != main)
    return out


def _add_tensor(tensors: dict[str, TensorInfo], name: str, val: Any) -> None:
    if isinstance(val, torch.Tensor):
        tensors[name] = TensorInfo(name, tuple(int(s) for s in val.shape), str(val.dtype))


def _refuse_unsupported(ep: torch.export.ExportedProgram, node: torch.fx.Node) -> None:
    """A call the graph cannot hold, refused at the model's line: a ``with torch.no_grad():``
    (or ``enable_grad``) block in the forward, which torch.export wraps as a region of its own,
    says what to write instead."""
    if node.target is operator.getitem or isinstance(node.target, torch._ops.OpOverload):
        return
    at = _user_line(node)
    name = getattr(node.target, "__name__", str(node.target))
    if name == "wrap_with_set_grad_enabled":
        inner = getattr(ep.graph_module, node.args[1].target, None) if len(node.args) > 1 \
            else None
        for n in inner.graph.nodes if inner is not None else ():
            at = at or _user_line(n)
        raise TraceError(
            "the forward switches autograd off or on inside itself (a `with torch.no_grad():` "
            "block, as a buffer's running average or a router's bookkeeping is written): "
            "ssdsl traces the forward as one differentiable graph", at,
            hint="compute the block's values from detached tensors instead (`x.detach()`: "
            "no gradient flows through them, as under no_grad) and drop the `with`, or move "
            "the bookkeeping out of the forward")
    raise TraceError(f"unsupported call in the exported graph: {name} (node {node.name})", at,
                     hint="this kind of call is not an ATen operator; write the forward "
                     "without it")


def _user_line(node: torch.fx.Node) -> Span | None:
    """The innermost line of the user's code in ``node``'s stack trace (its origin)."""
    import re
    found = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    torch_dir = str(Path(torch.__file__).resolve().parent)
    ssdsl_dir = str(Path(__file__).resolve().parents[1])
    ours = [(f, int(n)) for f, n in found if not f.startswith("<")
            and not str(Path(f).resolve()).startswith((torch_dir, ssdsl_dir))]
    if not ours:
        return None
    path, line = ours[-1]
    return file_line(path, line, shown_path(path))


def _convert(node: torch.fx.Node, alias: dict[str, str], tensors: dict[str, TensorInfo]
             ) -> Op | None:
    if node.target is operator.getitem:
        parent, index = node.args
        alias[node.name] = f"{parent.name}.{index}"
        _add_tensor(tensors, alias[node.name], node.meta.get("val"))
        return None
    if not isinstance(node.target, torch._ops.OpOverload):
        raise TraceError(f"unsupported call in the exported graph: {node.target} "
                         f"(node {node.name})")
    refs: list[str] = []

    def conv(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            name = alias.get(a.name, a.name)
            refs.append(name)
            return TensorRef(name)
        if isinstance(a, (list, tuple)):
            return tuple(conv(x) for x in a)
        return a

    args = tuple(conv(a) for a in node.args)
    kwargs = tuple((k, conv(v)) for k, v in node.kwargs.items())
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        outputs = tuple(f"{node.name}.{i}" for i in range(len(val)))
        returns = "list"
    elif isinstance(val, torch.Tensor):
        outputs, returns = (node.name,), "one"
        _add_tensor(tensors, node.name, val)
    else:
        return None  # no data out (an assertion): nothing to run or place
    target = _target_name(node.target)
    return Op(name=node.name, target=target, kind=_kind(target), module=_module_path(node),
              args=args, kwargs=kwargs, inputs=tuple(refs), outputs=outputs, returns=returns,
              calls=_module_calls(node))


def _target_name(target: torch._ops.OpOverload) -> str:
    ns = target.namespace
    return f"{ns}.{target._schema.name.split('::')[-1]}.{target._overloadname}"


def _kind(target: str) -> str:
    return kind_of(target)


def _module_calls(node: torch.fx.Node) -> tuple[tuple[str, int], ...]:
    """The module stack of ``node`` with call numbers: torch.export keys a module's second call
    ``'L__self__blocks.0@1'`` (its first has no ``@``)."""
    out = []
    for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
        head, at, n = str(key).rpartition("@")
        call = int(n) if at and n.isdigit() else 0
        if path != "model":
            out.append((_strip(path), call))
    return tuple(out)


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _strip(path) if path != "model" else ""


def _user_output(ep, node: torch.fx.Node, alias: dict[str, str]) -> str:
    OutputKind = torch.export.graph_signature.OutputKind
    for spec, arg in zip(ep.graph_signature.output_specs, node.args[0]):
        if spec.kind == OutputKind.USER_OUTPUT:
            return alias.get(arg.name, arg.name)
    raise TraceError("the traced forward has no output")
