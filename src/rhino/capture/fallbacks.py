"""Fake kernels for ops whose own fake (meta) kernel refuses inputs that the real kernel accepts.

Capture runs the training step on fake tensors, so an op's fake kernel decides what can be traced.
Some fake kernels check for the inputs one backend supports rather than those every backend
supports: ``aten._grouped_mm`` (``torch.nn.functional.grouped_mm``, which transformers 5 uses for
mixture-of-experts layers) insists on bfloat16 because the CUDA kernel does, while the CPU kernel
also takes float32 and float16. Eager PyTorch then trains a model that capture would reject.

A *fallback* is a fake implementation registered for one op while capture traces (and removed
afterwards, so nothing outside capture changes): it computes the output's shape and dtype without
the refusing check. The op stays in the graph as it is, so execution runs the real kernel, which
raises its own error for inputs it does not support; in the IR an op with no sharding rule runs
replicated. Adding an op is one function registered with ``@fallback("aten::name.overload")``.

One composite op is traced through an equivalent composition instead: ``torch.ctc_loss`` with the mean
reduction builds a tensor from the list of target lengths in C++ (``at::tensor``), which fake tensors
cannot hold; ``_ctc_mean`` takes the per-sequence losses and divides as that C++ code does.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch._library.simple_registry import singleton
from torch._library.utils import Kernel
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["FALLBACKS", "fallback", "fake_fallbacks"]

# qualified op name ("aten::_grouped_mm") -> fake implementation
FALLBACKS: dict[str, Callable] = {}


def fallback(qualname: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the fake implementation of ``qualname`` while capture traces."""
    def register(fn: Callable) -> Callable:
        FALLBACKS[qualname] = fn
        return fn
    return register


@contextlib.contextmanager
def fake_fallbacks() -> Iterator[None]:
    """Fake tensors use the fallbacks of ``FALLBACKS`` inside this block: FakeTensorMode consults the
    registry of fake implementations (``torch.library.register_fake``'s) before an op's meta kernel.
    The fallback is added to that registry directly (no dispatcher registration, so the meta kernel
    itself is untouched) and removed on exit, with the fake-tensor cache of outputs it produced."""
    added = []
    ctc = torch.ctc_loss
    torch.ctc_loss = _ctc_mean(ctc)
    try:
        for qualname, fn in FALLBACKS.items():
            holder = singleton.find(qualname).fake_impl
            if holder.kernel is not None:  # an implementation registered by someone else stays
                continue
            kernel = Kernel(fn, f"rhino.capture.fallbacks ({qualname})")
            holder.kernels.append(kernel)
            added.append((holder, kernel))
        yield
    finally:
        torch.ctc_loss = ctc
        for holder, kernel in added:
            holder.kernels.remove(kernel)
        if added:
            FakeTensorMode.cache_clear()


@fallback("aten::_grouped_mm")
def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """Shapes of ``_grouped_mm`` (as torch's meta kernel, without its bfloat16-only check, which the
    CPU kernel does not make): 2-D x 3-D -> (tokens, n) (experts over the rows of ``mat_a``);
    3-D x 2-D -> (m, n); 2-D x 2-D -> (groups, m, n) (the weight gradient); 3-D x 3-D -> bmm."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        shape = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        shape = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        shape = [mat_a.size(1), mat_b.size(1)]
    else:
        shape = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    torch._check(mat_a.size(-1) == mat_b.size(-2),
                 lambda: f"grouped_mm: contraction sizes differ ({list(mat_a.shape)} x {list(mat_b.shape)})")
    return mat_a.new_empty(shape, dtype=out_dtype or mat_a.dtype)


@fallback("aten::_ctc_loss")
def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """Shapes of ``_ctc_loss`` with the lengths as lists of ints (``F.ctc_loss(..., [T] * N, [S] * N)``):
    the loss per sequence ``(N,)`` and the forward variables ``(N, T, 2 * max(target_lengths) + 1)``, as
    the CPU kernel allocates them. Torch's fake kernel calls every form of the op dynamic, as it is where
    the lengths are tensors (their values give the shape), which stay refused."""
    batch = log_probs.size(1) if log_probs.dim() == 3 else 1
    # the real kernel's checks: the backward's fake is that kernel run on zeros, which reads past the log-probs where
    # a length exceeds them (a segmentation fault: a time-major step cut into micro-batches along time)
    torch._check(len(input_lengths) == batch, lambda: "input_lengths must be of size batch_size")
    torch._check(len(target_lengths) == batch, lambda: "target_lengths must be of size batch_size")
    for n in input_lengths:
        torch._check(0 <= n <= log_probs.size(0),
                     lambda: f"Expected input_lengths to have value at most {log_probs.size(0)}, but got value {n}")
    states = 2 * max(target_lengths, default=0) + 1
    return (log_probs.new_empty([batch]), log_probs.new_empty([batch, log_probs.size(0), states]))


def _ctc_mean(ctc: Callable) -> Callable:
    """``torch.ctc_loss`` whose mean reduction with lengths as lists of ints is ``(losses /
    clamp_min(lengths, 1)).mean()`` over the per-sequence losses, the reduction ATen computes (LossCTC.cpp,
    ``ctc_loss_impl``) on a tensor it makes from the list; every other call goes to ``ctc`` as it is."""
    def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1, zero_infinity=False):
        if reduction != 1 or isinstance(input_lengths, torch.Tensor) or isinstance(target_lengths, torch.Tensor):
            return ctc(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
        losses = ctc(log_probs, targets, input_lengths, target_lengths, blank, 0, zero_infinity)
        lengths = torch.tensor(list(target_lengths), dtype=losses.dtype, device=losses.device).clamp_min(1)
        return (losses / lengths).mean()
    return ctc_loss
