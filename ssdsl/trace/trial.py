"""One training step of a model file, tried in the planning process before anything else uses it.

``try_training_step`` runs the forward, the loss and the backward once on the ``meta`` device (no
memory, no arithmetic) and checks what the contract asks of each: the forward returns one
floating tensor, the loss is a floating scalar that depends on the parameters, the model has
parameters to train. A rank would otherwise be the first to hit these faults, deep inside the
distributed program; here they are reported at the model file's line (the function whose
result is wrong, or the line that raised).

``quiet_torch_logs`` silences torch's own logging (fake-tensor tracebacks, FX graph dumps) while
a model is traced, so that one error prints one message.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ssdsl.trace.model_file import (ModelFile, ModelFileContract, ModelFileRaised, _describe,
                                    _kind, def_span, default_loss, line_span, locate_in)

_TORCH_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx", "torch._dynamo", "torch.export",
                  "torch._export", "torch._functorch", "torch._inductor", "torch.fx.experimental",
                  "torch._guards", "torch.utils._sympy")


class ModelFileNoParameters(ModelFileContract):
    """``build_model()`` returned a model without trainable parameters."""

    default_hint = "a model to train has parameters with requires_grad=True"


class ModelFileBadOutput(ModelFileContract):
    """The forward returned something other than one floating tensor."""

    default_hint = ("the forward returns one floating tensor (wrap a model that returns a "
                    "tuple or a dict, as examples/hf_llama.py does)")


class NonDeterministicBatch(ModelFileContract):
    """``get_batch`` gave two different batches for the same step."""


class RandomOperator(ModelFileContract):
    """The traced training step draws random numbers (dropout, rand, ...)."""


class ModelFileBadLoss(ModelFileContract):
    """The loss is not a floating scalar that depends on the parameters."""

    default_hint = ("loss(output, target) returns one floating scalar computed from the output, "
                    "e.g. F.cross_entropy(output, target)")


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """Raise torch's tracing loggers to CRITICAL for the duration (restored after), and drop
    the export warning that the recurrent layers' own weight list (``nn.LSTM._flat_weights``,
    rebuilt in their forward) was assigned during export: it is torch's internals, not the
    user's, and it changes nothing in the trace."""
    saved = []
    for name in _TORCH_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"The tensor attributes (\S*\._flat_weights"
                                    r"\[\d+\](, )?)+ were assigned during export")
            yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


