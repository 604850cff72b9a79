"""The outer search's pipeline dimension: pipeline degree, stage cut, micro-batches and stage plan together.

After the single-stage search (``outer``), for the ``pipeline_plans`` best single-stage candidates (fitting
first, then by step time; unpriced ones by the model's), and for each pipeline degree ``pp`` (a divisor of
the world, at most ``max_pp``, dividing the candidate's outermost mesh axis, with stages that tile nodes):

1. **Stage plan**: the candidate's SPMD plan on the stage mesh, its outermost axis shrunk by ``pp``
   (Megatron-LM's layout: tensor parallelism inside a node, pipeline and data parallelism across
   nodes; ``cost.estimate``: stage ``s`` is ranks ``s W .. (s+1) W - 1``). Every node keeps its strategy,
   so each stage runs the plan's strategies on its own nodes.
2. **Micro-batches**: ``m`` in ``pp, 2 pp, 4 pp, ...`` and the rank's whole batch (micro-batches of one
   sample), those dividing the rank's batch (at most ``pipeline_microbatch_counts`` of them, the largest).
3. **Stage cut** per ``m`` (``search.stages``: balanced stage time, memory with the micro-batches in flight,
   least boundary bytes), priced with ``cost.estimate`` (event simulation of the schedule, per-stage memory
   with the in-flight activations: the fit check).

Rule ``pipeline_state_floor``: a degree is skipped, unpriced, when the stage plan's parameters, optimizer
state and gradients per rank, over ``pp``, exceed the device memory (some stage holds at least the average;
every count priced has ``m > 1``, so each stage holds its gradient buffer). The Megatron start's degrees
are checked before its stage preset is built (it splits state along ``tp`` only: at least ``1 / tp`` of it
per rank).

Rule ``pipeline_drop_recompute``: a stage plan whose single-stage plan recomputes is priced without
recomputation first (a stage holds 1/pp of the state; under 1F1B its in-flight activations stay about
those of one micro-batch of the whole model), and with it only when that does not fit; once a degree fits
without it, larger degrees of that stage plan are priced without it only.

Rule ``pipeline_megatron_start`` adds one more stage plan: the expert tensor-parallel preset with ``tp`` =
devices per node and data parallelism across nodes (Megatron-LM's 3D layout, arXiv 2104.04473 section 3),
built for each stage mesh (a shrunk plan's strided attention splits would count the whole mesh's local
batch: 175B-shaped at 24 layers, pp=8, m=96: 8.41 s shrunk vs 7.81 s built).
The best (fits, then step time) per (candidate, pp) joins the candidates. Rule ``pipeline_megatron_first``
prices the Megatron start's degrees before the searched stage plans'. Degrees are tried in increasing
order; rule ``pipeline_stop_early`` stops a stage plan at the first degree that fits and prices slower than
the fastest fitting plan so far (single-stage, an earlier degree, or an earlier stage plan): the bubble
grows with ``pp`` while the communication and memory it saves shrink. The best searched
stage plan's and the Megatron start's degrees are always priced; further stage plans only before the
search's time limit. Rule ``pipeline``: ``auto``
tries pipelines only when no single-stage plan fits; ``memory`` (the default) also when, on several nodes,
the fastest fitting one recomputes activations (it pays a second forward for memory, which stages of 1/pp
of the model may not need, or need on fewer devices: Megatron-LM's reason for pp); ``gain`` also when the
fastest fitting one's step is more than
``1 + pipeline_min_gain`` times its compute (a reshaped plan does the same compute per device, each stage
1/pp of the nodes on 1/pp of the devices, plus a bubble, so it can only win back exposed communication);
``never``; ``always``.
"""
from __future__ import annotations

import time
from dataclasses import replace

