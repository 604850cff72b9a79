"""Predicted step time and per-device memory of a plan on a cluster (pure Python, no torch).

``estimate`` composes the parts of the cost model:

1. **SPMD step** (``step.step_time``): per-node roofline compute on the rank's share, the
   redistributions the plan needs priced with alpha-beta collectives on the mesh axes' links, and
   the overlap assumptions of ``StepOptions`` (gradient reduction overlaps the rest of the backward
   pass; ZeRO-3 parameter gathers are prefetched; everything else blocks).
2. **Memory** (``memory.estimate_memory``): liveness over the per-rank program, by category.
3. **Recomputation** (``recompute.py``, ``remat.py``): ``full`` or ``selective`` change the saved
   activations and add forward compute; priced on the rewritten program the runtime executes.
4. **Pipelines and micro-batches** (``pipeline.py``): ``pp`` stages and ``microbatches`` per step with
   a 1F1B or GPipe schedule, priced from a stage per forward node (``stages``: given, chosen by a
   callback such as the search's ``search.stages``, or by default a contiguous cut of equal forward
   compute): an event simulation over stages x micro-batches (bubble from imbalance), boundary
   transfers, and each stage's memory with the micro-batches it holds in flight.

The mesh of a plan covers one pipeline stage; stages are the outermost rank dimension (ranks
``s * W .. (s+1) * W - 1`` form stage ``s`` for a stage mesh of ``W`` devices), so a stage's tensor-
and data-parallel groups are as close as the cluster allows and stage boundaries cross the slowest
links only when a stage fills whole nodes.

MFU = model FLOPs (the captured step's forward, backward and optimizer FLOPs, without
recomputation) per device per second / the device's dense peak for the matmul dtype. "Hardware"
TFLOP/s also count the recomputed forward (what Megatron-LM reports).
"""
from __future__ import annotations

import dataclasses

from typing import Callable, Union
from dataclasses import dataclass, field

from ..ir.graph import Graph
from ..ir.registry import OpKind, call_of, lookup
from ..ir.types import DType
from ..sharding.mesh import Mesh
from ..sharding.plan import ResolvedPlan, ShardingPlan, resolve
from ..sharding.presets import StrategySpec, mesh_for, parse_strategy, preset_plan
from .cluster import Cluster, axis_links, make_cluster
from .accumulate import SplitError, accumulation_windows
from .compute import Profile
from .memory import estimate_memory
from .pipeline import Schedule, pipeline_time, stage_list
from .recompute import Recompute, apply_recompute, remat_effect

from .step import StepOptions, step_time

__all__ = ["Estimate", "estimate", "estimate_microbatches", "estimate_strategy", "stage_cluster", "matmul_dtype"]

#: A stage cut: a stage per node for the forward nodes (-1 elsewhere), or a function of
#: ``(graph, resolved plan, StepTime, MemoryEstimate, pp, microbatches)`` returning one.
Cut = Union[list, Callable, None]


