"""Plan-independent loop pieces: optimizer spec, sharded optimizer steps, metrics, live view, JSON,
and a hand-written data-parallel loop on 2 launched ranks checked against the reference.

Oracles: torch.optim on the whole tensor (for shard updates), /proc/self/status (for peak memory),
and ``run_reference`` on one device (for the 2-rank loop, itself tested against a plain loop).
"""

from __future__ import annotations

import inspect

import io
import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ssdsl.runtime.dist import all_gather_objects, distributed
from ssdsl.runtime.launch import launch, report_event
from ssdsl.runtime.reference import RunRecord, compare_runs, run_reference, to_dtype, tolerance_for
from ssdsl.runtime.progress import LiveProgress
from ssdsl.runtime.train import (MetricsCollector, OptimizerSpec, RunResult,
                                 StepMetrics, UnknownOptimizer, build_optimizer, human_bytes,
                                 model_lr)
from ssdsl.trace.model_file import load_model_file

MODEL = textwrap.dedent('''
    import torch
    from torch import nn

    BATCH_SIZE = 8

    def build_model():
        return nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 3))

    def get_batch(step, batch_size):
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, 4, generator=g), torch.randint(0, 3, (batch_size,), generator=g)

    def make_optimizer(params):
        return torch.optim.Adam(params, lr=0.05, betas=(0.8, 0.9))
''')

NO_OPT_MODEL = textwrap.dedent('''
    import torch
    def build_model():
        return torch.nn.Linear(2, 2)
    def get_batch(step, batch_size):
        return torch.zeros(batch_size, 2), torch.zeros(batch_size, dtype=torch.long)
''')


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("train") / "tiny.py"
    path.write_text(MODEL)
    return path


@pytest.fixture(scope="module")
def mf(model_path):
    return load_model_file(model_path)


def test_optimizer_spec_takes_the_model_files_learning_rate(mf, tmp_path):
    params = [torch.nn.Parameter(torch.ones(2))]
    sgd = build_optimizer(OptimizerSpec("sgd"), mf, params)
    assert type(sgd) is torch.optim.SGD
    assert sgd.param_groups[0]["lr"] == 0.05 and sgd.param_groups[0]["momentum"] == 0
    adamw = build_optimizer(OptimizerSpec("adamw"), mf, params)
    assert type(adamw) is torch.optim.AdamW and adamw.param_groups[0]["lr"] == 0.05
    own = build_optimizer(OptimizerSpec("model"), mf, params)
    assert type(own) is torch.optim.Adam and own.param_groups[0]["betas"] == (0.8, 0.9)
    assert build_optimizer(OptimizerSpec("sgd", lr=0.3), mf, params).param_groups[0]["lr"] == 0.3
    plain = tmp_path / "plain.py"
    plain.write_text(NO_OPT_MODEL)
    assert model_lr(load_model_file(plain)) == 0.01
    # a model file whose optimizer is SGD: --optimizer adamw takes AdamW's own default rate (an
    # SGD rate is a step in gradient units, AdamW's in parameter units); --optimizer sgd its own
    adamw_plain = build_optimizer(OptimizerSpec("adamw"), load_model_file(plain), params)
    assert adamw_plain.param_groups[0]["lr"] == \
        inspect.signature(torch.optim.AdamW).parameters["lr"].default
    assert build_optimizer(OptimizerSpec("sgd"), load_model_file(plain),
                           params).param_groups[0]["lr"] == 0.01
    with pytest.raises(UnknownOptimizer, match="unknown optimizer 'lamb'"):
        OptimizerSpec("lamb")


def test_lr_sets_the_rate_of_the_model_files_own_optimizer(mf):
    """``--lr`` with ``--optimizer model`` (the default) is the rate of every group of the model
    file's optimizer, its other settings kept (it was ignored without a word). Oracle: the same
    Adam made by hand with that rate, trained alongside on the same batches."""
    own = build_optimizer(OptimizerSpec("model", lr=0.2), mf, [torch.nn.Parameter(torch.ones(2))])
    assert type(own) is torch.optim.Adam
    assert own.param_groups[0]["lr"] == 0.2 and own.param_groups[0]["betas"] == (0.8, 0.9)
    record = run_reference(mf, steps=3, dtype=torch.float64, optimizer=OptimizerSpec("model", 0.2))
    model = mf.build(seed=0).to(torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=0.2, betas=(0.8, 0.9))
    losses = []
    for step in range(3):
        inputs, y = mf.get_batch(step, 8)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(*(x.double() for x in inputs)), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert record.losses == pytest.approx(losses, rel=1e-12)
    default = run_reference(mf, steps=3, dtype=torch.float64, optimizer=OptimizerSpec("model"))
    assert default.losses[2] != pytest.approx(losses[2], rel=1e-6)  # the rate made a difference


@pytest.mark.parametrize("kind", ["model", "sgd", "adamw"])
def test_optimizer_on_shards_equals_the_whole_tensor_update(mf, kind):
    torch.manual_seed(0)
    full = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    shards = [torch.nn.Parameter(full.detach()[i * 2:(i + 1) * 2].clone()) for i in range(3)]
    oracle = {"model": lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.8, 0.9)),
              "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
              "adamw": lambda p: torch.optim.AdamW(p, lr=0.05)}[kind]([full])
    local = [build_optimizer(OptimizerSpec(kind), mf, [s]) for s in shards]
    for step in range(3):
        grad = torch.randn(6, 4, dtype=torch.float64)
        full.grad = grad
        oracle.step()
        for i, (s, opt) in enumerate(zip(shards, local)):
            s.grad = grad[i * 2:(i + 1) * 2].clone()
            opt.step()
    assert torch.equal(torch.cat([s.detach() for s in shards]), full.detach())


