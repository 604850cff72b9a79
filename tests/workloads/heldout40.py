"""Held-out workloads of session 40 (a helper's thirteenth batch: time-major layouts, loss normalisations,
optimizer set-ups), reduced to what failed."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class TwoHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 24), nn.Tanh())
        self.cls = nn.Linear(24, 4)
        self.reg = nn.Linear(24, 2)
        self.log_vars = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        h = self.trunk(x)
        return self.cls(h), self.reg(h)


def uncertainty_weights():
    """Kendall et al.'s learned task uncertainty, sum_i exp(-s_i) L_i + s_i, over a cross entropy and an MSE."""
    torch.manual_seed(0)
    model = TwoHead()
    g = torch.Generator().manual_seed(10)
    x, y, t = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g), torch.randn(8, 2, generator=g)

    def loss(model, x, y, t):
        lc, lr = model(x)
        ls = torch.stack([F.cross_entropy(lc, y), F.mse_loss(lr, t)])
        return (torch.exp(-model.log_vars) * ls + model.log_vars).sum()
    return model, torch.optim.Adam(model.parameters(), lr=5e-2), loss, (x, y, t)
