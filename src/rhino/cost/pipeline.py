"""Pipeline stages and micro-batches, analytically (pure Python; the pipeline runtime comes later).

The captured step is one SPMD program over the stage mesh; ``pp`` stages and ``m`` micro-batches
are modelled on top of it (Narayanan et al. 2021, arXiv 2104.04473, section 2.2):

- Stages are balanced: each holds 1/pp of the forward/backward compute, of the parameters,
  gradients and optimizer state, and of the activations (the search's stage planner will replace
  this with real stage boundaries).
- Per micro-batch, each forward/backward node is priced with the roofline at 1/m of its work
  (smaller GEMMs run at lower efficiency); blocking communication scales by 1/m (its bandwidth
  term; the per-message latency is then undercounted by (m-1) alphas per collective).
- Stage time per micro-batch ``t = (compute_mb + blocking_comm_mb) / pp + p2p_mb``; the
  pipeline takes ``(m + pp - 1) t``; the bubble is ``(pp - 1) t``. Both 1F1B and GPipe have this
  bubble; they differ in memory: the first stage holds ``min(pp, m)`` micro-batches of
  activations under 1F1B and ``m`` under GPipe.
- Stage-boundary transfers: the forward activations and their gradients crossing the boundary,
  ``2 * cut / m`` bytes per micro-batch (``cut``: the per-rank bytes live across the cut of the
  forward pass at position k/pp of its compute), on the intra-node link when a stage is smaller
  than a node, else on the network; on the critical path.
- The optimizer step runs once, after the pipeline, at 1/pp of its single-stage time. Gradient
  reduction over data-parallel axes overlaps the backward pass of the last micro-batch (when
  ``StepOptions.overlap_gradient_reduction``; with one stage it is exposed: the runtime reduces the
  accumulated gradients in the update program); ZeRO-3 gathers repeat per micro-batch and overlap
  the pipeline's compute (when ``prefetch_parameters``).
- Gradient accumulation (m > 1) keeps a full gradient buffer live across micro-batches. With one
  stage the memory is that of the two programs the runtime runs (``accumulation_memory``).

With pp = 1 and m = 1 the result is the event simulation of ``step.step_time`` unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..ir.graph import Graph
from ..sharding.plan import ResolvedPlan
from .cluster import AxisLink, Cluster
from .memory import MemoryEstimate
from .recompute import RecomputeEffect, forward_cuts
from .step import StepOptions, StepTime, node_compute

__all__ = ["Schedule", "PipelineTime", "pipeline_time", "scaled_memory", "accumulation_memory"]


class Schedule(str, Enum):
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"


@dataclass
class PipelineTime:
    step_seconds: float
    compute_seconds: float
    exposed_comm_seconds: float
    comm_total_seconds: float
    bubble_seconds: float
    recompute_seconds: float
    recompute_flops: float
    peak_bytes: int
    memory_at_peak: dict[str, int]
    notes: list[str] = field(default_factory=list)


def accumulation_memory(mem: MemoryEstimate, rc: RecomputeEffect, m: int, accumulators: int) -> dict[str, int]:
    """Gradient accumulation on one stage (pp = 1, m > 1), as ``runtime.rank_step`` runs it: the
    gradient program once per micro-batch, then the update program once (``cost.accumulate``).
    ``mem`` must carry the window peaks of the whole-batch step before and from the first optimizer
    node (``estimate_memory(..., windows=...)``). Both phases hold the state, the rank's whole batch (the
    caller's) and every gradient (the accumulators: all of them from micro-batch 2 on, and, as
    ``optimizer.step()`` after PyTorch's accumulation loop, during the update). The gradient phase has
    one micro-batch's activations and temporaries (1/m of the whole batch's at its peak); the update
    phase its own temporaries and new state. The peak is the larger phase. ``accumulators``: the
    gradient accumulators' bytes (``cost.accumulate.accumulation_windows``)."""
    phases = []
    for k, (_, at) in enumerate(mem.window_peaks):
        out = dict(at)
        out["batch"], out["gradients"] = mem.batch, accumulators
        if k == 0:
            out["activations"] = at.get("activations", 0) * rc.keep_fraction / m
            out["temporaries"] = at.get("temporaries", 0) / m
        phases.append({c: int(v) for c, v in out.items()})
    return max(phases, key=lambda d: sum(d.values()))


