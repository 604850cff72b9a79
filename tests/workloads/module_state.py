"""Models whose forward stores Python-side state on the module: kept activations (fine), a counter, an annealed
temperature, layers dropped by Python's random module (each a constant of a captured step: refused)."""
import random

import torch
import torch.nn as nn
import torch.nn.functional as F


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _loss(model, x, y):
    return F.mse_loss(model(x), y)


class KeepsHidden(nn.Module):
    """Keeps its hidden activation for logging, as a plain attribute (a tensor of the step's graph)."""
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
        self.last_hidden = None

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.last_hidden = h
        return self.b(h)


class WarmUp(nn.Module):
    """Scales its output up over the first calls, counting them in a Python int."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * min(1.0, self.calls / 10)


class LayerDrop(nn.Module):
    """Skips its middle layer when Python's random module says so (fairseq's LayerDrop, written with random)."""
    def __init__(self, rng=None):
        super().__init__()
        self.a, self.mid, self.b = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.rng = rng

    def forward(self, x):
        h = torch.relu(self.a(x))
        if (self.rng or random).random() >= 0.5:
            h = torch.relu(self.mid(h))
        return self.b(h)


def _w(model):
    return model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _batch()


def keeps_hidden():
    torch.manual_seed(0)
    return _w(KeepsHidden())


def warm_up():
    torch.manual_seed(0)
    return _w(WarmUp())


def layer_drop():
    torch.manual_seed(0)
    return _w(LayerDrop())


def layer_drop_held_rng():
    torch.manual_seed(0)
    return _w(LayerDrop(random.Random(0)))


class FeatureHooks(nn.Module):
    """A feature-matching loss reads what a forward hook, a closure over the model, collected (as distillation
    and perceptual losses do)."""
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
        self.feats = []
        self.a.register_forward_hook(lambda m, i, o: self.feats.append(o))

    def forward(self, x):
        self.feats.clear()
        return self.b(torch.tanh(self.a(x)))


def _feature_loss(model, x, y):
    out = model(x)
    return F.mse_loss(out, y) + 0.01 * model.feats[0].pow(2).mean()


def feature_hooks():
    torch.manual_seed(0)
    model = FeatureHooks()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), _feature_loss, _batch()


def lazy_linear():
    """A lazy layer whose input size its first call decides (eager training needs no dry run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), _loss, _batch()
