"""The single-device reference run, and the comparison that decides whether a parallel run matches it.

``run_reference(model_file, steps=...)`` trains the model on one device exactly as the model file
says (built under ``torch.manual_seed(seed)``, ``get_batch(step, batch_size)`` for every step, its
loss and optimizer) and records the loss of every step, the gradients of chosen steps and the final
state dict. A parallel run gathers the same things into a ``RunRecord``; ``compare_runs`` turns the
pair into a ``Verdict`` that says, with numbers, whether they match and where they differ most.

Both sides can run in float64 (``dtype=torch.float64`` converts the model and every floating batch
tensor): there a tolerance near 1e-10 separates a real fault, such as a gradient scaled by the
wrong factor, from rounding. Use ``OptimizerSpec("sgd")`` in tests: Adam-style optimizers nearly
cancel a constant factor on the gradient and would hide exactly that fault (DESIGN §7).

The forward must be deterministic for a check to mean anything: dropout with p > 0 draws different
random numbers on different layouts.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import attrs
import torch

from ssdsl.runtime.train import OptimizerSpec, build_optimizer
from ssdsl.trace.model_file import ModelFile, PlainModelRaised, _describe, locate_in

Tensors = Mapping[str, torch.Tensor]


@attrs.frozen(eq=False)
class RunRecord:
    """What a run produced: loss per step, final state (CPU tensors), gradients of some steps
    and, for those steps, each parameter's update by the optimizer (after minus before)."""

    losses: tuple[float, ...]
    final_state: Tensors
    grads: Mapping[int, Tensors] = attrs.field(factory=dict)
    updates: Mapping[int, Tensors] = attrs.field(factory=dict)


def to_dtype(batch: Any, dtype: torch.dtype) -> Any:
    """``batch`` with its floating tensors converted (integer tokens and labels stay as they are)."""
    if isinstance(batch, torch.Tensor):
        # ``to`` gives the tensor itself when it has the dtype already, through a dispatch
        return batch.to(dtype) if batch.is_floating_point() and batch.dtype != dtype else batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_dtype(b, dtype) for b in batch)
    return batch


def run_reference(model_file: ModelFile, *, steps: int, batch_size: int | None = None,
                  seed: int = 0, dtype: torch.dtype = torch.float32,
                  optimizer: OptimizerSpec = OptimizerSpec(),
                  grad_steps: Collection[int] = (), device: str | torch.device = "cpu"
                  ) -> RunRecord:
    """Train on one device for ``steps`` steps; record losses, the gradients of ``grad_steps``
    (before that step's optimizer update), those steps' parameter updates and the final state
    dict.

    Example::

        ref = run_reference(load_model_file("examples/gpt.py"), steps=5, dtype=torch.float64,
                            optimizer=OptimizerSpec("sgd"))
        ref.losses          # (4.17..., 4.16..., ...)
    """
    model = model_file.build(seed=seed).to(device=device, dtype=dtype)
    opt = build_optimizer(optimizer, model_file, model.parameters())
    names = {p: n for n, p in model.named_parameters()}
    losses: list[float] = []
    grads: dict[int, dict[str, torch.Tensor]] = {}
    updates: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(steps):
        inputs, target = model_file.get_batch(step, batch_size)
        inputs = tuple(t.to(device) for t in to_dtype(inputs, dtype))
        target = to_dtype(target, dtype).to(device)
        opt.zero_grad(set_to_none=True)
        try:
            loss = model_file.loss(model(*inputs), target)
            loss.backward()
        except Exception as exc:
            raise PlainModelRaised(
                f"the plain model (one device, {str(dtype).removeprefix('torch.')}) raised "
                f"{_describe(exc)} in step {step}", locate_in(model_file.path, exc),
                file=model_file.path) from exc
        before = {}
        if step in grad_steps:
            grads[step] = {names[p]: p.grad.detach().cpu().clone()
                           for p in model.parameters() if p.grad is not None}
            before = {n: p.detach().cpu().clone() for p, n in names.items()}
        opt.step()
        if before:
            updates[step] = {n: p.detach().cpu() - before[n] for p, n in names.items()}
        losses.append(float(loss.detach()))
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return RunRecord(losses=tuple(losses), final_state=state, grads=grads, updates=updates)