from ..cost.cluster import Cluster
from ..cost.estimate import Estimate, estimate_microbatches, stage_cluster
from ..cost.pipeline import Schedule, value_bytes
from ..ir.analysis import analyze
from ..ir.graph import Graph, Role
from ..sharding.mesh import Mesh
from ..sharding.placement import local_shape
from ..sharding.plan import PlanError, ShardingPlan, resolve
from ..sharding.presets import StrategySpec, preset_plan
from ..sharding.vocab import Recompute
from .coarsen import Cones
from .options import PipelineWhen, SearchOptions
from .stages import stage_cut

__all__ = ["pipeline_candidates", "worth_pipelining", "pipelines_certain", "stage_plan"]


def worth_pipelining(cands: list, options: SearchOptions, cluster: Cluster) -> bool:
    """Rule ``pipeline`` (module docstring)."""
    if options.pipeline is PipelineWhen.NEVER:
        return False
    if options.pipeline is PipelineWhen.ALWAYS:
        return True
    fitting = [c for c in cands if c.fits]
    if not fitting:
        return True
    if options.pipeline is PipelineWhen.AUTO or cluster.nodes < 2:
        return False
    best = min(fitting, key=lambda c: c.step_seconds).estimate
    if best.recompute != "none":
        return True
    return options.pipeline is PipelineWhen.GAIN and \
        best.step_seconds > (1 + options.pipeline_min_gain) * best.compute_seconds


def pipelines_certain(options: SearchOptions, cluster: Cluster) -> bool:
    """Rule ``pipeline`` will price pipelines whatever recomputing single-stage plans are found, given that
    none fits without recomputation: it prices them when nothing fits, and (``memory``, ``gain``, on
    several nodes) when the fastest fitting plan recomputes; ``always``."""
    if options.pipeline is PipelineWhen.ALWAYS:
        return True
    return options.pipeline in (PipelineWhen.MEMORY, PipelineWhen.GAIN) and cluster.nodes >= 2


