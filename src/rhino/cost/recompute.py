"""Activation recomputation: saved activation bytes and extra forward compute (pure Python).

Inputs: the per-rank ``MemoryEstimate`` (its activation spans: producer index, last forward use,
bytes) and the per-node compute times of ``StepTime``.

- ``none``: every activation is kept (the captured program).
- ``full`` (checkpointing, Chen et al. 2016 "Training Deep Nets with Sublinear Memory Cost",
  arXiv 1604.06174; Megatron-LM's full recompute): the forward pass is cut into ``K`` segments;
  only the tensors crossing a cut (what the next segment's forward reads) are kept, and during the
  backward pass one segment's activations are rematerialised at a time. With ``c`` the smallest cut
  in the middle 80% of the forward pass (between transformer layers: the residual stream) and ``A``
  the activation bytes, saved = ``K c + A / K``, minimised at ``K = sqrt(A / c)`` (rounded, at
  least 1). Extra work: the whole forward pass once more, with its blocking (tensor-parallel)
  communication.
- ``selective`` (policy "save the outputs of compute-heavy ops, recompute the cheap ones", as
  PyTorch's selective-checkpoint policies and Megatron-LM's selective recomputation of the
  attention core do): activations produced by MATMUL, CONV, ATTENTION, INDEX and LOSS ops (and
  opaque ops) are kept; those of element-wise, norm, reduction, random and data-movement ops are
  dropped and recomputed. Extra compute: the forward time of the dropped producers.

Memory at the peak: the peak's activation bytes scale by saved / all activations (the peak of a
training step sits at the forward/backward crossover, where all saved activations are live).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from math import isqrt

from ..ir.graph import Graph
from ..ir.registry import OpKind, lookup
from .memory import MemoryEstimate
from .step import NodeCost

__all__ = ["Recompute", "RecomputeEffect", "apply_recompute", "forward_cuts", "KEEP_KINDS"]

#: Op kinds whose outputs selective recomputation keeps.
KEEP_KINDS = frozenset({OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION, OpKind.INDEX, OpKind.LOSS, OpKind.OPAQUE})


class Recompute(str, Enum):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


@dataclass
class RecomputeEffect:
    mode: Recompute
    activations: int           # all activation bytes (no recomputation)
    saved: int                 # activation bytes kept for the backward pass
    extra_seconds: float       # recomputed forward compute per step
    extra_flops: float
    segments: int = 1
    notes: list[str] = field(default_factory=list)
    extra_comm_seconds: float = 0.0   # blocking communication of the recomputed forward (tensor parallelism)

    @property
    def keep_fraction(self) -> float:
        return self.saved / self.activations if self.activations else 1.0


def forward_cuts(mem: MemoryEstimate) -> list[int]:
    """``cuts[p]``: activation bytes produced at or before forward node ``p`` and read by a forward
    node after ``p`` (what a checkpoint after ``p`` must keep)."""
    b = mem.boundary
    if b < 0:
        return []
    diff = [0] * (b + 2)
    for born, last_fwd, size in mem.activation_spans:
        if born < 0 or last_fwd <= born:
            continue
        diff[born] += size
        diff[min(last_fwd, b + 1)] -= size
    cuts, run = [], 0
    for p in range(b + 1):
        run += diff[p]
        cuts.append(run)
    return cuts


def apply_recompute(graph: Graph, mem: MemoryEstimate, nodes: list[NodeCost], mode: Recompute | str) -> RecomputeEffect:
    """The effect of ``mode`` given the step's per-node costs (``StepTime.nodes``)."""
    mode = Recompute(mode)
    node_seconds = [c.compute for c in nodes]
    node_flops = [c.flops for c in nodes]
    total = sum(s for _, _, s in mem.activation_spans)
    if mode is Recompute.NONE or total == 0 or mem.boundary < 0:
        return RecomputeEffect(mode, total, total, 0.0, 0.0)
    b = mem.boundary
    if mode is Recompute.FULL:
        cuts = forward_cuts(mem)
        lo, hi = b // 10, max(b // 10 + 1, b - b // 10)
        middle = [c for c in cuts[lo:hi] if c > 0]
        c = min(middle) if middle else total
        k = max(1, isqrt(max(1, total // max(1, c))))
        saved = min(total, k * c + -(-total // k))
        comm = sum(c.comm for c in nodes[:b + 1] if c.kind == "blocking")
        return RecomputeEffect(mode, total, saved, sum(node_seconds[:b + 1]), sum(node_flops[:b + 1]), k,
                               [f"full recomputation: {k} segments, cut {c} B, keeps {saved / total:.0%} "
                                f"of the activations"], extra_comm_seconds=comm)
    dropped, secs, flops = 0, 0.0, 0.0
    for born, _, size in mem.activation_spans:
        d = lookup(graph.nodes[born].op) if born >= 0 else None
        if d is not None and d.kind not in KEEP_KINDS:
            dropped += size
            secs += node_seconds[born]
            flops += node_flops[born]
    return RecomputeEffect(mode, total, total - dropped, secs, flops, 1,
                           [f"selective recomputation keeps {(total - dropped) / total:.0%} of the activations"])
