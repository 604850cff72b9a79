"""Optimizers Rhino does not mirror, on a small MLP: their own step() is traced (capture/optim_traced.py).

Lion, a clipping SGD (global gradient norm inside step()), an Adam keeping its step counter in a tensor, a
slow-weights optimizer whose state starts from the parameter, torch's Rprop, ASGD and Adafactor (the last two
through ``capture.optim_kernels``) and a subclass of torch's SGD; and ones Rhino refuses with one sentence: a
Python step counter (in the state or on the optimizer), an SGD skipping gradients by their norm's ``.item()``
(reads a tensor's value), LBFGS (a closure).
The MLP has a frozen layer and an unused parameter (no gradient: stepped over).
"""
import math
import torch
import torch.nn as nn
import torch.nn.functional as F


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                beta1, beta2 = group["betas"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg * beta1 + p.grad * (1 - beta1)
                p.add_(torch.sign(update), alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class ClipSGD(torch.optim.Optimizer):
    """SGD with momentum and global gradient-norm clipping inside step()."""
    def __init__(self, params, lr=0.05, momentum=0.9, max_norm=0.5):
        super().__init__(params, dict(lr=lr, momentum=momentum, max_norm=max_norm))

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        for group in self.param_groups:
            scale = torch.clamp(group["max_norm"] / (total + 1e-6), max=1.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = torch.zeros_like(p)
                buf = st["buf"]
                buf.mul_(group["momentum"]).add_(p.grad * scale.to(p.dtype))
                p.sub_(group["lr"] * buf)


class TensorStepAdam(torch.optim.Optimizer):
    """Adam with its step counter in a tensor and bias corrections as tensor math."""
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=p.dtype)
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                st["step"] += 1
                st["m"].lerp_(p.grad, 1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                mhat = st["m"] / (1 - b1 ** st["step"])
                vhat = st["v"] / (1 - b2 ** st["step"])
                p.sub_(group["lr"] * mhat / (vhat.sqrt() + group["eps"]))


class IntStepAdam(TensorStepAdam):
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                st["step"] += 1
                st["m"].lerp_(p.grad, 1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                c1 = 1 - b1 ** st["step"]
                c2 = math.sqrt(1 - b2 ** st["step"])
                p.addcdiv_(st["m"], st["v"].sqrt() / c2 + group["eps"], value=-group["lr"] / c1)


class SGDClone(torch.optim.Optimizer):
    """Momentum buffer started from the first gradient (torch's SGD rule)."""
    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = p.grad.clone()
                else:
                    st["buf"].mul_(0.9).add_(p.grad)
                p.add_(st["buf"], alpha=-group["lr"])


class NormGateSGD(torch.optim.Optimizer):
    """Skips a parameter whose gradient norm is above a threshold, read as a Python number (``.item()``)."""
    def __init__(self, params, lr=0.05, gate=10.0):
        super().__init__(params, dict(lr=lr, gate=gate))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.norm().item() <= group["gate"]:
                    p.add_(p.grad, alpha=-group["lr"])


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
        self.body[2].requires_grad_(False)                # frozen
        self.unused = nn.Parameter(torch.ones(4))          # in the optimizer, never reached: no gradient

    def forward(self, x):
        return self.body(x)


def _mlp():
    torch.manual_seed(0)
    return _MLP()


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 16, generator=g)
    return x, (x @ torch.randn(16, 8, generator=g)).argmax(-1)


def _w(make):
    model = _mlp()
    return model, make(model.parameters()), loss_fn, _batch()


def lion(): return _w(lambda ps: Lion(ps, lr=1e-3, weight_decay=0.01))
def clipsgd(): return _w(lambda ps: ClipSGD(ps))
def tensorstep(): return _w(lambda ps: TensorStepAdam(ps))
def intstep(): return _w(lambda ps: IntStepAdam(ps))
def sgdclone(): return _w(lambda ps: SGDClone(ps))
def rprop(): return _w(lambda ps: torch.optim.Rprop(ps, lr=0.01))
def asgd(): return _w(lambda ps: torch.optim.ASGD(ps, lr=0.01))
def adafactor(): return _w(lambda ps: torch.optim.Adafactor(ps, lr=0.01))
def normgate(): return _w(lambda ps: NormGateSGD(ps))
def sparseadam(): return _w(lambda ps: torch.optim.SparseAdam(list(ps), lr=0.01))
def lbfgs(): return _w(lambda ps: torch.optim.LBFGS(ps, lr=0.1))


class MySGD(torch.optim.SGD):
    pass


def subclass(): return _w(lambda ps: MySGD(ps, lr=0.05, momentum=0.9))


class SlowWeights(torch.optim.Optimizer):
    """SGD plus a slow copy of each weight started from the weight itself (Lookahead-like, every step)."""
    def __init__(self, params, lr=0.05, alpha=0.5):
        super().__init__(params, dict(lr=lr, alpha=alpha))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "slow" not in st:
                    st["slow"] = p.detach().clone()
                p.add_(p.grad, alpha=-group["lr"])
                st["slow"].add_(p - st["slow"], alpha=group["alpha"])
                p.copy_(st["slow"])


class Counter(torch.optim.Optimizer):
    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))
        self.t = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.t += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / self.t)