@dataclass
class Estimate:
    cluster: str
    mesh: dict[str, int]
    strategy: str
    step_seconds: float
    compute_seconds: float           # compute on the critical path (incl. recomputation)
    comm_seconds: float              # exposed communication (not hidden behind compute)
    comm_total_seconds: float        # all communication, hidden or not
    bubble_seconds: float
    recompute_seconds: float
    flops_per_device: float          # model FLOPs per device per step (no recomputation)
    tflops_per_device: float         # model TFLOP/s per device
    hardware_tflops_per_device: float
    mfu: float
    memory_bytes: dict[str, int]     # category -> bytes live at the peak, and "peak"
    capacity_bytes: int
    fits: bool
    pp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    collectives: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    bubble_fraction: float = 0.0     # idle share of the stages' time in the pipeline phase
    step_idle_fraction: float = 0.0  # idle share of the stages' time over the whole step (the runtime's timers)
    stages: list[dict] = field(default_factory=list)   # per stage (pp > 1): ``pipeline.StageCost.to_dict``
    #: the stage of every node (pp > 1), for the plan file and the report
    node_stage: list[int] = field(default_factory=list, repr=False)
    #: why the runtime cannot run the stage cut (``cost.pipeline.stage_refusal``): then ``fits`` is False
    refused: str | None = None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "node_stage"}

    def text(self) -> str:
        """The ``rhino estimate`` table: step time split, throughput, communication, memory at the peak."""
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [f"estimate {self.strategy} on {self.cluster} (mesh {mesh}"
                 + (f", {self.microbatches} micro-batches, {self.schedule}" if self.microbatches > 1 else "")
                 + (f", recompute={self.recompute}" if self.recompute != Recompute.NONE else "") + ")",
                 f"  step time      {_t(self.step_seconds)} = compute {_t(self.compute_seconds)} + exposed "
                 f"communication {_t(self.comm_seconds)} + pipeline bubble {_t(self.bubble_seconds)}",
                 f"  throughput     {self.tflops_per_device:.2f} TFLOP/s per device (model FLOPs), MFU {self.mfu:.1%}"
                 + (f"; {self.hardware_tflops_per_device:.2f} TFLOP/s with recomputation"
                    if self.recompute != Recompute.NONE else ""),
                 f"  communication  {_t(self.comm_total_seconds)} in all"
                 + (": " + ", ".join(f"{k} x{v}" for k, v in sorted(self.collectives.items()))
                    if self.collectives else "")]
        mem = self.memory_bytes
        split = ", ".join(f"{k} {_b(mem[k])}" for k in _CATEGORIES if mem.get(k))
        lines.append(f"  memory/device  peak {_b(mem['peak'])} of {_b(self.capacity_bytes)}: "
                     f"{'fits' if mem['peak'] <= self.capacity_bytes else 'DOES NOT FIT'}")
        lines.append(f"                 at the peak: {split}")
        if self.refused:
            lines.append(f"  CANNOT RUN     {self.refused}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# the memory categories ``Estimate.text`` lists at the peak, in this order
_CATEGORIES = ("params", "gradients", "optimizer", "activations", "temporaries", "buffers", "batch", "updated_state",
               "messages")


def _b(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def _t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def matmul_dtype(graph: Graph) -> str:
    """The ``peak_flops`` key of the graph's matmuls (the dtype most of its matmul FLOPs use)."""
    acc: dict[str, float] = {}
    for node in graph.nodes:
        d = lookup(node.op)
        if d is None or d.kind not in (OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION):
            continue
        call = call_of(graph, node)
        dt = next((t.dtype for t in call.in_types if t.dtype.is_floating), DType.float32)
        key = {DType.bfloat16: "bf16", DType.float16: "fp16"}.get(dt, "fp32")
        acc[key] = acc.get(key, 0.0) + sum(t.numel for t in call.in_types)
    return max(acc, key=acc.get) if acc else "fp32"


def stage_cluster(cluster: Cluster, stage_world: int) -> Cluster:
    """The part of ``cluster`` one pipeline stage of ``stage_world`` devices occupies."""
    dpn = cluster.devices_per_node
    if stage_world <= dpn:
        if dpn % stage_world:
            raise ValueError(f"a pipeline stage of {stage_world} devices does not tile nodes of {dpn} devices; "
                             f"choose dp*tp dividing {dpn} or a multiple of it")
        return make_cluster(1, stage_world, cluster.device, cluster.inter_node, cluster.nics_per_node)
    if stage_world % dpn:
        raise ValueError(f"a pipeline stage of {stage_world} devices does not fill whole nodes of {dpn} devices")
    return make_cluster(stage_world // dpn, dpn, cluster.device, cluster.inter_node, cluster.nics_per_node)


def estimate(graph: Graph, cluster: Cluster, plan: ShardingPlan | ResolvedPlan | None = None, *, pp: int | None = None,
             microbatches: int | None = None, recompute: str | Recompute | None = None,
             schedule: str | Schedule = Schedule.ONE_F_ONE_B, options: StepOptions = StepOptions(),
             strategy: str = "", stages: Cut = None) -> Estimate:
    """Predict one training step of ``graph`` under ``plan`` (None: one replicated device per stage).
    ``microbatches`` / ``recompute`` left as None take the plan's own (``ShardingPlan.microbatches``,
    ``.recompute``); ``pp`` None takes the plan's ``stages``; ``stages``: the stage cut when ``pp > 1``
    (``Cut``; None: the plan's ``stage_of``, or when it has none the default cut)."""
    rp = _resolved(graph, plan)
    m = rp.plan.microbatches if microbatches is None else microbatches
    if pp is None:
        pp = rp.plan.stages
        schedule = rp.plan.schedule if schedule == Schedule.ONE_F_ONE_B else schedule
    chunks = rp.plan.chunks if pp == rp.plan.stages and Schedule(schedule) is Schedule.INTERLEAVED else 1
    if stages is None and pp > 1 and rp.plan.stages == pp and rp.plan.stage_of:
        stages = stage_list(graph, rp.plan.stage_of)
    return estimate_microbatches(graph, cluster, rp, pp=pp, microbatches=[m], recompute=recompute,
                                 schedule=schedule, options=options, strategy=strategy, stages=stages,
                                 chunks=chunks)[0]


def _resolved(graph: Graph, plan) -> ResolvedPlan:
    if isinstance(plan, ResolvedPlan):
        return plan
    return resolve(graph, plan if plan is not None else ShardingPlan(Mesh(("dp",), (1,)), {}, {}))


def estimate_microbatches(graph: Graph, cluster: Cluster, plan: ShardingPlan | ResolvedPlan | None, *, pp: int,
                          microbatches: list[int], recompute: str | Recompute | None = None,
                          schedule: str | Schedule = Schedule.ONE_F_ONE_B, options: StepOptions = StepOptions(),
                          strategy: str = "", stages: Cut = None, chunks: int = 1) -> list[Estimate]:
    """``estimate`` for each micro-batch count of ``microbatches``, sharing the SPMD step's pricing;
    ``chunks``: model chunks per stage (interleaved schedule; ``stages`` then cuts ``pp * chunks``)."""
    rp = _resolved(graph, plan)
    recompute = Recompute(rp.plan.recompute if recompute is None else recompute)
    schedule = Schedule(schedule)
    for m in microbatches:
        _check_degrees(rp, cluster, pp, m)
    sub = stage_cluster(cluster, rp.plan.mesh.world) if pp > 1 else cluster
    links = axis_links(sub, rp.plan.mesh)
    st = step_time(rp, cluster.device, links, options)
    # the update phase has its own peak: gradient accumulation and pipelines price it apart (the windows do not
    # depend on the micro-batch count, so one memory estimate serves every count)
    phased = pp > 1 or any(m > 1 for m in microbatches)
    windows, acc = _phase_windows(graph, rp) if phased else ((), None)
    mem = estimate_memory(graph, rp, windows=windows)
    # recomputation priced on the rewritten program the runtime runs (cost.remat)
    rc = apply_recompute(graph, mem, st.nodes, recompute) if recompute is Recompute.NONE else \
        remat_effect(rp, mem, st.nodes, recompute)
    out = []
    for m in microbatches:
        accumulators = acc if pp > 1 or m > 1 else None
        cut = stages(graph, rp, st, mem, pp, m) if callable(stages) else stages
        pl = pipeline_time(graph, rp, st, mem, rc, cluster, links, pp=pp, microbatches=m, schedule=schedule,
                           options=options, accumulators=accumulators, stages=cut if pp > 1 else None,
                           chunks=chunks)
        out.append(_compose(graph, cluster, rp, st, pl, pp, m, schedule, recompute, strategy, rc.notes))
    return out


def _phase_windows(graph: Graph, rp: ResolvedPlan) -> tuple[list[tuple[int, int]], int | None]:
    """``accumulation_windows``, or none for a step without an optimizer update to split at."""
    try:
        return accumulation_windows(graph, rp)
    except SplitError:
        return [], None


def _check_degrees(rp: ResolvedPlan, cluster: Cluster, pp: int, m: int) -> None:
    if pp < 1 or m < 1:
        raise ValueError("pp and microbatches must be positive integers")
    if pp > 1 and Schedule(rp.plan.schedule) is Schedule.INTERLEAVED and rp.plan.chunks > 1 and m % pp:
        raise ValueError(f"the interleaved schedule needs microbatches to be a multiple of pp={pp}; got {m}")
    mesh = rp.plan.mesh
    if mesh.world * pp != cluster.world:
        raise ValueError(f"the plan uses {mesh.world} devices x pp={pp} = {mesh.world * pp}, but cluster {cluster} "
                         f"has {cluster.world}; pick degrees whose product is {cluster.world}")


def _few_microbatches(pp: int, m: int) -> list[str]:
    """Fewer micro-batches than stages runs (the runtime takes it) but leaves stages idle: said, not refused."""
    if pp > 1 and m < pp:
        return [f"pp={pp} with {m} micro-batch{'es' if m > 1 else ''}: at most {m} of the {pp} stages "
                f"work{'s' if m == 1 else ''} at a time; microbatches >= {pp} keeps every stage busy"]
    return []


def _compose(graph, cluster, rp, st, pl, pp, m, schedule, recompute, strategy, notes) -> Estimate:
    mesh = rp.plan.mesh
    memory = dict(pl.memory_at_peak)   # bytes of each category live at the peak
    memory["peak"] = int(pl.peak_bytes)
    capacity = cluster.device.memory_bytes
    peak_key = matmul_dtype(graph)
    peak_flops = cluster.device.flops(peak_key) if peak_key in cluster.device.peak_flops else \
        cluster.device.flops("fp32")
    model_flops = st.flops / pp
    step = pl.step_seconds
    mfu = model_flops / step / peak_flops if step > 0 else 0.0
    name = strategy or rp.plan.strategy_string or ",".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.sizes))
    return Estimate(
        cluster=str(cluster), mesh={**({"pp": pp} if pp > 1 else {}), **dict(zip(mesh.names, mesh.sizes))},
        strategy=name, step_seconds=step, compute_seconds=pl.compute_seconds, comm_seconds=pl.exposed_comm_seconds,
        comm_total_seconds=pl.comm_total_seconds, bubble_seconds=pl.bubble_seconds,
        recompute_seconds=pl.recompute_seconds, flops_per_device=model_flops,
        tflops_per_device=model_flops / step / 1e12 if step > 0 else 0.0,
        hardware_tflops_per_device=(model_flops + pl.recompute_flops) / step / 1e12 if step > 0 else 0.0,
        mfu=mfu, memory_bytes=memory, capacity_bytes=capacity,
        fits=pl.peak_bytes <= capacity and not pl.refused, pp=pp,
        microbatches=m, schedule=schedule.value, recompute=recompute.value, collectives=st.collectives,
        notes=notes + pl.notes + _few_microbatches(pp, m), bubble_fraction=pl.bubble_fraction,
        step_idle_fraction=pl.step_idle_fraction, stages=[c.to_dict() for c in pl.stages],
        node_stage=pl.node_stage, refused=pl.refused)


def estimate_strategy(graph: Graph, cluster: Cluster, strategy: str | StrategySpec,
                      options: StepOptions = StepOptions(), schedule: str | Schedule = Schedule.ONE_F_ONE_B,
                      profile: Profile | None = None, stages: Cut = None) -> Estimate:
    """``estimate`` of the expert preset ``strategy`` (dp/tp/zero/sp on the stage mesh, pp and
    micro-batches analytic). Degrees left out fill the cluster with data parallelism."""
    spec = parse_strategy(strategy) if isinstance(strategy, str) else strategy
    if spec.dp * spec.tp * spec.pp != cluster.world:
        rest, r = divmod(cluster.world, spec.tp * spec.pp)
        given = isinstance(strategy, str) and "dp=" in strategy
        if r or given:
            raise ValueError(f"strategy {spec} uses {spec.world} devices but cluster {cluster} has {cluster.world}; "
                             f"make dp*tp*pp = {cluster.world}")
        spec = dataclasses.replace(spec, dp=rest)
    stage = StrategySpec(dp=spec.dp, tp=spec.tp, zero=spec.zero, sp=spec.sp)
    plan = preset_plan(graph, stage) if stage.world > 1 else ShardingPlan(mesh_for(stage), {}, {})
    if Schedule(schedule) is Schedule.ONE_F_ONE_B and spec.pp > 1:   # the strategy's own schedule
        schedule = spec.schedule
        plan.stages, plan.schedule, plan.chunks = spec.pp, spec.schedule, spec.chunks
    if profile is not None:
        options = dataclasses.replace(options, profile=profile)
    return estimate(graph, cluster, plan, pp=spec.pp, microbatches=spec.microbatches, recompute=spec.recompute,
                    schedule=schedule, options=options, strategy=str(spec), stages=stages)

