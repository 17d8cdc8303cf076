"""Losses whose divisor the data decides, under batch splits and micro-batches (issue 16).

A tiny token model (embedding, linear, head) is trained with each loss form a model file may
write: a plain mean, a sum, cross-entropy averaged over the labelled tokens (``ignore_index``),
a masked mean, label smoothing, and a sum divided by a count computed in the forward. The targets
hold ``-100`` at random, so the parts of a batch split hold different numbers of labelled tokens
(checked below): scaling each part's mean by its share of the batch would be wrong.

The oracle is the plain single-device model in float64 with plain SGD (``run_reference``): the
loss and every gradient of step 0 under ``dp`` on 2 and 4 devices (all ranks simulated in one
process, ``verify_plan``), and two steps with 4 micro-batches on one device. The slow tests run
the same forms on gloo: ``dp`` on 2 and 4 ranks and ``1f1b`` with 4 micro-batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ssdsl.cli import main
from ssdsl.elaborate import elaborate_file, elaborate_text
from ssdsl.materialize.program import materialize
from ssdsl.runtime.verify import compare_with_model, simulate_plan, verify_plan
from ssdsl.runtime.executor import RankProgram, assemble
from ssdsl.runtime.job import schedule_plan
from ssdsl.runtime.reference import norm_scaled_errors, run_reference
from ssdsl.runtime.train import OptimizerSpec
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform
from ssdsl.transform.microbatch import NotMicrobatchable

F64 = torch.float64
SGD = OptimizerSpec("sgd", 0.1)

MODEL = '''
import torch, torch.nn as nn, torch.nn.functional as F
V, C, T = 12, 8, 6
BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.fc = nn.Linear(C, C)
        self.head = nn.Linear(C, V)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(self.emb(x))))


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, V, (batch_size, T), generator=g)
    y = torch.randint(0, V, (batch_size, T), generator=g)
    drop = torch.rand(batch_size, T, generator=g) < 0.4
    return x, torch.where(drop, torch.full_like(y, -100), y)


def loss(o, t):
    LOSS
'''

FORMS = {
    "mean": "return o.pow(2).mean()",
    "example_mean": "return F.cross_entropy(o.flatten(0, 1), t.flatten().clamp(min=0))",
    "sum": "return F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction='sum')",
    "token_mean": "return F.cross_entropy(o.flatten(0, 1), t.flatten())",
    "masked_mean": ("m = (t != -100).to(o.dtype)\n"
                    "    terms = F.cross_entropy(o.flatten(0, 1), t.flatten().clamp(min=0), "
                    "reduction='none')\n"
                    "    return (terms.view_as(m) * m).sum() / m.sum()"),
    "label_smoothing": "return F.cross_entropy(o.flatten(0, 1), t.flatten(), label_smoothing=0.1)",
    "count": ("return F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction='sum') "
              "/ (t != -100).sum()"),
}


def model_file(tmp_path: Path, form: str) -> str:
    path = tmp_path / f"loss_{form if form in FORMS else 'other'}.py"
    path.write_text(MODEL.replace("LOSS", FORMS[form] if form in FORMS else form))
    return str(path)


def test_the_parts_hold_different_counts(tmp_path):
    """Otherwise the suite could not tell a share scaling from the right normalization."""
    mf = load_model_file(model_file(tmp_path, "token_mean"))
    for step in (0, 1):
        _, t = mf.get_batch(step, 8)
        kept = (t != -100).sum(dim=1)
        for parts in (2, 4):
            counts = {int(c) for c in kept.view(parts, -1).sum(dim=1)}
            assert len(counts) > 1, (step, parts)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_dp_matches_the_plain_model(tmp_path, form, world):
    mf = load_model_file(model_file(tmp_path, form))
    graph = trace(mf, device="cpu", model=mf.build(seed=0).to(F64))
    m = materialize(transform(graph, elaborate_file("dp", world=world)), dtype=F64)
    sim = simulate_plan(m, mf)
    problems, ref_loss, worst = compare_with_model(m, mf, sim)
    assert not problems
    assert sim.loss == pytest.approx(ref_loss, rel=1e-12)
    assert worst < 1e-12
    # the counts are taken from the whole batch on each rank: no collective in forward
    assert m.accounting()["forward"] == {}


def _microbatched(path: str, text: str) -> RankProgram:
    mf = load_model_file(path)
    model = mf.build(seed=0).to(F64)
    graph = trace(mf, device="cpu", model=model)
    t, lowered = schedule_plan(graph, elaborate_text(text, world=1))
    m = materialize(t, dtype=F64, schedule=lowered)
    return RankProgram(m, 0, mf, model, dtype=F64, optimizer=SGD, groups=None)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_microbatches_match_the_plain_model(tmp_path, form):
    path = model_file(tmp_path, form)
    prog = _microbatched(path, "plan p()\nmicrobatch along batch into 4\nstages into 2 as st\n"
                         "assign st[0] to device 0\nassign st[1] to device 0\n")
    assert prog.m.transformed.microbatches == 4
    ref = run_reference(load_model_file(path), steps=2, dtype=F64, optimizer=SGD)
    losses = [prog.step(0, None), prog.step(1, None)]
    assert losses == pytest.approx(ref.losses, rel=1e-12, abs=0)
    final = assemble(prog.shards())
    assert max(norm_scaled_errors({k: ref.final_state[k] for k in final}, final).values()) < 1e-10


PARAM_DIVISOR = ("return F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction='sum') "
                 "/ o.abs().sum()")


def test_a_divisor_that_depends_on_parameters_is_summed_by_the_adapters(tmp_path):
    mf = load_model_file(model_file(tmp_path, PARAM_DIVISOR))
    graph = trace(mf, device="cpu", model=mf.build(seed=0).to(F64))
    m = materialize(transform(graph, elaborate_file("dp", world=2)), dtype=F64)
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems
    assert verdict.max_grad_error < 1e-12
    assert set(m.accounting()["forward"]) == {"all_reduce"}


def test_micro_batches_refuse_a_divisor_that_depends_on_parameters(tmp_path):
    path = model_file(tmp_path, PARAM_DIVISOR)
    with pytest.raises(NotMicrobatchable) as err:
        _microbatched(path, "plan p()\n\nmicrobatch along batch into 4\nassign all to device 0\n")
    assert err.value.span.line == 3
    assert "parameters" in err.value.hint


# on gloo, the forms whose divisor the data decides (the others keep today's rule, run by the
# examples' suites); every form runs in the fast lane above
DATA_DEPENDENT = ["token_mean", "masked_mean", "label_smoothing", "count"]
EXACT = ["--dtype", "float64", "--optimizer", "sgd", "--steps", "2", "--check", "--json"]


@pytest.mark.slow
@pytest.mark.parametrize("plan, nproc, extra", [
    ("dp", 2, []), ("dp", 4, []),
    ("1f1b", 2, ["--set", "microbatches=4"]),
], ids=["dp-2", "dp-4", "1f1b-2x4"])
@pytest.mark.parametrize("form", DATA_DEPENDENT)
def test_run_on_gloo_matches_the_reference(tmp_path, capsys, form, plan, nproc, extra):
    code = main(["run", model_file(tmp_path, form), plan, "--nproc", str(nproc), *extra, *EXACT])
    out = json.loads(capsys.readouterr().out)
    assert out["check"]["ok"], out["check"]
    assert code == 0
    worst = {m["what"]: m["error"] for m in out["check"]["worst"]}
    assert worst["loss"] < 1e-9 and worst["param"] < 1e-9
