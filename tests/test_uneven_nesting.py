"""Copies of a weight whose regions overlap without being equal: a partition nested in one part
of a data-parallel split (``partition part 0 of layers.1 along out into 2`` after ``partition
all along batch into 2``) leaves layers.1 whole on one device and in halves on two others.

The rule: the weight is cut into the pieces on which the set of holders is constant, and the
gradient of each piece that several devices hold is summed over exactly those devices. The
expectations below are the holder sets written out by hand from the plan text (rows 0:32 of
layers.1 are held by devices 0 and 1, rows 32:64 by devices 1 and 2); the runs' oracle is the
single-device model (``--check`` in float64 with plain SGD). A plan whose pieces this runtime
cannot sum is refused at its line."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from ssdsl.check import check_programs
from ssdsl.check.program import GradientNotSummed
from ssdsl.cli import main
from ssdsl.ir.region import Region
from ssdsl.lower import lower_plan
from ssdsl.materialize.reducer import GradReducer, Weight, holder_pieces, plan_grad_reducer
from ssdsl.runtime import adapters
from ssdsl.runtime.job import JobSpec, plan_job
from tests.checked_run import assert_gloo_run_matches

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "mlp.py"
HAND = Path(__file__).parent / "plans" / "hand"
W1, B1 = "p_model_layers_1_weight", "p_model_layers_1_bias"  # layers.1 of the MLP: 64 x 64


def _rows(lo: int, hi: int, shape=(64, 64)) -> Region:
    return Region.box(shape, [(lo, hi), *[(0, s) for s in shape[1:]]])


def _summed(m, name: str) -> dict[tuple, set[int]]:
    """The reducer's sums of ``name``: region intervals -> the devices it is summed over."""
    out: dict[tuple, set[int]] = {}
    for b in m.reducer.buckets:
        for n, region in b.entries:
            if n == name:
                assert region.intervals not in out, f"{region!r} summed twice"
                out[region.intervals] = set(b.devices)
    return out


@pytest.fixture(scope="module")
def nested():
    return plan_job(JobSpec(str(MLP), str(HAND / "nested_uneven_dp_tp.ssp"), dtype="float64"),
                    3)[1]


# -- the pieces and their holders --------------------------------------------------------------

def test_holder_pieces_of_the_nested_plan_by_hand():
    full, top, bottom = _rows(0, 64), _rows(0, 32), _rows(32, 64)
    got = holder_pieces([(1, full), (0, top), (2, bottom)])
    assert [(r.intervals, devs) for r, devs in got] == [
        ((((0, 32),), ((0, 64),)), (0, 1)), ((((32, 64),), ((0, 64),)), (1, 2))]


def test_holder_pieces_of_rows_against_columns():
    """Row halves on devices 0, 2 and column halves on 1, 3: each quadrant has its own pair."""
    s = (4, 4)
    rows = [Region.box(s, [(0, 2), (0, 4)]), Region.box(s, [(2, 4), (0, 4)])]
    cols = [Region.box(s, [(0, 4), (0, 2)]), Region.box(s, [(0, 4), (2, 4)])]
    got = {r.intervals: devs for r, devs in
           holder_pieces([(0, rows[0]), (2, rows[1]), (1, cols[0]), (3, cols[1])])}
    assert got == {(((0, 2),), ((0, 2),)): (0, 1), (((0, 2),), ((2, 4),)): (0, 3),
                   (((2, 4),), ((0, 2),)): (1, 2), (((2, 4),), ((2, 4),)): (2, 3)}


def test_holder_pieces_merge_only_where_the_holders_agree():
    """Whole on 0, rows 0:2 on 1, rows 2:4 of nothing else: rows 2:4 held by 0 alone."""
    got = holder_pieces([(0, _rows(0, 4, (4, 3))), (1, _rows(0, 2, (4, 3)))])
    assert [(r.intervals, devs) for r, devs in got] == [
        ((((0, 2),), ((0, 3),)), (0, 1)), ((((2, 4),), ((0, 3),)), (0,))]


def test_the_nested_plan_sums_each_row_half_over_its_holders(nested):
    """The defect: layers.1 (whole on 1, row halves on 0 and 2) was in no bucket at all."""
    assert _summed(nested, W1) == {(((0, 32),), ((0, 64),)): {0, 1},
                                   (((32, 64),), ((0, 64),)): {1, 2}}
    assert _summed(nested, B1) == {(((0, 32),),): {0, 1}, (((32, 64),),): {1, 2}}
    # the weights split evenly keep their one bucket over the data-parallel pair
    assert _summed(nested, "p_model_layers_2_weight") == {(((0, 64),), ((0, 64),)): {0, 1}}
    # every read counts once (no replicate above it)
    assert {u.scale for u in nested.sources.values()} == {1.0}


def test_slices_of_a_leaf_are_reduced_into_it():
    """The reduce handlers on leaves larger than the bucket's entries (device 1's whole
    weight): each slice is summed with the other holder's and written back in place."""
    full, top, bottom = _rows(0, 4, (4, 3)), _rows(0, 2, (4, 3)), _rows(2, 4, (4, 3))
    red = plan_grad_reducer([Weight("w", (4, 3), torch.float64, ((0, top), (1, top)),
                                    sliced=True),
                             Weight("w", (4, 3), torch.float64, ((1, bottom), (2, bottom)),
                                    sliced=True)])
    grads = {d: torch.arange(12, dtype=torch.float64).view(4, 3) * (d + 1) for d in range(3)}
    sim = {0: {("w", top): top.slice_of(grads[0]).clone()},
           1: {("w", full): grads[1].clone()},
           2: {("w", bottom): bottom.slice_of(grads[2]).clone()}}
    adapters.reduce_gradients(red, 0, {}, simulate=sim)
    want = torch.cat([grads[0][:2] + grads[1][:2], grads[1][2:] + grads[2][2:]])
    torch.testing.assert_close(sim[1][("w", full)], want)
    torch.testing.assert_close(sim[0][("w", top)], want[:2])
    torch.testing.assert_close(sim[2][("w", bottom)], want[2:])


