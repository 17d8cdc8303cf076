"""A plan error that names an operator also says where the model's code calls it: the innermost
line outside torch, in the model file or in the library it imports (HF's modeling file, timm's
blocks). The plan's line stays the error's position; the model's line is a note under it, and
``--json`` gives it as ``origin``.

The oracle is the text of the files the test writes: the line holding the call that the error
must point at is found by its content, not by anything ssdsl computed."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from ssdsl.cli import main
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.trace.trial import RandomOperator
from ssdsl.transform.errors import MissingDim
from ssdsl.transform.microbatch import NotMicrobatchable

# a "library" beside the model file: the operators ssdsl refuses are made here, so the error's
# note must point into this file, not at the model file's line that calls into it
LIBRARY = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class NormedBlock(nn.Module):
    def __init__(self, width, p=0.0):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.p = p

    def forward(self, x):
        h = self.fc(x)
        h = self.bn(h)
        return F.dropout(h, p=self.p, training=self.training)
'''

MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

from {lib} import NormedBlock

BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = NormedBlock(16, p={p})
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.block(x))


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def loss(o, t):
    return F.cross_entropy(o, t) * o.pow(2).mean()
'''


@pytest.fixture
def files(tmp_path, monkeypatch):
    """(model file, library file) written to ``tmp_path``; a fresh library name per test, as
    the model file imports it by name."""
    lib = f"normed_lib_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{lib}.py").write_text(textwrap.dedent(LIBRARY))
    # no sys.path set up here: ssdsl puts the model file's folder on it, as `python net.py` does
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield lambda p=0.0: _write(tmp_path, lib, p), tmp_path / f"{lib}.py"
    sys.modules.pop(lib, None)


def _write(folder: Path, lib: str, p: float) -> str:
    path = folder / "net.py"
    path.write_text(textwrap.dedent(MODEL).replace("{lib}", lib).replace("{p}", repr(p)))
    return str(path)


def _line_of(path: Path, text: str) -> int:
    found = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


def test_a_batch_statistic_under_micro_batches_points_into_the_library(files):
    write, lib = files
    with pytest.raises(NotMicrobatchable) as err:
        verify_before_launch(JobSpec(write(), "gpipe", (("microbatches", "2"),)), 2)
    origin = err.value.origin
    assert origin is not None, err.value.render()
    assert Path(origin.file).name == lib.name
    assert origin.line == _line_of(lib, "self.bn(h)")
    text = err.value.render()
    assert f"note: the operator comes from {origin.file}:{origin.line}:" in text
    assert "h = self.bn(h)" in text  # the excerpt of that line
    # the error's own position is still the plan's microbatch line
    plan_line = Path(err.value.span.file).read_text().splitlines()[err.value.span.line - 1]
    assert plan_line.startswith("microbatch"), err.value.span


def test_a_loss_product_under_micro_batches_points_at_the_model_file(files, tmp_path):
    write, _ = files
    model = write()
    # the batch norm out of the way: dp only splits it by data parallelism is refused for
    # the statistic; replace the library block by one without it
    (tmp_path / "net.py").write_text(Path(model).read_text().replace(
        "self.head(self.block(x))", "self.head(self.block.fc(x))"))
    with pytest.raises(NotMicrobatchable) as err:
        verify_before_launch(JobSpec(model, "gpipe", (("microbatches", "2"),)), 2)
    origin = err.value.origin
    assert origin is not None, err.value.render()
    assert Path(origin.file).name == "net.py"
    # torch keeps the frames of modules' forwards only: the loss's operators are placed at
    # the loss function
    assert origin.line == _line_of(Path(model), "def loss(o, t):")


def test_dropout_inside_a_library_is_refused_with_the_library_line(files):
    write, lib = files
    with pytest.raises(RandomOperator) as err:
        trace(load_model_file(write(p=0.1)), device="meta")
    origin = err.value.origin
    assert origin is not None, err.value.render()
    assert Path(origin.file).name == lib.name
    assert origin.line == _line_of(lib, "F.dropout(h, p=self.p")


def test_a_missing_dim_of_one_operator_notes_its_line_and_json_carries_it(files, tmp_path,
                                                                        capsys):
    write, lib = files
    model = write()
    plan = tmp_path / "plan.ssp"
    plan.write_text("plan bad(n: int = world)\n"
                    "partition block.bn & kind(batch_norm) along heads into 2\n"
                    "assign all to device 0\n")
    with pytest.raises(MissingDim) as err:
        verify_before_launch(JobSpec(model, str(plan)), 2)
    assert err.value.origin is not None, err.value.render()
    assert err.value.origin.line == _line_of(lib, "self.bn(h)")
    assert main(["check", model, str(plan), "--world", "2", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    origins = [e["origin"] for e in doc["errors"]]
    assert {"file": err.value.origin.file, "line": _line_of(lib, "self.bn(h)")} in origins


def test_a_helper_module_beside_the_model_file_imports_as_under_python(files, capfd):
    write, lib = files
    model = write()
    assert str(Path(model).parent) not in sys.path
    assert main(["check", model, "dp", "--world", "1"]) == 0, capfd.readouterr()
    graph = trace(load_model_file(model), device="meta")
    # the block's operators come from the helper module's class
    assert {op.module for op in graph.ops} >= {"block.fc", "block.bn", "head"}
