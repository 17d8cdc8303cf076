"""User-written losses and layers the tracer once refused or crashed on.

- A BCE whose ``pos_weight`` / ``weight`` is smaller than the logits (``(C,)`` or ``(1, C)``,
  broadcast inside ``binary_cross_entropy_with_logits``) crashed the flowing names with
  ``KeyError: ('full', 1)``: the loss's rule read every input at the logits' shape. It now reads
  each at its own, broadcast as torch broadcasts (``ssdsl.ops.loss``). Oracles: the plain model (the graph's loss and
  gradients; one step of all ranks simulated in float64) and the shapes by hand.
- ``nn.LSTM(..., dropout=0.0)`` was refused as drawing random numbers: ``aten.lstm`` is tagged
  ``nondeterministic_seeded``, but it drops out only between layers, when ``dropout > 0`` and
  ``train``. Oracle: running the layer twice under different seeds (it draws random numbers
  exactly when the two results differ).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from ssdsl.ir.interpret import run_graph
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch
from ssdsl.trace import trace
from ssdsl.trace.export import graph_from_export
from ssdsl.trace.model_file import load_model_file
from ssdsl.trace.trial import random_operators

MODELS = Path(__file__).resolve().parent / "models"
POS_WEIGHT = str(MODELS / "bce_pos_weight.py")    # full((C,)) against (batch, seq, C)
DERIVED = str(MODELS / "bce_derived_weight.py")   # ones_like(logits[0]) * 3 and a (1, C) weight
LSTM = str(MODELS / "lstm_lm.py")


def _traced(path: str):
    mf = load_model_file(path)
    model = mf.build(seed=0).double()
    return mf, model, trace(mf, device="cpu", model=model)


@pytest.mark.parametrize("path, weights", [
    (POS_WEIGHT, {"pos_weight": (16,)}),
    (DERIVED, {"weight": (1, 16), "pos_weight": (16,)}),
])
def test_bce_reads_its_broadcast_weights_at_their_own_shapes(path, weights):
    """The loss's annotation reads every input at the shape that input has in the graph (the
    crash was a weight read at the logits' rank, right-aligned broadcasting as torch does).
    Each weight the model file makes (shapes read off it by hand) reaches the loss at its own
    shape, and its class dim is the logits' class dim."""
    from ssdsl.ops import annotate

    _, _, graph = _traced(path)
    (bce,) = [op for op in graph.ops if op.kind == "binary_cross_entropy_with_logits"]
    ann = annotate(graph, bce)
    for name, sig in zip(bce.inputs, ann.inputs):
        assert tuple(math.prod(f.size for f in d) for d in sig) == graph.tensors[name].shape
    logits = graph.tensors[bce.inputs[0]]
    assert logits.dim_names[0] == "batch"
    if path == POS_WEIGHT:
        assert logits.dim_names[:2] == ("batch", "seq")
    read = _bce_weights(bce)
    assert set(read) == set(weights)
    for key, shape in weights.items():
        made = graph.tensors[read[key]]
        assert made.shape == shape
        assert made.dim_names[-1] == logits.dim_names[-1]
        # the class label of the weight is the logits' (a split of the classes splits both)
        slot = bce.inputs.index(read[key])
        assert ann.inputs[slot][-1] == ann.inputs[0][-1]


def _bce_weights(bce) -> dict[str, str]:
    """The tensors ``binary_cross_entropy_with_logits(x, t, weight, pos_weight)`` weighs by."""
    given = dict(zip(("weight", "pos_weight"), bce.args[2:4]))
    given.update((k, v) for k, v in bce.kwargs if k in ("weight", "pos_weight"))
    return {k: v.name for k, v in given.items() if v is not None}


@pytest.mark.parametrize("path", [POS_WEIGHT, DERIVED])
def test_bce_graph_equals_the_model(path):
    mf, model, graph = _traced(path)
    inputs, target = mf.get_batch(0)
    inputs = tuple(x.double() for x in inputs)
    target = target.double()
    want = mf.loss(model(*inputs), target)
    want.backward()
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    got = run_graph(graph, params, (*inputs, target))
    got.backward()
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-12 * abs(float(want.detach()))
    for n, p in model.named_parameters():
        assert torch.allclose(params[n].grad, p.grad, atol=1e-12), n


@pytest.mark.parametrize("path, plan, params, world", [
    (POS_WEIGHT, "dp", (), 2),
    (DERIVED, "dp", (), 2),
    (POS_WEIGHT, "1f1b", (("microbatches", "2"),), 2),
])
def test_bce_with_broadcast_weights_trains_like_the_plain_model(path, plan, params, world):
    v = verify_before_launch(JobSpec(path, plan, params), world)
    assert v.verified and v.dtype == "float64", v
    assert abs(v.loss - v.reference_loss) <= 1e-12 * abs(v.reference_loss)
    assert v.max_grad_error < 1e-12


def _draws_random_numbers(layer: nn.Module, x: torch.Tensor) -> bool:
    """The oracle: the layer's output depends on the seed."""
    outs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            outs.append(layer(x)[0])
    return not torch.equal(*outs)


class _Layer(nn.Module):
    def __init__(self, cls, layers: int, dropout: float) -> None:
        super().__init__()
        self.rnn = cls(8, 8, num_layers=layers, dropout=dropout, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0].sum()


@pytest.mark.filterwarnings("ignore:dropout option adds dropout after all but last")
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("layers, dropout, training", [
    (1, 0.0, True), (2, 0.0, True), (1, 0.5, True), (2, 0.5, True), (2, 0.5, False)])
def test_a_recurrent_layer_is_random_only_when_it_drops_out(cls, layers, dropout, training):
    torch.manual_seed(0)
    model = _Layer(cls, layers, dropout).train(training)
    x = torch.randn(2, 5, 8)
    expected = _draws_random_numbers(model.rnn, x)
    assert expected == (layers > 1 and dropout > 0 and training)  # the schema's semantics
    ep = torch.export.export(model, (x,), strict=False)
    graph = graph_from_export(ep)
    kinds = {op.kind for op in graph.ops}
    assert kinds & {"lstm", "gru", "rnn_tanh"}, kinds
    assert bool(random_operators(graph)) == expected


def test_an_lstm_without_dropout_trains_like_the_plain_model():
    v = verify_before_launch(JobSpec(LSTM, "dp", ()), 2)
    assert v.verified and v.dtype == "float64", v
    assert abs(v.loss - v.reference_loss) <= 1e-12 * abs(v.reference_loss)
    assert v.max_grad_error < 1e-12


def test_tracing_an_lstm_says_nothing_of_torchs_own_weight_list():
    """torch.export warns that ``nn.LSTM._flat_weights`` (rebuilt by the layer's own forward)
    was assigned during export: torch's internals, not the user's; the tracer drops that one
    warning and no other."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trace(load_model_file(LSTM), device="meta")
    assert not [w for w in seen if "_flat_weights" in str(w.message)]
    with warnings.catch_warnings(record=True) as seen:  # torch does warn without the filter
        warnings.simplefilter("always")
        model = load_model_file(LSTM).build(seed=0)
        mf = load_model_file(LSTM)
        inputs, target = mf.get_batch(0, mf.batch_size)
        torch.export.export(model, tuple(inputs), strict=False)
    assert [w for w in seen if "_flat_weights" in str(w.message)]
