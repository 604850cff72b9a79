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
