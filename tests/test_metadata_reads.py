"""Operators that read a batch-carrying tensor for its dtype and device only, or tile a bias over
the batch, under data parallelism and micro-batches (HF Mistral's sliding-window mask starts
from ``positions.new_ones(())``; BLOOM's ALiBi is ``slopes.repeat(batch, 1, 1)``). The oracle is
the plain model: one step of all ranks simulated in this process against it, in float64."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch

MODEL = str(Path(__file__).resolve().parent / "models" / "window_alibi.py")


@pytest.mark.parametrize("plan, params, world", [
    ("dp", (), 2),
    ("dp", (), 4),
    ("1f1b", (("microbatches", "4"),), 2),
    ("gpipe", (("microbatches", "2"),), 2),
    ("dp_zero", (("stage", "3"),), 2),
])
def test_window_and_alibi_train_like_the_plain_model(plan, params, world):
    v = verify_before_launch(JobSpec(MODEL, plan, params), world)
    assert v.verified and v.dtype == "float64", v
    assert abs(v.loss - v.reference_loss) <= 1e-12 * abs(v.reference_loss)
    assert v.max_grad_error < 1e-12


DP_MICROBATCHES = """plan dp_mb(dp: int = world, microbatches: int = 2)
partition all along batch into dp
use one_f_one_b(stages=1, microbatches=microbatches, width=dp)
"""


@pytest.mark.parametrize("world, microbatches", [(2, 2), (2, 4), (4, 2)])
def test_data_parallel_micro_batches_train_like_the_plain_model(tmp_path, world, microbatches):
    """Data parallelism and micro-batches together (dp_tp_1f1b's dp x pp): the mask's
    ``positions.new_ones(())``, replicated by the data split because it reads the batch for its
    dtype only, once was cut into micro-batches over the whole batch, unlike every other
    operator, and the plan was refused ("micro-batch 1 differs from micro-batch 0")."""
    plan = tmp_path / "dp_mb.ssp"
    plan.write_text(DP_MICROBATCHES)
    v = verify_before_launch(JobSpec(MODEL, str(plan), (("microbatches", str(microbatches)),)),
                             world)
    assert v.verified and v.dtype == "float64", v
    assert abs(v.loss - v.reference_loss) <= 1e-12 * abs(v.reference_loss)
    assert v.max_grad_error < 1e-12


def test_a_source_read_for_its_dtype_is_not_a_splittable_dim():
    """``ssdsl trace`` does not offer the source's dims of ``new_ones`` as splittable, and
    partitioning that one operator alone along its source's batch is refused, located."""
    from ssdsl.ops import annotate
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file

    graph = trace(load_model_file(MODEL), device="meta")
    (op,) = [o for o in graph.ops if o.kind == "new_ones"]
    ann = annotate(graph, op)
    assert ann.splittable() == []
    assert {lab.mark for lab in ann.labels().values()} <= {"ignored", "frozen"}


CAST_LIKE = str(Path(__file__).resolve().parent / "models" / "cast_like.py")


@pytest.mark.parametrize("plan, params, world", [
    ("dp", (), 2),
    ("1f1b", (("microbatches", "2"),), 2),
])
def test_casts_like_tensors_of_other_shapes_train_like_the_plain_model(plan, params, world):
    """``type_as`` / ``.to(other)`` of an ``other`` whose shape is not the output's (a 0-dim
    scale cast like a (seq, seq) table, a (1, width) bias like the hidden states): traced (the
    broadcast rule once raised IndexError on it) and trained like the plain model."""
    v = verify_before_launch(JobSpec(CAST_LIKE, plan, params), world)
    assert v.verified and v.dtype == "float64", v
    assert abs(v.loss - v.reference_loss) <= 1e-12 * abs(v.reference_loss)
    assert v.max_grad_error < 1e-12


def test_the_tensor_cast_like_is_read_for_its_dtype_only():
    """The dims of ``other`` in ``x.type_as(other)`` are ignored (any piece of them gives the same
    output) where they are not the output's own: here its rank differs from the output's."""
    from ssdsl.ops import annotate
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file

    graph = trace(load_model_file(CAST_LIKE), device="meta")
    casts = [o for o in graph.ops if o.target == "aten.type_as.default"]
    assert len(casts) == 2
    anns = {tuple(graph.tensors[o.inputs[1]].shape): annotate(graph, o) for o in casts}
    scale, bias = anns[(6, 6)], anns[(8, 6, 8)]  # a 0-dim scale; the (1, 8) bias
    for ann, rank in ((scale, 2), (bias, 3)):
        other = {f.label for d in ann.inputs[1] for f in d}
        assert len(other) == rank and other == set(ann.ignored)
        assert not other & {f.label for d in ann.outputs[0] for f in d}


def test_a_rule_that_fails_on_unforeseen_shapes_replicates_its_operator(monkeypatch):
    """An annotation rule that raises on shapes it did not foresee (as the broadcast rule did on
    ``type_as``) leaves its operator without annotation, with the target and shapes in the
    reason: data parallelism still trains like the plain model (the operator is replicated), and
    micro-batching it is refused at the plan's line, not with a traceback."""
    from ssdsl.errors import SsdslError
    from ssdsl.ops import NotAnnotated, annotate
    from ssdsl.ops import core
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file

    def unforeseen(call):
        raise IndexError("list index out of range")

    monkeypatch.setitem(core._RULES, "aten.type_as.default", unforeseen)
    graph = trace(load_model_file(CAST_LIKE), device="meta")
    op = next(o for o in graph.ops if o.target == "aten.type_as.default")
    ann = annotate(graph, op)
    assert isinstance(ann, NotAnnotated)
    assert "aten.type_as.default" in ann.reason and "IndexError" in ann.reason
    v = verify_before_launch(JobSpec(CAST_LIKE, "dp", ()), 2)
    assert v.verified and v.dtype == "float64", v
    assert abs(v.loss - v.reference_loss) <= 1e-12 * abs(v.reference_loss)
    with pytest.raises(SsdslError) as info:
        verify_before_launch(JobSpec(CAST_LIKE, "1f1b", (("microbatches", "2"),)), 2)
    assert info.value.span is not None and info.value.span.file.endswith("1f1b.ssp")
