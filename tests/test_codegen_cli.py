"""``ssdsl compile``: golden per-rank files (modules and program texts), refusal to overwrite foreign files, plan errors.

Golden files live in ``tests/golden/codegen/<case>/rank<N>.py`` and are reviewed when they change;
``SSDSL_UPDATE_GOLDEN=1`` rewrites them. The other oracles are the file system (what is in the
folder before and after) and the plan text (the position an error must point at).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ssdsl.cli import main
from ssdsl.codegen import GENERATED_MARK

GOLDEN = Path(__file__).parent / "golden" / "codegen"
UPDATE = os.environ.get("SSDSL_UPDATE_GOLDEN") == "1"
ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "mlp_dp": ["examples/mlp.py", "dp", "--world", "2"],
    "gpt_megatron_tp": ["examples/gpt.py", "megatron_tp", "--world", "2",
                        "--set", "attn_out=attn.c_proj", "--set", "mlp_out=mlp.c_proj"],
}


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the case paths are relative to the checkout


def _compile(args: list[str], out: Path, capsys) -> tuple[int, str, str]:
    rc = main(["compile", *args, "-o", str(out)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case, tmp_path, capsys):
    rc, out, err = _compile(CASES[case], tmp_path, capsys)
    assert rc == 0, err
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["rank0.program", "rank0.py", "rank1.program", "rank1.py"]
    assert all(f"wrote {tmp_path / name}" in out for name in written if name.endswith(".py"))
    new = []
    for name in written:
        text = (tmp_path / name).read_text()
        path = GOLDEN / case / name
        if UPDATE or not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            new.append(path)
        assert text == path.read_text(), f"{path} differs (SSDSL_UPDATE_GOLDEN=1 to rewrite)"
    if new and not UPDATE:
        pytest.fail(f"wrote new golden files {new}; review them and run again")


def test_output_is_deterministic_and_path_free(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "nested" / "b"
    assert _compile(CASES["mlp_dp"], a, capsys)[0] == 0
    os.chdir(tmp_path)  # another working directory, absolute model path
    args = [str(ROOT / "examples/mlp.py"), *CASES["mlp_dp"][1:]]
    assert _compile(args, b, capsys)[0] == 0
    for name in ("rank0.py", "rank1.py", "rank0.program", "rank1.program"):
        text = (a / name).read_text()
        assert text == (b / name).read_text()
        assert str(ROOT) not in text and str(tmp_path) not in text


def test_refuses_folder_with_foreign_file(tmp_path, capsys):
    mine = tmp_path / "rank0.py"
    mine.write_text("# my own code\n")
    rc, out, err = _compile(CASES["mlp_dp"], tmp_path, capsys)
    assert rc == 2
    assert "did not generate: rank0.py" in err and "Traceback" not in err
    assert mine.read_text() == "# my own code\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.py"]


def test_refuses_output_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "out"
    target.write_text("data")
    rc, _, err = _compile(CASES["mlp_dp"], target, capsys)
    assert rc == 2 and "not a folder" in err
    assert target.read_text() == "data"


def test_recompile_replaces_generated_files_and_drops_stale_ranks(tmp_path, capsys):
    assert _compile(["examples/mlp.py", "dp", "--world", "4"], tmp_path, capsys)[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"rank{i}.{ext}" for i in range(4) for ext in ("py", "program"))
    (tmp_path / "notes.txt").write_text("kept")
    assert _compile(CASES["mlp_dp"], tmp_path, capsys)[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "rank0.program", "rank0.py",
                                                          "rank1.program", "rank1.py"]
    assert (tmp_path / "rank0.py").read_text().startswith(GENERATED_MARK)
    assert "WORLD = 2\n" in (tmp_path / "rank1.py").read_text()
    assert not list(tmp_path.glob(".*.tmp"))


def test_plan_error_exits_2_with_position(tmp_path, capsys):
    plan = tmp_path / "bad.ssp"
    plan.write_text("plan bad()\npartition layers.* along out into 3\nassign each part i to device i\n")
    rc, _, err = _compile(["examples/mlp.py", str(plan), "--world", "3"], tmp_path / "o", capsys)
    assert rc == 2
    first = err.splitlines()[0]
    assert first.startswith(f"{plan}:2:1: ") or first.startswith("bad.ssp:2:1: "), err
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_summary_counts_every_instruction_that_talks_to_other_ranks(tmp_path, capsys):
    # ZeRO-3 has no adapter between operators (dp) but gathers, reduces and sums the loss: the
    # summary counts what the written program file holds, instruction by instruction.
    import re
    rc, out, _ = _compile(["examples/gpt.py", "dp_zero", "--set", "stage=3", "--world", "2"],
                          tmp_path, capsys)
    assert rc == 0
    text = (tmp_path / "rank0.program").read_text()
    count = {k: len(re.findall(rf"^{k}\(", text, re.M))
             for k in ("comm", "reduce", "gather_params", "loss_sum")}
    assert count["gather_params"] > 0 and count["reduce"] > 0
    line = next(x for x in out.splitlines() if "rank0.py" in x)
    assert f"({sum(count.values())} communication steps:" in line
    assert f"{count['reduce']} gradient buckets" in line
    assert f"{count['gather_params']} ZeRO-3 parameter gathers" in line
