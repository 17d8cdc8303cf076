"""3F1B (AlphaFold2 recycling, issue 11): ``examples/evoformer_recycle.py`` runs its trunk three
times per step, the first two passes detached; ``stdlib_plans/recycle_1f1b.ssp`` cuts each pass
into stages (``stages into N over calls of blocks.*``) and runs the first passes as forward-only
units, with one backward per micro-batch.

Oracles: the single-device model (``run_reference``, plain PyTorch in float64), the plain model
simulated against all ranks' programs in one process (verification before launch), and the
bubble of GPipe with recycling computed by hand: on p devices, m micro-batches, R passes with
F = 1 and B = 2, GPipe's makespan is m (R F + B) + (p - 1)(F + B) (the fill of the forwards
and the drain of the backwards), so its idle share is (p - 1)(F + B) / makespan.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ssdsl.check import check_schedule
from tests.checked_run import assert_gloo_run_matches
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch
from ssdsl.schedule.builders import gpipe_recycle, recycle_stages, three_f_one_b
from ssdsl.schedule.simulate import simulate
from ssdsl.schedule.units import Pass
from tests.test_pipeline_inprocess import _check_two_steps, _program

ROOT = Path(__file__).resolve().parent.parent
RECYCLE = ROOT / "examples" / "evoformer_recycle.py"


def test_three_passes_on_one_device_train_like_the_plain_model(tmp_path):
    prog, mf = _program(tmp_path, "plan p()\nuse recycle_1f1b(stages=1, microbatches=2)\n",
                        model=RECYCLE)
    stages = prog.m.schedule.schedule.stages
    assert stages.num_stages == 3 and stages.forward_only == {0, 1}  # only the last pass trains
    begins = [i for i in prog.program.instructions if i.kind == "begin"]
    assert {b.unit for b in begins if not b.grad} == {f"{s}F{k}" for s in (0, 1)
                                                     for k in range(2)}
    _check_two_steps(prog, mf)


def test_two_ranks_verified_against_the_plain_model():
    v = verify_before_launch(JobSpec(str(RECYCLE), "recycle_1f1b", (("microbatches", "2"),)), 2)
    assert v.verified and v.dtype == "float64"
    assert abs(v.loss - v.reference_loss) < 1e-12 and v.max_grad_error < 1e-10


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16)])
def test_3f1b_has_gpipes_bubble_with_fewer_micro_batches_alive(p, m):
    r, f, b = 3, 1.0, 2.0
    ours, theirs = simulate(three_f_one_b(p, m, r)), simulate(gpipe_recycle(p, m, r))
    check_schedule(ours.schedule)
    check_schedule(theirs.schedule)
    makespan = m * (r * f + b) + (p - 1) * (f + b)
    assert theirs.makespan == ours.makespan == makespan
    assert ours.bubble_ratio == pytest.approx((p - 1) * (f + b) / makespan)
    assert theirs.peak_activations == (m,) * p   # GPipe holds every micro-batch's last pass
    assert max(ours.peak_activations) <= (3 * p) // 2


def test_the_plan_lowers_to_the_builders_order():
    from ssdsl.elaborate import elaborate_file
    from ssdsl.schedule.lower import lower_schedule
    for p, m in [(2, 4), (4, 8)]:
        plan = elaborate_file("recycle_1f1b", world=p, sets={"microbatches": str(m)})
        g = recycle_stages(p, 3)
        lowered = lower_schedule(plan.directives, edges=g.edges, forward_only=g.forward_only)
        check_schedule(lowered.schedule)
        assert lowered.schedule.text() == three_f_one_b(p, m, 3).text()
        assert all(u.kind is Pass.F for prog in lowered.schedule.programs for u in prog.units
                   if u.stage < 2 * p)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_run_matches_the_reference(capsys, world):
    assert_gloo_run_matches(capsys, RECYCLE, "recycle_1f1b", world)


EMBEDDED = '''
import importlib.util
import torch.nn as nn
_spec = importlib.util.spec_from_file_location("_evr", {path!r})
er = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(er)
BATCH_SIZE = er.BATCH_SIZE


class WithInputEmbedding(er.RecyclingEvoformer):
    def __init__(self):
        super().__init__()
        self.embed_m = nn.Linear(er.evo.C_M, er.evo.C_M)

    def forward(self, m_in, z_in):
        return super().forward(self.embed_m(m_in), z_in)


def build_model():
    return WithInputEmbedding()


def get_batch(step, batch_size):
    return er.get_batch(step, batch_size)
'''


def test_a_trained_operator_before_the_trunk_is_named(tmp_path):
    """A trained embedding before the recycled trunk joins pass 0's first stage, which 3F1B
    orders forwards of only: the refusal names the embedding and its model line (oracle: the
    model file written here), not only the micro-batches that lack a backward."""
    from ssdsl.elaborate import elaborate_file
    from ssdsl.errors import SsdslError
    from ssdsl.runtime.job import schedule_plan
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file
    model = tmp_path / "embedded.py"
    model.write_text(EMBEDDED.format(path=str(RECYCLE)))
    graph = trace(load_model_file(model), device="meta")
    with pytest.raises(SsdslError) as info:
        schedule_plan(graph, elaborate_file("recycle_1f1b", world=2))
    err = info.value
    assert "only forwards of stage 0" in err.message and "'embed_m'" in err.message
    assert err.span.file.endswith("recycle_1f1b.ssp")
    lines = model.read_text().splitlines()
    assert err.origin is not None and "self.embed_m(m_in)" in lines[err.origin.line - 1]
