"""A plan run on gloo ranks under ``--check`` in float64 with plain SGD, the strictest
comparison with the single-device model (DESIGN §7), read back from its JSON."""

from __future__ import annotations

import json

from ssdsl.cli import main


def assert_gloo_run_matches(capsys, model, plan: str, world: int, *, steps: int = 2,
                            tolerance: float = 1e-9) -> dict:
    """Run ``ssdsl run MODEL PLAN --nproc WORLD --check --dtype float64 --optimizer sgd``;
    assert it reports MATCH with loss and parameter errors under ``tolerance``; return the JSON."""
    code = main(["run", str(model), plan, "--nproc", str(world), "--steps", str(steps),
                 "--check", "--json", "--dtype", "float64", "--optimizer", "sgd"])
    out = json.loads(capsys.readouterr().out)
    assert out["check"]["ok"], out["check"]
    assert code == 0
    worst = {w["what"]: w["error"] for w in out["check"]["worst"]}
    assert worst["loss"] < tolerance and worst["param"] < tolerance, worst
    return out
