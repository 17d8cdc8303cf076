# expect: TraceError @
"""A forward that keeps a running average of an activation in a buffer inside a
``with torch.no_grad():`` block (the first statement of the block is marked): refused at the
model's line, with the rewrite that traces (tests/models/running_average.py trains)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 3)
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x):
        h = torch.relu(self.inp(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))  #<
        return self.out(h)


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 3, (batch_size,), generator=g)


def loss(output, target):
    return F.cross_entropy(output, target)
