"""The commands of the language: check, fmt (see test_lang_format), plans; and the stdlib found
through ssdsl.resources from an installed layout, not only from the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ssdsl.cli import main

ROOT = Path(__file__).resolve().parents[1]
STDLIB = sorted(p.stem for p in (ROOT / "stdlib_plans").glob("*.ssp"))


def test_plans_lists_every_stdlib_plan_with_parameters(capsys):
    assert main(["plans", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["command"] == "plans"
    listed = doc["plans"]
    assert sorted(p["name"] for p in listed) == STDLIB
    one = next(p for p in listed if p["name"] == "1f1b")
    assert one["plan"] == "one_f_one_b"
    assert one["signature"] == "stages: int = world, microbatches: int = 2 * stages, width: int = 1"
    assert one["params"] == {"stages": {"type": "int", "default": "world"},
                             "microbatches": {"type": "int", "default": "2 * stages"},
                             "width": {"type": "int", "default": "1"}}
    assert one["doc"].startswith("1F1B pipeline")
    assert main(["plans"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in STDLIB)


@pytest.mark.parametrize("name", STDLIB)
def test_check_elaborates_every_stdlib_plan(name, capsys):
    assert main(["check", name, "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert "directives" in out and f"{name}.ssp:" in out


def test_check_json_lists_the_directives(capsys):
    assert main(["check", "dp", "--set", "world=2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world"] == 2 and data["params"] == {"n": 2}
    assert [d["kind"] for d in data["directives"]] == ["partition", "assign", "assign"]
    assert data["directives"][1]["devices"] == [0]
    assert data["directives"][1]["selector"] == {"type": "part", "index": [0],
                                                 "base": {"type": "all"}}


@pytest.mark.parametrize("argv,needle", [
    (["check", "dp", "--set", "n"], "expected NAME=VALUE"),
    (["check", "dp", "--set", "n=x"], "'x' is not an int"),
    (["check", "dp", "--set", "m=2"], "has no parameter 'm'"),
    (["check", "dpp"], "did you mean 'dp'"),
    (["check", "nowhere.ssp"], "no plan file"),
    (["check", "model.py", "dp"], "model.py"),
    (["check", "dp", "--world", "2", "--set", "world=3"], "once"),
    (["check", "dp", "--world", "0"], "positive"),
])
def test_check_usage_errors_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_installed_layout_finds_grammar_and_stdlib(tmp_path: Path):
    """Copy the package as a wheel lays it out (grammar and plans inside it) to a place with no
    checkout around, and run the commands there in a fresh interpreter."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "ssdsl", site / "ssdsl",
                    ignore=shutil.ignore_patterns("__pycache__", "_grammar", "_stdlib_plans"))
    shutil.copytree(ROOT / "grammar", site / "ssdsl" / "_grammar")
    shutil.copytree(ROOT / "stdlib_plans", site / "ssdsl" / "_stdlib_plans")
    code = ("import json, sys\n"
            "from ssdsl.resources import stdlib_dir\n"
            "from ssdsl.elaborate import elaborate_file, stdlib_plans\n"
            "assert 'site' in str(stdlib_dir()), stdlib_dir()\n"
            "plan = elaborate_file('dp_tp_1f1b', world=8, sets={'dp': '2', 'tp': '2'})\n"
            "print(json.dumps([len(stdlib_plans()), len(plan.directives)]))\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [len(STDLIB), 13]