# ----------------------------------------------------------------------------- comparison


@attrs.frozen
class Tolerance:
    """Largest relative error accepted for losses and for (norm-scaled) tensors."""

    loss: float
    tensor: float


def tolerance_for(dtype: torch.dtype, *, reordered_sums: bool = False) -> Tolerance:
    """DESIGN §7: float32 1e-5 for data/tensor plans, 1e-4 where the summation order differs
    (pipelines, value splits summed in another order); float64 1e-10 (1e-9 reordered)."""
    if dtype == torch.bfloat16:  # autocast: 8 bits of mantissa in every matmul
        rtol = 2e-2
    elif dtype == torch.float64:
        rtol = 1e-9 if reordered_sums else 1e-10
    else:
        rtol = 1e-4 if reordered_sums else 1e-5
    return Tolerance(loss=rtol, tensor=rtol)


@attrs.frozen
class Mismatch:
    """The worst error of one kind: ``what`` is loss/param/grad, ``where`` a step or a name."""

    what: str
    where: str
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance  # NaN compares False: a NaN is never ok


@attrs.frozen
class Verdict:
    """The outcome of ``compare_runs``. ``worst`` holds the largest error of each kind compared;
    ``problems`` the structural faults (a missing parameter, a shape, a step count)."""

    tolerance: Tolerance
    loss_errors: tuple[float, ...]
    worst: tuple[Mismatch, ...]
    problems: tuple[str, ...] = ()
    expected_losses: tuple[float, ...] = ()
    actual_losses: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems and all(m.ok for m in self.worst)

    def summary(self) -> str:
        """A few lines for the terminal, starting with MATCH or MISMATCH."""
        lines = ["MATCH" if self.ok else "MISMATCH"]
        for m in self.worst:
            mark = "ok" if m.ok else "FAIL"
            lines.append(f"  {mark:4} worst {m.what} error {m.error:.3g} at {m.where} "
                         f"(tolerance {m.tolerance:.0e})")
        lines += [f"  FAIL {p}" for p in self.problems]
        bad = [(k, x) for k, x in enumerate(self.expected_losses) if not math.isfinite(x)]
        if bad:
            k, x = bad[0]
            lines.append(f"  note the plain model's own loss is {x} at step {k} (in "
                         f"{len(bad)} of {len(self.expected_losses)} steps): the comparison "
                         "shows the plan computes the same, not that the model trains in this "
                         "dtype")
        return "\n".join(lines)

    def per_step(self) -> str:
        """One line per step: reference loss, this run's loss, relative error, and a mark."""
        lines = [f"{'step':>5} {'reference':>14} {'this run':>14} {'rel. error':>10}"]
        for step, (e, a, err) in enumerate(zip(self.expected_losses, self.actual_losses,
                                               self.loss_errors)):
            mark = "" if err <= self.tolerance.loss else "  <- over tolerance"
            lines.append(f"{step:>5} {e:>14.8g} {a:>14.8g} {err:>10.2e}{mark}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "tolerance": attrs.asdict(self.tolerance),
                "expected_losses": list(self.expected_losses),
                "actual_losses": list(self.actual_losses),
                "loss_errors": list(self.loss_errors),
                "worst": [dict(attrs.asdict(m), ok=m.ok) for m in self.worst],
                "problems": list(self.problems)}


def relative_error(actual: float, expected: float) -> float:
    """``|actual - expected| / |expected|``, absolute when expected is 0. A NaN or infinite
    value on one side only is infinitely off; the same one on both (a plain model that computes
    NaN itself, reproduced) is not: the rule of verification before launch
    (``ssdsl.runtime.verify._loss_error``), so that the two never disagree."""
    if not (math.isfinite(actual) and math.isfinite(expected)):
        same = actual == expected or (math.isnan(actual) and math.isnan(expected))
        return 0.0 if same else math.inf
    return abs(actual - expected) / (abs(expected) or 1.0)


