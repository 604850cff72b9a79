"""Held-out workloads of session 33 that found bugs (tests/test_memory_integration.py, test_pipeline.py,
test_sharding.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def _batch(rows=8, cols=4, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g), torch.randint(0, classes, (rows,), generator=g)


class QR(nn.Module):
    """Both factors of a QR decomposition in the loss: LAPACK's Q and R are column-major, and
    ``linalg_qr.out`` writes a wrong R when the two are views of one storage (as arena slots are)."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(4, 4) * 0.3 + torch.eye(4))

    def forward(self, x):
        Q, R = torch.linalg.qr(self.W)
        return x @ self.W.t() + x @ Q + x @ R


def qr_both():
    torch.manual_seed(0)
    m = QR()
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), lambda m, x, y: F.cross_entropy(m(x)[:, :3], y), _batch()


class Hyper(nn.Module):
    """A hypernetwork: the weight of a layer is generated from a parameter, so its gradient (batch-independent)
    is sent between pipeline stages as a view of a gradient accumulator."""

    def __init__(self):
        super().__init__()
        self.z = nn.Parameter(torch.randn(4))
        self.gen_w = nn.Linear(4, 5 * 6)
        self.gen_b = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        W = self.gen_w(self.z).view(5, 6)
        return self.head(torch.relu(x @ W.t() + self.gen_b(self.z)))


def hypernet():
    torch.manual_seed(0)
    m = Hyper()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x, y: F.cross_entropy(m(x), y), _batch(cols=6, seed=25)


class Gates(nn.Module):
    """A Linear's output chunked into four gates of 5 features: tp=2 cannot split each chunk."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 20)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        a, b, c, d = self.fc(x).chunk(4, -1)
        return self.head(torch.tanh(a) * torch.sigmoid(b) + c * d)


def gates():
    torch.manual_seed(0)
    m = Gates()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x, y: F.cross_entropy(m(x), y), _batch(cols=6)


class Skew(nn.Module):
    """A parameter and its transpose in one op (x @ (S - S.t()))."""

    def __init__(self):
        super().__init__()
        self.S = nn.Parameter(torch.randn(8, 8) * 0.1)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(x @ (self.S - self.S.t())))


def skew():
    torch.manual_seed(0)
    m = Skew()
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), lambda m, x, y: F.cross_entropy(m(x), y), _batch(cols=8)
