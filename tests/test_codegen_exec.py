"""Generated per-rank code runs: on 2 gloo ranks it trains exactly like the interpreter.

Oracles: ``RankProgram`` (the interpreter of the same lowered program, which walks it instead of
running written code) for per-step losses, reduced gradients and final shards, compared
tightly; and the single-device reference (``run_reference``) for losses and final parameters at
DESIGN §7's float64 tolerance. Both plans of the golden files run: mlp dp and gpt megatron_tp.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.runtime.launch import launch
from ssdsl.runtime.reference import RunRecord, compare_runs, run_reference, tolerance_for
from ssdsl.runtime.train import OptimizerSpec
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
CASES = {"mlp_dp": (str(ROOT / "examples/mlp.py"), "dp", ()),
         "gpt_megatron_tp": (str(ROOT / "examples/gpt.py"), "megatron_tp",
                             (("attn_out", "attn.c_proj"), ("mlp_out", "mlp.c_proj")))}
STEPS = 2
LR = 0.1


def _worker(cases: dict, steps: int) -> dict:
    """On each rank: both programs from the same plan, trained side by side."""
    from ssdsl.codegen import Provenance, generate_rank
    from ssdsl.runtime.compiled import GeneratedRankProgram, load_module
    from ssdsl.elaborate import elaborate_file
    from ssdsl.runtime import dist as sdist
    from ssdsl.runtime.executor import RankProgram, assemble, create_groups
    from ssdsl.runtime.job import JobSpec, plan_job

    out = {}
    with sdist.distributed() as ctx:
        for name, (model, plan, sets) in cases.items():
            spec = JobSpec(model, plan, sets, steps, dtype="float64", optimizer="sgd", lr=LR)
            mf, m, full = plan_job(spec, ctx.world_size)
            prov = Provenance.of(model, elaborate_file(plan, world=ctx.world_size,
                                                       sets=dict(sets)))
            module = load_module(generate_rank(m, ctx.rank, prov), filename=f"rank{ctx.rank}.py")
            groups = create_groups(m)
            kw = dict(dtype=torch.float64, optimizer=OptimizerSpec("sgd", LR), groups=groups)
            interp = RankProgram(m, ctx.rank, mf, full, **kw)
            gen = GeneratedRankProgram(m, ctx.rank, mf, full, module=module, **kw)
            rec: dict = {"interp": [], "gen": [], "grads": []}
            for step in range(steps):
                rec["interp"].append(interp.step(step, None))
                rec["gen"].append(gen.step(step, None))
                rec["grads"].append([(k, interp.state.leaves[k].grad.clone(),
                                      gen.state.leaves[k].grad.clone())
                                     for k in interp.state.leaves])
            rec["shards"] = sdist.all_gather_objects((interp.shards(), gen.shards()))
            rec["params"] = assemble([s for pair in rec["shards"] for s in pair[1]])
            out[name] = rec
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(_worker, nproc=2, args=(CASES, STEPS), timeout_s=240)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_matches_interpreter(results, case):
    for rank, per_rank in enumerate(results):
        rec = per_rank[case]
        assert rec["gen"] == pytest.approx(rec["interp"], rel=1e-12), f"rank {rank} losses"
        for step, grads in enumerate(rec["grads"]):
            for key, a, b in grads:
                assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), (rank, step, key)
        for (ia, ga) in rec["shards"]:
            for (qa, ra, ta), (qb, rb, tb) in zip(ia, ga, strict=True):
                assert (qa, ra) == (qb, rb)
                assert torch.allclose(ta, tb, rtol=1e-12, atol=1e-14), (rank, qa, ra)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_matches_single_device(results, case):
    model, _plan, _sets = CASES[case]
    ref = run_reference(load_model_file(model), steps=STEPS, dtype=torch.float64,
                        optimizer=OptimizerSpec("sgd", LR))
    rec = results[0][case]
    mine = RunRecord(losses=tuple(rec["gen"]), final_state=rec["params"])
    expected = RunRecord(losses=ref.losses, final_state={k: v for k, v in ref.final_state.items()
                                                         if k in rec["params"]})
    assert set(expected.final_state) == set(rec["params"])
    verdict = compare_runs(expected, mine, tolerance=tolerance_for(torch.float64,
                                                                   reordered_sums=True))
    assert verdict.ok, verdict.summary()


# -- in one process: world 1, and the guard against a module of another plan ---------------------


def _one_rank(model: str, plan: str, sets: tuple = (), world: int = 1):
    from ssdsl.codegen import Provenance
    from ssdsl.elaborate import elaborate_file
    from ssdsl.runtime.job import JobSpec, plan_job

    spec = JobSpec(model, plan, sets, dtype="float64", optimizer="sgd", lr=LR)
    mf, m, full = plan_job(spec, world)
    prov = Provenance.of(model, elaborate_file(plan, world=world, sets=dict(sets)))
    return mf, m, full, prov


@pytest.mark.parametrize("case", sorted(CASES))
def test_world_one_trains_like_single_device(case):
    from ssdsl.codegen import generate_rank
    from ssdsl.runtime.compiled import GeneratedRankProgram, load_module

    model, plan, sets = CASES[case]
    mf, m, full, prov = _one_rank(model, plan, sets)
    module = load_module(generate_rank(m, 0, prov))
    prog = GeneratedRankProgram(m, 0, mf, full, module=module, dtype=torch.float64,
                                optimizer=OptimizerSpec("sgd", LR), groups=None)
    losses = [prog.step(step, None) for step in range(STEPS)]
    ref = run_reference(mf, steps=STEPS, dtype=torch.float64, optimizer=OptimizerSpec("sgd", LR))
    assert losses == pytest.approx(list(ref.losses), rel=1e-10)
    for qual, _region, t in prog.shards():
        assert torch.allclose(t, ref.final_state[qual], rtol=1e-10, atol=1e-12), qual


def test_module_of_another_rank_or_plan_is_refused():
    from ssdsl.codegen import generate_rank
    from ssdsl.runtime.compiled import GeneratedRankProgram, StaleProgram, load_module

    mf, m, full, prov = _one_rank(CASES["mlp_dp"][0], "dp", world=2)
    kw = dict(dtype=torch.float64, optimizer=OptimizerSpec("sgd", LR), groups=None)
    text = generate_rank(m, 1, prov)
    with pytest.raises(StaleProgram, match="rank 1 of 2, not of rank 0 of 2"):
        GeneratedRankProgram(m, 0, mf, full, module=load_module(text), **kw)
    edited = text.replace("aten.gelu.default(v['linear@0'])", "aten.relu.default(v['linear@0'])")
    assert edited != text
    with pytest.raises(StaleProgram, match="edited after"):
        GeneratedRankProgram(m, 1, mf, full, module=load_module(edited), **kw)
    _, m_tp, _, prov_tp = _one_rank(CASES["gpt_megatron_tp"][0], "megatron_tp", world=2)
    with pytest.raises(StaleProgram, match="another plan or model"):
        GeneratedRankProgram(m, 0, mf, full, module=load_module(generate_rank(m_tp, 0, prov_tp)),
                             **kw)


def test_compiled_file_on_disk_runs(tmp_path, capsys, monkeypatch):
    """The file `ssdsl compile` writes (traced on meta) runs as written, under the run's plan."""
    from ssdsl.cli import main
    from ssdsl.runtime.compiled import GeneratedRankProgram, load_program_file

    monkeypatch.chdir(ROOT)
    assert main(["compile", "examples/mlp.py", "dp", "--world", "1", "-o", str(tmp_path)]) == 0
    module = load_program_file(tmp_path / "rank0.py")
    mf, m, full, _prov = _one_rank(CASES["mlp_dp"][0], "dp")
    prog = GeneratedRankProgram(m, 0, mf, full, module=module, dtype=torch.float64,
                                optimizer=OptimizerSpec("sgd", LR), groups=None)
    losses = [prog.step(step, None) for step in range(STEPS)]
    ref = run_reference(mf, steps=STEPS, dtype=torch.float64, optimizer=OptimizerSpec("sgd", LR))
    assert losses == pytest.approx(list(ref.losses), rel=1e-10)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_1f1b_on_four_ranks_matches_the_reference(tmp_path, capsys, monkeypatch):
    """`ssdsl compile examples/gpt.py 1f1b` on 4 ranks, run with `ssdsl run --compiled`: every
    step's loss and the final parameters equal plain PyTorch on one device, in float64."""
    import json

    from ssdsl.cli import main

    monkeypatch.chdir(ROOT)
    out = tmp_path / "build"
    assert main(["compile", "examples/gpt.py", "1f1b", "--world", "4", "-o", str(out)]) == 0
    capsys.readouterr()
    code = main(["run", "examples/gpt.py", "1f1b", "--nproc", "4", "--compiled", str(out),
                 "--dtype", "float64", "--optimizer", "sgd", "--steps", "2", "--check",
                 "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result.get("check", {}).get("ok"), result


def test_generated_pipeline_with_recompute_trains_like_single_device(tmp_path):
    """Stages, micro-batches and recompute on one device, from a generated module: the units,
    the cut between stages and the checkpointed region all run from the written code."""
    from ssdsl.codegen import Provenance, generate_rank
    from ssdsl.elaborate import elaborate_file
    from ssdsl.runtime.compiled import GeneratedRankProgram, load_module
    from ssdsl.runtime.job import JobSpec, plan_job

    plan = tmp_path / "p.ssp"
    plan.write_text("plan p()\nmicrobatch along batch into 2\nstages into 2 as st\n"
                    "assign st[0] to device 0\nassign st[1] to device 0\nrecompute h.*.mlp\n"
                    "order on device 0:\n    forward st[0] mb 0..2, forward st[1] mb 0..2,\n"
                    "    backward st[1] mb 0..2, backward st[0] mb 0..2\n")
    model = str(ROOT / "examples/gpt.py")
    # a compiled run plans on a meta trace, as `ssdsl compile` does
    (tmp_path / "rank0.py").write_text("# written below\n")
    spec = JobSpec(model, str(plan), (), dtype="float64", optimizer="sgd", lr=LR,
                   compiled=str(tmp_path))
    mf, m, full = plan_job(spec, 1)
    text = generate_rank(m, 0, Provenance.of(model, elaborate_file(str(plan), world=1)))
    assert "rt.recompute(" in text and text.count("begins") == 8
    prog = GeneratedRankProgram(m, 0, mf, full, module=load_module(text), dtype=torch.float64,
                                optimizer=OptimizerSpec("sgd", LR), groups=None)
    losses = [prog.step(step, None) for step in range(STEPS)]
    ref = run_reference(mf, steps=STEPS, dtype=torch.float64, optimizer=OptimizerSpec("sgd", LR))
    assert losses == pytest.approx(list(ref.losses), rel=1e-10)
    for qual, _region, t in prog.shards():
        assert torch.allclose(t, ref.final_state[qual], rtol=1e-10, atol=1e-12), qual
