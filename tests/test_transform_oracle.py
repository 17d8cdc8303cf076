"""The transform, end to end, against plain PyTorch on one process.

For each (model, plan, world): the model runs once on a real CPU batch (in float64) and every
logical tensor is recorded. Then every part of every operator runs its ``LocalCall`` on the slices
of the real inputs that its input regions name; its outputs must equal the slices of the full
outputs that its output regions name (parts holding partial sums: their sum must). The oracle is
the full op's output on full inputs; nothing of the transform is used to compute it.

Gradients likewise: the vector-Jacobian product of each part's local call (upstream gradient: the
slice of a random full upstream gradient) must equal the slice of the full op's input gradient
when ``grad_value_part`` says (0, 1), and the V sibling parts that it says hold the partial sums
of one region must add up to that slice. Random partition/replicate plans (hypothesis) go
through the same two checks, or must be rejected with errors located in the plan.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssdsl.elaborate import elaborate_file, elaborate_text
from ssdsl.errors import ErrorGroup, SsdslError
from ssdsl.ir.graph import Graph, Op
from ssdsl.ir.interpret import call_target, run_op, with_step_values
from ssdsl.ir.region import Region
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import Part, Transformed, transform
from ssdsl.transform.normalize import normalize_losses

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# hand-written plans beside the stdlib ones (whose defaults fit gpt.py's GPT-2 module names)
GOOD = Path(__file__).resolve().parent / "plans" / "transform_good"

_MODELS: dict[str, tuple[Graph, dict[str, torch.Tensor]]] = {}


def model(name: str) -> tuple[Graph, dict[str, torch.Tensor]]:
    """The traced graph of an example and every tensor's value on batch 0 (float64)."""
    if name not in _MODELS:
        mf = load_model_file(EXAMPLES / f"{name}.py")
        net = mf.build(seed=0)
        # the loss normalization made explicit, as the transform does (its graph is this one)
        graph = normalize_losses(trace(mf, device="cpu", model=net))
        _MODELS[name] = graph, _values(graph, mf, net)
    return _MODELS[name]


