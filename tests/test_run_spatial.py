"""`ssdsl run --check` for spatial plans: every step's loss and the final parameters of the
parallel run equal the single-device reference (the oracle: plain PyTorch on one device).

float64 with plain SGD makes a mis-scaled gradient visible (DESIGN §7); one float32 run with the
model file's own optimizer checks the default path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "mlp.py")
GPT = str(ROOT / "examples" / "gpt.py")
EXACT = ["--dtype", "float64", "--optimizer", "sgd"]


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["run", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model, plan, nproc, extra", [
    (MLP, "dp", 2, []),
    (GPT, "megatron_tp", 2, []),
    (GPT, "megatron_tp", 4, []),
    (GPT, "dp_tp", 4, ["--set", "dp=2"]),
], ids=["mlp-dp2", "gpt-tp2", "gpt-tp4", "gpt-dp2xtp2"])
@pytest.mark.slow
def test_matches_reference_float64(capsys, model, plan, nproc, extra):
    code, out = run_json(capsys, model, plan, "--nproc", str(nproc), "--steps", "3",
                         "--check", *EXACT, *extra)
    assert out["check"]["ok"], out["check"]
    assert code == 0
    assert len(out["losses"]) == 3
    worst = {m["what"]: m["error"] for m in out["check"]["worst"]}
    assert worst["loss"] < 1e-9 and worst["param"] < 1e-9


@pytest.mark.slow
def test_gpt_dp_float32_model_optimizer(capsys):
    code, out = run_json(capsys, GPT, "dp", "--nproc", "2", "--steps", "3", "--check")
    assert code == 0 and out["check"]["ok"], out["check"]


@pytest.mark.slow
def test_megatron_forward_communication_is_one_all_reduce_per_row_linear(capsys):
    """gpt.py has 2 blocks, each with 2 row-parallel linears: 4 forward all-reduces, nothing else."""
    code, out = run_json(capsys, GPT, "megatron_tp", "--nproc", "2", "--steps", "1")
    assert code == 0
    assert set(out["communication"]["forward"]) == {"all_reduce"}
    assert out["communication"]["forward"]["all_reduce"]["count"] == 4
    assert out["communication"]["gradients"] == {}  # replicated weights get identical gradients


def test_bad_plan_fails_before_launch_with_location(capsys):
    code = main(["run", GPT, "megatron_tp", "--nproc", "2", "--set", "blocks=x.*"])
    err = capsys.readouterr().err
    assert code == 2
    assert "megatron_tp.ssp:13:1:" in err and "matches no operator" in err


def test_bad_flag_is_a_usage_error(capsys):
    assert main(["run", MLP, "dp", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_save_writes_a_single_device_state_dict_and_never_overwrites(capsys, tmp_path):
    """The saved, merged parameters load into the plain model and equal the reference's."""
    import torch

    from ssdsl.runtime.reference import run_reference
    from ssdsl.runtime.train import OptimizerSpec
    from ssdsl.trace.model_file import load_model_file

    out = tmp_path / "final.pt"
    assert main(["run", GPT, "megatron_tp", "--nproc", "2", "--steps", "2", *EXACT,
                 "--save", str(out)]) == 0
    saved = torch.load(out)
    mf = load_model_file(GPT)
    ref = run_reference(mf, steps=2, dtype=torch.float64, optimizer=OptimizerSpec("sgd"))
    model = mf.build(seed=0).double()
    model.load_state_dict(saved)  # strict: the tied lm_head.weight is saved too
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref.final_state[name], rtol=1e-12, atol=1e-12)
    capsys.readouterr()
    before = out.read_bytes()
    assert main(["run", GPT, "dp", "--nproc", "2", "--steps", "1", "--save", str(out)]) == 2
    assert "does not overwrite" in capsys.readouterr().err
    assert out.read_bytes() == before


@pytest.mark.slow
def test_under_torchrun_each_process_is_one_rank():
    """`torchrun -m ssdsl run ...`: the path past one machine; rank 0 prints the verdict."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ssdsl", "run", MLP, "dp", "--steps", "2", "--check", *EXACT, "--json"],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert out["world"] == 2 and out["ok"] is True


@pytest.mark.slow
def test_bfloat16_autocast_matches_the_autocast_reference(capsys):
    """--dtype bfloat16: float32 parameters, the forward in bfloat16 on both sides; the losses
    are not float32's (autocast is on) but match the single-device autocast run."""
    import torch

    from ssdsl.runtime.reference import run_reference
    from ssdsl.trace.model_file import load_model_file

    code, out = run_json(capsys, GPT, "megatron_tp", "--world", "2", "--steps", "3",
                         "--dtype", "bfloat16", "--check")
    assert code == 0 and out["check"]["ok"], out["check"]
    fp32 = run_reference(load_model_file(GPT), steps=3).losses
    assert any(abs(a - b) > 1e-6 * abs(b) for a, b in zip(out["losses"], fp32))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        bf16 = run_reference(load_model_file(GPT), steps=3).losses
    for got, want in zip(out["losses"], bf16, strict=True):
        assert abs(got - want) <= 2e-3 * abs(want)
