"""A parameter used by several operators (a tied embedding and LM head, one Linear applied twice)
gets the sum of all its uses' gradients whatever layout each use has (finding 2 of issue 10).

The oracle is the plain single-device model in float64: ``verify_plan`` simulates every rank in
one process and compares the loss and every rank's weight gradients with ``run_reference``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.elaborate import elaborate_text
from ssdsl.materialize.program import materialize
from ssdsl.runtime.verify import verify_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform
from tests.test_materialize_graph import gpt

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT / "tests" / "models" / "shared_linear.py"


def _plan(body: str) -> str:
    return "plan p(n: int = world)\n" + body + "replicate rest into n\nassign each part i to device i\n"


def _verify(mf, graph, body: str, world: int = 2):
    plan = elaborate_text(_plan(body), "p.ssp", world=world)
    m = materialize(transform(graph, plan), dtype=torch.float64)
    return verify_plan(m, model_file=mf)


def test_tied_parameter_is_one_graph_tensor_read_through_one_alias() -> None:
    _, graph, _ = gpt()
    (wte,) = [t for t, q in graph.params.items() if q == "wte.weight"]
    readers = [op for op in graph.ops if wte in op.inputs]
    assert [op.target for op in readers] == ["aten.alias.default"]
    shared = readers[0].outputs[0]
    assert sorted(op.module for op in graph.ops if shared in op.inputs) == ["lm_head", "wte"]


@pytest.mark.parametrize("body", [
    "partition lm_head along in into n\n",
    "partition lm_head along out into n\n",
    "partition lm_head along out into n\npartition wte along batch into n\n",
], ids=["head-in", "head-out", "head-out+embedding-batch"])
def test_tied_lm_head_split_any_way_matches_the_plain_model(body: str) -> None:
    mf, graph, _ = gpt()
    verdict = _verify(mf, graph, body)
    assert verdict.ok, verdict.problems[:5]


@pytest.mark.parametrize("body", [
    "partition first along out into n\npartition second along in into n\n",
    "partition first along in into n\npartition second along batch into n\n",
    # the shared weight is cut between two communication points of linear_2's inputs: the
    # lowered program once dropped that segment's backward, with the cut's gradient
    "partition shared along in into n\npartition first along out into n\n",
    "partition shared along batch into n\n",
], ids=["tied-out-in", "tied-in-batch", "twice-in", "twice-batch"])
def test_shared_weights_with_different_layouts(body: str) -> None:
    mf = load_model_file(SHARED)
    graph = trace(mf, device="cpu", model=mf.build(seed=0))
    # first.weight (tied to second.weight), shared.weight and shared.bias: one alias each
    aliases = sorted(op.module for op in graph.ops if op.target == "aten.alias.default")
    assert aliases == ["first", "shared", "shared"]
    assert graph.aliases == {"first.weight": ("second.weight",)}
    verdict = _verify(mf, graph, body)
    assert verdict.ok, verdict.problems[:5]


@pytest.mark.slow
def test_run_check_tied_lm_head_split_along_in(capsys, tmp_path) -> None:
    """Two ranks, three SGD steps in float64: every loss and the final parameters (lm_head.weight
    included, under its tied name) equal the plain model's."""
    import json

    from ssdsl.cli import main

    plan = tmp_path / "tied.ssp"
    plan.write_text(_plan("partition lm_head along in into n\n"))
    code = main(["run", str(ROOT / "examples" / "gpt.py"), str(plan), "--nproc", "2",
                 "--steps", "3", "--check", "--dtype", "float64", "--optimizer", "sgd", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["check"]["ok"], out["check"]
    worst = {m["what"]: m["error"] for m in out["check"]["worst"]}
    assert worst["param"] < 1e-9 and worst["loss"] < 1e-9
