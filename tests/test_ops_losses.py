"""torch's other losses split along the batch: KL divergence, binary cross-entropy on
probabilities, Huber, soft margin, hinge embedding, margin ranking, Poisson NLL (one term per
element), and cosine embedding, triplet margin and multi-margin (one term per sample over its
features). Without annotations each was refused under micro-batches ("cannot be split itself")
and ran whole behind an all-gather under data parallelism.

Oracles: PyTorch's op on the whole tensors (``tests.test_ops_oracle.check_parts``: the parts'
calls on slices combined, forward and gradients, float64), and the plain single-device model
(``verify_before_launch`` simulates every rank of one step in float64 against it)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from ssdsl.cli import main
from ssdsl.ops import FrozenDimError
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch
from tests.test_ops_oracle import annotated_sample, check_equal_splits, constant

D = torch.float64
MEAN, SUM, NONE = 1, 2, 0


def r(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 13 * sum(shape))
    return torch.randn(shape, generator=g, dtype=D)


def prob(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.sigmoid(r(*shape, seed=seed)) * 0.9 + 0.05


def sign(*shape: int, seed: int = 0) -> torch.Tensor:
    """Labels of +-1 (no loss takes a gradient for them)."""
    return constant(torch.where(r(*shape, seed=seed) > 0, 1.0, -1.0).to(D))


def classes(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(high + 1))


# target -> [(args, kwargs, the labels the annotation must offer to split)]
SAMPLES: dict[str, list] = {
    "aten.kl_div.default": [
        ([r(8, 6), prob(8, 6, seed=1)], {}, ["d0", "d1"]),                   # mean of elements
        ([r(8, 6), r(8, 6, seed=1), SUM], {"log_target": True}, ["d0", "d1"]),
        ([r(8, 6), prob(8, 6, seed=1), NONE], {}, ["d0", "d1"]),
    ],
    "aten.binary_cross_entropy.default": [
        ([prob(8, 6), prob(8, 6, seed=1)], {}, ["d0", "d1"]),
        ([prob(8, 6), prob(8, 6, seed=1), constant(prob(6, seed=2)), SUM], {}, ["d0", "d1"]),
    ],
    "aten.huber_loss.default": [
        ([r(8, 6), r(8, 6, seed=1), MEAN, 0.5], {}, ["d0", "d1"]),
        ([r(8, 6), r(8, 6, seed=1), NONE], {}, ["d0", "d1"]),
    ],
    "aten.soft_margin_loss.default": [([r(8, 6), sign(8, 6, seed=1)], {}, ["d0", "d1"])],
    "aten.hinge_embedding_loss.default": [
        ([r(8, 6), sign(8, 6, seed=1), 0.7, SUM], {}, ["d0", "d1"]),
    ],
    "aten.margin_ranking_loss.default": [
        ([r(8), r(8, seed=1), sign(8, seed=2), 0.1, MEAN], {}, ["d0"]),
    ],
    "aten.poisson_nll_loss.default": [
        ([r(8, 6), prob(8, 6, seed=1) * 3, True, False, 1e-8, MEAN], {}, ["d0", "d1"]),
        ([prob(8, 6), prob(8, 6, seed=1) * 3, False, True, 1e-8, SUM], {}, ["d0", "d1"]),
    ],
    "aten.cosine_embedding_loss.default": [
        ([r(8, 6), r(8, 6, seed=1), sign(8, seed=2), 0.1, MEAN], {}, ["N"]),
        ([r(8, 6), r(8, 6, seed=1), sign(8, seed=2), 0.0, NONE], {}, ["N"]),
    ],
    "aten.triplet_margin_loss.default": [
        ([r(8, 6), r(8, 6, seed=1), r(8, 6, seed=2), 1.0, 2.0, 1e-6, False, MEAN], {}, ["N"]),
        ([r(8, 6), r(8, 6, seed=1), r(8, 6, seed=2), 0.5, 1.0, 1e-6, True, SUM], {}, ["N"]),
    ],
    "aten.multi_margin_loss.default": [
        ([r(8, 5), classes(5, 8)], {}, ["N"]),
        ([r(8, 8), classes(8, 8), 2, 0.5, constant(prob(8, seed=3)), SUM], {}, ["N"]),  # C = N
    ],
    "aten.multilabel_margin_loss.default": [
        # each row's target classes, ended by -1
        ([r(4, 5), torch.tensor([[3, 0, -1, 1, 2], [1, -1, 0, 0, 0], [4, 3, 2, 1, 0],
                                 [-1, 2, 2, 2, 2]])], {}, ["N"]),
    ],
}
CASES = [(t, i) for t, calls in SAMPLES.items() for i in range(len(calls))]


def _annotated(target: str, index: int):
    return annotated_sample(SAMPLES, target, index)


@pytest.mark.parametrize(("target", "index"), CASES)
def test_the_labels_offered_to_split(target: str, index: int) -> None:
    _, _, ann = _annotated(target, index)
    assert sorted(ann.splittable()) == SAMPLES[target][index][2]


@pytest.mark.parametrize(("target", "index"), CASES)
def test_parts_combine_to_the_whole_loss(target: str, index: int) -> None:
    call, values, ann = _annotated(target, index)
    check_equal_splits(call, ann, values)


def test_a_samples_features_are_refused_with_a_reason() -> None:
    call, _, ann = _annotated("aten.cosine_embedding_loss.default", 0)
    with pytest.raises(FrozenDimError, match="normalizes over its features"):
        ann.split(call, "C", 2, 0)


MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8


def build_model():
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 6))


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(4100 + step)
    return (torch.randn(batch_size, 12, generator=g),), torch.randn(batch_size, 6, generator=g)


def loss(out, target):
    return {expr}
'''

# one term per element, one per sample, and torch's own compositions of them
LOSSES = {
    "kl_div batchmean": "F.kl_div(F.log_softmax(out, -1), target.softmax(-1), "
                        "reduction='batchmean')",
    "kl_div mean, log target": "F.kl_div(F.log_softmax(out, -1), F.log_softmax(target, -1), "
                               "log_target=True)",
    "binary cross-entropy": "F.binary_cross_entropy(torch.sigmoid(out), torch.sigmoid(target))",
    "huber, sum": "F.huber_loss(out, target, reduction='sum', delta=0.5)",
    "soft margin": "F.soft_margin_loss(out, target.sign())",
    "hinge embedding": "F.hinge_embedding_loss(out, target.sign())",
    "margin ranking": "F.margin_ranking_loss(out[:, 0], out[:, 1], target[:, 0].sign())",
    "poisson nll": "F.poisson_nll_loss(out, target.abs())",
    "cosine embedding": "F.cosine_embedding_loss(out, target, target[:, 0].sign())",
    "triplet margin": "F.triplet_margin_loss(out, target, -target)",
    "multi-margin": "F.multi_margin_loss(out, target.argmax(-1))",
    "multilabel soft margin": "F.multilabel_soft_margin_loss(out, (target > 0).to(out.dtype))",
    "multilabel margin": "F.multilabel_margin_loss(out, target.argsort(-1).masked_fill("
                         "torch.arange(6, device=target.device) >= 3, -1))",
}


def _model(tmp_path, name: str) -> str:
    path = tmp_path / "loss_model.py"
    path.write_text(textwrap.dedent(MODEL).replace("{expr}", LOSSES[name]))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("plan, params", [
    ("dp", ()),
    ("gpipe", (("microbatches", "2"),)),
    ("1f1b", (("microbatches", "4"),)),
])
@pytest.mark.parametrize("name", list(LOSSES))
def test_losses_train_like_the_plain_model(tmp_path, name, plan, params):
    v = verify_before_launch(JobSpec(_model(tmp_path, name), plan, params), 2)
    assert v.verified, v.line()
    assert v.max_grad_error < 1e-12


@pytest.mark.parametrize("name", ["kl_div mean, log target", "cosine embedding", "poisson nll"])
def test_data_parallel_computes_each_ranks_share_of_the_loss(tmp_path, name, capsys):
    """Each rank's rows only: no activation crosses ranks for the loss, in either direction;
    the loss's partial sums meet in the step's loss all-reduce."""
    assert main(["check", _model(tmp_path, name), "dp", "--world", "2", "--json"]) == 0
    comm = json.loads(capsys.readouterr().out)["communication"]
    assert comm["forward"] == {} and comm["backward"] == {}, comm
    assert comm["edges"] == [], comm
