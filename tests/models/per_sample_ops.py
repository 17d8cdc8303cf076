"""Per-sample operators users reported without annotation: ``F.normalize`` and ``x.norm(dim=-1)``
(``linalg_vector_norm``), FNet's ``torch.fft.fftn(x, dim=(1, 2)).real`` (``fft_fftn``,
``real``), ConvBERT's ``torch.multiply`` (``multiply``) and ``nn.Unfold`` (``im2col``)."""

import torch
import torch.nn.functional as F
from torch import nn

V, C, T = 16, 8, 6
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.a = nn.Linear(C, C)
        self.b = nn.Linear(C, C)
        self.mix = nn.Linear(3 * C, C)
        self.head = nn.Linear(C, V)

    def forward(self, x):
        h = self.emb(x)
        h = h + torch.fft.fftn(h, dim=(1, 2)).real / T
        g = torch.multiply(self.a(h), self.b(h))
        # ConvBERT's span convolution: windows of 3 positions over the sequence
        u = F.unfold(g.transpose(1, 2).unsqueeze(-1), kernel_size=(3, 1), padding=(1, 0))
        h = torch.tanh(self.mix(u.transpose(1, 2)))
        h = F.normalize(h, dim=-1) * h.norm(p=1, dim=-1, keepdim=True).clamp(max=3.0)
        return self.head(h)


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, V, (batch_size, T), generator=g)
    y = torch.randint(0, V, (batch_size, T), generator=g)
    return x, y


def loss(o, t):
    return F.cross_entropy(o.flatten(0, 1), t.flatten())