def compare_runs(expected: RunRecord, actual: RunRecord, *,
                 tolerance: Tolerance) -> Verdict:
    """Compare the loss of every step, the final state and the gradients both runs recorded."""
    problems: list[str] = []
    if len(actual.losses) != len(expected.losses):
        problems.append(f"{len(actual.losses)} steps ran, the reference ran "
                        f"{len(expected.losses)}")
    loss_errors = tuple(relative_error(a, e) for a, e in zip(actual.losses, expected.losses))
    worst: list[Mismatch] = []
    if loss_errors:
        step = max(range(len(loss_errors)), key=lambda i: _sortable(loss_errors[i]))
        worst.append(Mismatch("loss", f"step {step}", loss_errors[step], tolerance.loss))
    param = _worst_tensor("param", expected.final_state, actual.final_state, tolerance.tensor,
                          problems, "final state")
    worst += [param] if param else []
    for step in sorted(set(expected.grads) & set(actual.grads)):
        grad = _worst_tensor("grad", expected.grads[step], actual.grads[step], tolerance.tensor,
                             problems, f"gradients of step {step}", where_suffix=f" step {step}")
        worst += [grad] if grad else []
    return Verdict(tolerance=tolerance, loss_errors=loss_errors, worst=tuple(worst),
                   problems=tuple(problems), expected_losses=tuple(expected.losses),
                   actual_losses=tuple(actual.losses))


def _sortable(error: float) -> float:
    return math.inf if math.isnan(error) else error


def _worst_tensor(what: str, expected: Tensors, actual: Tensors, rtol: float,
                  problems: list[str], label: str, where_suffix: str = "") -> Mismatch | None:
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    if missing:
        problems.append(f"{label}: missing {', '.join(missing[:5])}"
                        + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    if extra:
        problems.append(f"{label}: unexpected {', '.join(extra[:5])}")
    errors = norm_scaled_errors(expected, actual, problems=problems, label=label)
    if not errors:
        return None
    name = max(errors, key=lambda n: _sortable(errors[n]))
    return Mismatch(what, name + where_suffix, errors[name], rtol)


def norm_scaled_errors(expected: Tensors, actual: Tensors, *, problems: list[str] | None = None,
                       label: str = "") -> dict[str, float]:
    """Per name: ``||a - e|| / max(||e||, typical)``, where ``typical`` is the norm a tensor of
    that many elements has at the root-mean-square element size of all of ``expected``.

    The floor is what makes gradients comparable: a gradient that is zero in theory (a key bias
    under softmax) is rounding noise in practice, and dividing by its own tiny norm would call
    noise a 100% error; measured against a typical tensor of its size, the noise is ~1e-7 (float32).
    A wrong factor f on a tensor of ordinary size shows as |f - 1|; on a tensor 1000x smaller than
    typical it shows as |f - 1| / 1000, still far above the tolerances.
    """
    common = [n for n in expected if n in actual]
    floats = [n for n in common if expected[n].is_floating_point()]
    finite = {n: expected[n].detach().double().cpu() for n in floats}
    finite = {n: t[t.isfinite()] for n, t in finite.items()}
    total_sq = sum(float(t.pow(2).sum()) for t in finite.values())
    total_numel = sum(t.numel() for t in finite.values()) or 1
    rms = math.sqrt(total_sq / total_numel)
    errors: dict[str, float] = {}
    for name in common:
        e, a = expected[name], actual[name]
        if tuple(e.shape) != tuple(a.shape):
            if problems is not None:
                problems.append(f"{label}: {name} has shape {tuple(a.shape)}, "
                                f"expected {tuple(e.shape)}")
            continue
        e64, a64 = e.detach().double().cpu(), a.detach().double().cpu()
        # an entry NaN or infinite on both sides alike is not off (``relative_error``'s rule);
        # on one side only it is infinitely off
        same = ~e64.isfinite() & ((a64 == e64) | (a64.isnan() & e64.isnan()))
        if bool(same.any()):
            e64, a64 = e64.masked_fill(same, 0.0), a64.masked_fill(same, 0.0)
        if not (bool(e64.isfinite().all()) and bool(a64.isfinite().all())):
            errors[name] = math.inf
            continue
        diff = float((a64 - e64).norm()) if e64.numel() else 0.0
        scale = max(float(e64.norm()), rms * math.sqrt(e64.numel()))
        errors[name] = diff / scale if scale else (0.0 if diff == 0 else math.inf)
    return errors