# -- the program check: a piece held by several ranks and summed by none -------------------------

def test_the_program_check_flags_a_piece_summed_nowhere(nested):
    """Defense in depth: the same plan with the reducer's old answer (no bucket for layers.1)
    lowers to programs that the program check refuses at a plan line."""
    check_programs(lower_plan(nested).programs, m=nested)  # the fixed reducer passes
    old = GradReducer(tuple(b for b in nested.reducer.buckets
                            if all(n not in (W1, B1) for n, _ in b.entries)))
    broken = attrs.evolve(nested, reducer=old)
    with pytest.raises(GradientNotSummed) as err:
        check_programs(lower_plan(broken).programs, m=broken)
    assert err.value.span is not None and err.value.span.file.endswith(
        "nested_uneven_dp_tp.ssp")
    assert "layers_1" in err.value.message


# -- refused at the plan's line ----------------------------------------------------------------

@pytest.mark.parametrize("plan, world, line, words", [
    # device 3 holds the whole weight and one quarter of it: two overlapping leaves
    ("nested_uneven_overlap_on_one_device", 4, 5, "two overlapping but different regions"),
    # ZeRO cannot shard a gradient reduced as slices of larger leaves
    ("nested_uneven_zero_bad", 3, 7, "ZeRO cannot shard"),
])
def test_refused_at_its_line(capsys, plan, world, line, words):
    code = main(["check", str(MLP), str(HAND / f"{plan}.ssp"), "--world", str(world)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{plan}.ssp:{line}:" in err and words in err, err
    assert "Traceback" not in err


# -- end to end on gloo ranks against the single-device model -----------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("plan, world", [
    ("nested_uneven_dp_tp", 3),  # row halves on 0 and 2, whole on 1
    ("nested_uneven_three_way", 4),  # rows 0:32 on 0, 32:48 on 2, 48:64 on 3, whole on 1
    ("nested_uneven_in", 3),  # column halves (split along in)
    ("nested_uneven_cross", 4),  # row halves on 0, 2 against column halves on 1, 3
    ("nested_uneven_microbatch", 3),
    ("nested_uneven_coshard", 2),  # both row halves on device 0, whole on 1
    ("nested_uneven_zero_other", 3),  # ZeRO on an evenly split weight beside the nest
])
def test_uneven_nesting_matches_the_plain_model(capsys, plan, world):
    assert_gloo_run_matches(capsys, MLP, str(HAND / f"{plan}.ssp"), world)


@pytest.mark.slow
def test_uneven_nesting_of_a_gpt_mlp_matches_the_plain_model(capsys):
    """h.0's MLP split Megatron-style (c_fc along out, c_proj along in) in batch part 0 only:
    its weights and c_fc's bias held unevenly (c_fc's rows 64:128 summed over devices 1 and 2,
    c_proj's columns 64:128 likewise); c_proj's bias, added by its first value part only, is an
    equal copy on devices 0 and 1."""
    assert_gloo_run_matches(capsys, ROOT / "examples" / "gpt.py",
                            str(HAND / "nested_uneven_gpt_mlp.ssp"), 3)


# -- the slices reduced in parts during the last backward (``ssdsl.runtime.overlap``) -----------

LEVERS = {"ssdsl.lower.overlap:PART_BYTES": 2048, "ssdsl.lower.overlap:REST_PART_BYTES": 2048}


def overlap_worker(plan: str, steps: int) -> tuple[list[float], dict, dict]:
    """One rank with buckets cut into 2 KiB parts: its losses, full parameters and counts."""
    import importlib

    import ssdsl
    from ssdsl.trace.model_file import load_model_file

    for where, value in LEVERS.items():
        module, attr = where.split(":")
        setattr(importlib.import_module(module), attr, value)
    mf = load_model_file(str(MLP))
    pm = ssdsl.parallelize(str(MLP), plan, optimizer="sgd", lr=0.05, dtype="float64",
                           verify=False)
    losses = [pm.train_step(*mf.get_batch(s, mf.batch_size)) for s in range(steps)]
    return losses, pm.full_state_dict(), dict(pm._program.runner.counts)


def _plain_sgd(steps: int, lr: float) -> tuple[list[float], dict]:
    """``tests.plain_reference.plain_sgd`` with the MLP's float inputs in float64 too."""
    from tests.plain_reference import plain_sgd
    return plain_sgd(str(MLP), steps, lr, float_inputs=True)


@pytest.mark.slow
def test_slices_reduced_in_parts_during_the_backward_match():
    from ssdsl.runtime.launch import launch
    from tests.plain_reference import assert_trains_like

    per_rank = launch(overlap_worker, nproc=3, args=(str(HAND / "nested_uneven_dp_tp.ssp"), 3),
                      timeout_s=300)
    want = _plain_sgd(3, 0.05)
    for losses, state, _ in per_rank:
        assert_trains_like(losses, state, want)
    # device 1 reduced its slices of layers.1 in parts (else this would test nothing)
    assert per_rank[1][2]["parts_overlapped"] >= 3 * 2