def _values(graph: Graph, mf, net: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {**dict(net.named_parameters()), **dict(net.named_buffers())}
    inputs, target = mf.get_batch(0)
    env = dict(zip(graph.inputs, with_step_values(graph, (*inputs, target)), strict=True))
    for t, q in {**graph.params, **graph.buffers}.items():
        env[t] = state[q] if q in state else state[graph.aliases[q][0]]
    env.update(graph.constants)
    env = {k: _f64(v) for k, v in env.items()}
    with torch.no_grad():
        for op in graph.ops:
            env.update(zip(op.outputs, (_f64(v) for v in run_op(op, env)), strict=True))
    return env


def _f64(v):
    return v.detach().double() if torch.is_tensor(v) and v.is_floating_point() else v


def plan(name: str, world: int, model_name: str):
    if (GOOD / f"{name}.ssp").is_file():
        return elaborate_file(GOOD / f"{name}.ssp", world=world)
    return elaborate_file(name, world=world, sets={"dp": "2"} if name == "dp_tp" else {})


_TRANSFORMED: dict[tuple, Transformed] = {}


def transformed(model_name: str, plan_name: str, world: int) -> Transformed:
    key = (model_name, plan_name, world)
    if key not in _TRANSFORMED:
        graph, _ = model(model_name)
        _TRANSFORMED[key] = transform(graph, plan(plan_name, world, model_name))
    return _TRANSFORMED[key]


CASES = [("mlp", "dp", 2), ("mlp", "dp", 4), ("gpt", "dp", 2), ("gpt", "dp", 4),
         ("gpt", "megatron_tp", 2), ("gpt", "dp_tp", 4), ("mlp", "mlp_2d", 4)]
IDS = [f"{m}-{p}-{w}" for m, p, w in CASES]


# ------------------------------------------------------------------------------ helpers

def region(graph: Graph, tensor: str, intervals) -> Region:
    return Region(graph.tensors[tensor].shape, intervals)


def local_inputs(graph: Graph, op: Op, part: Part, env) -> list:
    """The slices of ``op``'s real inputs that ``part`` reads (None where it reads nothing)."""
    return [None if r is None else region(graph, name, r).slice_of(env[name])
            for name, r in zip(op.inputs, part.sub.inputs, strict=True)]


def run_part(op: Op, part: Part, inputs: list) -> tuple:
    args, kwargs = part.sub.local.bind(inputs)
    out = call_target(part.sub.local.target, args, kwargs)
    out = tuple(out) if op.returns == "list" else (out,)
    scale = part.sub.local.scale
    return tuple(o * scale if scale != 1.0 else o for o in out)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape:
        return False
    if not want.is_floating_point():
        return torch.equal(got, want)
    return torch.allclose(got.double(), want, rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------------------ forward

@pytest.mark.parametrize(("model_name", "plan_name", "world"), CASES, ids=IDS)
def test_parts_recompose_every_op_output(model_name: str, plan_name: str, world: int) -> None:
    graph, env = model(model_name)
    split_ops = check_recompose(graph, env, transformed(model_name, plan_name, world))
    assert split_ops > len(graph.ops) // 2, "most ops should be split by these plans"


def check_recompose(graph: Graph, env, t: Transformed) -> int:
    """Assert that every op's parts recompose its real output; returns how many ops are split."""
    failures = []
    split_ops = 0
    for op in graph.ops:
        parts = t.parts[op.name]
        assert parts, op.name
        split_ops += any(p.ranges for p in parts)
        outs = {p.index: run_part(op, p, local_inputs(graph, op, p, env)) for p in parts}
        for j, name in enumerate(op.outputs):
            full = env[name]
            # whole-value parts: each equals its slice of the full output
            sums: dict[tuple, list] = {}
            for p in parts:
                r = region(graph, name, p.sub.outputs[j])
                if p.sub.value:
                    sums.setdefault((r, p.replica_index), []).append(outs[p.index][j])
                elif not _close(outs[p.index][j], r.slice_of(full)):
                    failures.append((op.name, p.index, name))
            # partial sums: those that write one region (in one replica) add up to it
            for (r, _), pieces in sums.items():
                assert len(pieces) > 1, (op.name, "a lone partial sum")
                if not _close(sum(pieces), r.slice_of(full)):
                    failures.append((op.name, "sum", name))
            # the parts of one replica cover the output exactly once (each partial-sum group once)
            cover = torch.zeros(full.shape, dtype=torch.int64)
            first = min(p.replica_index for p in parts)
            seen = set()
            for p in parts:
                r = region(graph, name, p.sub.outputs[j])
                if p.replica_index != first or r in seen:
                    continue
                seen.add(r)
                Region.full(full.shape).add_into(cover, r, torch.ones(r.local_shape,
                                                                      dtype=torch.int64))
            assert bool((cover == 1).all()), (op.name, name, "output not covered exactly once")
    assert not failures, failures[:10]
    return split_ops


@pytest.mark.parametrize(("model_name", "plan_name", "world"), CASES, ids=IDS)
def test_loss_from_parts(model_name: str, plan_name: str, world: int) -> None:
    """The loss op's parts add up to the model's loss, computed by the model itself."""
    mf = load_model_file(EXAMPLES / f"{model_name}.py")
    net = mf.build(seed=0).double()
    inputs, target = mf.get_batch(0)
    with torch.no_grad():
        want = mf.loss(net(*(_f64(x) for x in inputs)), target)
    graph, env = model(model_name)
    t = transformed(model_name, plan_name, world)
    loss_op = next(op for op in graph.ops if graph.output in op.outputs)
    parts = [p for p in t.parts[loss_op.name] if not any(p.replica_index)]
    got = sum(run_part(loss_op, p, local_inputs(graph, loss_op, p, env))[0] for p in parts)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12), (got, want)


# ------------------------------------------------------------------------------ placement

def expected_device(plan_name: str, part: Part, world: int) -> int:
    if plan_name == "dp_tp":       # part (d, t) on d * tp + t, dp = 2
        d, tp_index = part.index
        return d * (world // 2) + tp_index
    if plan_name == "mlp_2d":      # part (t, d) on t * dp + d, tp = 2
        tp_index, d = part.index
        return tp_index * (world // 2) + d
    (k,) = part.index
    return k


@pytest.mark.parametrize(("model_name", "plan_name", "world"), CASES, ids=IDS)
def test_placement(model_name: str, plan_name: str, world: int) -> None:
    graph, _ = model(model_name)
    t = transformed(model_name, plan_name, world)
    for op in graph.ops:
        parts = t.parts[op.name]
        assert len(parts) == world, op.name
        assert [p.device for p in parts] == list(range(world)), op.name
        for p in parts:
            assert p.device == expected_device(plan_name, p, world), (op.name, p.index)
            assert p.assigned_at is not None
    assert t.devices() == list(range(world))
    for dev in range(world):
        assert [p.op for p in t.parts_on(dev)] == [op.name for op in graph.ops]


def test_dp_tp_device_is_d_times_tp_plus_t() -> None:
    graph, _ = model("gpt")
    t = transformed("gpt", "dp_tp", 4)
    qkv = next(op for op in graph.ops if op.module == "h.0.attn.c_attn")
    by_index = {p.index: p.device for p in t.parts[qkv.name]}
    assert by_index == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}


# ------------------------------------------------------------------------------ gradients

def _op(graph: Graph, module: str, kind: str) -> Op:
    return next(op for op in graph.ops if op.module == module and op.kind == kind)


def test_grad_value_part_named_cases() -> None:
    graph, _ = model("gpt")
    tp = transformed("gpt", "megatron_tp", 2)
    col = _op(graph, "h.0.attn.c_attn", "linear")
    assert [tp.grad_value_part(p, 0) for p in tp.parts[col.name]] == [(0, 2), (1, 2)]
    assert [tp.grad_value_part(p, 1) for p in tp.parts[col.name]] == [(0, 1), (0, 1)]
    ln = _op(graph, "h.0.ln_1", "layer_norm")
    assert [tp.grad_value_part(p, 0) for p in tp.parts[ln.name]] == [(0, 1), (0, 1)]
    dp = transformed("gpt", "dp", 4)
    fc = _op(graph, "h.0.mlp.c_fc", "linear")
    assert graph.tensors[fc.inputs[1]].name in graph.params
    assert [dp.grad_value_part(p, 1) for p in dp.parts[fc.name]] == [(k, 4) for k in range(4)]
    assert [dp.grad_value_part(p, 0) for p in dp.parts[fc.name]] == [(0, 1)] * 4
    mlp_dp = transformed("mlp", "dp", 2)
    mgraph, _ = model("mlp")
    head = _op(mgraph, "head", "linear")
    assert [mlp_dp.grad_value_part(p, 1) for p in mlp_dp.parts[head.name]] == [(0, 2), (1, 2)]


def _vjp(op: Op, part: Part, inputs: list, upstream: tuple, i: int) -> torch.Tensor | None:
    """The gradient of ``part``'s outputs (dotted with ``upstream``) w.r.t. its ``i``-th input."""
    inputs = list(inputs)
    x = inputs[i].clone().requires_grad_(True)
    inputs[i] = x
    # every slot that names input i gets the leaf (an op may read one tensor twice)
    with torch.enable_grad():
        outs = run_part(op, part, inputs)
        total = sum((o * u).sum() for o, u in zip(outs, upstream) if o.is_floating_point())
        if not torch.is_tensor(total) or not total.requires_grad:
            return None
        (g,) = torch.autograd.grad(total, x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


@pytest.mark.parametrize(("model_name", "plan_name", "world"),
                         [("gpt", "megatron_tp", 2), ("gpt", "dp_tp", 4), ("mlp", "dp", 2),
                          ("mlp", "mlp_2d", 4)],
                         ids=["gpt-megatron_tp-2", "gpt-dp_tp-4", "mlp-dp-2", "mlp-mlp_2d-4"])
def test_grad_value_part_matches_autograd(model_name: str, plan_name: str, world: int) -> None:
    graph, env = model(model_name)
    checked, partial = check_grads(graph, env, transformed(model_name, plan_name, world))
    assert checked and partial


def check_grads(graph: Graph, env, t: Transformed) -> tuple[int, int]:
    """Assert ``grad_value_part`` against autograd for every part of every op; returns how many
    full-value and partial-sum gradients were compared."""
    gen = torch.Generator().manual_seed(0)
    checked = partial = 0
    for op in graph.ops:
        if not all(env[o].is_floating_point() for o in op.outputs):
            continue
        upstream = {o: torch.randn(env[o].shape, generator=gen, dtype=torch.float64)
                    for o in op.outputs}
        for i, name in enumerate(op.inputs):
            if not env[name].is_floating_point() or op.inputs.count(name) > 1:
                continue
            full_grad = _full_vjp(op, env, upstream, name)
            if full_grad is None:
                continue
            groups: dict[tuple, dict[int, torch.Tensor]] = {}
            for p in t.parts[op.name]:
                if p.sub.inputs[i] is None:
                    continue
                r = region(graph, name, p.sub.inputs[i])
                ups = tuple(region(graph, o, p.sub.outputs[j]).slice_of(upstream[o])
                            for j, o in enumerate(op.outputs))
                g = _vjp(op, p, local_inputs(graph, op, p, env), ups, i)
                k, v = t.grad_value_part(p, i)
                if v == 1:
                    assert torch.allclose(g, r.slice_of(full_grad), atol=1e-10), \
                        (op.name, p.index, i, "full-value gradient differs")
                    checked += 1
                else:
                    group = groups.setdefault((r, p.replica_index, v), {})
                    assert k not in group, (op.name, p.index, i, "two parts claim one share")
                    group[k] = g
            for (r, _, v), shares in groups.items():
                assert sorted(shares) == list(range(v)), (op.name, i)
                assert torch.allclose(sum(shares.values()), r.slice_of(full_grad), atol=1e-10), \
                    (op.name, i, "partial gradients do not add up")
                partial += 1
    return checked, partial


def _full_vjp(op: Op, env, upstream, name: str) -> torch.Tensor | None:
    """The full op's gradient w.r.t. tensor ``name``, by autograd on the original ATen call."""
    x = env[name].clone().requires_grad_(True)
    with torch.enable_grad():
        outs = run_op(op, {**env, name: x})
        total = sum((o * upstream[n]).sum() for o, n in zip(outs, op.outputs))
        if not torch.is_tensor(total) or not total.requires_grad:
            return None
        (g,) = torch.autograd.grad(total, x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


# ------------------------------------------------------------------------------ random plans

SELECTORS = {"mlp": ["all", "layers.*", "act", "head", "kind(linear)", "layers.1", "kind(gelu)",
                     "layers.0 | act", "rest"],
             "gpt": ["all", "h.*.attn", "h.0.mlp", "h.*.mlp.c_fc", "kind(linear)", "h.1",
                     "h.*.attn except h.*.attn.c_proj", "kind(sdpa)", "rest"]}
DIMS = {"mlp": ["batch", "in", "out", "features"], "gpt": ["batch", "seq", "heads", "in", "out"]}


@st.composite
def random_plan(draw, model_name: str) -> str:
    lines = ["plan fuzz()"]
    for _ in range(draw(st.integers(1, 3))):
        sel = draw(st.sampled_from(SELECTORS[model_name]))
        if draw(st.integers(0, 4)) == 0:
            lines.append(f"replicate {sel} into 2")
        else:
            dim = draw(st.sampled_from(DIMS[model_name]))
            lines.append(f"partition {sel} along {dim} into {draw(st.sampled_from([2, 4]))}")
    lines.append("assign all to device 0")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_random_plans_fail_with_a_position_or_recompose(model_name: str) -> None:
    """Random partition/replicate sequences: the transform either rejects the plan with errors
    located in it, or its parts recompose every op's output and gradients."""
    graph, env = model(model_name)
    accepted = []

    @settings(max_examples=12 if model_name == "mlp" else 6, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(random_plan(model_name))
    def check(text: str) -> None:
        try:
            t = transform(graph, elaborate_text(text, "fuzz.ssp", world=1))
        except SsdslError as err:
            for e in (err.errors if isinstance(err, ErrorGroup) else [err]):
                assert e.span is not None and e.span.file == "fuzz.ssp", e.render()
            return
        check_recompose(graph, env, t)
        check_grads(graph, env, t)
        accepted.append(text)

    check()
    assert accepted, "every random plan was rejected: the strategy tests nothing"
