"""Held-out workloads of session 38 (tests/test_heldout38.py)."""
import torch
import torch.nn as nn


class Draws(nn.Module):
    """Every common way of drawing noise in a forward (Gumbel noise from ``exponential_``, ``uniform_``,
    ``normal_``, ``torch.normal`` with a tensor mean, ``torch.randint``, ``random_``), each scaled by zero so
    that one device and any plan agree."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        gumbel = -torch.empty_like(h).exponential_().log()
        noise = (torch.empty_like(h).uniform_(-0.1, 0.1) + torch.empty_like(h).normal_(0, 0.01)
                 + torch.normal(torch.zeros_like(h), 0.01) + torch.randint(0, 2, h.shape).to(h.dtype)
                 + torch.empty_like(h).random_(10))
        return h + 0 * (gumbel + noise)


class DrawsInRange(Draws):
    """``x.random_(low, high)``, which torch.fx cannot write as Python (its overload is named ``from``)."""

    def forward(self, x):
        return super().forward(x) + 0 * torch.empty_like(x).random_(2, 5)


def _workload(model):
    g = torch.Generator().manual_seed(0)
    return (model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
            (torch.randn(8, 8, generator=g),))


def random_draws():
    torch.manual_seed(0)
    return _workload(Draws())


def random_in_range():
    torch.manual_seed(0)
    return _workload(DrawsInRange())


def _pair():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


ANNEAL = {"step": 0}


def annealed_in_closure():
    """A KL-annealing weight kept in the loss function's closure: a captured step would hold its first value."""
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    state = {"step": 0}

    def loss(model, x, y):
        state["step"] += 1
        return nn.functional.mse_loss(model(x), y) + min(1.0, state["step"] / 3) * model.weight.pow(2).sum()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), loss, _pair()


class GlobalCounter(nn.Module):
    """A forward that advances a module-level counter and scales by it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        ANNEAL["step"] += 1
        return self.lin(x) * (1.0 + 0.5 * ANNEAL["step"])


def global_counter():
    torch.manual_seed(0)
    m = GlobalCounter()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x, y: nn.functional.mse_loss(m(x), y), _pair()


def nonlocal_counter():
    """``nonlocal calls; calls += 1`` in the loss function."""
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    calls = 0

    def loss(model, x, y):
        nonlocal calls
        calls += 1
        return nn.functional.mse_loss(model(x), y) * calls
    return m, torch.optim.SGD(m.parameters(), lr=0.1), loss, _pair()


def legacy_weight_norm():
    """Dilated convolutions under ``torch.nn.utils.weight_norm`` (the hook-based one, which keeps ``weight`` as a
    computed tensor that ``copy.deepcopy`` refuses)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.utils.weight_norm(nn.Conv1d(4, 8, 3, padding=1)), nn.Tanh(),
                      nn.utils.weight_norm(nn.Conv1d(8, 4, 3, padding=2, dilation=2)))
    g = torch.Generator().manual_seed(1)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), lambda m, x: m(x).pow(2).mean(), \
        (torch.randn(8, 4, 16, generator=g),)


WARM = [0]


def _kl_weight():
    WARM[0] += 1
    return min(1.0, WARM[0] / 4)


def counter_in_a_helper():
    """The loss function calls a module-level helper that advances a global warm-up counter."""
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    return (m, torch.optim.SGD(m.parameters(), lr=0.1),
            lambda model, x, y: nn.functional.mse_loss(model(x), y) + _kl_weight() * model.weight.abs().sum(), _pair())


def tensor_in_closure():
    """A running mean kept as a plain tensor in the loss function's closure, updated in place every step."""
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    run_mean = torch.zeros(4)

    def loss(model, x, y):
        with torch.no_grad():
            run_mean.mul_(0.5).add_(0.5 * y.mean(0))
        return nn.functional.mse_loss(model(x), y - run_mean)
    return m, torch.optim.SGD(m.parameters(), lr=0.1), loss, _pair()


class PlainTensorAttribute(nn.Module):
    """A plain tensor attribute (not a buffer) that the forward scales in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.ones(4)

    def forward(self, x):
        out = self.lin(x) * self.scale.clone()
        with torch.no_grad():
            self.scale[:2].mul_(1.5)
        return out


def tensor_attribute():
    torch.manual_seed(0)
    m = PlainTensorAttribute()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x, y: nn.functional.mse_loss(m(x), y), _pair()


class FreshTensors(nn.Module):
    """Tensors made in the forward (``torch.tensor``, ``torch.ones``) and changed in place: part of the step."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        c = torch.tensor([1.0, 2.0, 3.0, 4.0])
        c.mul_(2)
        return self.lin(x) * c * torch.ones(4).add_(1)


def fresh_tensors():
    torch.manual_seed(0)
    m = FreshTensors()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x, y: nn.functional.mse_loss(m(x), y), _pair()


class Determinants(nn.Module):
    """A Glow-style invertible 1x1 mixing: ``x @ W.T`` with ``slogdet(W)``, ``det`` and ``logdet`` in the loss.
    ``qr``: W from a QR factorisation (not C-contiguous, as Glow initialises it), else C-contiguous."""

    def __init__(self, qr: bool):
        super().__init__()
        w = torch.linalg.qr(torch.randn(4, 4))[0] if qr else torch.randn(4, 4) + 3 * torch.eye(4)
        self.W = nn.Parameter(w)
        self.B = nn.Parameter(torch.randn(2, 4, 4) + 3 * torch.eye(4))   # a batch of matrices

    def forward(self, x):
        lad = torch.linalg.slogdet(self.W)[1] + torch.logdet(self.B @ self.B.mT + torch.eye(4)).sum()
        return x @ self.W.T, lad + 0.1 * torch.linalg.det(self.W) + 0.1 * torch.det(self.B.mT).sum()


def _flow_nll(model, x):
    z, logdet = model(x)
    return (0.5 * (z ** 2).sum(-1) - logdet).mean()


def determinants_qr():
    torch.manual_seed(0)
    m = Determinants(qr=True)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), _flow_nll, (torch.randn(8, 4),)


def determinants_contiguous():
    torch.manual_seed(0)
    m = Determinants(qr=False)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), _flow_nll, (torch.randn(8, 4),)


class CheckedLinalg(nn.Module):
    """``linalg.cholesky`` and ``linalg.solve`` (each checks its factorization: ``_linalg_check_errors``) in a step
    with an in-place op, and ``kthvalue`` along its default last dim."""

    def __init__(self):
        super().__init__()
        self.A = nn.Parameter(torch.randn(4, 4) * 0.3)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        s = self.A @ self.A.T + torch.eye(4)
        h = self.lin(x) @ torch.linalg.cholesky(s)
        h = torch.linalg.solve(s, h.T).T
        h = h.clone().add_(1.0)
        return h + torch.kthvalue(h, 2).values.unsqueeze(-1)


def checked_linalg():
    torch.manual_seed(0)
    m = CheckedLinalg()
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), lambda m, x, y: nn.functional.mse_loss(m(x), y), _pair()


def loss_weights_outside():
    """Multi-task uncertainty weights (Kendall et al.) trained by the optimizer but kept outside the model."""
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    log_vars = nn.Parameter(torch.zeros(2))

    def loss(model, x, y):
        per_task = ((model(x) - y[:, :2]) ** 2).mean(0)
        return (torch.exp(-log_vars) * per_task + log_vars).sum()
    return m, torch.optim.Adam(list(m.parameters()) + [log_vars], lr=1e-2), loss, _pair()
