"""Tensor-only forms of torch optimizer kernels that read a tensor's value as a Python number even when torch
compiles them, swapped in while ``optim_traced`` traces ``step()`` (``traceable_kernels``).

``torch.optim.Adafactor``'s single-tensor kernel (torch 2.13, ``torch/optim/_adafactor.py``) takes ``.item()`` of
its step counter, of each parameter's norm and of each update's norm, in every step: tracing stops there, so the
optimizer could not be captured at all. ``adafactor_in_tensors`` is that kernel op for op, with the Python doubles
it computes from those numbers (``step ** beta2_decay``, ``min(lr, step ** -0.5)``, ``max(eps2, |p| / sqrt(n))``,
``max(1, |u| / (sqrt(n) d))``) kept as float64 0-dim tensors and Python's ``min``/``max`` as ``clamp``. Where torch
hands such a double to a kernel as a scalar (``lerp_``'s weight, ``add_``'s alpha), the kernel rounds it to the
tensor's dtype; here the 0-dim tensor is rounded to that dtype first, and ``add_``'s ``alpha`` becomes a multiply
(one rounding more than the fused kernel: float64 steps differ from torch's in the last bits); ``square_`` is
``pow_(2)``, which it is in ATen (functionalization does not take that composite in-place op). ``asgd_in_tensors``
is ASGD's default (non-capturable) path the same way, its branch a ``torch.where`` over both arms.
"""
from __future__ import annotations

import contextlib

import torch
import torch.optim._adafactor as torch_adafactor
import torch.optim.asgd as torch_asgd

__all__ = ["adafactor_in_tensors", "asgd_in_tensors", "traceable_kernels"]

_TORCH_ASGD = torch_asgd._single_tensor_asgd      # torch's kernel, for its capturable path


@contextlib.contextmanager
def traceable_kernels():
    """The kernels of this module in place of torch's while tracing (``adafactor`` looks its kernel up by name)."""
    before = torch_adafactor._single_tensor_adafactor, torch_asgd._single_tensor_asgd
    torch_adafactor._single_tensor_adafactor, torch_asgd._single_tensor_asgd = adafactor_in_tensors, asgd_in_tensors
    try:
        yield
    finally:
        torch_adafactor._single_tensor_adafactor, torch_asgd._single_tensor_asgd = before


def adafactor_in_tensors(params, grads, row_vars, col_vars, variances, state_steps, grad_scale, found_inf, *,
                         d: float, lr, beta2_decay: float, weight_decay: float, eps1, eps2: float, maximize: bool,
                         has_complex: bool) -> None:
    """``torch.optim._adafactor._single_tensor_adafactor`` without ``.item()`` (module docstring)."""
    if grad_scale is not None or found_inf is not None:
        raise AssertionError("Grad scaling should occur outside of optimizer.step()")
    lr = float(lr)
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        step_t, row_var, col_var, variance = state_steps[i], row_vars[i], col_vars[i], variances[i]
        eps = torch.finfo(param.dtype).eps if eps1 is None else eps1
        step_t += 1
        step = step_t.to(torch.float64)                      # torch: step_t.item()
        one_minus_beta2_t = (step ** beta2_decay).to(param.dtype)
        rho_t = torch.clamp(step ** -0.5, max=lr)            # min(lr, 1 / step ** 0.5)
        alpha = torch.clamp(param.norm(2).to(torch.float64) / (param.numel() ** 0.5), min=eps2) * rho_t
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        if grad.dim() > 1:
            row_mean = torch.norm(grad, dim=-1, keepdim=True).pow_(2).div_(grad.size(-1))
            row_var.lerp_(row_mean, one_minus_beta2_t)
            col_mean = torch.norm(grad, dim=-2, keepdim=True).pow_(2).div_(grad.size(-2))
            col_var.lerp_(col_mean, one_minus_beta2_t)
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps))
        else:
            variance.lerp_(grad * grad, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps * eps).rsqrt_()
        update.mul_(grad)
        denom = torch.clamp(update.norm(2).to(torch.float64) / ((update.numel() ** 0.5) * d), min=1.0)
        param.sub_(update * (alpha / denom).to(param.dtype))


def asgd_in_tensors(params, grads, axs, mus, etas, state_steps, *, lambd: float, lr, t0: float, alpha: float,
                    weight_decay: float, maximize: bool, differentiable: bool, capturable: bool,
                    has_complex: bool) -> None:
    """``torch.optim.asgd._single_tensor_asgd``'s default path (``capturable=False``) without ``.item()`` (module
    docstring); with ``capturable`` torch's own kernel reads no number and runs as it is."""
    if capturable:
        return _TORCH_ASGD(params, grads, axs, mus, etas, state_steps, lambd=lambd, lr=lr, t0=t0, alpha=alpha,
                           weight_decay=weight_decay, maximize=maximize, differentiable=differentiable,
                           capturable=capturable, has_complex=has_complex)
    lr = float(lr)
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        mu, ax, eta, step_t = mus[i], axs[i], etas[i], state_steps[i]
        if torch.is_complex(param):
            grad, param, ax = torch.view_as_real(grad), torch.view_as_real(param), torch.view_as_real(ax)
        step_t += 1
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        eta_value = eta.to(torch.float64)                    # torch: eta.item()
        param.mul_((1 - lambd * eta_value).to(param.dtype))
        param.sub_(grad * eta_value.to(param.dtype))         # torch: add_(grad, alpha=-eta)
        ax.copy_(torch.where(mu != 1, ax + (param - ax) * mu, param))   # torch: if mu.item() != 1 ... else copy
        step = step_t.to(torch.float64)                      # torch: step_t.item()
        eta.copy_(lr / ((1 + lambd * lr * step) ** alpha))
        mu.copy_(1 / torch.clamp(step - t0, min=1))          # torch: 1 / max(1, step - t0)