class GramSGD(torch.optim.Optimizer):
    """A Shampoo-like step: a 2-D gradient preconditioned by its own Gram matrix (``L += G @ G.T``, then
    ``L @ G``), other gradients scaled to unit norm: non-linear in the gradient in ways an accumulation of
    micro-batches must not sum (the gradient is summed first, as PyTorch's accumulation loop does)."""
    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if p.dim() == 2:
                    st = self.state[p]
                    if not st:
                        st["gram"] = torch.zeros(p.shape[0], p.shape[0], dtype=p.dtype)
                    st["gram"].add_(g @ g.T)
                    update = st["gram"] @ g / (1 + st["gram"].diagonal().sum())
                else:
                    update = g / (torch.linalg.vector_norm(g) + 1e-3)
                p.sub_(group["lr"] * update)


def slow(): return _w(lambda ps: SlowWeights(ps))
def gram(): return _w(lambda ps: GramSGD(ps))
def counter(): return _w(lambda ps: Counter(ps))


class OldStyle(torch.optim.Optimizer):
    """Older optimizer code: a plain attribute, a 0-dim state made with torch.tensor, p.data rebound."""
    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))
        self.decay = 0.5                      # dropped by a plain deepcopy of an Optimizer

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["count"] = torch.tensor(0.0, dtype=p.dtype)
                st["count"] += 1
                p.data = p.data - group["lr"] * p.grad / st["count"] ** self.decay


class GroupCounter(torch.optim.Optimizer):
    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr, t=torch.zeros(())))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["t"] = group["t"] + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] / group["t"] * p.grad)


class Wrapping(torch.optim.Optimizer):
    """Lookahead-style: steps an inner optimizer, then pulls the weights back."""
    def __init__(self, inner):
        self.inner = inner
        self.param_groups, self.defaults, self.state = inner.param_groups, inner.defaults, inner.state
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    @torch.no_grad()
    def step(self, closure=None):
        self.inner.step()
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(0.5)


class OutKeyword(torch.optim.Optimizer):
    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["vmax"] = torch.zeros_like(p)
                torch.max(st["vmax"], p.grad * p.grad, out=st["vmax"])
                p.sub_(group["lr"] * p.grad / (st["vmax"].sqrt() + 1e-8))


class NeedsClosure(SGDClone):
    @torch.no_grad()
    def step(self, closure=None):
        assert closure is not None, "this optimizer needs a closure"
        return super().step()


def oldstyle(): return _w(lambda ps: OldStyle(ps))
def groupcounter(): return _w(lambda ps: GroupCounter(ps))
def wrapping(): return _w(lambda ps: Wrapping(torch.optim.SGD(ps, lr=0.05)))
def outkeyword(): return _w(lambda ps: OutKeyword(ps))
def needsclosure(): return _w(lambda ps: NeedsClosure(ps))


class ForeachAdam(torch.optim.Optimizer):
    """Multi-tensor Adam written with torch._foreach_* ops over each group's parameters."""
    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:
                    self.state[p].update(step=torch.tensor(0.0, dtype=p.dtype), m=torch.zeros_like(p),
                                         v=torch.zeros_like(p))
            grads = [p.grad for p in params]
            steps, ms, vs = ([self.state[p][k] for p in params] for k in ("step", "m", "v"))
            b1, b2 = group["betas"]
            torch._foreach_add_(steps, 1)
            torch._foreach_lerp_(ms, grads, 1 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, 1 - b2)
            denom = torch._foreach_sqrt([v / (1 - b2 ** s) for v, s in zip(vs, steps)])
            torch._foreach_add_(denom, group["eps"])
            updates = torch._foreach_div([m / (1 - b1 ** s) for m, s in zip(ms, steps)], denom)
            torch._foreach_add_(params, updates, alpha=-group["lr"])


def foreach(): return _w(lambda ps: ForeachAdam(ps))


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam's update scaled per parameter by the trust ratio ||p|| / ||update|| (torch.linalg.vector_norm)."""
    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["m"].lerp_(p.grad, 1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = st["m"] / (st["v"].sqrt() + group["eps"]) + group["weight_decay"] * p
                w, u = torch.linalg.vector_norm(p), update.norm()
                trust = torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
                p.sub_(group["lr"] * trust * update)


def lamb(): return _w(lambda ps: Lamb(ps))


def lion_gpt():
    """examples/gpt.py (a tied embedding) trained with Lion."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("gpt_example", Path(__file__).parents[2] / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    model, _, loss, batch = gpt.workload()
    return model, Lion(model.parameters(), lr=1e-4, weight_decay=0.1), loss, batch
