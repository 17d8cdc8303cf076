"""Shards initialised without the full model on a rank (DESIGN §6, issue 9): the launcher's
memory-mapped state file, or one written by local rank 0 under torchrun, gives exactly the
seeded single-device model's values; ranks plan from a trace on ``meta``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.runtime.init import StateFile, init_shards, initial_state_file
from ssdsl.runtime.job import JobSpec, plan_for_ranks
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")


@pytest.mark.parametrize("plan, sets", [("megatron_tp", (("tp", "2"),)),
                                        pytest.param("dp", (), marks=pytest.mark.slow)])
def test_shards_from_the_state_file_are_the_seeded_model_regions(plan, sets):
    spec = JobSpec(GPT, plan, sets, dtype="float64", seed=3)
    mf, m, on_meta = plan_for_ranks(spec, 2)
    assert on_meta
    # oracle: the plain model, built and indexed by qualified name, without ssdsl's slicing
    model = load_model_file(GPT).build(seed=3).to(torch.float64)
    state = dict(model.named_parameters(remove_duplicate=False))
    g = m.transformed.graph
    with initial_state_file(mf, seed=3) as path:
        for rank in range(2):
            leaves, _ = init_shards(m, rank, StateFile(path))
            assert leaves
            for (name, region), value in leaves.items():
                full = state[g.params[name]]
                want = full.detach()
                for dim, ivs in enumerate(region.intervals):  # strided regions: several runs
                    rows = torch.cat([torch.arange(a, b) for a, b in ivs])
                    want = want.index_select(dim, rows)
                assert value.dtype == torch.float64 and value.requires_grad
                assert torch.equal(value.detach(), want)


def _devices(value) -> list:
    if isinstance(value, torch.device):
        return [value]
    if isinstance(value, (list, tuple)):
        return [d for v in value for d in _devices(v)]
    return []


@pytest.mark.parametrize("model", [GPT, pytest.param(str(ROOT / "examples" / "hf_llama.py"),
                                                     marks=pytest.mark.slow)])
def test_ranks_plan_without_building_tensors(model):
    """No meta device is left in any argument (``arange(device=)``, ``to(x, device, dtype)``)."""
    mf, m, on_meta = plan_for_ranks(JobSpec(model, "dp"), 2)
    found = [d for op in m.transformed.graph.ops
             for d in _devices((*op.args, *(v for _, v in op.kwargs)))]
    assert on_meta and found and torch.device("meta") not in found


def _train(spec: JobSpec) -> dict:
    from ssdsl.runtime.job import rank_main
    return rank_main(spec)


@pytest.mark.slow
def test_torchrun_path_local_rank_zero_writes_the_state():
    """No launcher state file (as under torchrun): local rank 0 writes it; the run matches the
    single-device reference in float64."""
    from ssdsl.runtime.launch import launch
    from ssdsl.runtime.reference import run_reference
    from ssdsl.runtime.train import OptimizerSpec

    spec = JobSpec(GPT, "megatron_tp", (("tp", "2"),), steps=2, dtype="float64",
                   optimizer="sgd")
    result = launch(_train, nproc=2, args=(spec,), timeout_s=300)[0]
    ref = run_reference(load_model_file(GPT), steps=2, dtype=torch.float64,
                        optimizer=OptimizerSpec("sgd"))
    for a, b in zip(result["losses"], ref.losses):
        assert abs(a - b) < 1e-9 * max(1.0, abs(b))
    for name, value in result["params"].items():
        want = ref.final_state[name]
        assert float((value - want).abs().max()) <= 1e-9 * max(1.0, float(want.abs().max()))