def stage_plan(plan: ShardingPlan, pp: int) -> ShardingPlan | None:
    """``plan`` with its outermost mesh axis shrunk by ``pp`` (None when it does not divide)."""
    mesh = plan.mesh
    if mesh.sizes[0] % pp:
        return None
    sizes = (mesh.sizes[0] // pp,) + tuple(mesh.sizes[1:])
    return ShardingPlan(Mesh(mesh.names, sizes), dict(plan.inputs), dict(plan.strategies), plan.fingerprint,
                        plan.strategy_string, dict(plan.meta), 1, plan.recompute)


def _microbatch_counts(graph: Graph, rp, pp: int, options: SearchOptions) -> list[int]:
    """Micro-batch counts for ``pp`` stages dividing the rank's batch (module docstring, step 2)."""
    batch = [i for i in graph.inputs if i.role is Role.BATCH and graph.types[i.value].rank > 0]
    if not batch:
        return []
    t = graph.types[batch[0].value]
    local = local_shape(t.shape, rp.value[batch[0].value], rp.plan.mesh)[0] if rp.value.get(batch[0].value) \
        else t.shape[0]
    out, m = [], pp
    while m <= local:
        if local % m == 0:
            out.append(m)
        m *= 2
    if local % pp == 0 and local not in out:
        out.append(local)          # micro-batches of one sample (Megatron-LM's choice)
    return out[-options.pipeline_microbatch_counts:][::-1]    # largest first (rule pipeline_reuse_cut)


def _degrees(cluster: Cluster, mesh: Mesh, options: SearchOptions) -> list[int]:
    out = []
    for pp in range(2, min(options.max_pp, cluster.world) + 1):
        if cluster.world % pp or mesh.sizes[0] % pp:
            continue
        try:
            stage_cluster(cluster, cluster.world // pp)
        except ValueError:
            continue
        out.append(pp)
    return out


def _megatron_start(graph: Graph, cluster: Cluster, like) -> list:
    """Rule ``pipeline_megatron_start``: the expert tensor-parallel preset (tp = devices per node, data
    parallel across nodes) as one more stage plan, with ``like``'s recomputation (a bare ``Candidate``
    without a plan: the preset is built per stage mesh, ``_stage_plan_of``; its mesh is the whole mesh's
    ``dp x tp``, for the degrees)."""
    from .outer import Candidate
    tp = cluster.devices_per_node
    if tp < 2 or cluster.world % tp or cluster.world == tp:
        return []
    mesh = Mesh(("dp", "tp"), (cluster.world // tp, tp))
    return [Candidate(mesh, like.recompute, None, None, 0.0, status=like.status, problem={"preset_tp": tp})]


def _stage_plan_of(graph: Graph, cluster: Cluster, c, pp: int, fingerprint: str) -> ShardingPlan | None:
    """The stage plan of candidate ``c`` for ``pp`` stages: the Megatron start's preset built for the stage
    mesh itself (its strided attention splits count the stage's own local batch), else ``stage_plan``."""
    tp = c.problem.get("preset_tp")
    if tp is None:
        return stage_plan(c.plan, pp)
    try:
        return preset_plan(graph, StrategySpec(dp=cluster.world // (tp * pp), tp=tp), fingerprint=fingerprint)
    except ValueError:
        return None


def _state_floor(graph: Graph, rp, pp: int, a=None) -> float:
    """Rule ``pipeline_state_floor``: bytes some stage's rank holds at least, whatever the cut: its share of
    the parameters and optimizer state under the stage plan, and of the gradients (``analyze``'s; with
    ``m > 1`` micro-batches ``cost.pipeline.scaled_memory`` holds a full gradient buffer of the stage's
    parameters, and every count priced here has ``m >= pp >= 2``), is at least the average, ``1 / pp``."""
    a = a if a is not None else analyze(graph)
    total = sum(value_bytes(graph, rp, i.value) for i in graph.inputs
                if i.role in (Role.PARAM, Role.FROZEN, Role.BUFFER, Role.OPT_STATE))
    total += sum(value_bytes(graph, rp, v) for v in a.gradients)
    return total / pp


def _megatron_floor(graph: Graph, a, tp: int, pp: int) -> float:
    """Rule ``pipeline_state_floor`` for the Megatron start before its stage preset is built: that preset
    splits state (and so gradients) along its ``tp`` axis only (no ZeRO; data parallelism replicates it), so
    each rank holds at least ``1 / tp`` of a stage's state and gradients, and some stage at least ``1 / pp``
    of them (``_state_floor``)."""
    total = sum(graph.types[i.value].nbytes for i in graph.inputs
                if i.role in (Role.PARAM, Role.FROZEN, Role.BUFFER, Role.OPT_STATE))
    total += sum(graph.types[v].nbytes for v in a.gradients)
    return total / (tp * pp)


def _best(ests: list[Estimate]) -> Estimate:
    return min(ests, key=lambda e: (not e.fits, e.step_seconds))


def _price(graph: Graph, cluster: Cluster, rp, pp: int, counts: list[int], modes: list, options: SearchOptions,
           cones: Cones, deadline: float) -> Estimate:
    """The best (fits, then step) of ``counts`` micro-batches x recomputation ``modes``; a later mode is priced
    only when the earlier ones do not fit (rule ``pipeline_drop_recompute``)."""
    cut = stage_cut(cones=cones if options.stage_cut_cones else None, schedule=Schedule.ONE_F_ONE_B, ilp_limit=options.stage_ilp_limit,
                    tolerance=options.stage_tolerance, workers=options.workers,
                    seconds=max(0.5, min(options.stage_ilp_seconds, deadline - time.perf_counter())),
                    capacity=cluster.device.memory_bytes * options.memory_fraction,
                    reuse=options.pipeline_reuse_cut)
    ests: list[Estimate] = []
    for mode in modes:
        ests += estimate_microbatches(graph, cluster, rp, pp=pp, microbatches=counts, recompute=mode, stages=cut)
        if _best(ests).fits:
            break
    return _best(ests)


def _modes(recompute: Recompute, options: SearchOptions, dropped: bool) -> list:
    """Recomputation modes to price a stage plan with (rule ``pipeline_drop_recompute``)."""
    if recompute is Recompute.NONE or not options.pipeline_drop_recompute:
        return [recompute]
    return [Recompute.NONE] if dropped else [Recompute.NONE, recompute]


def pipeline_candidates(graph: Graph, cluster: Cluster, cands: list, options: SearchOptions, cones: Cones,
                        deadline: float, say=None, *, megatron_modes: list | None = None) -> list:
    """Pipelined candidates (module docstring) from the single-stage ``cands`` (``outer.Candidate``).
    ``megatron_modes``: the recomputation modes the Megatron start is priced with, in order (default: rule
    ``pipeline_drop_recompute``'s, from the best searched stage plan's)."""
    from .outer import Candidate     # the outer search's record (outer imports this module)
    say = say or (lambda event, info: None)
    base = [c for c in cands if c.plan is not None]
    base.sort(key=lambda c: (not c.fits, c.estimate is None,
                             c.step_seconds if c.estimate is not None else c.model_seconds))
    base = base[:options.pipeline_plans]
    if options.pipeline_megatron_start and base:
        like = base[0] if not megatron_modes else replace(base[0], recompute=Recompute(megatron_modes[-1]))
        start = _megatron_start(graph, cluster, like)
        at = 0 if options.pipeline_megatron_first else 1
        base[at:at] = start
    forced = 2 if options.pipeline_megatron_start else 1
    out, a, fingerprint = [], analyze(graph), graph.fingerprint()
    fastest = min((c.step_seconds for c in cands if c.fits), default=float("inf"))
    for k, c in enumerate(base):
        dropped = False
        for pp in _degrees(cluster, c.mesh, options):
            if k >= forced and time.perf_counter() > deadline:
                return out      # the best searched plan and the Megatron start are always priced
            t0 = time.perf_counter()
            tp = c.problem.get("preset_tp")
            if tp is not None and options.pipeline_state_floor and \
                    _megatron_floor(graph, a, tp, pp) > cluster.device.memory_bytes * options.memory_fraction:
                continue        # rule pipeline_state_floor, before the stage preset is built
            plan = _stage_plan_of(graph, cluster, c, pp, fingerprint)
            if plan is None:
                continue
            try:
                rp = resolve(graph, plan, fingerprint=fingerprint)
            except (PlanError, ValueError):
                continue        # a split no longer divides its dim on the smaller stage mesh
            counts = _microbatch_counts(graph, rp, pp, options)
            if not counts or options.pipeline_state_floor and \
                    _state_floor(graph, rp, pp, a) > cluster.device.memory_bytes * options.memory_fraction:
                continue        # no micro-batch count, or no cut can fit the state (rule pipeline_state_floor)
            modes = megatron_modes if tp is not None and megatron_modes else \
                _modes(Recompute(c.recompute), options, dropped)
            e = _price(graph, cluster, rp, pp, counts, modes, options, cones, deadline)
            dropped |= e.fits and e.recompute == Recompute.NONE.value
            plan.microbatches, plan.stages, plan.schedule = e.microbatches, pp, e.schedule
            plan.recompute = e.recompute
            plan.stage_of = {graph.nodes[i].name: s for i, s in enumerate(e.node_stage) if s >= 0 and
                             a.is_forward(i)}
            cand = Candidate(plan.mesh, Recompute(e.recompute), plan, None, time.perf_counter() - t0,
                             status=c.status, problem=dict(c.problem))
            cand.keep(plan, e)
            out.append(cand)
            say("scored", {"mesh": f"pp={pp} x {plan.mesh}", "step_seconds": e.step_seconds, "fits": e.fits,
                           "peak": e.memory_bytes["peak"], "microbatches": e.microbatches,
                           "recompute": e.recompute})
            if options.pipeline_stop_early and e.fits and e.step_seconds > fastest:
                break       # rule pipeline_stop_early: fits, and slower than a plan with fewer stages or another
            fastest = min(fastest, e.step_seconds) if e.fits else fastest
    return out
