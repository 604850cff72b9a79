"""Workloads that are wrong on purpose: each function is one user mistake."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def wrong_arity():
    m = _mlp()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), None


def not_a_module():
    m = _mlp()
    return "model", torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x: m(x).sum(), (torch.randn(2, 8),)


def batch_does_not_fit():
    m = _mlp()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x: m(x).sum(), (torch.randn(2, 5),)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # depends on a value: cannot be captured
            y = y * 2
        return y


def data_dependent():
    torch.manual_seed(0)
    m = DataDependent()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x: m(x).sum(), (torch.randn(2, 8),)


_GENERATED = {}
exec("def scaled(y):\n    return y * 2 if y.sum() > 0 else y\n", _GENERATED)   # code whose file is "<string>"


def data_dependent_generated():
    torch.manual_seed(0)
    m = nn.Linear(8, 4)
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x: _GENERATED["scaled"](m(x)).sum(), \
        (torch.randn(2, 8),)


def non_scalar_loss():
    m = _mlp()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x: m(x), (torch.randn(2, 8),)


def raises():
    raise RuntimeError("cannot build the model")


def foreign_optimizer():
    m = _mlp()
    other = nn.Linear(3, 3)
    return m, torch.optim.SGD(other.parameters(), lr=0.1), lambda m, x: m(x).sum(), (torch.randn(2, 8),)


def unsupported_optimizer():  # LBFGS needs a closure: no single step to capture
    m = _mlp()
    return m, torch.optim.LBFGS(m.parameters(), lr=0.1), lambda m, x: m(x).sum(), (torch.randn(2, 8),)


def graph_batch():
    """A graph's node features and an edge list indexing them: its rows along dim 0 are not independent
    samples, so micro-batches (the first B/m rows of every batch tensor) index past the nodes they hold."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    edges = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])
    y = torch.randint(0, 3, (8,), generator=g)

    def loss(m, x, edges, y):
        return nn.functional.cross_entropy(m(x).index_select(0, edges), y)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loss, (x, edges, y)


def batchnorm_cumulative():
    """``BatchNorm1d(momentum=None)``: torch reads ``1 / num_batches_tracked`` as a Python number in the
    module's forward, which a graph cannot hold; the sentence names the momentum, not torch.where."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x: m(x).square().mean(), (torch.randn(8, 4),)


def bag_offsets():
    """``nn.EmbeddingBag`` on a flat list of 24 ids with 8 bag offsets: both split in two, but the second
    micro-batch's offsets start at 12, not 0 (its first micro-batch is valid: only the second fails)."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(20, 4, mode="mean")
    g = torch.Generator().manual_seed(0)
    flat = torch.randint(0, 20, (24,), generator=g)
    y = torch.randn(8, 4, generator=g)
    return bag, torch.optim.SGD(bag.parameters(), lr=0.1), \
        lambda m, f, o, y: F.mse_loss(m(f, o), y), (flat, torch.arange(0, 24, 3), y)


def sequence_first():
    """A (time, batch, features) input beside per-sample labels: a micro-batch takes time steps of one and
    samples of the other, so the step does not even trace on it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), \
        lambda m, x, y: nn.functional.cross_entropy(m(x).mean(0), y), (x, y)


def boolean_selection():
    """A masked mean written with boolean indexing: the selection's size depends on the mask's values."""
    model = _mlp()
    x = torch.randn(8, 8)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x)[m(x) > 0].mean(), (x,)


def complex_parameter():
    """A complex nn.Parameter (a filter applied in the frequency domain)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 5)
    model.filt = nn.Parameter(torch.randn(5, dtype=torch.complex64))
    x = torch.randn(8, 8)
    return model, torch.optim.Adam(model.parameters(), lr=0.1), \
        lambda m, x: torch.fft.irfft(torch.fft.rfft(x) * m.filt, n=8).pow(2).mean(), (x,)


def adaptive_softmax():
    """nn.AdaptiveLogSoftmaxWithLoss's forward selects each cluster's rows by target (inside torch)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(8, 16), "asm": nn.AdaptiveLogSoftmaxWithLoss(16, 20, cutoffs=[4, 10])})
    x, y = torch.randn(8, 8), torch.randint(0, 20, (8,))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x, y: m["asm"](m["body"](x), y).loss, (x, y)
