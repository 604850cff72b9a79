"""Workloads whose learning rate follows a ``torch.optim.lr_scheduler`` (the file's ``lr_scheduler``):
tests/test_schedule.py."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _workload(make_optimizer):
    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    return model, make_optimizer(model), lambda m, x, y: F.cross_entropy(m(x), y), (x, y)


def workload():
    """AdamW with decoupled weight decay."""
    return _workload(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))


def sgd_groups():
    """SGD with momentum, two param groups at different rates."""
    return _workload(lambda m: torch.optim.SGD([{"params": m.a.parameters(), "lr": 0.1},
                                                {"params": list(m.b.parameters()) + list(m.c.parameters())}],
                                               lr=0.05, momentum=0.9))


def lr_scheduler(optimizer):
    """Two warm-up steps, then a cosine decay over ten."""
    warm = 2
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / 10)))


def batches():
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
