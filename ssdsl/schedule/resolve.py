"""From a transformed graph and its deferred directives to a placed, micro-batched pipeline.

``resolve_pipeline(t)`` does what ``transform`` left for this phase:

1. ``stages ... as st`` becomes a stage number per operator: contiguous segments of the graph's
   (topological) operator order, chosen by selectors or balanced by estimated cost
   (``op_cost``: multiply-adds for a matmul, a convolution or an attention, the elements of
   its largest tensor for any other operator); among the cuts within ``STAGE_SLACK`` of the best
   balance, those that send the fewest bytes (``cut_bytes``: between transformer blocks rather
   than inside one);
2. ``assign st[i] to devices G`` places every part of stage i's operators, exactly as an
   ``assign`` of those operators would (one part per device of G, row-major);
3. ``microbatch along batch into M`` splits every part in time (``ssdsl.transform.microbatch``);
4. the order directives are lowered (``lower_schedule``) with the stage DAG of the graph: stage a
   feeds stage b when an operator of b reads a tensor an operator of a produces (skip edges too);
   without stages, orders between operators become the operator order (``order_operators``).

The result is not checked here: ``ssdsl.check.check_schedule`` runs on ``Lowered.schedule``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from ssdsl.errors import ErrorCollector, SsdslError
from ssdsl.elaborate.directives import Assign, Microbatch, Path, Recompute, Stages, StageRef
from ssdsl.gcpause import gc_paused
from ssdsl.ir.batchfree import batch_free
from ssdsl.ir.grad import loss_grad_tensors
from ssdsl.ir.graph import Op
from ssdsl.ops import Annotation
from ssdsl.ops.macs import aten_name, multiply_adds
from ssdsl.schedule.lower import LowerError, Lowered, SeveralPipelines, lower_schedule
from ssdsl.schedule.oporder import order_operators
from ssdsl.schedule.stages import balance_stages
from ssdsl.source import Span
from ssdsl.transform.apply import assign_ops, check_placed, placing_span
from ssdsl.transform.microbatch import split_microbatches
from ssdsl.transform.parts import Transformed
from ssdsl.transform.select import part_prefix, path_matches, select_ops


class StagesNotContiguous(LowerError):
    """Stage selectors do not cut the operator order into contiguous segments."""


class StagesOverlap(LowerError):
    """Two stage selectors of one ``stages`` statement select the same operator."""


class TooManyStages(LowerError):
    """More stages than operators."""


class BadCallsSelector(LowerError):
    """``stages into N over calls of X``: X is not a module path, or N does not divide."""


class BadRecompute(LowerError):
    """A ``recompute`` names a stage the plan does not have."""


def op_cost(t: Transformed, op: Op) -> float:
    """Estimated work of ``op``, in multiply-adds or elements touched.

    A contraction (matmul, convolution, attention) costs its multiply-adds, as the cost model
    counts them (``ssdsl.ops.macs``). Any other operator moves memory: it costs
    the elements of its largest tensor, counting of each only the labels that every element
    of the operator's work goes through (not ``Annotation.windows``: a pooling's input
    positions, an embedding's vocabulary). The product of all of an operator's labels is no
    measure here: a split, a slice, a concatenation or an index has labels of its own on each
    side, and their product was hundreds of times its work."""
    ann = t.annotations[op.name]
    if not (isinstance(ann, Annotation) and ann.sizes()):
        return float(sum(t.graph.tensors[x].numel for x in op.outputs))
    macs = multiply_adds(aten_name(op.target), ann.sizes())
    if macs is not None:
        return float(sum(macs) if isinstance(macs, tuple) else macs)
    return float(max(math.prod(f.size for dim in sig for f in dim if f.label not in ann.windows)
                     for sig in (*ann.inputs, *ann.outputs)))


# How much more than the best balance's largest stage cost an automatic cut may give its largest
# stage to send fewer bytes between stages (0: balance alone, as before)
STAGE_SLACK = 0.05


def cut_bytes(t: Transformed) -> list[float]:
    """``out[i]``: the bytes per step a stage cut right before operator i sends, forward and
    back: every tensor made before i and read at or after it (twice when it needs a gradient),
    except the values that need no batch (each stage computes its own, ``ssdsl.ir.batchfree``).
    Sources (the batch, parameters) are read where they are needed and cross nothing."""
    g = t.graph
    free = batch_free(g)
    needs = loss_grad_tensors(g)
    last: dict[str, int] = {}
    for i, op in enumerate(g.ops):
        for x in op.inputs:
            last[x] = i
    diff = [0.0] * (len(g.ops) + 1)
    for i, op in enumerate(g.ops):
        if op.name in free:
            continue
        for x in op.outputs:
            u = last.get(x, -1)
            if u <= i:
                continue
            info = g.tensors[x]
            size = info.numel * _itemsize(info.dtype) * (2 if x in needs else 1)
            diff[i + 1] += size
            diff[u + 1] -= size
    out, live = [], 0.0
    for i in range(len(g.ops)):
        live += diff[i]
        out.append(live)
    return out


def _itemsize(dtype: str) -> int:
    found = getattr(torch, dtype.rpartition(".")[2], None)
    return torch.empty((), dtype=found).element_size() if isinstance(found, torch.dtype) else 4


def _balanced(t: Transformed, idx: Sequence[int], n: int, crossing: list[float] | None
              ) -> tuple[range, ...]:
    """``balance_stages`` over the operators at (contiguous) positions ``idx``.

    Every stage gets an operator with a backward where there are enough: a stage made only of
    operators the loss differentiates nothing of (a mask or a position table computed from the
    batch; values that need no batch cross no cut, so the least crossing favoured them) runs
    forwards only, and the stdlib's orders, which give every stage backwards, are refused. So
    the cut is made between atoms, each a run of such operators with the next operator that
    has a backward. Where fewer than ``n`` operators have one (a recycling pass, detached
    whole: ``stages into N over calls``), the cut is between operators."""
    ops = t.graph.ops
    costs = [op_cost(t, ops[i]) for i in idx]
    cross = None if crossing is None or STAGE_SLACK <= 0 else [crossing[i] for i in idx]
    needs = loss_grad_tensors(t.graph)
    with_grad = [k for k, i in enumerate(idx) if any(x in needs for x in ops[i].outputs)]
    starts = [0] + [k + 1 for k in with_grad[:-1]]
    if len(with_grad) < n or len(starts) == len(costs):
        return _balance(costs, n, cross)
    bounds = starts + [len(costs)]
    atoms = _balance([sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])], n,
                     None if cross is None else [cross[a] for a in starts])
    return tuple(range(bounds[r.start], bounds[r.stop]) for r in atoms)


def _balance(costs: list[float], n: int, crossing: list[float] | None) -> tuple[range, ...]:
    if crossing is None:
        return balance_stages(costs, n)
    return balance_stages(costs, n, crossing=crossing, slack=STAGE_SLACK)


def stage_map(t: Transformed, st: Stages) -> dict[str, int]:
    """The stage of every operator under ``st`` (see the module doc)."""
    names = [op.name for op in t.graph.ops]
    if st.selectors:
        return _by_selectors(t, st)
    if st.over is not None:
        return _by_calls(t, st)
    if st.count > len(names):
        raise TooManyStages(f"{st.count} stages but the model has only {len(names)} operators",
                            st.span, hint="ask for fewer stages")
    ranges = _balanced(t, range(len(names)), st.count, cut_bytes(t))
    return {names[i]: s for s, r in enumerate(ranges) for i in r}


def call_numbers(t: Transformed, st: Stages) -> list[int]:
    """For each operator, in graph order, the call of ``st.over``'s module(s) it belongs to.

    An operator inside a call of a module the path names (the outermost module of its stack the
    path matches) takes that call's number; any other operator takes the number of the next
    operator that has one (the recycling embedding before a pass joins that pass), and the
    operators after the last call (the head and the loss) join the last call."""
    sel = st.over
    if not isinstance(sel, Path):
        raise BadCallsSelector(f"'stages ... over calls of {sel}': calls are counted per module, "
                               "so this must be a module path", st.span,
                               hint="name the repeated modules by path, e.g. 'over calls of "
                                    "blocks.*'")
    select_ops(t.graph, sel, st.span)  # nothing matched: the usual error, with suggestions
    found: list[int | None] = []
    for op in t.graph.ops:
        found.append(next((k for path, k in op.calls if path_matches(sel, path)), None))
    out, nxt = [0] * len(found), max((k for k in found if k is not None), default=0)
    for i in range(len(found) - 1, -1, -1):
        nxt = found[i] if found[i] is not None else nxt
        out[i] = nxt
    return out


def _by_calls(t: Transformed, st: Stages) -> dict[str, int]:
    ops = t.graph.ops
    calls = call_numbers(t, st)
    n_calls = max(calls) + 1
    if st.count % n_calls:
        raise BadCallsSelector(
            f"'{st}': the modules '{st.over}' are called {n_calls} times in one forward, and "
            f"{st.count} stages do not divide into {n_calls} equal groups", st.span,
            hint=f"ask for a multiple of {n_calls} stages ({n_calls} * stages)")
    per = st.count // n_calls
    crossing = cut_bytes(t) if per > 1 else None
    out: dict[str, int] = {}
    for k in range(n_calls):
        idx = [i for i, c in enumerate(calls) if c == k]
        if not idx:
            raise BadCallsSelector(f"no operator runs in call {k} of '{st.over}' (calls are "
                                   f"numbered 0..{n_calls - 1})", st.span)
        if idx != list(range(idx[0], idx[-1] + 1)):
            other = next(ops[i] for i in range(idx[0], idx[-1]) if calls[i] != k)
            raise StagesNotContiguous(
                f"call {k} of '{st.over}' is not one stretch of the operator order (operator "
                f"'{other.name}' of call {calls[ops.index(other)]} comes inside it)", st.span,
                hint="the calls must run one after another, as the passes of a recycled trunk do")
        if len(idx) < per:
            raise TooManyStages(f"{per} stages per call but call {k} of '{st.over}' has only "
                                f"{len(idx)} operators", st.span, hint="ask for fewer stages")
        ranges = _balanced(t, idx, per, crossing)
        for s, r in enumerate(ranges):
            for j in r:
                out[ops[idx[j]].name] = k * per + s
    return out


def forward_only_stages(t: Transformed) -> frozenset[int]:
    """The stages none of whose operators computes something the loss differentiates (a
    recycling pass before the last: its output reaches the loss only through a detach)."""
    needs = loss_grad_tensors(t.graph)
    with_grad = {t.stage(op.name) for op in t.graph.ops if any(x in needs for x in op.outputs)}
    return frozenset(set(t.stage_of.values()) - with_grad)


class TrainedStageOnlyForward(SsdslError):
    """The plan orders only forwards of a stage whose operators the loss differentiates."""


def _check_trained_stages_have_backwards(t: Transformed, lowered: Lowered) -> None:
    """A stage the loss differentiates (some operator of it computes what the gradient flows
    through) of which the plan orders forwards only: name those operators, since the plan's
    author took the stage for a forward-only one (a recycling pass before the last, which a
    trained operator outside the trunk joined) or forgot its backwards. The schedule checker's
    own rule (every unit once) would say only which micro-batches lack a backward."""
    from ssdsl.schedule.units import Pass
    sched = lowered.schedule
    with_backward = {u.stage for p in sched.programs for u in p.units if u.kind is not Pass.F}
    first_forward: dict[int, Span | None] = {}
    for prog in sched.programs:
        for u, span in zip(prog.units, prog.spans):
            if u.kind is Pass.F and (first_forward.get(u.stage) is None):
                first_forward[u.stage] = span
    if all(s in with_backward or s in sched.stages.forward_only for s in first_forward):
        return
    needs = loss_grad_tensors(t.graph)
    errors = ErrorCollector()
    for s in sorted(first_forward):
        if s in with_backward or s in sched.stages.forward_only:
            continue
        trained = [op for op in t.graph.ops
                   if t.stage(op.name) == s and any(x in needs for x in op.outputs)]
        modules = list(dict.fromkeys(f"'{op.module or '<top>'}'" for op in trained))
        shown = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3
                                          else "")
        where = t.graph.origin(trained[0].name) if trained else None
        err = TrainedStageOnlyForward(
            f"the plan orders only forwards of stage {s}, but the loss differentiates what it "
            f"computes: the operators of {shown} (the gradient reaches them without a "
            ".detach()) need its backwards", first_forward[s],
            hint=f"order the backwards of stage {s} for every micro-batch, or select those "
                 "operators into a stage that has backwards (a recycling plan orders backwards "
                 "of its last pass only: a trained operator before the trunk needs a stage of "
                 "its own, or a place inside the trunk)")
        err.origin = where
        errors.add(err)
    errors.raise_if_any()


def _by_selectors(t: Transformed, st: Stages) -> dict[str, int]:
    chosen: dict[str, int] = {}
    module = {op.name: op.module for op in t.graph.ops}
    for s, sel in enumerate(st.selectors):
        for name in select_ops(t.graph, sel, st.span):
            first = chosen.setdefault(name, s)
            if first != s:  # the later stage would silently lose it (and may end up empty)
                raise StagesOverlap(
                    f"operator '{name}' (in '{module.get(name) or '<top>'}') is selected by "
                    f"stage {first} ('{st.selectors[first]}') and by stage {s} ('{sel}'): "
                    "each operator belongs to one stage", st.span,
                    hint="make the stage selectors disjoint (`A except B` removes B's "
                         "operators from A)")
    out: dict[str, int] = {}
    current = 0
    for op in t.graph.ops:  # an unselected operator joins the stage of the operator before it
        s = chosen.get(op.name, current)
        if s < current:
            raise StagesNotContiguous(
                f"operator '{op.name}' (in '{op.module or '<top>'}') is selected by stage {s} "
                f"but comes after operators of stage {current}: stages must be contiguous",
                st.span, hint="select consecutive operators for each stage, in model order")
        out[op.name] = current = s
    return _split_selected(t, st, out) if st.splits else out


def _split_selected(t: Transformed, st: Stages, group_of: dict[str, int]) -> dict[str, int]:
    """``stages A into N, ...``: the operators of selector i (a contiguous stretch) balanced into
    ``splits[i]`` stages, numbered after the stages of the selectors before it."""
    ops = t.graph.ops
    crossing = cut_bytes(t) if any(n > 1 for n in st.splits) else None
    out: dict[str, int] = {}
    first = 0
    for i, n in enumerate(st.splits):
        idx = [k for k, op in enumerate(ops) if group_of[op.name] == i]
        if len(idx) < n:
            raise TooManyStages(f"'{st.selectors[i]} into {n}': {n} stages but the selector has "
                                f"only {len(idx)} operators", st.span,
                                hint="ask for fewer stages")
        for s, r in enumerate(_balanced(t, idx, n, crossing)):
            for j in r:
                out[ops[idx[j]].name] = first + s
        first += n
    return out


def stage_edges(t: Transformed) -> list[tuple[int, int]]:
    """``(a, b)`` for every stage a whose output a later stage b reads."""
    producer = {x: op.name for op in t.graph.ops for x in op.outputs}
    edges = set()
    for op in t.graph.ops:
        for x in op.inputs:
            if x in producer:
                a, b = t.stage(producer[x]), t.stage(op.name)
                if a != b:
                    edges.add((min(a, b), max(a, b)))
    return sorted(edges)


def _stage_assigns(t: Transformed, st: Stages, stage_of: dict[str, int]):
    by_stage: dict[int, list[str]] = {}
    for name, s in stage_of.items():
        by_stage.setdefault(s, []).append(name)
    out = []
    for d in t.deferred:
        if isinstance(d, Assign):
            _, base = part_prefix(d.selector)
            if isinstance(base, StageRef) and base.group == st.name \
                    and 0 <= base.index < st.count:
                out.append((by_stage.get(base.index, []), d))
    return out


@gc_paused()
def resolve_pipeline(t: Transformed) -> tuple[Transformed, Lowered | None]:
    """Stages placed, micro-batches split, and the schedule lowered (None without ``stages``)."""
    found = [d for d in t.deferred if isinstance(d, Stages)]
    if len(found) > 1:
        raise SeveralPipelines("a second 'stages' statement; a plan has one pipeline",
                               found[1].span, hint=f"the first is at {found[0].span}")
    lowered = None
    if found:
        st = found[0]
        stage_of = stage_map(t, st)
        t = attrs.evolve(assign_ops(t, _stage_assigns(t, st, stage_of)), stage_of=stage_of)
        lowered = lower_schedule(t.deferred, edges=stage_edges(t),
                                 forward_only=forward_only_stages(t))
        _check_trained_stages_have_backwards(t, lowered)
    else:  # orders between operators: the one operator order every device walks
        t = order_operators(t)
    t = attrs.evolve(t, recompute=recompute_ops(t, found[0] if found else None))
    check_placed(t, placing_span(t.deferred))
    mbs = [d for d in t.deferred if isinstance(d, Microbatch)]
    if mbs:
        t = split_microbatches(t, mbs[-1])
    return t, lowered


def recompute_ops(t: Transformed, st: Stages | None) -> dict[str, Span]:
    """The operators the ``recompute`` statements select (with the span of the first that
    selects each): ``recompute st[i]`` is the operators
    of stage i, any other selector is resolved as ``partition`` resolves it (a selector that
    matches nothing is an error at its statement, with the closest names)."""
    chosen: dict[str, Span] = {}
    errors = ErrorCollector()
    for d in t.deferred:
        if not isinstance(d, Recompute):
            continue
        with errors.catch():
            _, base = part_prefix(d.selector)
            names = _stage_ops(t, st, base, d) if isinstance(base, StageRef) \
                else select_ops(t.graph, d.selector, d.span)
            for name in names:
                chosen.setdefault(name, d.span)
    errors.raise_if_any()
    return chosen


def _stage_ops(t: Transformed, st: Stages | None, ref: StageRef, d: Recompute) -> list[str]:
    if st is None or ref.group != st.name:
        have = f"its stages are '{st.name}'" if st is not None else "it has no 'stages' statement"
        raise BadRecompute(f"'recompute {d.selector}': the plan has no stages named "
                           f"'{ref.group}' ({have})", d.span,
                           hint="recompute operators by module path ('recompute h.0..4') or "
                           "name the stages of the plan's 'stages ... as NAME'")
    if not 0 <= ref.index < st.count:
        raise BadRecompute(f"'recompute {d.selector}': stage {ref.index} does not exist "
                           f"({st.name}[0..{st.count}])", d.span)
    return [op.name for op in t.graph.ops if t.stage(op.name) == ref.index]