def try_training_step(mf: ModelFile, model: torch.nn.Module,
                      batch: tuple[tuple[torch.Tensor, ...], torch.Tensor]) -> None:
    """Forward, loss and backward of ``model`` (built on ``meta``) on ``batch``; raise a
    ``ModelFileError`` subclass, located in the model file, for the first fault.

    Faults of the meta device itself (an operator without a meta kernel, a value-dependent
    operation) are not the model file's: they are left for the tracer, which reports them.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ModelFileNoParameters(
            "build_model() returned a model with no trainable parameters: there is nothing to "
            "train", def_span(mf.path, mf.build_model), file=mf.path,
            hint="register weights as nn.Parameter (nn.Linear, nn.Embedding, ...); buffers and "
                 "plain tensors are not trained")
    inputs, target = (tuple(t.to("meta") for t in batch[0]), batch[1].to("meta"))
    try:
        with quiet_torch_logs():
            _step(mf, model, inputs, target)
            if mf.has_optimizer:
                _optimizer(mf, params)
    finally:
        for p in params:
            p.grad = None


def _optimizer(mf: ModelFile, params: list[torch.nn.Parameter]) -> None:
    """``make_optimizer(params)`` must give an optimizer (every rank calls it on its shards)."""
    where = def_span(mf.path, mf.make_optimizer)
    opt = _call(mf, "make_optimizer(params)", lambda: mf.make_optimizer(params), where)
    if opt is _SKIP:
        return
    if not all(hasattr(opt, a) for a in ("step", "zero_grad", "param_groups")):
        raise ModelFileContract(
            f"make_optimizer(params) must return a torch.optim.Optimizer; it returned "
            f"{_kind(opt)}", where, file=mf.path,
            hint="return the optimizer, e.g. return torch.optim.AdamW(params, lr=1e-3)")


def _step(mf: ModelFile, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
          target: torch.Tensor) -> None:
    forward = type(model).forward
    out = _call(mf, "the model's forward", lambda: model(*inputs), def_span(mf.path, forward))
    if out is _SKIP:
        return
    if not isinstance(out, torch.Tensor):
        raise ModelFileBadOutput(
            f"the model's forward must return one tensor; it returned {_kind(out)}",
            def_span(mf.path, forward), file=mf.path,
            hint="wrap the model so that forward returns the logits tensor (examples/hf_llama.py "
                 "does this for a model that returns a dict)")
    if not out.is_floating_point():
        raise ModelFileBadOutput(
            f"the model's forward returned {_kind(out)}: integers cannot carry gradients",
            def_span(mf.path, forward), file=mf.path,
            hint="return the floating logits; take argmax (if at all) outside the model")
    where = def_span(mf.path, mf.loss)
    what = "the loss"
    if where is None and mf.loss is default_loss:  # what it gets wrong comes from get_batch
        where = def_span(mf.path, mf.get_batch_fn)
        what = ("the default loss (cross-entropy of the output's last dim against integer "
                "targets; define loss(output, target) for another target)")
    loss = _call(mf, what, lambda: mf.loss(out, target), where)
    if loss is _SKIP:
        return
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        why = " (a loss with reduction='none'? use 'mean' or 'sum')" \
            if isinstance(loss, torch.Tensor) else ""
        raise ModelFileBadLoss(f"loss(output, target) must return a scalar tensor; it returned "
                               f"{_kind(loss)}{why}", where, file=mf.path)
    if not loss.is_floating_point():
        raise ModelFileBadLoss(f"loss(output, target) returned {_kind(loss)}; a loss is floating",
                               where, file=mf.path)
    if not loss.requires_grad:
        raise ModelFileBadLoss("the loss does not depend on any parameter (it has no gradient)",
                               where, file=mf.path,
                               hint="compute the loss from the model's output without .detach(),"
                                    " torch.no_grad() or .item()")
    _call(mf, "the backward pass", lambda: loss.reshape(()).backward(), None)


_SKIP = object()


def loss_fault(mf: ModelFile, exc: BaseException) -> ModelFileRaised | None:
    """The error to report for ``exc``, raised while tracing the forward and loss, when it was
    raised inside the loss: at the model file's line, and for the default loss at
    ``get_batch``, whose target it got wrong; else None. (The step on ``meta`` checks the loss
    first, but it cannot when the forward needs values there, as Hugging Face models' masks
    may: then a wrong target reaches the tracer.)"""
    codes = {f.f_code for f, _ in traceback.walk_tb(exc.__traceback__)}
    if mf.loss is default_loss and default_loss.__code__ in codes:
        where = def_span(mf.path, mf.get_batch_fn)
        what = ("the default loss (cross-entropy of the output's last dim against integer "
                "targets; define loss(output, target) for another target)")
    elif getattr(mf.loss, "__code__", None) in codes:
        where = locate_in(mf.path, exc) or def_span(mf.path, mf.loss)
        what = "the loss"
    else:
        return None
    return ModelFileRaised(f"{what} raised {_describe(exc)}", where, file=mf.path,
                           hint="the target get_batch returns must fit the model's output")


def check_batch_deterministic(mf: ModelFile, batch_size: int | None) -> None:
    """``NonDeterministicBatch`` (at ``get_batch``'s ``def`` line) when two calls of
    ``get_batch(0, ...)`` differ. The global random generators (torch's, Python's, numpy's)
    are set to different seeds for the two calls, so that a batch drawn from them differs even
    where the caller happens to have reseeded them in between; the caller's state is kept."""
    first, second = (_with_global_seed(seed, lambda: mf.get_batch(0, batch_size))
                     for seed in (1_234_567, 7_654_321))
    a, b = (*first[0], first[1]), (*second[0], second[1])
    # A batch made on the meta device (a model file for planning only) has no values to
    # compare: its shapes and dtypes must still agree.
    if len(a) != len(b) or any(x.shape != y.shape or x.dtype != y.dtype or x.device != y.device
                               or (not x.is_meta and not torch.equal(x, y))
                               for x, y in zip(a, b)):
        raise NonDeterministicBatch(
            "get_batch(0, batch_size) returned two different batches: every rank calls it and "
            "must get the same batch", def_span(mf.path, mf.get_batch_fn), file=mf.path,
            hint="draw the batch from a generator seeded by the step, e.g. "
            "torch.Generator().manual_seed(step)")


def _with_global_seed(seed: int, fn: Any) -> Any:
    import random
    np = sys.modules.get("numpy")
    py_state = random.getstate()
    np_state = np.random.get_state() if np is not None else None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            if np is not None:
                np.random.seed(seed % 2**32)
            return fn()
    finally:
        random.setstate(py_state)
        if np is not None:
            np.random.set_state(np_state)


def random_operators(graph: Any) -> list[str]:
    """Names of the operators that draw random numbers in a training step."""
    from ssdsl.ir.interpret import resolve_target
    found = []
    for op in graph.ops:
        target = resolve_target(op.target)
        if torch.Tag.nondeterministic_seeded in target.tags and not _draws_nothing(op, target):
            found.append(op.name)
    return found


# The arguments that hold a seeded operator's dropout probability: ``dropout(x, p, train)``,
# ``scaled_dot_product_attention(..., dropout_p)``, the recurrent layers' ``lstm(..., dropout,
# train, ...)`` (also ``gru``, ``rnn_tanh``, ``rnn_relu``, ``_cudnn_rnn``).
_PROBABILITIES = ("p", "dropout_p", "dropout")


def _draws_nothing(op: Any, target: Any) -> bool:
    """A dropout-like operator with probability 0, or not training (``dropout(x, p, train)``,
    ``scaled_dot_product_attention(..., dropout_p=0.0)``): it draws nothing. A recurrent layer
    (an argument ``num_layers``: ``lstm``, ``gru``, ``rnn_tanh``...) drops out only between its
    layers, on every output but the last layer's, so one layer draws nothing either."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(target._schema.arguments):
        if i < len(op.args):
            bound[arg.name] = op.args[i]
        elif arg.name in dict(op.kwargs):
            bound[arg.name] = dict(op.kwargs)[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    if "train" in bound and bound["train"] is False:
        return True
    if isinstance(bound.get("num_layers"), int) and bound["num_layers"] <= 1:
        return True
    return any(_is_zero(bound.get(name)) for name in _PROBABILITIES)


def _is_zero(value: Any) -> bool:
    """Whether ``value`` is the number 0 (not ``False``, not a tensor)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def refuse_random_operators(graph: Any, path: str, lines: dict[str, int] | None = None) -> None:
    """``RandomOperator`` naming the first random operator of ``graph``, if any, at the model
    file's line that calls it when ``lines`` (operator name -> line) knows it."""
    found = random_operators(graph)
    if not found:
        return
    op = graph.op(found[0])
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    line = (lines or {}).get(op.name)
    raise RandomOperator(
        f"the training step draws random numbers: operator '{op.name}' ({op.kind}, in "
        f"'{op.module or '<top>'}'){more}; each rank would draw different numbers, so the "
        "parallel run could not equal the single-device model",
        line_span(path, line, None) if line else None, file=path,
        hint="set dropout probabilities to 0 (or build the model without random operators)",
        origin=getattr(graph, "origin", lambda _: None)(op.name))


def _call(mf: ModelFile, what: str, fn: Any, fallback: Any) -> Any:
    """``fn()``; an exception it raises becomes ``ModelFileRaised`` at the model file's line
    that raised it, else at ``fallback`` (the function that was called)."""
    try:
        return fn()
    except Exception as exc:
        span = locate_in(mf.path, exc)
        if _meta_limitation(exc):
            if span is None or not _raised_by_model_file(mf.path, exc):
                return _SKIP  # inside a library: the tracer says whether it can go on
            if _other_device(exc):
                raise ModelFileRaised(
                    f"{what} mixes a tensor made on another device with the model's at this "
                    f"line ({_describe(exc)})", span, file=mf.path,
                    hint="ssdsl plans with the model's tensors on the meta device (shapes "
                    "only), and runs them on each rank's device: a tensor made apart from them "
                    "(a module-level constant, a torch.tensor(...) without a device) must follow "
                    "them: create it with device=x.device, or move it with .to(x.device)"
                    ) from exc
            raise ModelFileRaised(
                f"{what} needs tensor values at this line ({_describe(exc)})", span,
                file=mf.path, hint="ssdsl plans on shapes only (meta and fake tensors): "
                "no .item(), .tolist() or value-dependent Python in forward and loss; create "
                "tensors on the input's device (device=x.device)") from exc
        span = span or fallback
        raise ModelFileRaised(f"{what} raised {_describe(exc)}", span, file=mf.path,
                              hint="tried once on the meta device (shapes only) before planning"
                              ) from exc


_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def _raised_by_model_file(path: str, exc: BaseException) -> bool:
    """Whether the innermost frame outside torch itself is the model file's (its own
    ``.item()``), rather than a library it calls (transformers' may read values on meta)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(_TORCH_DIR)]
    return bool(frames) and Path(frames[-1].filename).resolve() == Path(path).resolve()


def _other_device(exc: Exception) -> bool:
    """A meta tensor met one on a real device (``Tensor on device cpu is not on the expected
    device meta!``, ``Expected all tensors to be on the same device``)."""
    text = str(exc).lower()
    return "expected device meta" in text or ("same device" in text and "meta" in text)


def _meta_limitation(exc: Exception) -> bool:
    """A fault of running on ``meta`` rather than of the model (no kernel, a value needed)."""
    text = str(exc).lower()
    return isinstance(exc, NotImplementedError) or "meta" in text or "data-dependent" in text \
        or "item()" in text
