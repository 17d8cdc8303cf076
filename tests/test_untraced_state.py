"""State the forward never reads (an unused submodule, a persistent buffer) is in every saved
state: ``--save``, a merged ``--checkpoint`` and ``full_state_dict`` load strictly into the plain
model (found by a sweep of models that are not in the repository: those entries were dropped).

Oracles: the seeded model's own ``state_dict`` (the entries no step changes) and the plain model
trained with SGD (``run_reference``) for the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.runtime import checkpoint as ckpt
from ssdsl.runtime.init import StateFile, write_state
from ssdsl.runtime.job import JobSpec, plan_job
from ssdsl.runtime.reference import run_reference
from ssdsl.runtime.train import OptimizerSpec
from ssdsl.trace.model_file import load_model_file

MODEL = Path(__file__).resolve().parent / "models" / "unused_state.py"
UNREAD = {"spare.weight", "spare.bias", "version"}


def test_the_unread_entries_come_whole_from_the_initial_state(tmp_path):
    mf, m, model = plan_job(JobSpec(str(MODEL), "dp", dtype="float64"), 2)
    keys = ckpt.state_keys_of(mf, seed=0)
    built = mf.build(seed=0).state_dict()
    path = write_state(model, tmp_path / "state")
    for source in (model, StateFile(path)):
        got = ckpt.untraced_state(source, m.transformed.graph, keys, torch.float64)
        assert set(got) == UNREAD
        for k, v in got.items():
            want = built[k].to(torch.float64) if built[k].is_floating_point() else built[k]
            assert v.dtype == want.dtype and torch.equal(v, want), k


@pytest.mark.slow  # two rank processes
@pytest.mark.parametrize("plan", ["dp", "1f1b"])
def test_saved_and_merged_states_load_strictly(tmp_path, capsys, plan):
    from ssdsl.cli import main
    saved, directory = tmp_path / "saved.pt", tmp_path / "ck"
    assert main(["run", str(MODEL), plan, "--nproc", "2", "--steps", "2", "--dtype", "float64",
                 "--optimizer", "sgd", "--save", str(saved), "--checkpoint",
                 str(directory)]) == 0
    mf = load_model_file(str(MODEL))
    ref = run_reference(mf, steps=2, dtype=torch.float64, optimizer=OptimizerSpec("sgd"))
    built = mf.build(seed=0).double().state_dict()
    for state in (torch.load(saved), ckpt.merge_checkpoint(directory)["model"]):
        plain = mf.build(seed=0).double()
        plain.load_state_dict(state, strict=True)
        for k, v in plain.state_dict().items():
            want = built[k] if k in UNREAD else ref.final_state[k]
            assert torch.allclose(v, want, rtol=1e-12, atol=1e-15), k


def api_worker(model: str) -> dict:
    import ssdsl
    pm = ssdsl.parallelize(model, "dp", dtype="float64", optimizer="sgd")
    mf = load_model_file(model)
    pm.train_step(*mf.get_batch(0, mf.batch_size))
    return pm.full_state_dict()


@pytest.mark.slow  # two rank processes
def test_full_state_dict_loads_strictly():
    from ssdsl.runtime.launch import launch
    states = launch(api_worker, nproc=2, args=(str(MODEL),), timeout_s=300)
    mf = load_model_file(str(MODEL))
    built = mf.build(seed=0).double().state_dict()
    for state in states:
        plain = mf.build(seed=0).double()
        plain.load_state_dict(state, strict=True)
        for k in UNREAD:
            assert torch.equal(plain.state_dict()[k], built[k]), k
