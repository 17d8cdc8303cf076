"""Co-shard (issue 11): several parts of one operator on a device, run one after another, each
recomputed in backward (``stdlib_plans/coshard.ssp``).

Oracles: the plain single-device model in float64 (``verify_before_launch`` simulates every
rank's lowered program in this process and compares loss and gradients with ``run_reference``;
the slow tests run gloo ranks with ``--check --dtype float64 --optimizer sgd``); the plan's own
assignment (part i on device i // colocate) for the order of the parts; Megatron's analytic
communication (one all-reduce of the activation per row-parallel linear in forward).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ssdsl.cli import main
from ssdsl.elaborate import elaborate_file
from ssdsl.errors import SsdslError
from ssdsl.lower import lower_rank
from ssdsl.lower.instr import Call, RecomputeBegin, RecomputeEnd
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import JobSpec, schedule_plan
from ssdsl.runtime.preflight import verify_before_launch
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
SWIN = ROOT / "examples" / "swin.py"
SWIN_NAMES = {"blocks": "stages.*.*", "attn_out": "attn.proj", "mlp_out": "mlp.2"}
EXACT = ["--check", "--dtype", "float64", "--optimizer", "sgd", "--steps", "2", "--json"]
N_LAYER, B, T, C = 2, 8, 16, 32  # examples/gpt.py


def _sets(values: dict) -> tuple[tuple[str, str], ...]:
    return tuple((k, str(v)) for k, v in values.items())


def _materialized(plan: str, world: int, sets: dict):
    graph = trace(load_model_file(GPT), device="meta")
    t, lowered = schedule_plan(graph, elaborate_file(plan, world=world,
                                                     sets=dict(_sets(sets))))
    return materialize(t, schedule=lowered)


@pytest.mark.parametrize("world, colocate", [(1, 2), (2, 2), (1, 4)])
def test_gpt_step_matches_the_plain_model(world: int, colocate: int) -> None:
    spec = JobSpec(str(GPT), "coshard", _sets({"colocate": colocate}))
    v = verify_before_launch(spec, world)
    assert v.verified, v.reason
    assert v.dtype == "float64" and v.max_grad_error < 1e-10
    assert abs(v.loss - v.reference_loss) < 1e-12


@pytest.mark.slow
def test_swin_step_matches_the_plain_model() -> None:
    v = verify_before_launch(JobSpec(str(SWIN), "coshard", _sets(SWIN_NAMES)), 2)
    assert v.verified, v.reason
    assert v.max_grad_error < 1e-10


def test_replicas_sharing_a_device_count_once() -> None:
    # two replicas of every operator on device 0: each weight read counts half its gradient
    plan = ROOT / "tests" / "plans" / "coshard_replicas.ssp"
    v = verify_before_launch(JobSpec(str(GPT), str(plan)), 2)
    assert v.verified, v.reason
    assert v.max_grad_error < 1e-10


def test_parts_run_one_after_another_each_recomputed() -> None:
    m = _materialized("coshard", 2, {"colocate": 2})
    for rank in (0, 1):
        mine = {(2 * rank,), (2 * rank + 1,)}  # part i on device i // colocate
        prog = lower_rank(m, rank).instructions
        attn = [i for i in prog if isinstance(i, Call) and "attn" in
                (m.transformed.graph.op(i.op).module or "") and "h.0." in
                (m.transformed.graph.op(i.op).module or "") + "."]
        assert {c.part for c in attn} == mine
        # part-major: every call of the first part before any call of the second
        order = [c.part for c in attn]
        first = order.index(max(mine))
        assert set(order[:first]) == {min(mine)} and set(order[first:]) == {max(mine)}
        # each recomputed region holds the calls of one part only
        region: list | None = None
        regions = 0
        for ins in prog:
            if isinstance(ins, RecomputeBegin):
                region = []
            elif isinstance(ins, RecomputeEnd):
                assert len({c.part for c in region}) == 1, region
                regions += 1
                region = None
            elif isinstance(ins, Call) and region is not None:
                region.append(ins)
        assert regions == N_LAYER * 2 * 2  # (attn, mlp) x parts per device, per block


def test_communication_is_megatrons() -> None:
    # a device adds its parts' partial sums, then one all-reduce per row-parallel linear
    acc = _materialized("coshard", 2, {"colocate": 2}).accounting()
    per = 2 * (2 - 1) * B * T * C * 4  # bandwidth-optimal all-reduce of one float32 activation
    assert acc["forward"] == {"all_reduce": {"count": 2 * N_LAYER, "bytes": 2 * N_LAYER * per}}
    assert acc["backward"]["all_reduce"]["count"] == 2 * N_LAYER
    mega = _materialized("megatron_tp", 2, {}).accounting()
    assert acc["forward"] == mega["forward"] and acc["backward"] == mega["backward"]


def _error(plan: str, world: int, sets: dict) -> SsdslError:
    with pytest.raises(SsdslError) as info:
        _materialized(plan, world, sets)
    err = info.value
    return getattr(err, "errors", [err])[0]


def test_colocate_that_does_not_divide_the_heads_is_located() -> None:
    err = _error("coshard", 2, {"colocate": 4})  # 4 heads into 2 x 4 parts
    assert type(err).__name__ == "IndivisibleError"
    assert err.span.file.endswith("coshard.ssp") and (err.span.line, err.span.column) == (18, 1)
    assert "heads" in err.message and "8 parts" in err.message


def test_colocate_below_one_is_refused_at_its_require() -> None:
    err = _error("coshard", 2, {"colocate": 0})
    assert err.span.file.endswith("coshard.ssp") and err.span.line == 16
    assert "colocate" in err.message


def test_coshard_with_micro_batches_is_refused_at_the_assign(tmp_path) -> None:
    plan = tmp_path / "p.ssp"
    plan.write_text("plan p()\nmicrobatch along batch into 2\nuse coshard(tp=2)\n")
    err = _error(str(plan), 2, {})
    assert type(err).__name__ == "UnsupportedPlacement"
    assert err.span.file.endswith("coshard.ssp") and err.span.line == 23
    assert "micro-batches" in err.message


@pytest.mark.slow
@pytest.mark.parametrize("model, names", [(GPT, {}), (SWIN, SWIN_NAMES)],
                         ids=["gpt", "swin"])
def test_gloo_ranks_match_the_plain_model(capsys, model: Path, names: dict) -> None:
    sets = [x for k, v in names.items() for x in ("--set", f"{k}={v}")]
    code = main(["run", str(model), "coshard", "--nproc", "2", "--set", "colocate=2", *sets,
                 *EXACT])
    out = json.loads(capsys.readouterr().out)
    assert out["check"]["ok"], out["check"]
    assert max(out["check"]["loss_errors"]) < 1e-12
    assert code == 0


LLAMA_NAMES = {"blocks": "lm.model.layers.*", "attn": "self_attn", "attn_out": "self_attn.o_proj",
               "mlp": "mlp", "mlp_out": "mlp.down_proj"}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed")
def test_hf_llama_on_one_device_matches_the_plain_model() -> None:
    # its 2 key/value heads allow tp * colocate = 2: both parts on the one device. Planned in
    # float64, so the plan keeps LLaMA's own float32 casts (RMSNorm) and the simulated step
    # computes exactly where the plain model does: agreement to float64 rounding.
    spec = JobSpec(str(ROOT / "examples" / "hf_llama.py"), "coshard",
                   _sets({**LLAMA_NAMES, "colocate": 2}), dtype="float64")
    v = verify_before_launch(spec, 1)
    assert v.verified, v.reason
    assert v.max_grad_error < 1e-10


def test_the_checker_reads_the_parts_order() -> None:
    # the second part's first call moved before everything: it reads a value not made yet
    import attrs

    from ssdsl.check.program import UndefinedValue, check_programs
    from ssdsl.lower import lower_plan

    m = _materialized("coshard", 2, {"colocate": 2})
    programs = list(lower_plan(m).programs)
    check_programs(programs, m=m)  # as lowered
    ins = list(programs[0].instructions)
    i = next(k for k, x in enumerate(ins) if isinstance(x, Call) and x.part == (1,)
             and any("~1@" in v for v in x.outs))
    ins.insert(1, ins.pop(i))
    programs[0] = attrs.evolve(programs[0], instructions=tuple(ins))
    with pytest.raises(UndefinedValue):
        check_programs(programs, m=m)


def test_parts_that_communicate_between_them_run_operator_by_operator() -> None:
    # c_proj along out reads the whole hidden dim: an all-gather between the co-sharded linears
    plan = ROOT / "tests" / "plans" / "coshard_gathered.ssp"
    v = verify_before_launch(JobSpec(str(GPT), str(plan)), 2)
    assert v.verified, v.reason
    assert v.max_grad_error < 1e-10
    graph = trace(load_model_file(GPT), device="meta")
    t, lowered = schedule_plan(graph, elaborate_file(str(plan), world=2))
    prog = lower_rank(materialize(t, schedule=lowered), 0).instructions
    fc = [i.part for i in prog if isinstance(i, Call) and i.op in ("linear_2", "linear_3")]
    assert fc == [(0,), (1,), (0,), (1,)]  # operator-major: both parts of c_fc, then c_proj's
