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


def bce_float32_target():
    """Binary targets made with ``.float()`` stay float32 under a float64 default dtype: the loss kernel computes
    ``(1 - target) * input`` in the target's float32 and returns a float32 loss. The step's in-place ops (the
    mean's backward ``div_``) make capture functionalize it, which must keep the op whole."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    y = (torch.rand(8, 3, generator=torch.Generator().manual_seed(2)) > 0.5).float()
    w = torch.rand(3, generator=torch.Generator().manual_seed(3)).float()
    return (m, torch.optim.SGD(m.parameters(), lr=0.1),
            lambda m, x, y: F.binary_cross_entropy_with_logits(m(x), y, pos_weight=w), (x, y))


def _ctc(m, x, tgt):
    lp = m(x).log_softmax(-1).transpose(0, 1)
    b = lp.shape[1]
    return F.ctc_loss(lp, tgt, [lp.shape[0]] * b, [tgt.shape[1]] * b)


def ctc_lengths():
    """CTC with one input and one target length per sample, as lists: a list as long as the batch is an
    argument of the op, so the step at half the batch is another graph (micro-batches are refused)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(30)
    x, tgt = torch.randn(8, 7, 4, generator=g), torch.randint(1, 6, (8, 3), generator=g)
    m = nn.Linear(4, 6)
    return m, torch.optim.SGD(m.parameters(), lr=0.1), _ctc, (x, tgt)
