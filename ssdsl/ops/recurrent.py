"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``: ``aten.lstm``, ``aten.gru``,
``aten.rnn_tanh``, ``aten.rnn_relu``). The sequences of a batch run independently, so the batch
dim is spatial: in the input (dim 0 with ``batch_first``, else dim 1), in every initial state
(dim 1, whatever ``batch_first`` says) and in every output alike. Everything else is kept whole:
the time dim carries the state from one step to the next, each gate reads every feature and
every hidden unit, and the weights are read whole by every sequence (a part of the batch gives
its weights' gradients as partial sums, which data parallelism adds up as for any weight).
The ATen call always has a batch: the module adds one to an unbatched input before it."""

from __future__ import annotations

from ssdsl.ops.build import plain
from ssdsl.ops.core import Annotation, Call, register

_TIME = "the recurrence carries its state along the sequence, one step after another"
_FEATURES = "each gate of the recurrent cell reads every feature of its input"
_HIDDEN = "each gate of the recurrent cell reads every hidden unit of the state"
_LAYERS = "the layers (and directions) of the recurrent stack feed one another"
_WEIGHT = "a recurrent layer's weight is read whole at every step"


@register("aten.lstm.input", "aten.gru.input", "aten.rnn_tanh.input", "aten.rnn_relu.input")
def recurrent(call: Call) -> Annotation:
    x = call.shape(0, "input")
    batch_first = bool(call.arg(8, "batch_first", False))
    hx = call.arg(1, "hx")
    n_state = len(hx) if isinstance(hx, (list, tuple)) else 1
    shapes = call.in_shapes
    states, weights = shapes[1:1 + n_state], shapes[1 + n_state:]
    frozen: dict[str, str] = {"t": _TIME, "i": _FEATURES, "o": _HIDDEN}
    x_labels = ["b", "t", "i"] if batch_first else ["t", "b", "i"]
    out_labels = ["b", "t", "o"] if batch_first else ["t", "b", "o"]
    ins = [plain(x_labels, x)]
    for k, s in enumerate(states):
        frozen.update({f"s{k}l": _LAYERS, f"s{k}h": _HIDDEN})
        ins.append(plain([f"s{k}l", "b", f"s{k}h"], s))
    for k, w in enumerate(weights):
        labels = [f"w{k}d{d}" for d in range(len(w))]
        frozen.update({lab: _WEIGHT for lab in labels})
        ins.append(plain(labels, w))
    outs = [plain(out_labels, call.out_shapes[0])]
    # the final states: shaped like the initial ones (an LSTM's cell state as its hidden state)
    for k, s in enumerate(call.out_shapes[1:]):
        frozen.update({f"n{k}l": _LAYERS, f"n{k}h": _HIDDEN})
        outs.append(plain([f"n{k}l", "b", f"n{k}h"], s))
    return Annotation(tuple(ins), tuple(outs), frozen=frozen)
