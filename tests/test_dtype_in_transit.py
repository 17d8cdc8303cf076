"""A tensor the model keeps in another precision than the run's (rotary tables cast to float32 in
a float64 run) crosses ranks in its own dtype: the lowered ``comm`` says so, the simulator
refuses a program whose sender and receiver disagree on the dtype (on the wire the bytes would be
read as another dtype: garbage, silently), and the distributed run equals the plain model.

The oracle is the plain model (a direct forward here, ``run_reference`` through ``--check``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ssdsl.lower import lower_plan
from ssdsl.ir.region import Region
from ssdsl.lower.instr import Comm, Msg
from ssdsl.lower.walk import Exchange, MessageMismatch, Wait
from ssdsl.runtime.job import JobSpec, plan_job
from ssdsl.runtime.simulate import simulate_model_file

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "models" / "float32_table.py"


def _planned():
    return plan_job(JobSpec(str(MODEL), "1f1b", dtype="float64"), 2)


def test_the_float32_table_travels_as_float32() -> None:
    mf, m, _ = _planned()
    comms = [i for p in lower_plan(m).programs for i in p.instructions if isinstance(i, Comm)]
    assert {c.dtype for c in comms} == {"float", "float32"}
    sim = simulate_model_file(m, lower_plan(m).programs, mf)
    g = torch.Generator().manual_seed(700)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    model = mf.build(seed=0).double()
    want = float(torch.nn.functional.cross_entropy(model(x.double()), y).detach())
    assert abs(sim.loss - want) < 1e-6 * max(1.0, abs(want))


def test_the_simulator_refuses_a_dtype_the_receiver_does_not_expect() -> None:
    """The in-process exchange refuses what gloo would deliver as garbage bytes."""
    exchange = Exchange()
    region = Region.full((2, 3))
    exchange.send(0, Msg("send", 1, 7, 0, 0, region), None,
                  payload=torch.zeros(2, 3, dtype=torch.float32), shape=(2, 3))
    w = Wait(1, Msg("recv", 0, 7, 0, 0, region), None,
             payload=torch.empty(2, 3, dtype=torch.float64), shape=(2, 3))
    with pytest.raises(MessageMismatch, match="float32"):
        exchange.try_recv(w)


@pytest.mark.slow
def test_a_pipeline_run_equals_the_plain_model(capsys) -> None:
    from ssdsl.cli import main
    code = main(["run", str(MODEL), "1f1b", "--nproc", "2", "--steps", "2", "--check",
                 "--dtype", "float64", "--optimizer", "sgd", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["check"]["ok"], out
