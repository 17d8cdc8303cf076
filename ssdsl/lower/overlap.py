"""Which gradient buckets a rank reduces while its last backward still runs: a rule on the
rank's lowered program, read by the executor (``ssdsl.runtime.overlap`` runs it) and by the cost
model (``ssdsl.cost``), so that what is costed is what runs.

A data-parallel program ends ``Backward ... ReduceBucket(s) ... OptimizerStep``: every bucket's
all-reduce waits for the whole backward. ``overlap_plan`` finds the buckets that may start
sooner: the plain all-reduce buckets (no ZeRO) that follow the program's last backward with
nothing between them but instructions that meet no one (unit ends, frees, waiting for sends,
each other). During that last backward no later gradient can reach their weights, so a weight's
gradient is final once autograd has accumulated it (a post-accumulate hook says so).

The executor then runs each such bucket as a few all-reduces of its parts, the first
``PART_BYTES`` or so, the others ``REST_PART_BYTES``, taken from the bucket's end (the weights
autograd reaches first), and starts each part as
soon as its gradients are final and every part before it has started: so every member issues
the same all-reduces on the bucket's group in the same order, the order of the program's
buckets, whatever the timing. Nothing else meets on the way (that is what makes a bucket
eligible), so the collectives each group sees are the program's, the bucket's one all-reduce
carried in consecutive pieces; the bucket's instruction waits for them where the program puts
it. A part sums the same elements as the whole bucket would.

A bucket of one part is left where it stands, and so are the buckets after it: on gloo here an
all-reduce handed to the process group's thread and waited for later cost more than one run in
place when there is nothing to overlap it with (the tiny GPT's 5 ms step: 1.06 against 1.00,
``bench/bench_levers.py``).
"""

from __future__ import annotations

import attrs

from ssdsl.lower.instr import Program, ReduceBucket

# about how many bytes of gradient the first all-reduce of an overlapped bucket carries, and
# each later one, as DDP sizes its buckets (1 MiB, then 25 MiB): the first starts early in the
# backward, and few all-reduces cost less than many where communication takes the same cores
# as the backward (gloo on this CPU: 0.99 of DDP's CPU time per step against 1.05 with 1 MiB
# parts, the peers' GPT on 2 ranks). PART_BYTES = 0 turns the overlap off (benchmarks compare);
# REST_PART_BYTES = None makes every part PART_BYTES.
PART_BYTES = 1 << 20
REST_PART_BYTES: int | None = 25 << 20

BACKWARDS = frozenset({"backward", "backward_weight"})
# what may stand between the last backward and an overlapped bucket: nothing that meets others
_QUIET = frozenset({"end", "free", "wait_sends", "begin"})


@attrs.frozen
class OverlapPlan:
    """``last``: the ordinal of the program's last backward among its backward instructions;
    ``parts``: for each overlapped bucket (by number), its entries' positions in parts, in the
    order they start."""

    last: int
    parts: dict[int, tuple[tuple[int, ...], ...]]


def _parts(ins: ReduceBucket, sizes: list[int], part_bytes: int,
           rest_bytes: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Positions of the bucket's entries grouped from its end, the first group about
    ``part_bytes``, the others about ``rest_bytes`` (default: ``part_bytes`` too)."""
    groups: list[list[int]] = []
    size = 0
    for i in reversed(range(len(ins.entries))):
        # the cap of the group being filled: the first one's, or the later ones'
        cap = part_bytes if len(groups) <= 1 or rest_bytes is None else rest_bytes
        if not groups or size + sizes[i] > cap:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += sizes[i]
    return tuple(tuple(g) for g in groups)


def overlapped_buckets(buckets, nbytes: dict) -> dict[int, tuple[tuple[int, ...], ...]]:
    """The rule of ``overlap_plan`` on a rank's gradient buckets in program order, right after
    its last backward as the lowering puts them (``ssdsl.materialize.reducer.Bucket``s, or
    anything with ``entries``, ``zero`` and ``devices``): position in ``buckets`` -> its parts.
    The cost model reads it, so that what it overlaps is what the executor overlaps."""
    parts: dict[int, tuple[tuple[int, ...], ...]] = {}
    for i, b in enumerate(buckets):
        split = _split(b, len(b.devices), nbytes, PART_BYTES, REST_PART_BYTES)
        if split is None:
            break
        parts[i] = split
    return parts


def _split(bucket, members: int, nbytes: dict, part_bytes: int, rest_bytes: int | None
           ) -> tuple[tuple[int, ...], ...] | None:
    """A bucket's parts if it may be reduced in parts during the last backward, else None:
    a plain all-reduce (no ZeRO) over 2 or more members that splits into 2 or more parts (a
    small bucket's one all-reduce is quicker where it stands, and the buckets after it must not
    start before it)."""
    if part_bytes <= 0 or bucket.zero or members < 2:
        return None
    split = _parts(bucket, [nbytes[e] for e in bucket.entries], part_bytes, rest_bytes)
    return split if len(split) >= 2 else None


def overlap_plan(program: Program, nbytes: dict, *, part_bytes: int | None = None,
                 rest_bytes: int | None | str = "default") -> OverlapPlan | None:
    """The buckets of ``program`` to reduce during its last backward, or None (none can be).
    ``nbytes`` gives each entry's (weight, region) gradient size in bytes; the first part of a
    bucket holds about ``part_bytes``, the others about ``rest_bytes`` (defaults:
    ``PART_BYTES``, ``REST_PART_BYTES``; None: ``part_bytes`` too)."""
    part_bytes = PART_BYTES if part_bytes is None else part_bytes
    rest_bytes = REST_PART_BYTES if rest_bytes == "default" else rest_bytes
    if part_bytes <= 0:
        return None
    kinds = [ins.kind for ins in program.instructions]
    lasts = [i for i, k in enumerate(kinds) if k in BACKWARDS]
    if not lasts:
        return None
    parts: dict[int, tuple[tuple[int, ...], ...]] = {}
    for ins in program.instructions[lasts[-1] + 1:]:
        if ins.kind in _QUIET:
            continue
        split = _split(ins, len(ins.group), nbytes, part_bytes, rest_bytes) \
            if ins.kind == "reduce" else None
        if split is None:
            break
        parts[ins.bucket] = split
    return OverlapPlan(len(lasts) - 1, parts) if parts else None
