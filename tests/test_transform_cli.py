"""``ssdsl check MODEL PLAN``: the per-operator table, its JSON, and errors with positions.

Expectations come from the models' sizes (gpt: 4 heads, batch 8; mlp: batch 8) and the plans'
text, not from the transform's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp.py")
BAD = ROOT / "tests" / "plans" / "transform_bad"


def run_json(capsys, *argv: str) -> dict:
    assert main(["check", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_table_lists_every_operator_with_its_split(capsys) -> None:
    assert main(["check", GPT, "megatron_tp", "--world", "2"]) == 0
    out = capsys.readouterr().out
    for word in ("name", "kind", "module", "parts", "split dims", "devices"):
        assert word in out
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if "│" in line}
    assert "heads/2" in lines["linear"] and "h.0.attn.c_attn" in lines["linear"]
    assert "partial sums" in lines["linear_1"]          # c_proj: row parallel
    assert "x2 copies" in lines["layer_norm"]
    assert "0,1" in lines["cross_entropy_loss"]
    assert "megatron_tp on" in out and "world=2" in out


def test_json_megatron(capsys) -> None:
    doc = run_json(capsys, GPT, "megatron_tp", "--world", "2")
    assert doc["plan"] == "megatron_tp" and doc["world"] == 2 and doc["devices"] == [0, 1]
    ops = {op["name"]: op for op in doc["ops"]}
    qkv = next(op for op in doc["ops"] if op["module"] == "h.0.attn.c_attn")
    assert qkv["split"] == {"heads": 2} and qkv["copies"] == 1
    # 4 heads into 2: heads 0..2 on device 0, heads 2..4 on device 1
    assert [(p["device"], p["ranges"]["heads"]) for p in qkv["parts"]] == [(0, [0, 2]), (1, [2, 4])]
    proj = next(op for op in doc["ops"] if op["module"] == "h.1.mlp.c_proj")
    assert proj["partial_sums"] and all(p["partial_sum"] for p in proj["parts"])
    # c_fc's output features: 4 * 32 = 128 into 2
    fc = next(op for op in doc["ops"] if op["module"] == "h.0.mlp.c_fc")
    assert [list(p["ranges"].values()) for p in fc["parts"]] == [[[0, 64]], [[64, 128]]]
    assert ops["layer_norm"]["copies"] == 2 and ops["layer_norm"]["split"] == {}
    # the GELU between the MLP's linears follows the column split: no copies, one dim in 2
    gelu = next(op for op in doc["ops"] if op["module"] == "h.0.mlp" and op["kind"] == "gelu")
    assert gelu["copies"] == 1 and list(gelu["split"].values()) == [2]
    assert all(len(op["parts"]) == 2 and op["devices"] == [0, 1] for op in doc["ops"])


@pytest.mark.parametrize("world", [2, 4])
def test_json_dp_on_mlp(capsys, world: int) -> None:
    doc = run_json(capsys, MLP, "dp", "--world", str(world))
    assert doc["devices"] == list(range(world))
    linears = [op for op in doc["ops"] if op["kind"] == "linear"]
    assert len(linears) == 4                                   # 3 hidden layers + head
    step = 8 // world
    for op in linears:
        assert op["split"] == {"batch": world}
        assert [p["ranges"]["batch"] for p in op["parts"]] == \
            [[k * step, (k + 1) * step] for k in range(world)]
        assert [p["device"] for p in op["parts"]] == list(range(world))


def test_json_dp_tp_device_is_d_times_tp_plus_t(capsys) -> None:
    """stdlib dp_tp, dp=2 and tp=2: the part (d, t) is on device d * 2 + t."""
    doc = run_json(capsys, GPT, "dp_tp", "--world", "4", "--set", "dp=2")
    qkv = next(op for op in doc["ops"] if op["module"] == "h.1.attn.c_attn")
    assert qkv["split"] == {"batch": 2, "heads": 2}
    assert [(p["index"], p["device"]) for p in qkv["parts"]] == \
        [([0, 0], 0), ([0, 1], 1), ([1, 0], 2), ([1, 1], 3)]


def test_error_exits_two_with_position(capsys) -> None:
    plan = BAD / "selector_matches_nothing.ssp"
    assert main(["check", GPT, str(plan), "--world", "2"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert "selector_matches_nothing.ssp:6:1: 'h.*.atn' matches no operator" in captured.err
    assert "did you mean 'h.*.attn'?" in captured.err
    assert captured.out == ""


def test_unplaced_parts_exit_two(capsys) -> None:
    assert main(["check", MLP, str(BAD / "unplaced_parts.ssp"), "--world", "2"]) == 2
    assert "unplaced_parts.ssp:6:1:" in capsys.readouterr().err


def test_missing_model_file_exits_two(capsys, tmp_path) -> None:
    assert main(["check", str(tmp_path / "nope.py"), "dp"]) == 2
    err = capsys.readouterr().err
    assert "nope.py" in err and "Traceback" not in err


def test_notes_are_printed(capsys) -> None:
    """dp on gpt: ops without a batch dim (arange, the position embedding) are replicated."""
    assert main(["check", GPT, "dp", "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "note:" in out and "without dim 'batch'" in out


def test_table_names_splits_in_the_plans_words(capsys, tmp_path) -> None:
    """A split the plan wrote `along out` / `along in` reads back with those words in the
    table (not the annotation's labels n and k); the JSON keeps the labels of its schema.
    Oracle: the plan text below, and the labels docs/json.md's `split` has always used."""
    plan = tmp_path / "tp.ssp"
    plan.write_text("plan tp()\npartition layers.1 along out into 2\n"
                    "partition layers.2 along in into 2\nreplicate rest into 2\n"
                    "assign each part i to device i\n")
    assert main(["check", MLP, str(plan), "--world", "2"]) == 0
    out = capsys.readouterr().out
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if "│" in line}
    assert " out/2 " in lines["linear_1"] and "n/2" not in lines["linear_1"]
    assert " in/2 (partial sums)" in lines["linear_2"] and "k/2" not in lines["linear_2"]
    assert "(a..b: devices a to b-1" not in out  # no range is shown (devices 0,1)
    doc = run_json(capsys, MLP, str(plan), "--world", "2")
    split = {op["name"]: op["split"] for op in doc["ops"]}
    assert split["linear_1"] == {"n": 2} and split["linear_2"] == {"k": 2}
    assert "split_words" not in doc["ops"][0]
