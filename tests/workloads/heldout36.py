"""Held-out workloads of session 36 that found bugs (tests/test_pipeline_heldout.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import spectral_norm


class LastMean(nn.Module):
    """A buffer written through ``out=`` and never read: the step's graph has no reader of its old value."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.register_buffer("last", torch.zeros(8))

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        with torch.no_grad():
            torch.mean(h, 0, out=self.last)
        return self.c(h)


def _xy():
    return (torch.randn(8, 6, generator=torch.Generator().manual_seed(1)),
            torch.randn(8, 3, generator=torch.Generator().manual_seed(2)))


def write_only_buffer():
    torch.manual_seed(0)
    m = LastMean()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x, y: F.mse_loss(m(x), y), _xy()


def spectral_last():
    """spectral_norm's power iteration writes its ``_u`` buffer through ``out=`` (never reading the old one)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), spectral_norm(nn.Linear(8, 3)))
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x, y: F.mse_loss(m(x), y), _xy()


class MaxNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 6, max_norm=1.0)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, t):
        return self.b(torch.tanh(self.a(self.emb(t).sum(1))))


def maxnorm():
    """nn.Embedding(max_norm=...) renormalises its rows in the forward: the update reads a batch-made value."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    t, y = torch.randint(0, 12, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g)
    m = MaxNorm()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, t, y: F.cross_entropy(m(t), y), (t, y)


class SpatialTransformer(nn.Module):
    """A localisation net predicts each sample's affine ``theta``; ``affine_grid`` + ``grid_sample`` warp the input."""

    def __init__(self):
        super().__init__()
        self.loc = nn.Sequential(nn.Flatten(), nn.Linear(2 * 6 * 6, 8), nn.Tanh(), nn.Linear(8, 6))
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        theta = self.loc(x).view(-1, 2, 3) + torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.head(torch.relu(self.conv(F.grid_sample(x, grid, align_corners=False))).flatten(1))


def spatial_transformer():
    torch.manual_seed(0)
    m = SpatialTransformer()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 2, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), lambda m, x, y: F.cross_entropy(m(x), y), (x, y)
