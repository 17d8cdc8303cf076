"""The single-device reference and the comparison verdict.

Oracle: a training loop written out by hand in this file with plain PyTorch (explicit optimizer,
explicit batch conversion), not ``run_reference``'s code path.
"""

from __future__ import annotations

import importlib.util
import math
import textwrap
from pathlib import Path

import pytest
import torch

from ssdsl.runtime.reference import (Mismatch, RunRecord, Tolerance, compare_runs,
                                     norm_scaled_errors, relative_error, run_reference,
                                     tolerance_for)
from ssdsl.runtime.train import OptimizerSpec
from ssdsl.trace.model_file import load_model_file

MODEL = textwrap.dedent('''
    import torch
    from torch import nn

    BATCH_SIZE = 6

    def build_model():
        return nn.Sequential(nn.Linear(5, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))

    def get_batch(step, batch_size):
        g = torch.Generator().manual_seed(1000 + step)
        return torch.randn(batch_size, 5, generator=g), torch.randint(0, 3, (batch_size,), generator=g)

    def make_optimizer(params):
        return torch.optim.Adam(params, lr=0.05)
''')


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ref") / "tiny_mlp.py"
    path.write_text(MODEL)
    return path


@pytest.fixture(scope="module")
def mf(model_path):
    return load_model_file(model_path)


