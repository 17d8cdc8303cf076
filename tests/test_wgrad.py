"""The weight half of a split backward in closed form (``ssdsl.runtime.wgrad``).

The oracle of each rule is autograd: the same call run eagerly on tensors that require grad,
``torch.autograd.grad`` of its output against the weights from the same output gradient
(float64). The end-to-end tests train split-backward plans against the plain model
(``run_reference``), with the rules on and off, and count the calls the rules took.
"""

from __future__ import annotations

import pytest
import torch

from ssdsl.lower.instr import BackwardWeight, Call, Program
from ssdsl.ops.core import LocalCall, Slot
from ssdsl.runtime import wgrad

D = torch.float64


def _rule(target, args, kwargs, names, cuts, outs=("y",), scale=1.0):
    """The rule ``rules_of`` gives the mixing call ``target(*args, **kwargs)`` whose inputs are
    ``names`` and whose weight inputs are read through ``cuts``."""
    call = Call("op", (0,), outs, names, LocalCall(target, args, tuple(kwargs.items()), scale))
    bw = BackwardWeight((), (), ((outs, tuple((c, c + "_src") for c in cuts)),),
                        tuple(v for v in names if v is not None and v not in cuts))
    got = wgrad.rules_of(Program(0, 1, (call, bw)))[id(bw)]
    assert got[0] is bw
    return got[1][0]


def _check(target, args, kwargs, values: dict, cuts, outs=("y",), scale=1.0, first=0):
    """The rule's gradients equal autograd's for every cut."""
    names = tuple(values)
    rule = _rule(target, args, kwargs, names, cuts, outs, scale)
    assert rule is not None, target
    leaves = {k: v.detach().clone().requires_grad_(k in cuts) for k, v in values.items()}
    call = LocalCall(target, args, tuple(kwargs.items()), scale)
    a, kw = call.bind([leaves[k] for k in names])
    from ssdsl.ir.interpret import resolve_target
    y = resolve_target(target)(*a, **kw)
    y = y[first] if isinstance(y, (tuple, list)) else y
    y = y * scale if scale != 1.0 else y
    g = torch.randn_like(y)
    want = torch.autograd.grad(y, [leaves[c] for c in cuts], g)
    env = dict(leaves)
    if len(outs) == 3:  # native_layer_norm's mean and rstd, as the forward left them
        full = resolve_target(target)(*a, **kw)
        env[outs[1]], env[outs[2]] = full[1].detach(), full[2].detach()
    kept = {outs[first]: g}
    made = rule(env, dict(kept))
    assert made is not None
    got = dict(made)
    assert set(got) == set(cuts)
    for c, w in zip(cuts, want):
        assert got[c].shape == leaves[c].shape
        torch.testing.assert_close(got[c], w, rtol=1e-12, atol=1e-12)


def _r(*shape):
    return torch.randn(*shape, dtype=D)


@pytest.mark.parametrize("xshape", [(3, 5, 4), (6, 4), (4,)], ids=["3d", "2d", "1d"])
def test_linear_weight_and_bias(xshape):
    _check("aten.linear.default", (Slot(0), Slot(1), Slot(2)), {},
           {"x": _r(*xshape), "w": _r(7, 4), "b": _r(7)}, ("w", "b"))


def test_linear_without_bias_and_with_a_scale():
    _check("aten.linear.default", (Slot(0), Slot(1)), {}, {"x": _r(2, 3, 4), "w": _r(5, 4)},
           ("w",), scale=0.5)


def test_linear_bias_alone():
    _check("aten.linear.default", (Slot(0), Slot(1), Slot(2)), {},
           {"x": _r(2, 3, 4), "w": _r(5, 4), "b": _r(5)}, ("b",))


def test_layer_norm():
    _check("aten.layer_norm.default", (Slot(0), [4], Slot(1), Slot(2), 1e-5), {},
           {"x": _r(3, 5, 4), "w": _r(4), "b": _r(4)}, ("w", "b"))


def test_layer_norm_over_two_dims_weight_alone():
    _check("aten.layer_norm.default", (Slot(0), [5, 4], Slot(1), None, 1e-3), {},
           {"x": _r(3, 5, 4), "w": _r(5, 4)}, ("w",))


def test_native_layer_norm_reads_the_forward_mean_and_rstd():
    _check("aten.native_layer_norm.default", (Slot(0), [4], Slot(1), Slot(2), 1e-5), {},
           {"x": _r(3, 5, 4), "w": _r(4), "b": _r(4)}, ("w", "b"),
           outs=("y", "mean", "rstd"))


def test_mm_cut_on_either_side():
    _check("aten.mm.default", (Slot(0), Slot(1)), {}, {"x": _r(6, 4), "w": _r(4, 3)}, ("w",))
    _check("aten.mm.default", (Slot(0), Slot(1)), {}, {"w": _r(6, 4), "x": _r(4, 3)}, ("w",))


def test_matmul_batched_activation_times_a_matrix():
    _check("aten.matmul.default", (Slot(0), Slot(1)), {}, {"x": _r(2, 3, 4), "w": _r(4, 5)},
           ("w",))


def test_addmm_bias_and_matrix():
    _check("aten.addmm.default", (Slot(0), Slot(1), Slot(2)), {},
           {"b": _r(5), "x": _r(6, 4), "w": _r(4, 5)}, ("b", "w"))


