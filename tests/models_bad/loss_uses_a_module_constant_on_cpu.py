# expect: ModelFileRaised @:12
import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8
CLASS_WEIGHTS = torch.linspace(0.5, 2.0, 4)  # made on the CPU, apart from the model


def build_model():
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def loss(out, target):
    return F.cross_entropy(out, target, weight=CLASS_WEIGHTS.to(out.dtype))  #<
