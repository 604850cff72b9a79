"""Held-out workloads of session 35 that found bugs (tests/test_sharding.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Bilinear(nn.Module):
    """nn.Bilinear between two projections of a 3-d input: ``aten._trilinear`` in forward and backward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(6, 4)
        self.bil = nn.Bilinear(8, 4, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.bil(torch.relu(self.a(x)), torch.relu(self.b(x)))))


def bilinear():
    torch.manual_seed(0)
    m = Bilinear()
    x = torch.randn(8, 3, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 3, 2, generator=torch.Generator().manual_seed(2))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), lambda m, x, y: F.mse_loss(m(x), y), (x, y)
