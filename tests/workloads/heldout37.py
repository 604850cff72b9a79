"""Held-out workloads of session 37 that found bugs (tests/test_user_optimizers.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ClippingSGD(torch.optim.SGD):
    """Gradient clipping in a subclass of torch's SGD: its first step starts the momentum buffer from the
    gradient (``torch.clone(grad)``), so that state is not a function of the state before the step."""

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_norm=0.05)
        return super().step(closure)


class ClippingAdamW(torch.optim.AdamW):
    """Value clipping before torch's AdamW, whose step reads its step counter as a number unless compiling."""

    def step(self, closure=None):
        for group in self.param_groups:
            torch.nn.utils.clip_grad_value_(group["params"], clip_value=0.01)
        return super().step(closure)


class StartedFromGradient(torch.optim.Optimizer):
    """A user-written optimizer whose first step stores a gradient-made state with its own first update
    (an Adagrad-like scale started at the first squared gradient, not at zeros)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "scale" not in st:
                    st["scale"] = p.grad * p.grad + 1.0
                    p.add_(p.grad, alpha=-2 * group["lr"])    # a different first update
                else:
                    st["scale"].mul_(0.9).addcmul_(p.grad, p.grad, value=0.1)
                    p.addcdiv_(p.grad, st["scale"].sqrt(), value=-group["lr"])


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _xy(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _mse(m, x, y):
    return F.mse_loss(m(x), y)


def clip_norm_sgd():
    torch.manual_seed(1)
    m = _mlp()
    return m, ClippingSGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.1), _mse, _xy(1)


def clip_value_adamw():
    torch.manual_seed(2)
    m = _mlp()
    return m, ClippingAdamW(m.parameters(), lr=1e-2, weight_decay=0.1), _mse, _xy(2)


def started_from_gradient():
    torch.manual_seed(3)
    m = _mlp()
    return m, StartedFromGradient(m.parameters()), _mse, _xy(3)


class Routed(nn.Module):
    """Top-2 routing with a load-balancing term whose counts start from ``torch.zeros(n, e)`` (no dtype: the
    default dtype of whoever runs it)."""

    def __init__(self, d=8, e=4):
        super().__init__()
        self.e = e
        self.router = nn.Linear(d, e, bias=False)
        self.experts = nn.Parameter(torch.randn(e, d, d) * 0.2)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        top, idx = probs.topk(2, dim=-1)
        y = sum(torch.bmm(x.unsqueeze(1), self.experts.index_select(0, idx[:, k])).squeeze(1) * top[:, k:k + 1]
                for k in range(2))
        counts = torch.zeros(x.shape[0], self.e).scatter_add(1, idx, torch.ones_like(top))
        aux = self.e * (counts.mean(0) / 2 * probs.mean(0)).sum()
        return self.out(torch.tanh(y) + x), aux


def _routed_loss(m, x, y):
    out, aux = m(x)
    return F.mse_loss(out, y) + 0.01 * aux


def routed():
    torch.manual_seed(4)
    m = Routed()
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), _routed_loss, _xy(4)


def _linear():
    torch.manual_seed(5)
    m = nn.Linear(8, 4)
    return m, torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5), _mse, _xy(5)


def param_hook():
    """Per-value gradient clipping as torch's docs write it: a hook on each parameter (it changes the gradient
    autograd gives the parameter; the traced parameters are other tensors, so it ran nowhere)."""
    m, opt, loss, batch = _linear()
    for p in m.parameters():
        p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    return m, opt, loss, batch


def step_hooks():
    """Clipping in an optimizer step pre-hook, weight clamping in a post-hook (WGAN's critic), on torch's SGD."""
    m, opt, loss, batch = _linear()

    def clip(o, args, kwargs):
        torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], 0.01)

    def clamp(o, args, kwargs):
        with torch.no_grad():
            for g in o.param_groups:
                for p in g["params"]:
                    p.clamp_(-0.3, 0.3)
    opt.register_step_pre_hook(clip)
    opt.register_step_post_hook(clamp)
    return m, opt, loss, batch


def post_accumulate_hook():
    m, opt, loss, batch = _linear()
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(0.5))
    return m, opt, loss, batch


class FFTKernel(nn.Module):
    """A learned kernel applied as a product of spectra: its gradient comes back through rfft's backward, whose
    last storage is complex (the real gradient a view of it); a pipeline's stages exchange complex values."""

    def __init__(self, d=8, n=8):
        super().__init__()
        self.k = nn.Parameter(torch.randn(d, n) * 0.1)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):                        # x: [batch, n, d]
        u = self.proj(x).transpose(1, 2)
        n = u.shape[-1]
        y = torch.fft.irfft(torch.fft.rfft(u, n=2 * n) * torch.fft.rfft(self.k, n=2 * n), n=2 * n)[..., :n]
        return self.head(y.transpose(1, 2).mean(1))


def fft_kernel():
    torch.manual_seed(6)
    m = FFTKernel()
    g = torch.Generator().manual_seed(6)
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x, y: F.mse_loss(m(x), y), \
        (torch.randn(8, 8, 8, generator=g), torch.randn(8, 4, generator=g))
