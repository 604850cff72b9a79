"""Activation recomputation: saved activation bytes and extra forward compute (pure Python).

Inputs: the per-rank ``MemoryEstimate`` (its activation spans: producer index, last forward use,
bytes) and the per-node compute times of ``StepTime``. ``cost.remat`` executes exactly this: it
rewrites the graph with the segments of ``segment_choices`` and the kept kinds of ``KEEP_KINDS``, and
``remat_effect`` prices the rewritten program with the same liveness estimate (what ``estimate``
uses); ``apply_recompute`` is the fast analytic reading of the same rules (the search's).

- ``none``: every activation is kept (the captured program).
- ``full`` (checkpointing, Chen et al. 2016 "Training Deep Nets with Sublinear Memory Cost",
  arXiv 1604.06174; Megatron-LM's full recompute): the forward pass is cut into ``K`` segments;
  only the tensors crossing a cut (what a later segment's forward reads) and the last segment's
  activations are kept, and during the backward pass one segment's activations are rematerialised
  at a time. With ``c`` the smallest cut in the middle 80% of the forward pass (between
  transformer layers: the residual stream) and ``A`` the activation bytes, saved ~ ``K c + A / K``,
  minimised at ``K = sqrt(A / c)`` (rounded, at least 1). Cuts count every value a later forward
  node reads (a checkpoint keeps it even if the backward did not need it). For ``k`` from 1 to
  ``2K``, each next cut goes at the least-crossed position within ``A / 2k`` of the previous cut
  plus ``A / k`` activation bytes; the segmentations are ranked by their predicted worst moment and
  the best few compared on the estimate of their rewritten graphs (``cost.remat``). Extra work: the
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

from dataclasses import dataclass, field

from ..ir.analysis import analyze
from ..ir.graph import Graph
from ..sharding.plan import ResolvedPlan
from .memory import MemoryEstimate, estimate_memory
from .remat import KEEP_KINDS, Recompute, Segments, forward_cuts, full_segments, remat, remat_resolved
from .step import NodeCost

__all__ = ["Recompute", "RecomputeEffect", "Segments", "apply_recompute", "remat_effect", "forward_cuts",
           "full_segments", "KEEP_KINDS"]


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


def apply_recompute(graph: Graph, mem: MemoryEstimate, nodes: list[NodeCost], mode: Recompute | str) -> RecomputeEffect:
    """The effect of ``mode`` given the step's per-node costs (``StepTime.nodes``) without a plan (the
    search's reading, fast): ``cost.remat`` rewrites the graph once at global sizes; the storages its
    backward reads from the forward, at ``mem``'s sizes, are the saved bytes; the extra work is the
    rerun nodes' (``remat_effect`` prices a plan's rewritten program itself)."""
    mode = Recompute(mode)
    total = sum(s for _, _, s in mem.activation_spans)
    if mode is Recompute.NONE or total == 0 or analyze(graph).loss_node is None:
        return RecomputeEffect(mode, total, total, 0.0, 0.0)
    new, origin = remat(graph, mode)
    kept = set(estimate_memory(new).activation_values)   # storages the rewritten backward reads
    saved = sum(size for (_, _, size), v in zip(mem.activation_spans + mem.forward_only_spans,
                                                 mem.activation_values + mem.forward_only_values) if v in kept)
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    rerun = [nodes[index[o]] for o in origin.values()]
    k = new.meta.get("recompute", {}).get("segments", 1)
    return RecomputeEffect(mode, total, saved, sum(c.compute for c in rerun), sum(c.flops for c in rerun), k,
                           [f"{mode.value} recomputation: {len(rerun)} forward nodes rerun in {k} segments, "
                            f"keeps {saved / total:.0%} of the activations"],
                           extra_comm_seconds=sum(c.comm for c in rerun if c.kind == "blocking"))


def remat_effect(rp: ResolvedPlan, mem: MemoryEstimate, nodes: list[NodeCost], mode: Recompute | str,
                 rank: int = 0) -> RecomputeEffect:
    """The effect of ``mode`` priced on the rewritten program of a plan: ``memory`` is
    ``estimate_memory`` of ``remat(graph)`` under the mapped plan (``saved``: its activation bytes);
    the extra compute is the copies' (each runs its original's strategy: ``nodes``, the original
    program's ``StepTime.nodes``) and the extra blocking communication their originals' (a copy reading
    a checkpoint in another sharding reuses the forward's redistribution, so this slightly overcounts)."""
    mode = Recompute(mode)
    total = mem.activations
    graph = rp.graph
    new, origin = remat(graph, mode)
    if not origin:
        return RecomputeEffect(mode, total, total, 0.0, 0.0, notes=[f"{mode.value} recomputation: nothing to "
                                                                    f"recompute"], memory=mem)
    mem2 = estimate_memory(new, remat_resolved(rp, new, origin), rank)
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    rerun = [nodes[index[o]] for o in origin.values()]
    k = new.meta.get("recompute", {}).get("segments", 1)
    return RecomputeEffect(
        mode, total, mem2.activations, sum(c.compute for c in rerun), sum(c.flops for c in rerun),
        k, [f"{mode.value} recomputation: {len(rerun)} forward nodes rerun in {k} segments, keeps "
            f"{mem2.activations / max(1, total):.0%} of the activations"],
        extra_comm_seconds=sum(c.comm for c in rerun if c.kind == "blocking"), memory=mem2)
