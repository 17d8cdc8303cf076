"""A forward that fails only under torch.export, at a shape that does not broadcast (as HF
Nystromformer's attention mask does under tracing): eager and meta runs pass."""
import torch, torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc(x)
        if torch.compiler.is_exporting():
            h = h + torch.zeros(3, 5, device=h.device, dtype=h.dtype)  # FAILS UNDER EXPORT
        return h


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)
