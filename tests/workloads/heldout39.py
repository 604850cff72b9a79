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


class Float32Region(nn.Module):
    """A float64 model that runs one matmul in float32 (``h.float()``, as code does around a kernel that wants it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = nn.functional.linear(h.float(), self.b.weight.float(), self.b.bias.float()).to(x.dtype)
        return self.c(torch.relu(h))


def float32_region():
    torch.manual_seed(31)
    g = torch.Generator().manual_seed(31)
    model = Float32Region()
    return (model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x, y: (m(x) - y).pow(2).mean(),
            (torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)))


class ScaledSGD(torch.optim.SGD):
    """An optimizer that accumulates the gradients' sum into a tensor attribute (outside ``self.state``)."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.scale = torch.tensor(4.0)

    @torch.no_grad()
    def step(self, closure=None):
        total = sum(p.grad.sum() for g in self.param_groups for p in g["params"])
        super().step()
        self.scale.add_(total)


def attribute_from_gradients():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = nn.Linear(4, 4)
    return (model, ScaledSGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
            (torch.randn(8, 4, generator=g),))
