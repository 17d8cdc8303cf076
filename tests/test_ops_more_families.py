"""Models built of operators that had no annotation (each replicated behind an all-gather under
data parallelism, and refused under micro-batches): a small U-Net (instance norm, PReLU,
a transposed convolution, bilinear and nearest upsampling, pixel shuffle), a gated text encoder (GLU, flip, cumulative
product, standard deviation, cosine similarity, ``index_select``, ``topk``, ``one_hot``) and a
VOLO-style fold (reflect padding, an in-place leaky ReLU, ``F.unfold`` and ``F.fold``).

Oracle: the plain single-device model (``verify_before_launch`` simulates every rank of one step
in float64 against it); the per-operator oracle is ``tests/test_ops_annotations.py`` (torch's op
on the whole tensors against the parts)."""

from __future__ import annotations

import json
import textwrap

import pytest

from ssdsl.cli import main
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch

UNET = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.InstanceNorm2d(8, affine=True)
        self.act = nn.PReLU(8)
        self.mid = nn.Conv2d(8, 8, 3, padding=1)
        self.deconv = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.up = nn.Conv2d(16, 12, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)
        self.out = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        skip = self.act(self.norm(self.down(x)))
        y = F.max_pool2d(skip, 2)
        y = F.relu6(self.mid(y))
        y = self.deconv(y) + F.interpolate(y, scale_factor=2, mode="bilinear",
                                           align_corners=False)
        y = self.up(torch.cat([y, skip], 1))
        y = F.interpolate(self.shuffle(y), size=(8, 8), mode="nearest")
        return self.out(y)


def build_model():
    return UNet()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(5200 + step)
    x = torch.randn(batch_size, 3, 8, 8, generator=g)
    return (x,), x.flip(-1)


def loss(out, target):
    return F.huber_loss(out, target, delta=0.5)
'''

ENCODER = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, SEQ = 24, 8, 6
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.gate = nn.Linear(WIDTH, 2 * WIDTH)
        self.keys = nn.Parameter(torch.randn(4, WIDTH))
        self.head = nn.Linear(WIDTH + 4, VOCAB)

    def forward(self, idx):
        h = F.glu(self.gate(self.embed(idx)), dim=-1)
        h = h + h.flip(1) * 0.5 + torch.sigmoid(h).cumprod(1) * 0.1
        h = h / (h.std(-1, keepdim=True) + 1.0)
        sim = F.cosine_similarity(h.unsqueeze(2), self.keys, dim=-1)
        top, _ = sim.topk(2, dim=-1)
        picked = h.index_select(2, torch.arange(WIDTH - 1, -1, -1, device=h.device))
        hot = F.one_hot(sim.argmax(-1), 4).to(h.dtype)
        return self.head(torch.cat([picked + top.sum(-1, keepdim=True), hot], -1))


def build_model():
    return Encoder()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(5300 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return (data[:, :-1],), data[:, 1:]


def loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
'''

FOLD = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8


class FoldNet(nn.Module):
    """Outlook-style mixing (VOLO): windows unfolded, mixed, folded back (overlapping ones
    add), after a reflect-padded stem with an in-place leaky ReLU."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3)
        self.mix = nn.Linear(9, 9)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        x = F.leaky_relu(self.stem(F.pad(x, (1, 1, 1, 1), mode="reflect")), 0.1, inplace=True)
        w = F.unfold(x, 3, padding=1)                                  # (N, 4 * 9, 36)
        w = self.mix(w.reshape(x.shape[0], 4, 9, 36).transpose(2, 3)).transpose(2, 3)
        y = F.fold(w.reshape(x.shape[0], 36, 36), (6, 6), 3, padding=1)
        return self.head(F.elu(y).flatten(1))


def build_model():
    return FoldNet()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(5400 + step)
    return (torch.randn(batch_size, 3, 6, 6, generator=g),), torch.randint(0, 5, (batch_size,),
                                                                            generator=g)
'''

MODELS = {"unet": UNET, "encoder": ENCODER, "fold": FOLD}


def _model(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(MODELS[name]))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("plan, params, world", [
    ("dp", (), 2),
    ("dp", (), 4),
    ("gpipe", (("microbatches", "2"),), 2),
    ("1f1b", (("microbatches", "4"),), 2),
])
@pytest.mark.parametrize("name", list(MODELS))
def test_models_train_like_the_plain_model(tmp_path, name, plan, params, world):
    v = verify_before_launch(JobSpec(_model(tmp_path, name), plan, params), world)
    assert v.verified, v.line()
    assert v.max_grad_error < 1e-12


@pytest.mark.parametrize("name", list(MODELS))
def test_data_parallel_moves_no_activation(tmp_path, name, capsys):
    """Each rank's samples only, end to end: dp exchanges the gradients and nothing else."""
    assert main(["check", _model(tmp_path, name), "dp", "--world", "2", "--json"]) == 0
    comm = json.loads(capsys.readouterr().out)["communication"]
    assert comm["forward"] == {} and comm["backward"] == {}, comm
    assert comm["edges"] == [], comm


def test_a_transposed_convolution_counts_its_multiply_adds():
    """Each input element meets each kernel element once for each output channel: N Ci H W
    Co kh kw multiply-adds (the count the cost model and the stage cut read)."""
    import torch

    from ssdsl.ops import annotate_call
    from ssdsl.ops.macs import multiply_adds
    from tests.test_ops_oracle import make_call

    call, _ = make_call("aten.conv_transpose2d.input",
                        [torch.randn(2, 4, 3, 5), torch.randn(4, 6, 2, 3), None, [2, 2]])
    ann = annotate_call(call)
    assert multiply_adds("conv_transpose2d", ann.sizes()) == 2 * 4 * 3 * 5 * 6 * 2 * 3