def scaled_memory(mem: MemoryEstimate, rc: RecomputeEffect, pp: int, m: int, schedule: Schedule,
                  accumulators: int | None = None) -> dict[str, int]:
    """Per-category bytes live at the peak of one stage's rank (see the module docstring)."""
    if pp == 1 and m > 1 and accumulators is not None and len(mem.window_peaks) == 2:
        return accumulation_memory(mem, rc, m, accumulators)
    exact = rc.memory is not None and rc.memory is not mem  # the recomputing program's own estimate
    at = dict(rc.memory.breakdown if exact else mem.breakdown)
    keep = 1.0 if exact else rc.keep_fraction
    in_flight = 1 if pp == 1 else (min(pp, m) if schedule is Schedule.ONE_F_ONE_B else m)
    out = {}
    for cat, v in at.items():
        if cat in ("params", "optimizer", "buffers", "gradients", "updated_state"):
            out[cat] = v / pp
        elif cat == "activations":
            out[cat] = v * keep * in_flight / (pp * m)
        else:  # temporaries, batch
            out[cat] = v / m
    if m > 1:  # the accumulation buffer holds every gradient across micro-batches
        out["gradients"] = max(out.get("gradients", 0), mem.gradients / pp)
    return {k: int(v) for k, v in out.items()}


def _boundary_bytes(mem: MemoryEstimate, node_seconds: list[float], pp: int) -> float:
    """Largest per-rank cut at the forward positions that split its compute into pp equal parts."""
    cuts = forward_cuts(mem)
    if pp == 1 or not cuts:
        return 0.0
    fwd = node_seconds[:len(cuts)]
    total = sum(fwd) or 1.0
    worst, acc, k = 0, 0.0, 1
    for p, t in enumerate(fwd):
        acc += t
        if k < pp and acc >= total * k / pp:
            worst = max(worst, cuts[p])
            k += 1
    return float(worst)


def pipeline_time(graph: Graph, rp: ResolvedPlan, st: StepTime, mem: MemoryEstimate, rc: RecomputeEffect,
                  cluster: Cluster, links: list[AxisLink], *, pp: int, microbatches: int, schedule: Schedule,
                  options: StepOptions, accumulators: int | None = None) -> PipelineTime:
    m = microbatches
    at_peak = scaled_memory(mem, rc, pp, m, schedule, accumulators)
    peak = sum(at_peak.values())
    if pp == 1 and m == 1:
        extra = rc.extra_seconds + rc.extra_comm_seconds
        return PipelineTime(st.step_seconds + extra, st.compute_seconds + rc.extra_seconds,
                            st.exposed_comm_seconds + rc.extra_comm_seconds, st.comm_seconds + rc.extra_comm_seconds,
                            0.0, rc.extra_seconds, rc.extra_flops, peak, at_peak)
    mesh = rp.plan.mesh
    fb_mb = 0.0
    for node, cost in zip(graph.nodes, st.nodes):
        if cost.optimizer or cost.compute == 0.0:
            continue
        strategy = rp.plan.strategies.get(node.name)
        fb_mb += node_compute(graph, node, strategy, mesh, cluster.device, allow_tf32=options.allow_tf32,
                              profile=options.profile, extra_scale=1.0 / m).seconds
    fb_mb += rc.extra_seconds / m
    blocking_mb = (st.comm_by_kind.get("blocking", 0.0) + rc.extra_comm_seconds) / m
    p2p_mb = 0.0
    notes = []
    if pp > 1:
        cut = _boundary_bytes(mem, [c.compute for c in st.nodes], pp)
        same_node = mesh.world < cluster.devices_per_node
        bw = cluster.intra_node.bandwidth if same_node else cluster.inter_node_bandwidth_per_device
        lat = cluster.intra_node.latency_s if same_node else cluster.inter_node.latency_s
        p2p_mb = 2 * (cut / m / bw + lat)
        notes.append(f"stage boundary: {cut / m / 2**20:.1f} MiB per micro-batch each way over "
                     f"{'the intra-node link' if same_node else 'the network'}")
    t_stage = (fb_mb + blocking_mb) / pp + p2p_mb
    pipe = (m + pp - 1) * t_stage
    bubble = (pp - 1) * t_stage
    opt = st.optimizer_compute / pp
    grad = st.comm_by_kind.get("gradient", 0.0) / pp
    # backward = 2x forward FLOPs for matmul layers (Kaplan et al. 2020, arXiv 2001.08361): 2/3 of a pass
    # gradient accumulation on one stage (runtime.rank_step) reduces in the update program, after the last
    # micro-batch's backward: nothing to hide behind (DDP's no_sync then a synchronised last micro-batch
    # would overlap it)
    window = t_stage * 2 / 3 if options.overlap_gradient_reduction and pp > 1 else 0.0
    grad_exposed = max(0.0, grad - window)
    prefetch = st.comm_by_kind.get("prefetch", 0.0) * m / pp
    pref_exposed = max(0.0, prefetch - pipe) if options.prefetch_parameters else prefetch
    step = pipe + opt + grad_exposed + pref_exposed
    compute = m * fb_mb / pp + opt
    comm_total = m * blocking_mb / pp + grad + prefetch + (m + pp - 1) * p2p_mb
    exposed = max(0.0, step - compute - bubble)
    return PipelineTime(step, compute, exposed, comm_total, bubble, rc.extra_seconds / pp, rc.extra_flops / pp,
                        peak, at_peak, notes)
