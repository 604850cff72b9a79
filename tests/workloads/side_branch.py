"""A Megatron pair beside an independent branch: the row-parallel output's all-reduce can travel while
the branch computes (cost model vs overlapped program, tests/test_overlap.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class SideBranch(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.side = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, x, z):
        a = self.down(F.gelu(self.up(x)))
        b = torch.tanh(self.side(z))
        return self.head(a * b)


def loss_fn(model, x, z, y):
    return F.cross_entropy(model(x, z), y)


def side_branch(width=256, hidden=1024, batch=64):
    torch.manual_seed(0)
    model = SideBranch(width, hidden)
    x, z = torch.randn(batch, width), torch.randn(batch, width)
    y = torch.randint(4, (batch,))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, (x, z, y)
