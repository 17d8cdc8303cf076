"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) split along the batch. Without an
annotation ``aten.lstm`` was replicated: data parallelism gathered the whole batch for it and ran
it on every rank (twice the work at 2 ranks, and an all-gather each way), and micro-batches
could not split it.

Oracles: PyTorch's op on the whole tensors (``tests.test_ops_oracle.check_parts``: the batch cut
into parts, the parts' calls on slices put together, forward and gradients, float64), and the
plain single-device model (``verify_before_launch`` simulates every rank of one step in float64
against it)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from ssdsl.cli import main
from ssdsl.ops import FrozenDimError
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch
from tests.test_ops_oracle import annotated_sample, check_equal_splits

D = torch.float64


def r(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 11 * sum(shape))
    return torch.randn(shape, generator=g, dtype=D) * 0.5


def _weights(gates: int, inp: int, hidden: int, layers: int = 1, dirs: int = 1,
             bias: bool = True) -> list[torch.Tensor]:
    """The flat weights in ATen's order: per layer and direction w_ih, w_hh (b_ih, b_hh)."""
    out = []
    for layer in range(layers):
        width = inp if layer == 0 else hidden * dirs
        for d in range(dirs):
            seed = 100 * layer + 10 * d
            out += [r(gates * hidden, width, seed=seed), r(gates * hidden, hidden, seed=seed + 1)]
            if bias:
                out += [r(gates * hidden, seed=seed + 2), r(gates * hidden, seed=seed + 3)]
    return out


# target -> [(args, kwargs, labels the annotation must offer to split)]; the arguments after
# the weights: has_biases, num_layers, dropout, train, bidirectional, batch_first
SAMPLES: dict[str, list] = {
    "aten.lstm.input": [
        ([r(4, 3, 5), [r(1, 4, 6), r(1, 4, 6, seed=1)], _weights(4, 5, 6), True, 1, 0.0, True,
          False, True], {}, ["b"]),                                  # batch_first
        ([r(3, 4, 5), [r(4, 4, 6), r(4, 4, 6, seed=1)], _weights(4, 5, 6, 2, 2), True, 2, 0.0,
          True, True, False], {}, ["b"]),                            # 2 layers, both directions
        ([r(3, 6, 5), [r(1, 6, 6), r(1, 6, 6, seed=1)], _weights(4, 5, 6, bias=False), False, 1,
          0.0, True, False, False], {}, ["b"]),                      # no biases, time first
    ],
    "aten.gru.input": [
        ([r(6, 3, 5), r(1, 6, 4), _weights(3, 5, 4), True, 1, 0.0, True, False, True], {},
         ["b"]),
    ],
    "aten.rnn_tanh.input": [
        ([r(3, 6, 5), r(2, 6, 4), _weights(1, 5, 4, 2), True, 2, 0.0, True, False, False], {},
         ["b"]),
    ],
    "aten.rnn_relu.input": [
        ([r(4, 3, 5), r(2, 4, 4), _weights(1, 5, 4, 1, 2), True, 1, 0.0, True, True, True], {},
         ["b"]),
    ],
}
CASES = [(t, i) for t, calls in SAMPLES.items() for i in range(len(calls))]


def _annotated(target: str, index: int):
    return annotated_sample(SAMPLES, target, index)


@pytest.mark.parametrize(("target", "index"), CASES)
def test_only_the_batch_splits(target: str, index: int) -> None:
    _, _, ann = _annotated(target, index)
    assert sorted(ann.splittable()) == SAMPLES[target][index][2]


@pytest.mark.parametrize(("target", "index"), CASES)
def test_batch_parts_combine_to_the_whole_call(target: str, index: int) -> None:
    call, values, ann = _annotated(target, index)
    check_equal_splits(call, ann, values)


def test_the_time_dim_is_refused_with_a_reason() -> None:
    call, _, ann = _annotated("aten.lstm.input", 0)
    with pytest.raises(FrozenDimError, match="carries its state along the sequence"):
        ann.split(call, "t", 3, 0)


GRU_MODEL = '''
import torch
from torch import nn

VOCAB, WIDTH, SEQ = 32, 12, 6
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.{layer}
        self.head = nn.Linear({out}, VOCAB)

    def forward(self, idx):
        h = self.embed(idx){transpose}
        out, _ = self.rnn(h)
        return self.head(out{transpose})


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(7100 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return (data[:, :-1],), data[:, 1:]


def loss(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
'''

LAYERS = {
    "gru, batch first": ("GRU(WIDTH, WIDTH, batch_first=True)", "WIDTH", ""),
    "bidirectional lstm, 2 layers, time first": (
        "LSTM(WIDTH, WIDTH, num_layers=2, bidirectional=True)", "2 * WIDTH",
        ".transpose(0, 1)"),
    "relu rnn": ("RNN(WIDTH, WIDTH, nonlinearity='relu', batch_first=True)", "WIDTH", ""),
}


def _model(tmp_path, name: str) -> str:
    layer, out, transpose = LAYERS[name]
    path = tmp_path / "rnn_lm.py"
    path.write_text(textwrap.dedent(GRU_MODEL).replace("{layer}", layer)
                    .replace("{out}", out).replace("{transpose}", transpose))
    return str(path)


@pytest.mark.parametrize("plan, params, world", [
    ("dp", (), 2),
    ("dp", (), 4),
    ("gpipe", (("microbatches", "2"),), 2),
])
@pytest.mark.parametrize("name", list(LAYERS))
def test_recurrent_models_train_like_the_plain_model(tmp_path, name, plan, params, world):
    v = verify_before_launch(JobSpec(_model(tmp_path, name), plan, params), world)
    assert v.max_grad_error < 1e-12


@pytest.mark.parametrize("name", list(LAYERS))
def test_data_parallel_runs_the_recurrent_layer_on_each_ranks_share(tmp_path, name, capsys):
    """The layer's own rows only: no activation crosses ranks in either direction; what dp
    exchanges is the gradients (the recurrent weights' among them)."""
    assert main(["check", _model(tmp_path, name), "dp", "--world", "2", "--json"]) == 0
    comm = json.loads(capsys.readouterr().out)["communication"]
    assert comm["forward"] == {} and comm["backward"] == {}, comm
    assert comm["edges"] == [], comm
