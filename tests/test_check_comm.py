"""`ssdsl check MODEL PLAN` reports the derived communication, and `--verify` checks it."""

from __future__ import annotations

import json
from pathlib import Path

from ssdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")


def check_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["check", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_megatron_report_matches_the_analytic_volume(capsys):
    """gpt.py: B=8, T=16, C=32, 2 blocks, float32. Each row-parallel linear's output is all-reduced
    once in forward; ring all-reduce moves 2 (p - 1) x its bytes in total (the adapters' convention)."""
    code, out = check_json(capsys, GPT, "megatron_tp", "--world", "2")
    assert code == 0
    b, t, c, blocks, p, itemsize = 8, 16, 32, 2, 2, 4
    per_all_reduce = 2 * (p - 1) * b * t * c * itemsize
    comm = out["communication"]
    assert comm["forward"] == {"all_reduce": {"count": 2 * blocks,
                                              "bytes": 2 * blocks * per_all_reduce}}
    assert comm["backward"] == comm["forward"]
    assert comm["gradients"] == {}
    assert comm["total_bytes"] == 4 * blocks * per_all_reduce


def test_verify_passes_and_reports_a_simulated_step(capsys):
    code, out = check_json(capsys, GPT, "dp", "--world", "2", "--verify")
    assert code == 0
    v = out["verify"]
    assert v["ok"] and not v["problems"] and v["edges_checked"] > 0
    assert abs(v["loss"] - v["reference_loss"]) <= 1e-5 * abs(v["reference_loss"])


def test_verify_without_model_is_a_usage_error(capsys):
    assert main(["check", "dp", "--verify"]) == 2
    assert "--verify needs a model" in capsys.readouterr().err


def test_program_prints_a_rank_program_that_reads_back(capsys):
    """``--program R`` prints rank R's lowered program (it raised NameError once); the text
    reads back with ``ssdsl.lower.parse_program``."""
    from ssdsl.lower import parse_program

    assert main(["check", GPT, "dp", "--world", "2", "--program", "1"]) == 0
    text = capsys.readouterr().out
    assert parse_program(text).rank == 1
