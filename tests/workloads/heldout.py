"""Small workloads unlike the examples, for tests/test_pipeline_heldout.py."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class _SharedNorm(nn.Module):
    """One BatchNorm applied after the first layer and again before the head: its running statistics are read
    on the first stage and their new value made on the last."""

    def __init__(self, d=16, layers=6):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.bn = nn.BatchNorm1d(d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.inp(x)))
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(self.bn(h))


def _loss(model, x, y):
    return F.cross_entropy(model(x), y)


def shared_norm():
    torch.manual_seed(0)
    net = _SharedNorm()
    g = torch.Generator().manual_seed(1)
    return net, torch.optim.SGD(net.parameters(), lr=0.05), _loss, (torch.randn(16, 8, generator=g),
                                                                    torch.randint(4, (16,), generator=g))
