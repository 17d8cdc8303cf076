"""``ssdsl trace``: the table names the flowing dims, ``--json`` gives every op, and a broken model
file is a user error (exit 2, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

from ssdsl.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_table_lists_ops_and_splittable_dims(capsys) -> None:
    assert main(["trace", str(EXAMPLES / "gpt.py")]) == 0
    out = capsys.readouterr().out
    assert "h.0.attn.c_attn" in out and "heads:4" in out and "batch:8" in out


def test_json_has_every_op_with_dims(capsys) -> None:
    assert main(["trace", str(EXAMPLES / "mlp.py"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    kinds = [op["kind"] for op in data["ops"]]
    assert kinds.count("linear") == 4 and kinds[-1] == "cross_entropy"
    first = data["ops"][0]
    assert first["module"] == "layers.0" and first["outputs"][0]["shape"] == [8, 64]
    marks = {d["label"]: d["mark"] for d in first["dims"]}
    assert marks == {"b0": "spatial", "k": "reduced", "n": "spatial"}
    assert all(op["annotated"] for op in data["ops"])


def test_broken_model_file_is_a_user_error(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n")
    assert main(["trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "get_batch" in err and "Traceback" not in err


def test_untraceable_forward_is_a_user_error(tmp_path, capsys) -> None:
    bad = tmp_path / "branchy.py"
    bad.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = torch.nn.Parameter(torch.ones(4))\n"
        "    def forward(self, x):\n"
        "        return x * self.w if x.sum() > 0 else x\n"
        "def build_model():\n    return M()\n"
        "def get_batch(step, bs):\n    return torch.randn(bs, 4), torch.zeros(bs, dtype=torch.long)\n")
    assert main(["trace", str(bad), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    # found by the one-step trial before torch.export, at the line that needs values
    assert "branchy.py:7:" in err and "needs tensor values" in err, err
