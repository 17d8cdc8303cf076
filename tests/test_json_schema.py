"""`--json` of every command: one envelope (schema_version, command, ok), the same names for the
same data across commands, errors as JSON, and docs/json.md naming every top-level field.

Oracle: the documents themselves read back, and the field tables of docs/json.md.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ssdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp.py")

COMMANDS = {
    "plans": ["plans"],
    "trace": ["trace", MLP],
    "check": ["check", GPT, "megatron_tp", "--world", "2"],
    "show": ["show", "1f1b", "--world", "2", "--no-picture"],
    "cost": ["cost", GPT, "dp", "--world", "2"],
}


def _doc(capsys, argv) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _documented_fields(command: str, *, optional: bool = False) -> set[str]:
    """The field names in the table under docs/json.md's `## ssdsl COMMAND` heading (without
    the fields documented as "only with" some flag, unless ``optional``)."""
    text = (ROOT / "docs" / "json.md").read_text()
    section = text.split(f"## `ssdsl {command} --json`")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| (.*)$", section, flags=re.M)
    return {name for name, meaning in rows if optional or not meaning.startswith("only with")}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_document_has_the_envelope_and_is_documented(command, capsys):
    code, doc = _doc(capsys, COMMANDS[command])
    assert code == 0
    assert list(doc)[:3] == ["schema_version", "command", "ok"]
    assert doc["schema_version"] == 1 and doc["command"] == command and doc["ok"] is True
    assert set(doc) == _documented_fields(command), "docs/json.md and the document differ"


def test_same_names_for_the_same_data(capsys):
    _, check = _doc(capsys, COMMANDS["check"])
    _, plans = _doc(capsys, COMMANDS["plans"])
    assert isinstance(check["params"], dict) and isinstance(plans["plans"][0]["params"], dict)
    assert {"forward", "backward", "gradients", "total_bytes"} <= set(check["communication"])


def test_the_check_plan_only_document(capsys):
    code, doc = _doc(capsys, ["check", "dp", "--world", "2"])
    assert code == 0 and doc["command"] == "check" and doc["params"] == {"n": 2}


def test_errors_are_json_under_json(capsys):
    code = main(["check", GPT, "dp", "--world", "3", "--json"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert code == 2
    assert doc["ok"] is False and doc["command"] == "check" and doc["schema_version"] == 1
    err = doc["errors"][0]
    assert err["kind"] == "IndivisibleError" and err["line"] == 7 and err["column"] == 1
    assert err["file"].endswith("dp.ssp") and "the batch has 8 rows" in err["message"]
    assert "dp.ssp:7:1" in captured.err  # a person watching still reads the text
    assert main(["run", MLP, "dp", "--world", "2", "--set", "world=3", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["errors"][0]["kind"] == "UsageError" and doc["command"] == "run"


@pytest.mark.slow
def test_run_document(capsys, tmp_path):
    code, doc = _doc(capsys, ["run", MLP, "dp", "--world", "2", "--steps", "2"])
    assert code == 0 and doc["command"] == "run"
    assert set(doc) == _documented_fields("run")
    assert doc["params"] == {} and doc["world"] == 2
    assert {"forward", "backward", "gradients", "total_bytes"} <= set(doc["communication"])
    assert [r["step"] for r in doc["steps_detail"]] == [0, 1]
    row = doc["steps_detail"][0]
    lines = (ROOT / "docs" / "json.md").read_text().split("## `--metrics FILE`")[1]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", lines, flags=re.M))
    assert set(row) == documented