def _proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def test_metrics_time_steps_and_read_peak_memory():
    metrics = MetricsCollector(rank=3, samples_per_step=16, device=torch.device("cpu"))
    with pytest.raises(RuntimeError):
        metrics.end(0, loss=1.0)
    # Enough to lift the high-water mark by ~128 MiB above whatever it was.
    extra = _proc_status_bytes("VmHWM") - _proc_status_bytes("VmRSS") + 128 * 2**20
    old_peak = _proc_status_bytes("VmHWM")
    for step in range(4):
        metrics.begin()
        big = torch.ones(extra // 4) if step == 1 else None  # touched by ones()
        m = metrics.end(step, loss=float(step), comm_bytes=100 * step)
        del big
    assert m.rank == 3 and m.step == 3
    assert m.samples_per_s == pytest.approx(16 / m.step_s)
    # ru_maxrss and /proc's VmHWM read the same kernel counter.
    assert abs(m.peak_memory_bytes - _proc_status_bytes("VmHWM")) < 8 * 2**20
    assert m.peak_memory_bytes > old_peak + 100 * 2**20
    summary = metrics.summary(warmup=1)
    assert summary.steps == 4 and summary.comm_bytes_per_step == 150.0
    assert summary.median_step_s == sorted(h.step_s for h in metrics.history[1:])[1]


def test_live_view_shows_a_row_per_rank():
    from rich.console import Console

    console = Console(file=io.StringIO(), width=100, force_terminal=False)
    with LiveProgress(nproc=2, steps=10, title="t", console=console) as view:
        view.on_event(1, StepMetrics(1, 4, 2.5, 0.1, 80.0, 3 * 2**20, 512 * 2**20))
        view.on_event(0, {"not": "metrics"})
        out = _render_text(view.render())
    assert "5/10" in out and "2.5" in out and "3.0 MiB" in out and "512.0 MiB" in out
    assert "starting" in out  # rank 0 has reported nothing yet
    assert "2.5000" in out and "100.0" in out  # loss and ms/step of rank 1
    assert human_bytes(512) == "512 B" and human_bytes(3 * 2**30) == "3.0 GiB"


def _render_text(renderable) -> str:
    from rich.console import Console
    console = Console(file=io.StringIO(), width=120)
    console.print(renderable)
    return console.file.getvalue()


def test_run_result_json_shape():
    ref = RunRecord((1.0, 0.5), {"w": torch.ones(2)})
    verdict = compare_runs(ref, ref, tolerance=tolerance_for(torch.float32))
    result = RunResult(model="m.py", plan="dp", nproc=2, steps=2, batch_size=8, seed=0,
                       dtype="float32", optimizer="sgd", losses=(1.0, 0.5), ranks=(),
                       check=verdict.as_dict())
    data = json.loads(result.to_json())
    assert data["ok"] is True and data["losses"] == [1.0, 0.5]
    assert data["check"]["worst"][0]["what"] == "loss"


# ----------------------------------------------------------------- 2 ranks against the reference

def data_parallel_worker(model_path: str, steps: int) -> dict:
    """A hand-written data-parallel loop: each rank takes half the batch, gradients are averaged."""
    mf = load_model_file(model_path)
    with distributed(timeout_s=30) as ctx:
        model = mf.build(seed=0).double()
        opt = build_optimizer(OptimizerSpec("sgd"), mf, model.parameters())
        metrics = MetricsCollector(rank=ctx.rank, samples_per_step=mf.batch_size,
                                   device=ctx.device)
        losses = []
        for step in range(steps):
            metrics.begin()
            inputs, target = mf.get_batch(step, mf.batch_size)
            half = mf.batch_size // ctx.world_size
            rows = slice(ctx.rank * half, (ctx.rank + 1) * half)
            x = to_dtype(inputs, torch.float64)[0][rows]
            opt.zero_grad()
            loss = mf.loss(model(x), target[rows])
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ctx.world_size
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / ctx.world_size)
            report_event(metrics.end(step, loss=losses[-1],
                                     comm_bytes=sum(p.numel() * 8 for p in model.parameters())))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {"losses": losses, "state": state, "ranks": all_gather_objects(ctx.rank)}


@pytest.mark.slow
def test_two_rank_data_parallel_loop_matches_the_reference(mf, model_path):
    events: list[StepMetrics] = []
    results = launch(data_parallel_worker, nproc=2, args=(str(model_path), 3),
                     on_event=lambda rank, m: events.append(m), timeout_s=120)
    assert [r["ranks"] for r in results] == [[0, 1], [0, 1]]
    assert sorted((m.rank, m.step) for m in events) == [(r, s) for r in (0, 1) for s in range(3)]
    ref = run_reference(mf, steps=3, dtype=torch.float64, optimizer=OptimizerSpec("sgd"))
    for r in results:
        actual = RunRecord(tuple(r["losses"]), r["state"])
        verdict = compare_runs(ref, actual,
                               tolerance=tolerance_for(torch.float64, reordered_sums=True))
        assert verdict.ok, verdict.summary()
    # A perturbation of 1e-8 in one weight, far below float32 noise, is caught in float64.
    wrong = {k: v.clone() for k, v in results[0]["state"].items()}
    wrong["0.weight"] += 1e-8
    verdict = compare_runs(ref, RunRecord(tuple(results[0]["losses"]), wrong),
                           tolerance=tolerance_for(torch.float64))
    assert not verdict.ok
    assert any(m.where == "0.weight" and not m.ok for m in verdict.worst)
