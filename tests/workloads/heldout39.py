"""Held-out workloads of session 39 (tests/test_heldout39.py)."""
import torch
import torch.nn as nn


class PhaseNet(nn.Module):
    """Features made with complex numbers in the middle of a model: ``torch.polar`` (a learned rotation), a
    complex product, ``angle`` and ``abs``. Their backward multiplies by the Python scalar ``1j``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.rot = nn.Parameter(torch.linspace(-1.0, 1.0, 4))
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        h = self.lin(x)
        z = torch.complex(h[:, :4], h[:, 4:] + 1.0)
        z = z * torch.polar(torch.ones_like(self.rot), self.rot)
        feats = torch.cat([z.abs(), torch.sin(z.angle()), torch.view_as_real(z * z.conj() + z ** 2).flatten(1)], -1)
        return self.head(feats)


def phases():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = PhaseNet()
    return (model, torch.optim.Adam(model.parameters(), lr=1e-2), lambda m, x, y: (m(x) - y).pow(2).mean(),
            (torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)))
