"""Gradient buckets in flat buffers that live as long as the rank's weights (the distributed
executor's plain all-reduce buckets, and each part of an overlapped one).

A bucket's all-reduce carries its weights' gradients (and, in the bucket that carries it, the
rank's loss) in one flat tensor. Made anew each step, that tensor costs a concatenation, a copy
for the collective to write into, and the views the gradients become afterwards, one
``narrow``/``view`` pair per weight: on the tiny GPT (28 weights, 2 ranks on gloo) about 125 us
of a 2.3 ms step, more than the step lost to ``DistributedDataParallel``. ``FlatGrads`` makes the
buffer and its views once: each step copies the gradients in with one ``_foreach_copy_``, the
all-reduce writes in place, and the views become the weights' ``.grad``, as DDP's
``gradient_as_bucket_view`` does.

The views stay the weights' gradients until the next step's ``zero_grad(set_to_none=True)`` drops
them (``RankProgram.train_batch`` begins with it); the same buffer then takes the next step's
gradients. A bucket whose weights differ in dtype or device has no flat buffer (``flat_grads``
gives None) and is reduced as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# False: every bucket is flattened anew each step (benchmarks compare)
ENABLED = True


class FlatGrads:
    """One flat buffer of ``leaves``' gradients in order, then one element for the loss when
    ``loss``; ``views[i]`` is leaf ``i``'s gradient in it, ``loss_view`` the loss's element."""

    __slots__ = ("buf", "views", "loss_view")

    def __init__(self, leaves: Sequence[torch.Tensor], loss: bool) -> None:
        total = sum(leaf.numel() for leaf in leaves)
        first = leaves[0]
        self.buf = torch.zeros(total + (1 if loss else 0), dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for leaf in leaves:
            n = leaf.numel()
            self.views.append(self.buf[offset:offset + n].view(leaf.shape))
            offset += n
        self.loss_view = self.buf[total:total + 1] if loss else None

    def fill(self, leaves: Sequence[torch.Tensor], loss: torch.Tensor | None = None
             ) -> torch.Tensor:
        """The buffer holding this step's gradients of ``leaves`` (zeros for a weight the
        backward did not reach) and ``loss`` (one element) where the buffer carries it."""
        dst, src = [], []
        with torch.no_grad():
            for leaf, view in zip(leaves, self.views):
                g = leaf.grad
                if g is None:
                    view.zero_()
                else:  # a gradient that is the view already (not dropped) copies onto itself
                    dst.append(view)
                    src.append(g)
            if self.loss_view is not None:
                if loss is None:
                    self.loss_view.zero_()
                else:
                    dst.append(self.loss_view)
                    src.append(loss.reshape(1))
            if dst:
                torch._foreach_copy_(dst, src)
        return self.buf

    def hand_out(self, leaves: Sequence[torch.Tensor]) -> None:
        """The reduced gradients become the weights' ``.grad``."""
        for leaf, view in zip(leaves, self.views):
            leaf.grad = view

    def loss(self) -> float:
        """The reduced loss the buffer carried."""
        return float(self.loss_view.item())


def flat_grads(leaves: Sequence[torch.Tensor], loss: bool) -> FlatGrads | None:
    """A flat buffer for ``leaves``, or None where one tensor cannot hold their gradients (no
    leaves, several dtypes or devices, a sparse or non-strided weight)."""
    if not ENABLED or not leaves:
        return None
    first = leaves[0]
    if any(leaf.dtype != first.dtype or leaf.device != first.device
           or leaf.layout != torch.strided for leaf in leaves):
        return None
    return FlatGrads(leaves, loss)


__all__ = ["FlatGrads", "flat_grads"]
