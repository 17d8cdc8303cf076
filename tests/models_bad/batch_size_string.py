# expect: ModelFileContract @
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, 4, generator=g)
    y = torch.randint(0, 3, (batch_size,), generator=g)
    return x, y

BATCH_SIZE = '8'  #<
