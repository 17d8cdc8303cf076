"""Per-sample operators users found without annotation (replicated: data parallelism gathered
the batch for them, micro-batching refused them):

- ``linalg_vector_norm`` (``F.normalize(x, dim=-1)``, ``x.norm(dim=-1)``): the kept dims split;
  the normed dims are frozen (a norm of parts is not a plain sum of the parts' norms); ``dim=None``
  norms every dim;
- ``fft_fftn`` and the rest of ``torch.fft`` (HF FNet: ``fftn(x, dim=(1, 2)).real``): the
  transformed dims are whole, the others (the batch) split; ``real`` / ``imag`` are elementwise,
  ``view_as_real`` / ``view_as_complex`` pass every dim but the (real, imaginary) pair;
- ``multiply`` (HF ConvBERT's ``torch.multiply``) was no shape case the elementwise rule
  rejects: the alias ``aten.multiply.Tensor`` (and ``divide``, ``subtract``, ``true_divide``) was
  not registered; ConvBERT's ``nn.Unfold`` (``im2col``) came next: batch and channels split.

Oracles: the ATen op on whole tensors, by PyTorch (``tests.test_ops_oracle.check_parts``: each
splittable label cut into parts, the parts' local calls on slices, combined as the annotation
says, compared with the whole op, forward and gradients), and for the small model the plain
single-device model in float64 (``compare_with_model``) under ``dp`` and ``1f1b``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.ops import FrozenDimError, NotAnnotated, annotate_call, registered
from tests.test_ops_oracle import annotated_sample, check_parts, equal_parts, make_call, take

D = torch.float64
C128 = torch.complex128


def r(*shape: int, seed: int = 0, positive: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7 * sum(shape))
    t = torch.randn(shape, generator=g, dtype=D)
    return t.abs() + 0.5 if positive else t


def z(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.complex(r(*shape, seed=seed), r(*shape, seed=seed + 1))


INF = float("inf")

# target -> [(args, kwargs, labels the annotation must offer to split)]
SAMPLES: dict[str, list] = {
    "aten.linalg_vector_norm.default": [
        ([r(2, 4, 6), 2, [-1], True], {}, ["d0", "d1"]),      # F.normalize
        ([r(2, 4, 6), 2.0, [-1]], {}, ["d0", "d1"]),          # x.norm(dim=-1)
        ([r(2, 4, 6)], {}, []),                               # dim=None: every dim normed
        ([r(2, 4, 6), 1.0, [0, 2]], {}, ["d1"]),
        ([r(2, 4, 6), INF], {"dim": 1, "keepdim": True}, ["d0", "d2"]),
        ([r(2, 4, 6), 3], {"dim": [2], "dtype": D}, ["d0", "d1"]),
        ([r(6, 4), 0.5, None, True], {}, []),
    ],
    "aten.fft_fftn.default": [
        ([r(2, 4, 6), None, [1, 2]], {}, ["d0"]),             # FNet
        ([r(2, 4, 6)], {}, []),                               # every dim
        ([r(2, 4, 6), [4]], {"norm": "ortho"}, ["d0", "d1"]),  # s alone: the last len(s) dims
        ([z(2, 4, 6), [4, 8], [0, 2]], {}, ["d1"]),
    ],
    "aten.fft_ifftn.default": [([z(2, 4, 6), None, [1, 2]], {}, ["d0"])],
    "aten.fft_rfftn.default": [([r(2, 4, 6), None, [0, 1]], {}, ["d2"])],
    "aten.fft_irfftn.default": [([z(2, 4, 6), [4, 10], [1, 2]], {}, ["d0"])],
    "aten.fft_hfftn.default": [([z(2, 4, 6), None, [-1]], {}, ["d0", "d1"])],
    "aten.fft_ihfftn.default": [([r(2, 4, 6), None, [1]], {}, ["d0", "d2"])],
    "aten.fft_fft.default": [([r(2, 4, 6)], {}, ["d0", "d1"]), ([z(2, 4, 6), 6, 1], {},
                                                                ["d0", "d2"])],
    "aten.fft_ifft.default": [([z(2, 4, 6), None, 0, "forward"], {}, ["d1", "d2"])],
    "aten.fft_rfft.default": [([r(2, 4, 6)], {}, ["d0", "d1"])],
    "aten.fft_irfft.default": [([z(2, 4, 6), 8, 1], {}, ["d0", "d2"])],
    "aten.fft_hfft.default": [([z(2, 4, 6)], {}, ["d0", "d1"])],
    "aten.fft_ihfft.default": [([r(2, 4, 6), None, 0], {}, ["d1", "d2"])],
    "aten.fft_fft2.default": [([r(2, 4, 6, 3)], {}, ["d0", "d1"])],
    "aten.fft_ifft2.default": [([z(2, 4, 6), None, [0, 2]], {}, ["d1"])],
    "aten.fft_rfft2.default": [([r(2, 4, 6)], {}, ["d0"])],
    "aten.fft_irfft2.default": [([z(2, 4, 6)], {}, ["d0"])],
    "aten.fft_hfft2.default": [([z(2, 4, 6)], {}, ["d0"])],
    "aten.fft_ihfft2.default": [([r(2, 4, 6)], {}, ["d0"])],
    "aten._fft_r2c.default": [([r(2, 4, 6), [1, 2], 0, True], {}, ["d0"])],
    "aten._fft_c2c.default": [([z(2, 4, 6), [1], 0, True], {}, ["d0", "d2"])],
    "aten._fft_c2r.default": [([z(2, 4, 6), [2], 0, 10], {}, ["d0", "d1"])],
    "aten.real.default": [([z(2, 4, 6)], {}, ["d0", "d1", "d2"]),
                          ([r(2, 4)], {}, ["d0", "d1"])],
    "aten.imag.default": [([z(2, 4, 6)], {}, ["d0", "d1", "d2"])],
    "aten.view_as_real.default": [([z(2, 4, 6)], {}, ["d0", "d1", "d2"])],
    "aten.view_as_complex.default": [([r(4, 6, 2)], {}, ["d0", "d1"])],
    "aten.multiply.Tensor": [([r(2, 4, 6, seed=1), r(2, 4, 6, seed=2)], {}, ["d0", "d1", "d2"]),
                             ([r(2, 4, 6), r(4, 1)], {}, ["d0", "d1", "d2"])],
    "aten.multiply.Scalar": [([r(4, 6), 2.5], {}, ["d0", "d1"])],
    "aten.divide.Tensor": [([r(4, 6), r(6, positive=True)], {}, ["d0", "d1"])],
    "aten.divide.Scalar": [([r(4, 6), 2.5], {}, ["d0", "d1"])],
    "aten.divide.Tensor_mode": [([r(4, 6), r(6, positive=True)], {"rounding_mode": "floor"},
                                 ["d0", "d1"])],
    "aten.subtract.Tensor": [([r(4, 6), r(1, 6)], {"alpha": 2}, ["d0", "d1"])],
    "aten.subtract.Scalar": [([r(4, 6), 2.5], {}, ["d0", "d1"])],
    "aten.true_divide.Tensor": [([r(4, 6), r(4, 6, positive=True)], {}, ["d0", "d1"])],
    "aten.true_divide.Scalar": [([r(4, 6), 2.5], {}, ["d0", "d1"])],
    "aten.im2col.default": [
        ([r(2, 8, 6, 1), [3, 1], [1, 1], [1, 0], [1, 1]], {}, ["N", "C"]),  # ConvBERT
        ([r(2, 4, 6, 6), [3, 3], [1, 1], [1, 1], [2, 2]], {}, ["N", "C"]),
        ([r(4, 6, 6), [2, 2], [2, 1], [0, 0], [1, 2]], {}, ["C"]),          # unbatched
    ],
}

CASES = [(t, i) for t, calls in SAMPLES.items() for i in range(len(calls))]


def test_the_reported_operators_are_registered() -> None:
    assert not set(SAMPLES) - set(registered())


def _annotated(target: str, index: int):
    return annotated_sample(SAMPLES, target, index)


@pytest.mark.parametrize(("target", "index"), CASES)
def test_splittable_labels(target: str, index: int) -> None:
    """The dims a user expects: kept dims of a norm, untransformed dims of an FFT, every dim of
    an elementwise op, batch and channels of an unfold."""
    _, _, ann = _annotated(target, index)
    assert sorted(ann.splittable()) == sorted(SAMPLES[target][index][2])


@pytest.mark.parametrize(("target", "index"), CASES)
def test_split_parts_combine_to_whole(target: str, index: int) -> None:
    """Each splittable label cut into 2 (and 3 where it divides): the parts' local calls on the
    slices, put together, equal PyTorch's call on the whole tensors, with the gradients."""
    call, values, ann = _annotated(target, index)
    for label in ann.splittable():
        size = ann.sizes()[label]
        for n in (2, 3):
            if size % n == 0:
                check_parts(call, ann, values, equal_parts(ann, label, n))


