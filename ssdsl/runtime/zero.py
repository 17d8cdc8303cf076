"""ZeRO-sharded gradient buckets on one rank: the chunk of a bucket this rank steps.

A bucket's weights are laid out in one flat buffer, padded to a multiple of the group size,
and each weight becomes a view of its stretch of it. The optimizer steps ``ZeroShard.param``, a
view of this rank's chunk of the buffer, so its state (Adam's moments, SGD's momentum) exists
only for that chunk, and its in-place update lands in the weights themselves. The all-gather
after the step (``GatherBucket``) writes every member's chunk back into the buffer, and so into
every weight. Element-wise optimizers give on a chunk exactly the slice of the update on the
whole tensor (``ssdsl.runtime.train.build_optimizer``), which is why the numbers equal an
unsharded run's.

Stage 3 keeps the weights sharded too: ``store`` (this rank's padded chunk) is what persists,
``param`` a view of it that the optimizer steps, and the buffer's storage exists only between a
``GatherParams`` and its ``FreeParams`` (``allocate``/``release``: the storage is resized, so the
weights, and the tensors autograd saved of them, see the gathered values again when it is
refilled for backward).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from ssdsl.ir.region import Region
from ssdsl.lower.instr import Program, ReduceBucket
from ssdsl.materialize.reducer import shard_range

LeafKey = tuple[str, Region]


@attrs.define(eq=False)
class ZeroShard:
    """This rank's part of sharded bucket ``ins``: the padded flat buffer its weights are views
    of, and ``param``, the chunk ``[lo, hi)`` of it that this rank's optimizer steps."""

    ins: ReduceBucket
    buffer: torch.Tensor
    param: torch.nn.Parameter
    lo: int
    hi: int
    index: int  # this rank's position in the bucket's group: it owns chunk ``index``
    chunk: int  # elements per chunk (the buffer holds ``chunk * len(group)``)
    store: torch.Tensor | None = None  # stage 3: the padded chunk that persists
    work: object = None  # stage 3: an all-gather in flight into the buffer
    # what the optimizer steps: for each entry of the bucket with elements in [lo, hi), a
    # Parameter viewing that stretch of ``param``, and its offsets in ``param``; each goes to the
    # parameter group the model file's ``make_optimizer`` gives the entry's weight, so that
    # groups (no weight decay for biases, another rate for the head) hold under ZeRO too
    pieces: list = attrs.field(factory=list)  # [(entry index, a, b, Parameter)]

    @property
    def padded_chunk(self) -> torch.Tensor:
        """This rank's chunk of the buffer with its padding: what it contributes to the gather."""
        if self.store is not None:
            return self.store
        return self.buffer[self.index * self.chunk:(self.index + 1) * self.chunk]

    @property
    def allocated(self) -> bool:
        return self.buffer.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        """Stage 3: storage for the whole buffer again (its values are the next gather's)."""
        if not self.allocated:
            self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())

    def release(self) -> None:
        """Stage 3: drop the buffer's storage; the weights (its views) hold nothing until the
        next ``allocate``."""
        self.buffer.untyped_storage().resize_(0)

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (the bucket's gradients) padded with zeros to the buffer's length."""
        extra = self.buffer.numel() - flat.numel()
        return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat

    def set_grad(self, chunk_grad: torch.Tensor) -> None:
        """The reduced gradient of this rank's chunk (padding left out)."""
        self.param.grad = chunk_grad[:self.hi - self.lo].clone()
        self.link_grads()

    def link_grads(self) -> None:
        """Each piece's gradient: its stretch of ``param.grad`` (zeros when there is none)."""
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        for _, a, b, piece in self.pieces:
            piece.grad = self.param.grad[a:b]

    def gathered(self, full: torch.Tensor) -> None:
        """Every member's updated chunk, in group order: into the buffer, so into the weights."""
        with torch.no_grad():
            self.buffer.copy_(full)


def zero_shards(program: Program, leaves: Mapping[LeafKey, torch.nn.Parameter]
                ) -> dict[int, ZeroShard]:
    """A ``ZeroShard`` for each sharded bucket ``program`` reduces; the weights of its entries
    become views of the shard's buffer (their values unchanged)."""
    out: dict[int, ZeroShard] = {}
    for ins in program.instructions:
        if not (isinstance(ins, ReduceBucket) and ins.zero):
            continue
        weights = [leaves[e] for e in ins.entries]
        numel = sum(w.numel() for w in weights)
        p = len(ins.group)
        chunk = -(-numel // p)
        buffer = weights[0].detach().new_zeros(chunk * p)
        offset = 0
        with torch.no_grad():
            for w in weights:
                n = w.numel()
                buffer[offset:offset + n].copy_(w.detach().reshape(-1))
                w.data = buffer[offset:offset + n].view_as(w)
                offset += n
        index = ins.group.index(program.rank)
        lo, hi = shard_range(numel, p, index)
        if ins.zero == 3:
            store = buffer[index * chunk:(index + 1) * chunk].clone()
            shard = ZeroShard(ins, buffer, torch.nn.Parameter(store[:hi - lo]), lo, hi, index,
                              chunk, store)
            shard.release()
        else:
            shard = ZeroShard(ins, buffer, torch.nn.Parameter(buffer[lo:hi]), lo, hi, index,
                              chunk)
        offset = 0
        for i, w in enumerate(weights):
            a, b = max(lo, offset), min(hi, offset + w.numel())
            if a < b:  # this weight has elements in the chunk: a view of them
                view = shard.param.detach()[a - lo:b - lo]
                shard.pieces.append((i, a - lo, b - lo, torch.nn.Parameter(view)))
            offset += w.numel()
        out[ins.bucket] = shard
    return out


def rebuild_weights(shards: Mapping[int, Mapping[int, ZeroShard]]) -> None:
    """Every rank's stage-3 buffers filled from the members' chunks (``shards`` by rank, all
    ranks in this process): the weights readable again, as after a gather."""
    for mine in shards.values():
        for bucket, shard in mine.items():
            if shard.store is None:
                continue
            shard.allocate()
            with torch.no_grad():
                shard.buffer.copy_(torch.cat([shards[q][bucket].store for q in shard.ins.group]))


def optimizer_params(leaves: Mapping[LeafKey, torch.nn.Parameter],
                     shards: Mapping[int, ZeroShard]
                     ) -> tuple[list[torch.nn.Parameter], dict[int, list[torch.nn.Parameter]]]:
    """What this rank's optimizer is built over, and what it steps instead.

    The optimizer is made over this rank's weights as they are (their shapes and order, so
    that a ``make_optimizer`` that groups them, by ``p.dim()`` or otherwise, groups them as on
    one device); each weight of a sharded bucket is then replaced, in its group, by its pieces
    of this rank's chunk (``ZeroShard.pieces``; none where the chunk holds none of it):
    ``{id(weight): pieces}``."""
    substitute: dict[int, list[torch.nn.Parameter]] = {}
    for s in shards.values():
        for e in s.ins.entries:
            substitute.setdefault(id(leaves[e]), [])
        for i, _, _, piece in s.pieces:
            substitute[id(leaves[s.ins.entries[i]])].append(piece)
    return list(leaves.values()), substitute


def model_state_bytes(leaves: Mapping[LeafKey, torch.nn.Parameter],
                      shards: Mapping[int, ZeroShard],
                      opt: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds now.

    Weights that are views of a shard's buffer are counted by their own elements (the padding
    of the buffer is at most a group's size of elements). Under stage 3 a bucket's weights are
    counted by the chunk that persists (padding included), not by the buffer gathered for a
    while."""
    def nbytes(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()
    third = {e for s in shards.values() if s.store is not None for e in s.ins.entries}
    params = sum(nbytes(w) for k, w in leaves.items() if k not in third)
    params += sum(nbytes(s.store) for s in shards.values())
    grads = sum(nbytes(w.grad) for w in leaves.values())
    grads += sum(nbytes(s.param.grad) for s in shards.values())
    state = 0
    if opt is not None:
        for st in opt.state.values():
            state += sum(nbytes(v) for v in st.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": state,
            "total": params + grads + state}
