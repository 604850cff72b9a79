"""Activation recomputation: saved activation bytes and extra forward compute (pure Python).

Inputs: the per-rank ``MemoryEstimate`` (its activation spans: producer index, last forward use,
bytes) and the per-node compute times of ``StepTime``. ``cost.remat`` executes exactly this: it
rewrites the graph with the segments of ``full_segments`` and the kept kinds of ``KEEP_KINDS``, and
``remat_effect`` prices the rewritten program with the same liveness estimate (what ``estimate``
uses); ``apply_recompute`` is the fast analytic reading of the same rules (the search's).

- ``none``: every activation is kept (the captured program).
- ``full`` (checkpointing, Chen et al. 2016 "Training Deep Nets with Sublinear Memory Cost",
  arXiv 1604.06174; Megatron-LM's full recompute): the forward pass is cut into ``K`` segments;
  only the tensors crossing a cut (what a later segment's forward reads) and the last segment's
  activations are kept, and during the backward pass one segment's activations are rematerialised
  at a time. With ``c`` the smallest cut in the middle 80% of the forward pass (between
  transformer layers: the residual stream) and ``A`` the activation bytes, saved ~ ``K c + A / K``,
  minimised at ``K = sqrt(A / c)`` (rounded, at least 1). The ``K - 1`` cuts: for ``k = 1..K-1``,
  the forward position with the smallest cut among those whose activation bytes made so far are
  within ``A / 2K`` of ``k A / K`` (equal segments, cut where the least crosses). Extra work: the
  forward nodes of the first ``K - 1`` segments once more, with their blocking (tensor-parallel)
  communication.
- ``selective`` (policy "save the outputs of compute-heavy ops, recompute the cheap ones", as
  PyTorch's selective-checkpoint policies and Megatron-LM's selective recomputation of the
  attention core do): within the same segments, activations produced by MATMUL, CONV, ATTENTION,
  INDEX and LOSS ops (and opaque ops) are kept as well; those of element-wise, norm, reduction and
  data-movement ops are dropped and recomputed from them (the segments bound the chains of cheap ops
  a recomputation replays, as a per-layer checkpoint region does). Extra compute: the forward time
  of the dropped producers.
- Random ops (dropout, rand; ``registry.is_random``) are never rerun: their outputs are kept.

Memory at the peak: with the rewritten program's estimate (``RecomputeEffect.memory``) its peak
breakdown; else the peak's activation bytes scale by saved / all activations (the peak of a
training step sits at the forward/backward crossover, where all saved activations are live).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from enum import Enum
from math import isqrt

from ..ir.graph import Graph
from ..ir.registry import OpKind, is_random, lookup
from .memory import MemoryEstimate
from .step import NodeCost

__all__ = ["Recompute", "RecomputeEffect", "Segments", "apply_recompute", "forward_cuts", "full_segments",
           "KEEP_KINDS"]

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
    memory: MemoryEstimate | None = None  # the rewritten program's estimate (``cost.remat.remat_effect``)

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


@dataclass(frozen=True)
class Segments:
    """How ``full`` (and ``selective``) cut the forward pass: ``k`` segments, the representative cut
    ``cut`` (bytes), and ``positions``: the forward node indices after which it is cut (ascending)."""

    k: int
    cut: int
    positions: tuple[int, ...]


def full_segments(mem: MemoryEstimate) -> Segments:
    """The segments of the module docstring (``K = sqrt(A / c)``, cuts at the least-crossed positions
    near equal activation bytes)."""
    total = sum(s for _, _, s in mem.activation_spans)
    b = mem.boundary
    if total == 0 or b < 0:
        return Segments(1, 0, ())
    cuts = forward_cuts(mem)
    lo, hi = b // 10, max(b // 10 + 1, b - b // 10)
    middle = [c for c in cuts[lo:hi] if c > 0]
    c = min(middle) if middle else total
    k = max(1, isqrt(max(1, total // max(1, c))))
    made = [0] * (b + 1)   # activation bytes made at or before each forward node
    for born, _, size in mem.activation_spans:
        if 0 <= born <= b:
            made[born] += size
    for p in range(1, b + 1):
        made[p] += made[p - 1]
    positions: list[int] = []
    for j in range(1, k):
        target, half = j * total / k, total / (2 * k)
        near = [p for p in range((positions[-1] + 1) if positions else 0, b) if abs(made[p] - target) <= half]
        if near:
            positions.append(min(near, key=lambda p: (cuts[p], abs(made[p] - target))))
    return Segments(k, c, tuple(positions))


def _kept_analytic(graph: Graph, mem: MemoryEstimate, seg: Segments, mode: "Recompute") -> tuple[int, set[int]]:
    """(activation bytes kept, forward nodes rerun) as ``cost.remat`` decides, read from the spans."""
    pos, last = seg.positions, len(seg.positions)
    kept, rerun = 0, set()
    for born, last_fwd, size in mem.activation_spans:
        d = lookup(graph.nodes[born].op) if born >= 0 else None
        s = bisect_left(pos, born) if born >= 0 else last
        keep = (s == last or bisect_left(pos, last_fwd) > s or d is None or d.kind is OpKind.OPAQUE
                or is_random(graph.nodes[born].op) or (mode is Recompute.SELECTIVE and d.kind in KEEP_KINDS))
        if keep:
            kept += size
        else:
            rerun.add(born)
    if mode is Recompute.FULL:  # the whole forward of the recomputed segments
        end = pos[-1] if pos else -1
        rerun = {i for i in range(end + 1) if not is_random(graph.nodes[i].op)}
    return kept, rerun


def apply_recompute(graph: Graph, mem: MemoryEstimate, nodes: list[NodeCost], mode: Recompute | str) -> RecomputeEffect:
    """The effect of ``mode`` given the step's per-node costs (``StepTime.nodes``), read analytically
    from the activation spans (fast: the search calls it; ``cost.remat.remat_effect`` prices the
    rewritten program itself)."""
    mode = Recompute(mode)
    total = sum(s for _, _, s in mem.activation_spans)
    if mode is Recompute.NONE or total == 0 or mem.boundary < 0:
        return RecomputeEffect(mode, total, total, 0.0, 0.0)
    seg = full_segments(mem)
    saved, rerun = _kept_analytic(graph, mem, seg, mode)
    secs = sum(nodes[i].compute for i in rerun)
    flops = sum(nodes[i].flops for i in rerun)
    comm = sum(nodes[i].comm for i in rerun if nodes[i].kind == "blocking")
    return RecomputeEffect(mode, total, saved, secs, flops, seg.k,
                           [f"{mode.value} recomputation: {seg.k} segments, cut {seg.cut} B, keeps "
                            f"{saved / total:.0%} of the activations"], extra_comm_seconds=comm)