@pytest.mark.parametrize(("target", "index"), CASES)
def test_split_of_an_inner_factor_combines_to_whole(target: str, index: int) -> None:
    """The same with a label cut into factors by the tracer (the batch of a micro-batch split
    viewed as ``(2 b/2)``), the inner factor split."""
    call, values, ann = _annotated(target, index)
    for label in ann.splittable():
        size = ann.sizes()[label]
        if size % 2 == 0 and size > 2:
            cut = ann.refined(label, [2, size // 2])
            check_parts(call, cut, values, equal_parts(cut, f"{label}.1", size // 2))


@pytest.mark.parametrize(("target", "args", "kwargs", "dim", "reason"), [
    ("aten.linalg_vector_norm.default", [r(2, 4, 6), 2, [-1], True], {}, "d2",
     "linalg_vector_norm over it is not a sum of parts"),
    ("aten.linalg_vector_norm.default", [r(2, 4, 6)], {}, "d0",
     "linalg_vector_norm over it is not a sum of parts"),
    ("aten.fft_fftn.default", [r(2, 4, 6), None, [1, 2]], {}, "d1", "fft_fftn transforms"),
    ("aten.fft_fftn.default", [r(2, 4, 6), None, [1, 2]], {}, "f2", "fft_fftn transforms"),
    ("aten.fft_rfft.default", [r(2, 4, 6)], {}, "f2", "fft_rfft transforms"),
    ("aten.im2col.default", [r(2, 4, 6, 6), [3, 3], [1, 1], [1, 1], [1, 1]], {}, "h0",
     "window"),
    ("aten.view_as_real.default", [z(2, 4)], {}, "ri", "real and imaginary"),
])
def test_whole_dims_are_refused_with_a_reason(target, args, kwargs, dim, reason) -> None:
    """A norm over a split dim would need a combine that is not a plain sum (none exists), an FFT
    reads the whole of each transformed dim, an unfold's windows cross a part's boundary."""
    call, _ = make_call(target, args, kwargs)
    ann = annotate_call(call)
    assert ann.labels()[dim].mark == "frozen"
    with pytest.raises(FrozenDimError, match=reason):
        ann.split(call, dim, 2, 0)


@pytest.mark.parametrize("n", [2, 4])
def test_fnet_mixing_splits_by_the_batch_with_gradients(n: int) -> None:
    """FNet's ``fftn(x, dim=(1, 2)).real`` split along the batch through both operators (the
    complex tensor between them stays on its part): the output and the input gradient equal
    PyTorch's on the whole batch. ``check_parts`` cannot take gradients through a complex output,
    so the two annotated calls are chained here."""
    x = r(4, 6, 8)
    fft_call, _ = make_call("aten.fft_fftn.default", [x, None, [1, 2]])
    fft_ann = annotate_call(fft_call)
    mid = torch.fft.fftn(x, dim=(1, 2))
    real_call, _ = make_call("aten.real.default", [mid])
    real_ann = annotate_call(real_call)
    assert fft_ann.splittable() == ["d0"] and "d0" in real_ann.splittable()

    from ssdsl.ir.interpret import call_target
    whole = x.clone().requires_grad_()
    want = torch.fft.fftn(whole, dim=(1, 2)).real
    gout = r(4, 6, 8, seed=5)
    (want_grad,) = torch.autograd.grad(want, whole, gout)

    got = torch.zeros_like(want)
    got_grad = torch.zeros_like(x)
    for ranges in equal_parts(fft_ann, "d0", n):
        a = fft_ann.partition(fft_call, ranges)
        b = real_ann.partition(real_call, ranges)
        assert b.inputs[0] == a.outputs[0]
        piece = take(x, a.inputs[0]).clone().requires_grad_()
        args, kwargs = a.local.bind([piece])
        spectrum = call_target(a.local.target, args, kwargs)
        args, kwargs = b.local.bind([spectrum])
        out = call_target(b.local.target, args, kwargs)
        rows = slice(*b.outputs[0][0][0])
        got[rows] = out.detach()
        (g,) = torch.autograd.grad(out, piece, gout[rows])
        got_grad[slice(*a.inputs[0][0][0])] = g
    assert torch.allclose(got, want.detach(), atol=1e-12)
    assert torch.allclose(got_grad, want_grad, atol=1e-12)


# -- a model with all of them: traced, then trained one step under dp and 1f1b -----------------

MODEL = str(Path(__file__).resolve().parent / "models" / "per_sample_ops.py")
ONE_F_ONE_B = ("plan p()\nmicrobatch along batch into 4\nstages into 2 as st\n"
               "assign st[0] to device 0\nassign st[1] to device 1\n"
               "order on device 0: forward st[0] mb 0..1, interleave(forward st[0] mb 1..4, "
               "backward st[0] mb 0..3), backward st[0] mb 3..4\n"
               "order on device 1: interleave(forward st[1] mb 0..4, backward st[1] mb 0..4)\n")


def test_the_model_traces_with_every_operator_annotated() -> None:
    from ssdsl.ops import annotate
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file

    graph = trace(load_model_file(MODEL), device="meta")
    kinds = {o.kind for o in graph.ops}
    assert {"linalg_vector_norm", "fft_fftn", "real", "multiply", "im2col"} <= kinds
    missing = {o.target: annotate(graph, o).reason for o in graph.ops
               if isinstance(annotate(graph, o), NotAnnotated)}
    assert not missing, missing
    for o in graph.ops:
        if o.kind in ("linalg_vector_norm", "fft_fftn", "real", "multiply", "im2col"):
            ann = annotate(graph, o)
            assert ann.label_for("batch") in ann.splittable(), o.kind


@pytest.mark.parametrize("plan", ["dp", ONE_F_ONE_B], ids=["dp-2", "1f1b-2x4"])
def test_the_model_splits_along_the_batch(plan: str) -> None:
    """Oracle: the plain model in float64, one step of every rank simulated from the lowered
    programs. Under dp nothing but the weight gradients crosses devices (no gathered batch);
    under 1f1b the micro-batches take every operator (they refused the unannotated ones)."""
    from ssdsl.elaborate import elaborate_file, elaborate_text
    from ssdsl.materialize.program import materialize
    from ssdsl.runtime.job import schedule_plan
    from ssdsl.runtime.verify import compare_with_model, simulate_plan
    from ssdsl.trace.export import trace
    from ssdsl.trace.model_file import load_model_file

    mf = load_model_file(MODEL)
    graph = trace(mf, device="cpu")
    elaborated = elaborate_file(plan, world=2) if plan == "dp" else \
        elaborate_text(plan, world=2)
    t, lowered = schedule_plan(graph, elaborated)
    m = materialize(t, dtype=D, schedule=lowered)
    sim = simulate_plan(m, mf)
    problems, ref_loss, worst = compare_with_model(m, mf, sim)
    assert not problems, problems
    assert sim.loss == pytest.approx(ref_loss, rel=1e-12)
    assert worst < 1e-12
    if plan == "dp":
        kinds = {k for e in m.edges.values()
                 for k in (*e.adapter.kinds,
                           *(e.adapter.backward.kinds if e.adapter.backward else ()))}
        assert m.accounting()["forward"] == {} and "all_gather" not in kinds
