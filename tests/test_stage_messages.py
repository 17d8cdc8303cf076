"""Refusals of stage groups in statements that do not take them point at the statement that
uses the stage and say what it does wrong (they called `zero` "partition or replicate")."""

from __future__ import annotations

import json
from pathlib import Path

from ssdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "mlp.py")

ZERO_OF_STAGE = """plan p()
partition all along batch into 2
microbatch along batch into 2
stages into 2 as st
assign st[0] to devices [0, 1]
assign st[1] to devices [2, 3]
order on devices 0..2: forward st[0] mb 0..2, backward st[0] mb 0..2
order on devices 2..4: forward st[1] mb 0..2, backward st[1] mb 0..2
zero st[0] over devices 0..2
"""


def _errors(tmp_path, capsys, text: str) -> list[dict]:
    plan = tmp_path / "p.ssp"
    plan.write_text(text)
    code = main(["check", MLP, str(plan), "--world", "4", "--json"])
    assert code == 2
    return json.loads(capsys.readouterr().out)["errors"]


def _line_of(text: str, start: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(start))


def test_zero_of_a_stage_is_not_called_partition_or_replicate(tmp_path, capsys):
    errors = _errors(tmp_path, capsys, ZERO_OF_STAGE)
    e = errors[0]
    assert e["line"] == _line_of(ZERO_OF_STAGE, "zero st[0]")
    assert "partition or replicate" not in e["message"]
    assert "this statement" in e["message"]
