"""Fourier transforms (``torch.fft``: FNet's ``fftn(x, dim=(1, 2)).real``) and the complex views
around them. Every output element of a transform reads the whole of each transformed dim, so the
transformed dims are frozen, in the input and the output (whose size may differ: ``rfft`` keeps
``n // 2 + 1`` frequencies); every other dim (the batch) is independent and spatial. A part runs
the same call on its slice: ``n`` / ``s`` name sizes of transformed dims only, which no part
splits."""

from __future__ import annotations

from collections.abc import Sequence

from ssdsl.ops.build import dims, norm_dim, plain
from ssdsl.ops.core import Annotation, Call, Factor, register

ONE_DIM = ["fft", "ifft", "rfft", "irfft", "hfft", "ihfft"]          # (self, n, dim=-1, norm)
TWO_DIM = ["fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2"]    # (self, s, dim=(-2,-1), norm)
N_DIM = ["fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn"]      # (self, s, dim=None, norm)
PRIMITIVE = ["_fft_r2c", "_fft_c2c", "_fft_c2r"]                     # (self, dim, ...)


def _as_list(v) -> list[int]:
    return [v] if isinstance(v, int) else list(v)


def _transformed(call: Call, rank: int) -> set[int]:
    """The dims the call transforms."""
    name = call.op.target.split(".")[1]
    if name in PRIMITIVE:
        d: Sequence[int] | None = _as_list(call.arg(1, "dim"))
    elif name[len("fft_"):] in ONE_DIM:
        d = [call.arg(2, "dim", -1)]
    elif name[len("fft_"):] in TWO_DIM:
        d = _as_list(call.arg(2, "dim", [-2, -1]))
    else:
        d = call.arg(2, "dim")
        if d is None:
            s = call.arg(1, "s")
            # torch.fft: without dim, every dim; with s, the last len(s) dims
            d = list(range(rank)) if s is None else list(range(rank - len(_as_list(s)), rank))
        d = _as_list(d)
    return {norm_dim(int(x), rank) for x in d}


@register(*[f"aten.fft_{n}.default" for n in ONE_DIM + TWO_DIM + N_DIM],
          *[f"aten.{n}.default" for n in PRIMITIVE])
def fft(call: Call) -> Annotation:
    (x,) = call.in_shapes[:1]
    (out,) = call.out_shapes
    labels = dims(len(x))
    done = _transformed(call, len(x))
    name = call.op.kind
    out_labels = [f"f{k}" if k in done else lab for k, lab in enumerate(labels)]
    frozen = {}
    for k in done:
        frozen[labels[k]] = f"{name} transforms along it (each output reads all of it)"
        frozen[out_labels[k]] = f"{name} transforms along it (each output reads all of it)"
    return Annotation((plain(labels, x),), (plain(out_labels, out),), frozen=frozen)


@register("aten.view_as_real.default")
def view_as_real(call: Call) -> Annotation:
    """A complex tensor seen as real pairs: every dim passes through; the new last dim (real,
    imaginary) is whole."""
    (x,) = call.in_shapes
    labels = dims(len(x))
    (out,) = call.out_shapes
    sig = (*plain(labels, x), (Factor("ri", out[-1]),))
    return Annotation((plain(labels, x),), (sig,),
                      frozen={"ri": "the real and imaginary parts of one number"})


@register("aten.view_as_complex.default")
def view_as_complex(call: Call) -> Annotation:
    """Real pairs seen as complex numbers: every dim but the last (the pair, whole) passes."""
    (x,) = call.in_shapes
    labels = dims(len(x) - 1)
    sig = (*plain(labels, x[:-1]), (Factor("ri", x[-1]),))
    return Annotation((sig,), (plain(labels, x[:-1]),),
                      frozen={"ri": "the real and imaginary parts of one number"})