@pytest.mark.parametrize("dims, stride, padding, groups", [(2, [1, 1], [1, 1], 1),
                                                           (2, [2, 1], [0, 2], 4),
                                                           (1, [1], [1], 2), (3, [1], [0], 1)],
                         ids=["2d", "2d-strided-depthwise", "1d-grouped", "3d"])
def test_convolution_weight_and_bias(dims, stride, padding, groups):
    c_in, c_out = 4, 8
    x = _r(2, c_in, *([5] * dims))
    w = _r(c_out, c_in // groups, *([3] * dims))
    _check(f"aten.conv{dims}d.default", (Slot(0), Slot(1), Slot(2), stride, padding, [1], groups),
           {}, {"x": x, "w": w, "b": _r(c_out)}, ("w", "b"))


def test_add_and_mul_broadcast_to_the_weight():
    _check("aten.add.Tensor", (Slot(0), Slot(1)), {}, {"x": _r(3, 5, 4), "b": _r(4)}, ("b",))
    _check("aten.mul.Tensor", (Slot(0), Slot(1)), {}, {"g": _r(1, 4), "x": _r(3, 5, 4)}, ("g",))


def test_what_no_rule_covers_is_left_to_autograd():
    # an operator without a rule; a cut activation; a scaled add (alpha)
    assert _rule("aten.bmm.default", (Slot(0), Slot(1)), {}, ("x", "w"), ("w",)) is None
    assert _rule("aten.linear.default", (Slot(0), Slot(1)), {}, ("x", "w"), ("x", "w")) is None
    assert _rule("aten.add.Tensor", (Slot(0), Slot(1)), {"alpha": 2}, ("x", "b"), ("b",)) is None
    # at run time: mixed dtypes, and a kept gradient for a second output
    rule = _rule("aten.linear.default", (Slot(0), Slot(1)), {}, ("x", "w"), ("w",))
    env = {"x": _r(3, 4), "w": _r(5, 4).float().requires_grad_()}
    assert rule(env, {"y": _r(3, 5)}) is None
    rule = _rule("aten.native_layer_norm.default", (Slot(0), [4], Slot(1), None, 1e-5), {},
                 ("x", "w"), ("w",), outs=("y", "m", "r"))
    env = {"x": _r(3, 4), "w": _r(4).requires_grad_()}
    assert rule(env, {"y": _r(3, 4), "m": _r(3, 1)}) is None


@pytest.mark.parametrize("enabled, early", [(True, True), (True, False), (False, True)],
                         ids=["rules", "rules-norms-in-weight-half", "autograd"])
def test_split_backward_trains_like_the_plain_model_with_the_rules_on_and_off(
        tmp_path, monkeypatch, enabled, early):
    """Three stages on one device, every weight half after every input half: two steps against
    the plain model (``run_reference``, float64); with the rules on, every mixing call of the
    example GPT (linears, layer norms) takes one, with them off none does. With ``EARLY``, the
    layer norms' cut gradients come from the input half (and only theirs)."""
    from tests.test_pipeline_inprocess import _check_two_steps, _program
    from tests.test_split_backward import GPT, THREE_STAGES

    monkeypatch.setattr(wgrad, "ENABLED", enabled)
    monkeypatch.setattr(wgrad, "EARLY", early)
    prog, mf = _program(tmp_path, THREE_STAGES, GPT)
    ins = prog.program.instructions
    writer = {o: x for x in ins if isinstance(x, Call) for o in x.outs}
    mixes = [outs for x in ins if isinstance(x, BackwardWeight) for outs, _ in x.mixes]
    norms = [o for o in mixes if writer[o[0]].call.target == "aten.layer_norm.default"]
    assert mixes and norms and len(norms) < len(mixes)
    _check_two_steps(prog, mf)
    assert prog.runner.closed_form == (2 * len(mixes) if enabled else 0)
    assert prog.runner.from_input_half == (2 * len(norms) if enabled and early else 0)


GPT = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
LR, STEPS = 0.05, 3


def zb_worker(plan: str, enabled: bool) -> tuple[list[float], dict, int]:
    import ssdsl
    from ssdsl.runtime import wgrad as wgrad_mod
    from ssdsl.trace.model_file import load_model_file

    wgrad_mod.ENABLED = enabled
    mf = load_model_file(GPT)
    pm = ssdsl.parallelize(GPT, plan, optimizer="sgd", lr=LR, dtype="float64", verify=False)
    losses = [pm.train_step(*mf.get_batch(s, mf.batch_size)) for s in range(STEPS)]
    return losses, pm.full_state_dict(), pm._program.runner.closed_form


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["zb_h1", "zb_v"])
def test_zero_bubble_on_two_ranks_trains_like_the_plain_model_with_the_rules(plan):
    """The ranks run their weight halves through the rules (the linears and layer norms of the
    stages that receive activations) and train as the plain model does (float64, 1e-10)."""
    from ssdsl.runtime.launch import launch
    from tests.plain_reference import assert_trains_like, plain_sgd

    per_rank = launch(zb_worker, nproc=2, args=(plan, True), timeout_s=600)
    want = plain_sgd(GPT, STEPS, LR)
    for losses, state, _ in per_rank:
        assert_trains_like(losses, state, want)
    assert sum(n for *_, n in per_rank) > 0  # the stages' mixing calls took the rules
