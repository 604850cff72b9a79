"""Gradient accumulation fused into the matmul that makes the gradient (a rewrite of a lowered program).

A program of a later micro-batch (``lower.spmd.Part.accumulate``) adds each gradient it makes into an
accumulator in place: ``acc.add_(g)``. A weight's gradient is usually a matmul, seen through transposes,
``g = t(...t(mm(a, b)))``; the program then allocates a weight-sized result, writes it, and reads it again
for the addition, once per micro-batch, while the work of the matmul shrinks with the micro-batch.

**Rewrite** (``fuse_matmul_accumulation``): ``acc.add_(t^k(mm(a, b)))``, where the ``mm`` and every
transpose of the chain have no other reader, becomes ``t^(k mod 2)(acc).addmm_(a, b)``: the matmul adds
its product into the accumulator (``beta = 1``: BLAS reads the accumulator instead of a fresh result, no
separate pass, no allocation). A transpose of the accumulator is a view of it, so ``acc`` is updated.
Exactness: the same products summed in the same order within each element, then added to the
accumulator; BLAS may add a long contraction into the accumulator in several partial sums, so the result
can differ from ``mm`` then ``add_`` by rounding (float64: about 1e-16 relative).
"""
from __future__ import annotations

import torch
import torch.fx

__all__ = ["fuse_matmul_accumulation"]

_MM = torch.ops.aten.mm.default
_T = torch.ops.aten.t.default


def fuse_matmul_accumulation(fg: torch.fx.Graph) -> set[torch.fx.Node]:
    """Rewrite every fusable ``add_`` of ``fg`` (module docstring) in place; returns the nodes removed."""
    removed: set[torch.fx.Node] = set()
    for add in [n for n in fg.nodes if n.op == "call_function" and n.target is torch.Tensor.add_]:
        if len(add.args) != 2 or add.kwargs or add.users:
            continue
        acc, x = add.args
        chain = []
        while isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target is _T and len(x.users) == 1:
            chain.append(x)
            x = x.args[0]
        if not (isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target is _MM
                and len(x.users) == 1 and not x.kwargs and all(isinstance(a, torch.fx.Node) for a in x.args)):
            continue
        a, b = x.args
        with fg.inserting_before(add):
            target = fg.call_function(_T, (acc,)) if len(chain) % 2 else acc
            fg.call_function(torch.Tensor.addmm_, (target, a, b))
        for n in [add, *chain, x]:      # readers first
            fg.erase_node(n)
            removed.add(n)
    return removed