def _hand_loop(model_path: Path, *, steps: int, seed: int, dtype: torch.dtype, opt: str,
               grad_scale: float = 1.0, grad_step: int | None = None) -> RunRecord:
    """Plain PyTorch; imports the model file itself rather than going through ModelFile."""
    spec = importlib.util.spec_from_file_location("hand_loop_model", model_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(seed)
    model = module.build_model().to(dtype)
    if opt == "model":
        optim = torch.optim.Adam(model.parameters(), lr=0.05)
    elif opt == "sgd":
        optim = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, grads = [], {}
    for step in range(steps):
        x, y = module.get_batch(step, 6)
        optim.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(dtype)), y)
        loss.backward()
        for p in model.parameters():
            p.grad.mul_(grad_scale)
        if step == grad_step:
            grads[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
        optim.step()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return RunRecord(tuple(losses), state, grads)


def _identical(a: RunRecord, b: RunRecord) -> bool:
    return a.losses == b.losses and a.final_state.keys() == b.final_state.keys() and all(
        torch.equal(a.final_state[k], b.final_state[k]) for k in a.final_state)


def test_same_seed_gives_identical_runs_and_another_seed_does_not(mf):
    a = run_reference(mf, steps=3, seed=7)
    b = run_reference(mf, steps=3, seed=7)
    c = run_reference(mf, steps=3, seed=8)
    assert _identical(a, b)
    assert not _identical(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("opt", ["model", "sgd", "adamw"])
def test_reference_equals_a_hand_written_loop(mf, model_path, dtype, opt):
    ref = run_reference(mf, steps=4, seed=3, dtype=dtype, optimizer=OptimizerSpec(opt),
                        grad_steps=(2,))
    hand = _hand_loop(model_path, steps=4, seed=3, dtype=dtype, opt=opt, grad_step=2)
    assert _identical(ref, hand)
    assert all(v.dtype == dtype for v in ref.final_state.values())
    assert ref.grads.keys() == {2}
    for name, g in hand.grads[2].items():
        assert torch.equal(ref.grads[2][name], g)


def test_identical_runs_pass_with_zero_error(mf):
    a = run_reference(mf, steps=3, dtype=torch.float64, optimizer=OptimizerSpec("sgd"),
                      grad_steps=(0, 2))
    b = run_reference(mf, steps=3, dtype=torch.float64, optimizer=OptimizerSpec("sgd"),
                      grad_steps=(0, 2))
    verdict = compare_runs(a, b, tolerance=tolerance_for(torch.float64))
    assert verdict.ok, verdict.summary()
    assert [m.what for m in verdict.worst] == ["loss", "param", "grad", "grad"]
    assert all(m.error == 0.0 for m in verdict.worst)
    assert verdict.summary().startswith("MATCH")


@pytest.mark.parametrize("scale", [1 + 1e-6, 0.5])
def test_float64_sgd_check_catches_a_scaled_gradient(mf, model_path, scale):
    ref = run_reference(mf, steps=3, seed=0, dtype=torch.float64, optimizer=OptimizerSpec("sgd"),
                        grad_steps=(0,))
    wrong = _hand_loop(model_path, steps=3, seed=0, dtype=torch.float64, opt="sgd",
                       grad_scale=scale, grad_step=0)
    verdict = compare_runs(ref, wrong, tolerance=tolerance_for(torch.float64))
    assert not verdict.ok
    failing = {m.what for m in verdict.worst if not m.ok}
    assert {"param", "grad"} <= failing
    # Step 0 runs before any update: its loss still matches; later steps do not.
    assert verdict.loss_errors[0] == 0.0 and verdict.loss_errors[2] > 1e-10
    grad = next(m for m in verdict.worst if m.what == "grad")
    # Step 0's gradients are taken at equal parameters: the error is the factor, to rounding.
    assert grad.error == pytest.approx(abs(scale - 1), rel=1e-6)
    assert "MISMATCH" in verdict.summary() and "FAIL" in verdict.summary()
    table = verdict.per_step().splitlines()
    assert len(table) == 4 and "over tolerance" not in table[1] and "over tolerance" in table[3]
    assert f"{ref.losses[2]:.8g}" in table[3] and f"{wrong.losses[2]:.8g}" in table[3]


def test_tolerances_separate_float32_rounding_from_float64(mf):
    f32 = run_reference(mf, steps=3, dtype=torch.float32, optimizer=OptimizerSpec("sgd"))
    f64 = run_reference(mf, steps=3, dtype=torch.float64, optimizer=OptimizerSpec("sgd"))
    assert compare_runs(f64, f32, tolerance=tolerance_for(torch.float32)).ok
    assert not compare_runs(f64, f32, tolerance=tolerance_for(torch.float64)).ok


def test_tolerance_table_follows_the_design():
    assert tolerance_for(torch.float32) == Tolerance(1e-5, 1e-5)
    assert tolerance_for(torch.float32, reordered_sums=True) == Tolerance(1e-4, 1e-4)
    assert tolerance_for(torch.float64).tensor == 1e-10


def test_norm_scaled_error_ignores_noise_on_a_zero_gradient_but_not_a_wrong_factor():
    big = torch.linspace(-1, 1, 64, dtype=torch.float64)
    small = torch.full((8,), 1e-3, dtype=torch.float64)
    expected = {"w": big, "kbias": torch.zeros(8, dtype=torch.float64), "small": small}
    noisy = {"w": big, "kbias": torch.full((8,), 1e-17, dtype=torch.float64), "small": small}
    errors = norm_scaled_errors(expected, noisy)
    assert errors["kbias"] < 1e-15  # noise measured against a typical tensor of 8 elements
    # A wrong factor on a tensor far smaller than typical is scaled down by the floor, yet stays
    # orders of magnitude above every tolerance.
    doubled = dict(noisy, small=2 * small)
    rms = math.sqrt((big.pow(2).sum() + small.pow(2).sum()).item() / 80)
    by_hand = small.norm().item() / (rms * math.sqrt(8))
    assert norm_scaled_errors(expected, doubled)["small"] == pytest.approx(by_hand)
    assert by_hand > 1e-3
    assert norm_scaled_errors({"s": small}, {"s": 2 * small})["s"] == pytest.approx(1.0)


def test_structural_problems_are_reported():
    e = RunRecord((1.0, 0.5), {"a": torch.ones(3), "b": torch.ones(2)})
    a = RunRecord((1.0,), {"a": torch.ones(4), "c": torch.ones(1)})
    verdict = compare_runs(e, a, tolerance=tolerance_for(torch.float32))
    assert not verdict.ok
    text = "\n".join(verdict.problems)
    assert "1 steps ran, the reference ran 2" in text
    assert "missing b" in text and "unexpected c" in text
    assert "a has shape (4,), expected (3,)" in text


def test_nan_loss_is_a_mismatch():
    e = RunRecord((1.0, 0.5), {"a": torch.ones(3)})
    a = RunRecord((1.0, math.nan), {"a": torch.ones(3)})
    verdict = compare_runs(e, a, tolerance=tolerance_for(torch.float32))
    assert not verdict.ok
    assert verdict.worst[0] == Mismatch("loss", "step 1", math.inf, 1e-5)
    assert verdict.as_dict()["ok"] is False


def test_relative_error():
    assert relative_error(1.1, 1.0) == pytest.approx(0.1)
    assert relative_error(0.5, 0.0) == 0.5
    assert relative_error(math.inf, math.inf) == 0.0
    assert relative_error(math.nan, 1.0) == math.inf


def test_reference_records_the_update_of_each_grad_step(mf, model_path):
    """``RunRecord.updates[s]``: each parameter after step ``s`` minus before it. Oracle: the
    hand-written loop's state after one step minus the seeded model's own parameters."""
    ref = run_reference(mf, steps=1, seed=3, dtype=torch.float64, optimizer=OptimizerSpec("sgd"),
                        grad_steps=(0,))
    hand = _hand_loop(model_path, steps=1, seed=3, dtype=torch.float64, opt="sgd")
    spec = importlib.util.spec_from_file_location("hand_loop_model", model_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(3)
    first = {n: p.detach().to(torch.float64) for n, p in module.build_model().named_parameters()}
    assert ref.updates.keys() == {0} and ref.updates[0].keys() == first.keys()
    for name, before in first.items():
        want = hand.final_state[name] - before
        assert torch.allclose(ref.updates[0][name], want, rtol=0, atol=1e-15)
        assert want.abs().max() > 0


def test_step_check_scales_by_the_parameters_update_not_the_buffers():
    """Verification's optimizer-step comparison is relative to the largest update of a
    parameter: a buffer that moves a million times more (a running statistic) must not hide a
    shard that is off by a thousandth of the update."""
    from types import SimpleNamespace

    from ssdsl.ir.region import Region
    from ssdsl.runtime.simulate import Simulation
    from ssdsl.runtime.verify import _step_problems
    g = SimpleNamespace(params={"w0": "lin.weight"}, aliases={})
    after = {"lin.weight": torch.ones(3, 2, dtype=torch.float64),
             "norm.running_mean": torch.full((2,), 1e6, dtype=torch.float64)}
    update = {"lin.weight": torch.full((3, 2), 0.01, dtype=torch.float64),
              "norm.running_mean": torch.full((2,), 1e6, dtype=torch.float64)}
    off = after["lin.weight"].clone()
    off[1, 1] += 1e-5  # a thousandth of the update
    region = Region.full((3, 2))
    sim = Simulation(loss=0.0, grads={}, params={1: {("w0", region): off}})
    problems = _step_problems(g, sim, after, update, rtol=1e-9)
    assert len(problems) == 1 and "lin.weight" in problems[0] and "off by 0.001" in problems[0]
    same = Simulation(loss=0.0, grads={}, params={1: {("w0", region): after["lin.weight"]}})
    assert _step_problems(g, same, after, update, rtol=1e-9) == []


def test_nan_on_both_sides_is_verifications_rule():
    """``--check`` and verification before launch treat a NaN alike (they disagreed on HF CANINE
    in float64, whose plain model computes NaN): the same NaN or inf on both sides is not off,
    on one side only it is infinitely off; and the verdict says the plain model's own loss is
    not finite. Oracle: values written by hand."""
    from ssdsl.runtime.verify import _loss_error, _max_error
    grads = torch.tensor([1.0, math.nan, 2.0, math.inf])
    e = RunRecord((1.0, math.nan), {"a": grads.clone(), "b": torch.ones(2)})
    a = RunRecord((1.0, math.nan), {"a": grads.clone(), "b": torch.ones(2)})
    verdict = compare_runs(e, a, tolerance=tolerance_for(torch.float64))
    assert verdict.ok, verdict.summary()
    assert "the plain model's own loss is nan at step 1 (in 1 of 2 steps)" in verdict.summary()
    assert relative_error(math.nan, math.nan) == 0.0 == _loss_error(math.nan, math.nan)
    assert _max_error(grads.clone(), grads) == 0.0
    # a NaN or an inf on one side only
    for bad in ([1.0, 0.0, 2.0, math.inf], [1.0, math.nan, 2.0, 5.0], [math.nan, math.nan, 2.0,
                                                                       math.inf]):
        off = RunRecord((1.0, math.nan), {"a": torch.tensor(bad), "b": torch.ones(2)})
        verdict = compare_runs(e, off, tolerance=tolerance_for(torch.float64))
        assert not verdict.ok and verdict.worst[1].error == math.inf, bad
    # the finite entries of a tensor that holds a shared NaN are still compared
    near = grads.clone()
    near[0] = 1.5
    errors = norm_scaled_errors({"a": grads}, {"a": near})
    assert 0 < errors["a"] < math.inf
    assert "note" not in compare_runs(RunRecord((1.0,), {}), RunRecord((1.0,), {}),
                                      tolerance=tolerance_for(torch.float64)).summary()
