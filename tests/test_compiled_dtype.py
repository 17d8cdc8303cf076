"""``ssdsl compile --dtype`` and ``run --compiled``: the files are written from a trace in the
run's dtype, its creation operators on the CPU and its lifted constants real, as the interpreter
plans (found by a sweep of models that are not in the repository: a ``.to(weight.dtype)`` was
written as float32 for a float64 run, and a loss's class weights stayed on the meta device).
A model whose program does not depend on the dtype (the GPT example) still runs files compiled
in float32 under float64 (test_codegen_exec.py); one whose program does is refused with a hint
that names --dtype. Oracle: the plain model (``--check``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssdsl.cli import main

MODEL = Path(__file__).resolve().parent / "models" / "dtype_and_constant.py"


def _compile(tmp_path: Path, dtype: str) -> Path:
    out = tmp_path / f"build_{dtype}"
    assert main(["compile", str(MODEL), "dp", "--world", "2", "--dtype", dtype, "-o",
                 str(out)]) == 0
    return out


@pytest.mark.slow  # two rank processes
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_compiled_in_the_runs_dtype_matches_the_plain_model(tmp_path, capsys, dtype):
    out = _compile(tmp_path, dtype)
    capsys.readouterr()
    code = main(["run", str(MODEL), "dp", "--nproc", "2", "--compiled", str(out), "--dtype",
                 dtype, "--optimizer", "sgd", "--steps", "2", "--check", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["check"]["ok"], result


@pytest.mark.slow  # two rank processes
def test_compiled_in_another_dtype_is_refused_with_the_flag_to_give(tmp_path, capsys):
    out = _compile(tmp_path, "float32")
    capsys.readouterr()
    code = main(["run", str(MODEL), "dp", "--nproc", "2", "--compiled", str(out), "--dtype",
                 "float64", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "digest mismatch" in err and "--dtype" in err, err
