"""Pipeline stages and micro-batches, priced from the actual stage cut (pure Python).

The captured step is one SPMD program over the stage mesh (every stage uses the plan's mesh and
strategies on its own nodes); ``pp`` stages and ``m`` micro-batches are modelled on top of it
(Narayanan et al. 2021, arXiv 2104.04473, section 2.2), from a **stage per node**:

- **The cut**: a stage per forward node with ``stage(u) <= stage(v)`` on every edge (the search's
  ``search.stages``; without one, the runtime's default ``ir.stages.contiguous_cut``). Every other node
  follows as the runtime runs it (``ir.stages.assign_stages``: backward nodes with their forward ops,
  optimizer updates on every stage holding their parameter, a tied parameter on both stages).
- **Per stage and micro-batch**: forward time ``F_s`` and backward time ``B_s`` are the roofline times of
  the stage's nodes at ``1/m`` of their work (``step.node_compute``: smaller GEMMs run less efficiently)
  plus their blocking (tensor-parallel) communication at ``1/m`` (its bandwidth term); recomputation
  adds each stage's share (by forward time) of the recomputed forward to its backward.
- **Boundary transfers**: a forward value made on stage ``a`` and read on stage ``b > a`` crosses the
  boundaries ``a .. b-1`` (per-rank bytes under the plan, ``1/m`` per micro-batch), its gradient (floating
  values) the same way back; a transfer between stages on one node uses the intra-node link (or, with a
  measured profile, its point-to-point alpha-beta fit: ``rhino profile``), else the network (ranks
  ``s * W .. (s+1) * W - 1`` form stage ``s``: ``cost.estimate``).
- **Schedule** (``simulate``): an event simulation over stages x micro-batches. Each stage runs its
  operations in its schedule's order, each as soon as its input has arrived: GPipe runs all ``m``
  forwards then all backwards; 1F1B runs ``min(pp - s - 1, m)`` warm-up forwards on stage ``s``, then
  alternates one forward and one backward, then drains; interleaved 1F1B (``chunks = v``: ``pp * v``
  virtual stages, virtual stage ``c * pp + d`` on device ``d``, Megatron-LM's order from
  ``ir.stages.schedule_order``; every virtual boundary is a transfer). The bubble comes from the simulated
  idle time, so imbalance and transfers show in it (no balanced formula; with balanced stages and free
  transfers it equals Megatron's ``(pp - 1) (t_f + t_b) / v``, tested).
- **After the pipeline**, per stage: the data-parallel gradient reduction of the stage's gradients
  (hidden behind the stage's last backward when ``StepOptions.overlap_gradient_reduction``), ZeRO-3
  gathers repeated per micro-batch (hidden behind the stage's compute when ``prefetch_parameters``),
  then the optimizer update of the stage's parameters. The step ends when the last stage finishes.
- **Memory per stage**, in two phases, the larger is the stage's peak. The pipeline phase from the whole
  graph's peak before the first optimizer node (``MemoryEstimate.window_peaks``): parameters, gradients and
  buffers scale by the stage's parameter bytes over the model's (a tied parameter held by two stages counts
  on both: the shares may sum above 1), optimizer state by its state bytes, activations by the bytes the
  stage's forward nodes save, times the micro-batches in flight (1F1B: ``min(pp - s, m)``; GPipe: ``m``;
  interleaved: ``in_flight``) over ``m``; temporaries at ``1/m``; the whole local batch (every stage's
  runtime holds it through the step: ``runtime.pipeline``); with ``m > 1`` a full gradient
  buffer of the stage's parameters; the boundary values the runtime holds (``_message_bytes``). The update
  phase is counted over the stage's own update program (``update_phases``: its optimizer nodes, its state,
  the replaced part freed at its last read, its gradient accumulators and the batch held). The reported peak
  is the largest stage's. Measured against ``PipelineStep.run_measured`` on the examples
  (``docs/benchmarks.md``, "Cost model: pipeline stage memory"): the update phase was missing (GPT,
  ``pp=2,microbatches=4``: 26% under), the tied weight split, the boundary values left out; the update phase
  scaled from the whole step's was 28% under on the MLP (its stage's largest weight's update is not the step's).

With ``pp = 1`` the single-stage formulas are unchanged: with one micro-batch the event simulation of
``step.step_time``; with gradient accumulation the two programs ``runtime.rank_step`` runs
(``accumulation_memory``) and the compute of ``m`` micro-batches.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from ..ir.analysis import analyze
from ..ir.graph import Graph, Role
from ..ir.registry import Accumulate, lookup
from ..ir.stages import Phase, Schedule, StageAssignment, assign_stages, contiguous_cut, schedule_order
from ..sharding.placement import local_shape
from ..sharding.plan import ResolvedPlan
from .cluster import AxisLink, Cluster
from .compute import Profile
from .memory import MemoryEstimate, program_peaks
from .recompute import RecomputeEffect
from .step import StepOptions, StepTime, node_compute

__all__ = ["Schedule", "PipelineTime", "StageCost", "pipeline_time", "scaled_memory", "stage_phases",
           "stage_refusal", "accumulation_memory",
           "simulate", "in_flight", "value_bytes", "stage_list"]


@dataclass
class StageCost:
    """One stage of a pipelined plan: what it runs and holds (per rank of the stage)."""
    forward_ops: int
    params: int                      # parameter values read by its forward nodes
    forward_seconds: float           # per micro-batch, with its blocking communication
    backward_seconds: float
    send_bytes: int                  # per micro-batch, forward, to the next stage
    memory: dict[str, int] = field(default_factory=dict)     # at the stage's peak (the larger phase)
    phases: list[dict[str, int]] = field(default_factory=list)   # per phase: pipeline, then update

    @property
    def peak(self) -> int:
        return sum(self.memory.values())

    def to_dict(self) -> dict:
        return {"forward_ops": self.forward_ops, "params": self.params, "forward_seconds": self.forward_seconds,
                "backward_seconds": self.backward_seconds, "send_bytes": self.send_bytes,
                "peak_bytes": self.peak, "memory": dict(self.memory),
                "phases": [{"phase": name, "bytes": sum(ph.values()), "memory": dict(ph)}
                           for name, ph in zip(("pipeline", "update"), self.phases)]}


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
    bubble_fraction: float = 0.0     # idle share of stage-time in the pipeline phase
    stages: list[StageCost] = field(default_factory=list)
    node_stage: list[int] = field(default_factory=list)
    step_idle_fraction: float = 0.0  # idle share of stage-time over the whole step (``runtime.pipeline`` timers)
    refused: str | None = None       # why the runtime cannot run this stage cut (``stage_refusal``), or None


def accumulation_memory(mem: MemoryEstimate, rc: RecomputeEffect, m: int, accumulators: int,
                        update: dict[str, int] | None = None) -> dict[str, int]:
    """Gradient accumulation on one stage (pp = 1, m > 1), as ``runtime.rank_step`` runs it: the
    gradient program once per micro-batch, then the update program once (``cost.accumulate``).
    ``mem`` must carry the window peaks of the whole-batch step before and from the first optimizer
    node (``estimate_memory(..., windows=...)``). Both phases hold the state, the rank's whole batch (the
    caller's) and every gradient (the accumulators: all of them from micro-batch 2 on, and, as
    ``optimizer.step()`` after PyTorch's accumulation loop, during the update). The gradient phase has
    one micro-batch's activations and temporaries (1/m of the whole batch's at its peak); the update
    phase its own temporaries and new state. The peak is the larger phase. ``accumulators``: the
    gradient accumulators' bytes (``cost.accumulate.accumulation_windows``). ``update``: the update phase
    counted over the update program itself (``accumulation_update``), used as it is."""
    windows = mem.window_peaks if update is None else mem.window_peaks[:1]   # the update phase counted instead
    phases = [] if update is None else [dict(update)]
    for k, (_, at) in enumerate(windows):
        out = dict(at)
        out["batch"], out["gradients"] = mem.batch, accumulators
        if k == 0:
            out["activations"] = at.get("activations", 0) * rc.keep_fraction / m
            out["temporaries"] = at.get("temporaries", 0) / m
        phases.append({c: int(v) for c, v in out.items()})
    return max(phases, key=lambda d: sum(d.values()))


def accumulation_update(graph: Graph, rp: ResolvedPlan) -> dict[str, int]:
    """The update phase of gradient accumulation (pp = 1, m > 1) counted over the update program itself
    (``cost.memory.program_peaks``): the state held (the replaced part freed at its last read, as
    ``runtime.rank_step`` hands it to the update), the accumulators (the boundary values, at their produced
    sharding) and the whole batch held (the caller's)."""
    from .accumulate import split_step
    split = split_step(graph)
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    a = analyze(graph)
    held = [i.value for i in graph.inputs] + [a.root[v] for v in split.boundary]
    return program_peaks(graph, rp, [([index[n] for n in split.update_nodes], held)])[0]


def in_flight(schedule: Schedule, pp: int, m: int, s: int, chunks: int = 1) -> float:
    """Micro-batches whose activations stage ``s`` holds at once: 1F1B ``min(pp - s, m)``, GPipe ``m``;
    interleaved: the warm-up chunk-micro-batches plus one (``ir.stages.schedule_order``), each a
    ``1 / chunks`` share of the device's activations (Megatron-LM, arXiv 2104.04473, section 2.2.2)."""
    if pp == 1:
        return 1
    if schedule is Schedule.INTERLEAVED and chunks > 1:
        return min(m * chunks, (pp - s - 1) * 2 + (chunks - 1) * pp + 1) / chunks
    return min(pp - s, m) if schedule is not Schedule.GPIPE else m


def _at_peak(mem: MemoryEstimate, rc: RecomputeEffect) -> tuple[dict, float]:
    """The whole-batch peak's categories and the kept share of its activations."""
    exact = rc.memory is not None and rc.memory is not mem  # the recomputing program's own estimate
    return dict(rc.memory.breakdown if exact else mem.breakdown), 1.0 if exact else rc.keep_fraction


def scaled_memory(mem: MemoryEstimate, rc: RecomputeEffect, pp: int, m: int, schedule: Schedule,
                  accumulators: int | None = None, shares: dict[str, float] | None = None,
                  stage: int = 0, chunks: int = 1, update: dict[str, int] | None = None) -> dict[str, int]:
    """Per-category bytes live at the peak of stage ``stage``'s rank (module docstring). ``shares``: the
    stage's fraction of the parameters (``"params"``), optimizer state (``"optimizer"``) and saved
    activations (``"activations"``); None: ``1 / pp`` each (balanced stages)."""
    if pp == 1 and m > 1 and accumulators is not None and len(mem.window_peaks) == 2:
        return accumulation_memory(mem, rc, m, accumulators, update)
    return max(stage_phases(mem, rc, pp, m, schedule, shares, stage, chunks), key=lambda d: sum(d.values()))


def stage_phases(mem: MemoryEstimate, rc: RecomputeEffect, pp: int, m: int, schedule: Schedule,
                 shares: dict[str, float] | None = None, stage: int = 0, chunks: int = 1,
                 messages: int = 0, update: dict[str, int] | None = None) -> list[dict[str, int]]:
    """``scaled_memory``'s bytes per category at the peak of each phase of the stage: with ``pp > 1`` and
    the step's two windows (``MemoryEstimate.window_peaks``), the pipeline phase (forwards and backwards
    of the micro-batches) then the update; else the whole step's peak alone. ``messages``: the pipeline
    phase's boundary values held by the runtime (``_message_bytes``). ``update``: the update phase counted
    over the stage's own update program (``update_phases``), used as it is instead of scaled."""
    at, keep = _at_peak(mem, rc)
    sh = shares if shares is not None else {"params": 1 / pp, "optimizer": 1 / pp, "activations": 1 / pp}
    phases = [at]
    if pp > 1 and len(mem.window_peaks) == 2:
        # the pipeline phase (before the first optimizer node) and the update phase, each at its own peak
        exact = rc.memory is not None and rc.memory is not mem
        phases = [at if exact else dict(mem.window_peaks[0][1]), dict(mem.window_peaks[1][1])]
    flight = in_flight(schedule, pp, m, stage, chunks)
    out = []
    for k, ph in enumerate(phases):
        if k == 1 and update is not None:
            out.append(dict(update))
            continue
        cat_bytes = {}
        for cat, v in ph.items():
            if cat in ("params", "buffers", "gradients", "updated_state"):
                cat_bytes[cat] = v * sh["params"]
            elif cat == "optimizer":
                cat_bytes[cat] = v * sh["optimizer"]
            elif cat == "activations":
                cat_bytes[cat] = v * keep * flight * sh["activations"] / m
            elif k == 1:  # the update's temporaries are per parameter; the whole batch stays held
                cat_bytes[cat] = v * sh["params"] if cat == "temporaries" else v
            else:  # temporaries, batch
                cat_bytes[cat] = v / m
        if m > 1:  # the accumulation buffer holds every gradient of the stage across micro-batches
            cat_bytes["gradients"] = max(cat_bytes.get("gradients", 0), mem.gradients * sh["params"])
        if pp > 1:  # every stage's runtime holds the whole local batch through the step (runtime.pipeline)
            cat_bytes["batch"] = mem.batch
        if messages and k == 0:
            cat_bytes["messages"] = messages
        out.append({c: int(v) for c, v in cat_bytes.items()})
    return out


def simulate(fwd: list[float], bwd: list[float], send_f: list[float], send_b: list[float], m: int,
             schedule: Schedule, chunks: int = 1, over_f: list[float] | None = None,
             over_b: list[float] | None = None) -> tuple[list[float], list[float]]:
    """Event simulation of one pipeline (module docstring): per device, (time its last operation ends,
    time it was busy). ``fwd`` / ``bwd``: per (virtual) stage and micro-batch; ``send_f[s]`` / ``send_b[s]``:
    transfer time from stage s to s+1 / back. Virtual stage ``c * pp + d`` runs on device ``d``; each device
    runs ``ir.stages.schedule_order``; an operation starts when its device is free and its input arrived.
    ``over_f`` / ``over_b``: per stage, seconds each forward / backward also occupies its device outside
    its program (its messages: not busy)."""
    V = len(fwd)
    pp = V // chunks
    of, ob = over_f or [0.0] * V, over_b or [0.0] * V
    order = [schedule_order(schedule.value, d, pp, m, chunks) for d in range(pp)]
    done: dict[tuple, float] = {}
    free, pos = [0.0] * pp, [0] * pp
    left = 2 * m * V
    while left:
        moved = False
        for d in range(pp):
            while pos[d] < len(order[d]):
                kind, s, j = order[d][pos[d]]
                if kind == "F":
                    dep = 0.0 if s == 0 else done.get(("F", s - 1, j))
                    dep = dep if s == 0 or dep is None else dep + send_f[s - 1]
                else:
                    dep = done.get(("F", s, j)) if s == V - 1 else done.get(("B", s + 1, j))
                    dep = dep if s == V - 1 or dep is None else dep + send_b[s]
                if dep is None:
                    break
                start = max(free[d], dep)
                free[d] = done[(kind, s, j)] = start + (fwd[s] + of[s] if kind == "F" else bwd[s] + ob[s])
                pos[d] += 1
                left -= 1
                moved = True
        assert moved, "the pipeline schedule deadlocked"
    return free, [m * sum(fwd[c * pp + d] + bwd[c * pp + d] for c in range(chunks)) for d in range(pp)]


def value_bytes(graph: Graph, rp: ResolvedPlan, vid: int) -> int:
    """Bytes of value ``vid`` on one rank under the plan (its local shape)."""
    t = graph.types[vid]
    sh = rp.value.get(vid)
    if sh is None:
        return t.nbytes
    n = 1
    for d in local_shape(t.shape, sh, rp.plan.mesh):
        n *= d
    return n * t.dtype.itemsize


def stage_list(graph: Graph, stage_of: dict[str, int]) -> list[int]:
    """A stage per node index from forward node name -> stage (-1 for nodes without one)."""
    return [stage_of.get(n.name, -1) for n in graph.nodes]


def _boundaries(graph: Graph, rp: ResolvedPlan, sa: StageAssignment, pp: int) -> tuple[list, list, list]:
    """Per boundary s (stage s to s+1): forward and backward bytes per step (whole batch, per rank), and per
    stage the bytes it receives once after the pipeline (update phase: a tied weight's summed gradient)."""
    fwd, bwd, upd = [0] * (pp - 1), [0] * (pp - 1), [0] * pp
    for c in sa.crossings:
        b = value_bytes(graph, rp, c.value)
        if c.phase is Phase.UPDATE:
            upd[c.dst] += b
            continue
        lo, hi = min(c.src, c.dst), max(c.src, c.dst)
        for k in range(lo, hi):
            (fwd if c.phase is Phase.FORWARD else bwd)[k] += b
    return fwd, bwd, upd


def _message_bytes(graph: Graph, rp: ResolvedPlan, sa: StageAssignment, virtual: list[int], m: int,
                   flight: float) -> int:
    """Boundary values a device's rank holds in the pipeline phase (``runtime.pipeline``; each value once, as
    one tensor serves every send of it): the forward values it sends and receives for the micro-batches in
    flight (a sent one is kept until the peer is known to have it: ``runtime.pipeline_messages``, when the
    gradient of its micro-batch comes back), one micro-batch's gradients sent and received."""
    mine = set(virtual)
    fwd, bwd = set(), set()
    for c in sa.crossings:
        if c.phase is not Phase.UPDATE and (c.src in mine or c.dst in mine):
            (fwd if c.phase is Phase.FORWARD else bwd).add(c.value)
    return int(sum(value_bytes(graph, rp, v) for v in fwd) * flight / m
               + sum(value_bytes(graph, rp, v) for v in bwd) / m)


def _shares(graph: Graph, rp: ResolvedPlan, mem: MemoryEstimate, sa: StageAssignment, stage: list[int],
            pp: int) -> tuple[list[dict], list[int]]:
    """Per stage: its share of parameters, optimizer state and saved activations; parameter counts."""
    par, opt, act, count = [0] * pp, [0] * pp, [0] * pp, [0] * pp
    total = {"params": 0, "optimizer": 0}      # each tensor once: a tied one held by two stages counts on both
    for inp in graph.inputs:
        if inp.role not in (Role.PARAM, Role.FROZEN, Role.BUFFER, Role.OPT_STATE):
            continue
        b = value_bytes(graph, rp, inp.value)
        total["optimizer" if inp.role is Role.OPT_STATE else "params"] += b
        for s in sa.holders.get(inp.name, (0,)):
            if inp.role is Role.OPT_STATE:
                opt[s] += b
            else:
                par[s] += b
                count[s] += inp.role is not Role.BUFFER
    for (p, _, b) in mem.activation_spans:
        act[stage[p]] += b

    def share(xs: list[int], s: int, whole: int) -> float:
        return xs[s] / whole if whole else 1 / pp

    return [{"params": share(par, s, total["params"]), "optimizer": share(opt, s, total["optimizer"]),
             "activations": share(act, s, sum(act))} for s in range(pp)], count


def _link(cluster: Cluster, stage_world: int, boundary: int, pp: int | None = None,
          profile: Profile | None = None) -> tuple[float, float, bool]:
    """(bandwidth, latency, within a node) of the transfer across ``boundary`` (after its last rank); with
    ``pp``: ``boundary`` between virtual stages, from device ``boundary % pp`` to the next one's device.
    Within a node a measured point-to-point fit (``profile.p2p_*``, ``rhino profile``) replaces the link's."""
    if pp is None:
        same = (boundary + 1) * stage_world % cluster.devices_per_node != 0
    else:
        a, b = boundary % pp, (boundary + 1) % pp
        dpn = cluster.devices_per_node
        same = (a * stage_world) // dpn == (b * stage_world) // dpn == ((a + 1) * stage_world - 1) // dpn
    if same and profile is not None and profile.p2p_bandwidth:
        return profile.p2p_bandwidth, profile.p2p_latency_s or 0.0, True
    if same:
        return cluster.intra_node.bandwidth, cluster.intra_node.latency_s, True
    return cluster.inter_node_bandwidth_per_device, cluster.inter_node.latency_s, False


_ASSIGNED: dict = {}


def _assigned(graph: Graph, stage_of: dict[str, int], pp: int) -> StageAssignment:
    """``assign_stages``, remembered for the last (graph, cut): the search prices one cut at several
    micro-batch counts (``search.stages.stage_cut``, rule ``pipeline_reuse_cut``)."""
    key = (len(graph.nodes), pp, tuple(sorted(stage_of.items())))
    hit = _ASSIGNED.get("last")
    if hit is not None and hit[0]() is graph and hit[1] == key:
        return hit[2]
    sa = assign_stages(graph, stage_of, pp)
    _ASSIGNED["last"] = (weakref.ref(graph), key, sa)
    return sa


_RENEWED: dict = {}


def stage_refusal(graph: Graph, sa: StageAssignment) -> str | None:
    """Why ``runtime.pipeline`` cannot run this stage assignment, or None. A buffer renewed by a forward node
    (a BatchNorm's running statistics) is renewed on that node's stage, micro-batch by micro-batch; it must be
    held by that stage alone: one module applied on two stages (a BatchNorm used twice) reads it on one
    stage and renews it on another. The runtime raises this sentence (``pipeline_spec``); the search, pricing
    the cut, marks the plan as not fitting."""
    for name, node in _renewed_buffers(graph):
        s = sa.node_stage.get(node)
        if s is None or sa.holders.get(name) == {s}:
            continue
        read = sorted(sa.holders.get(name, ()))
        read = f"stage{'s' if len(read) > 1 else ''} {', '.join(map(str, read))}"
        return (f"buffer {name} is read on {read} but its new value is made on stage {s} (the cut falls between "
                f"its reads and its update, as for a BatchNorm applied twice or a cut with too few nodes between "
                f"such spans), and a pipeline updates a buffer where it is read: use fewer pipeline stages, or a "
                f"plan (--plan) whose cut keeps the buffer's reads and its update on one stage")
    return None


def _renewed_buffers(graph: Graph) -> list[tuple[str, str]]:
    """(buffer, the forward node making its new value) per buffer the gradient part renews; remembered for
    the last graph."""
    hit = _RENEWED.get("last")
    if hit is not None and hit[0]() is graph:
        return hit[1]
    from .accumulate import SplitError, split_step
    try:
        split = split_step(graph)
    except SplitError:        # no loss: no runtime pipeline
        split = None
    a = analyze(graph)
    out_value = {o.name: o.value for o in graph.outputs}
    grad_nodes = set(split.grad_nodes) if split is not None else set()
    out = []
    for n in split.grad_state_outputs if split is not None else ():
        p = a.producer.get(out_value[n])
        if p is not None and graph.nodes[p].name in grad_nodes and a.is_forward(p):
            out.append((n, graph.nodes[p].name))
    _RENEWED["last"] = (weakref.ref(graph), out)
    return out


def pipeline_time(graph: Graph, rp: ResolvedPlan, st: StepTime, mem: MemoryEstimate, rc: RecomputeEffect,
                  cluster: Cluster, links: list[AxisLink], *, pp: int, microbatches: int, schedule: Schedule,
                  options: StepOptions, accumulators: int | None = None,
                  stages: list[int] | None = None, chunks: int = 1) -> PipelineTime:
    """Step time and memory of ``pp`` stages x ``microbatches`` (module docstring). ``stages``: a stage per
    node for the forward nodes (-1 elsewhere; others are derived); None: ``ir.stages.contiguous_cut``.
    ``chunks``: model chunks per device (interleaved schedule): ``stages`` are then the ``pp * chunks``
    virtual stages, virtual stage ``c * pp + d`` on device ``d``."""
    m = microbatches
    if pp == 1:
        return _single_stage(graph, rp, st, mem, rc, cluster, m, schedule, options, accumulators)
    V = pp * chunks
    stage_of = contiguous_cut(graph, V) if stages is None else \
        {graph.nodes[i].name: s for i, s in enumerate(stages) if s >= 0}
    sa = _assigned(graph, stage_of, V)
    stage = [sa.node_stage.get(n.name, -1) for n in graph.nodes]
    mesh = rp.plan.mesh
    f_mb, b_mb, ops, grad, pref, opt = _stage_work(graph, rp, st, rc, cluster, options, sa, stage, V, m)
    fb, bb, upd = _boundaries(graph, rp, sa, V)
    send_f, send_b, notes = [], [], []
    for k in range(V - 1):
        bw, lat, same = _link(cluster, mesh.world, k, pp if chunks > 1 else None, options.profile)
        send_f.append(fb[k] / m / bw + lat)
        send_b.append(bb[k] / m / bw + lat)
    worst = max(range(V - 1), key=lambda k: fb[k])
    notes.append(f"stage boundaries: up to {fb[worst] / m / 2**20:.1f} MiB per micro-batch forward "
                 f"(boundary {worst}/{worst + 1})")
    over_f, over_b = _message_overhead(sa, V, pp, options.profile)
    end, busy = simulate(f_mb, b_mb, send_f, send_b, m, schedule, chunks, over_f, over_b)
    dev = [[c * pp + d for c in range(chunks)] for d in range(pp)]      # device -> its virtual stages
    pipe = max(end)
    finish, work = [], []
    divide = _divide_seconds(graph, rp, sa, V, cluster, options.profile)
    for d in range(pp):
        g, p_, o, u, div = (sum(x[v] for v in dev[d]) for x in (grad, pref, opt, upd, divide))
        window = b_mb[d] if options.overlap_gradient_reduction else 0.0   # chunk 0 runs the last backward
        hidden = busy[d] if options.prefetch_parameters else 0.0
        bw, lat, _ = _link(cluster, mesh.world, max(d - 1, 0), None, options.profile)
        summed = u / bw + lat if u else 0.0     # a tied weight's gradient from another stage
        finish.append(end[d] + div + max(0.0, g - window) + max(0.0, p_ * m - hidden) + summed + o)
        work.append(busy[d] + finish[d] - end[d] - summed)   # programs run after the pipeline phase are busy
    step = max(finish)
    crit = max(range(pp), key=lambda d: finish[d])
    compute = busy[crit] + sum(opt[v] for v in dev[crit])
    bubble = max(0.0, pipe - max(busy))
    comm_total = sum(c.comm for c in st.nodes) / pp + (m) * (sum(send_f) + sum(send_b))
    shares, params = _shares(graph, rp, mem, sa, stage, V)
    updates = update_phases(graph, rp, sa, dev)
    costs = []
    for d in range(pp):
        share = {k: sum(shares[v][k] for v in dev[d]) for k in shares[0]}
        phases = stage_phases(mem, rc, pp, m, schedule, shares=share, stage=d, chunks=chunks,
                              messages=_message_bytes(graph, rp, sa, dev[d], m,
                                                      in_flight(schedule, pp, m, d, chunks)),
                              update=updates[d])
        costs.append(StageCost(sum(ops[v] for v in dev[d]), sum(params[v] for v in dev[d]),
                               sum(f_mb[v] for v in dev[d]), sum(b_mb[v] for v in dev[d]),
                               int(fb[d] / m) if d < V - 1 else 0, max(phases, key=lambda x: sum(x.values())),
                               phases))
    peak_stage = max(costs, key=lambda c: c.peak)
    idle = 1.0 - sum(busy) / (pp * pipe) if pipe > 0 else 0.0
    step_idle = 1.0 - sum(work) / (pp * step) if step > 0 else 0.0
    return PipelineTime(step, compute, max(0.0, step - compute - bubble), comm_total, bubble,
                        rc.extra_seconds / pp, rc.extra_flops / pp, peak_stage.peak, dict(peak_stage.memory),
                        notes, idle, costs, stage, step_idle, stage_refusal(graph, sa))


def update_phases(graph: Graph, rp: ResolvedPlan, sa: StageAssignment, devices: list[list[int]]) -> list[dict]:
    """Per device (the virtual stages it runs): bytes per category at the peak of its update phase, counted over
    its own update program (``cost.memory.program_peaks``): the optimizer nodes its stages run, with the state
    they hold (the replaced part freed at its last read, as ``runtime.pipeline`` hands it to the update), the
    gradient accumulators those nodes read and the batch (the runtime keeps both through the update) held."""
    a = analyze(graph)
    programs = []
    for stages in devices:
        mine = set(stages)
        nodes = [i for i, n in enumerate(graph.nodes) if sa.update_stages.get(n.name, frozenset()) & mine]
        names = {name for s in stages for name in sa.held_by(s)}
        held = [i.value for i in graph.inputs if i.name in names or i.role is Role.BATCH]
        held += [r for i in nodes for r in a.node_roots[i] if r in a.gradients]
        programs.append((nodes, held))
    return program_peaks(graph, rp, programs)


def _divide_seconds(graph: Graph, rp: ResolvedPlan, sa: StageAssignment, V: int, cluster: Cluster,
                    profile: Profile | None) -> list[float]:
    """Per virtual stage: the runtime's division of its accumulated parameter gradients by m after the last
    micro-batch (``runtime.pipeline``: one in-place pass, read + write, at the element-wise rate: the
    profile's measured one, else the device's memory bandwidth)."""
    rate = (profile.kind_bandwidth or {}).get("elementwise") if profile is not None else None
    rate = rate or cluster.device.memory_bandwidth
    out = [0.0] * V
    for inp in graph.inputs:
        if inp.role is Role.PARAM:
            for s in sa.holders.get(inp.name, (0,)):
                out[s] += 2 * value_bytes(graph, rp, inp.value) / rate
    return out


def _message_overhead(sa: StageAssignment, V: int, pp: int, profile: Profile | None) -> tuple[list, list]:
    """Per virtual stage: seconds its forward / backward spend on their messages (``profile.p2p_message_s``
    per message sent or received; a value between two chunks of one device is no message). A forward value
    is counted at its receiver's forward, which receives it for its backward too."""
    over_f, over_b = [0.0] * V, [0.0] * V
    cost = profile.p2p_message_s if profile is not None and profile.p2p_message_s else 0.0
    for c in sa.crossings:
        if not cost or c.phase is Phase.UPDATE or c.src % pp == c.dst % pp:
            continue
        side = over_f if c.phase is Phase.FORWARD else over_b
        side[c.src] += cost
        side[c.dst] += cost
    return over_f, over_b


_MICRO: dict = {}


def _micro_min_dims(graph: Graph, m: int, profile: Profile | None) -> dict[str, int]:
    """Per MATMUL node: its smallest dimension at one micro-batch (``compute.op_time``'s ``min_dim``). A
    micro-batch is the batch split m ways as data parallelism over m ranks splits it (the runtime checks the
    same: ``runtime.rank_step.same_structure``), so the local shapes of the ``dp=m`` preset are a
    micro-batch's (the stage plan's own sharding is not applied: a data-parallel stage's rows are fewer still).
    Empty without a measured ``profile.thin_gemm_d0`` (nothing uses them), for m = 1, or when
    the batch does not split m ways. Remembered per m for the last graph (the search prices one graph at
    several micro-batch counts)."""
    if m == 1 or profile is None or not profile.thin_gemm_d0:
        return {}
    hit = _MICRO.get("last")
    if hit is None or hit[0]() is not graph:
        hit = _MICRO["last"] = (weakref.ref(graph), {})
    if m in hit[1]:
        return hit[1][m]
    from ..ir.registry import OpKind, lookup
    from ..sharding.plan import PlanError, resolve
    from ..sharding.presets import parse_strategy, preset_plan
    out: dict[str, int] = {}
    try:
        micro = resolve(graph, preset_plan(graph, parse_strategy(f"dp={m}")))
    except (PlanError, ValueError):
        micro = None
    for node in graph.nodes if micro is not None else ():
        opdef = lookup(node.op)
        if opdef is None or opdef.kind is not OpKind.MATMUL:
            continue
        mats = [tuple(micro.local_shape(r.id)) for r in node.input_refs() if graph.types[r.id].rank >= 2]
        if len(mats) >= 2:
            a, b = mats[-2], mats[-1]
            out[node.name] = int(min(a[-2], a[-1], b[-1]))
    hit[1][m] = out
    return out


def _accumulation_seconds(graph: Graph, rp: ResolvedPlan, stage: list[int], V: int, cluster: Cluster,
                          profile: Profile | None) -> list[float]:
    """Per virtual stage: seconds one later micro-batch spends adding its gradients into the accumulators
    (``runtime.pipeline``, ``lower.spmd.Part.accumulate``): a gradient made by a matrix product (seen through
    transposes) is added by the product itself (``lower.accumulate``: the accumulator read once more), any
    other with an in-place add (read both, write one); at the element-wise rate (the profile's measured one,
    else the device's memory bandwidth)."""
    rate = (profile.kind_bandwidth or {}).get("elementwise") if profile is not None else None
    rate = rate or cluster.device.memory_bandwidth
    out = [0.0] * V
    for vid, i, passes in _gradient_passes(graph):
        if stage[i] >= 0:
            out[stage[i]] += passes * value_bytes(graph, rp, vid) / rate
    return out


_PASSES: dict = {}


def _accumulate(op: str) -> Accumulate | None:
    opdef = lookup(op)
    return None if opdef is None else opdef.accumulate


def _gradient_passes(graph: Graph) -> list[tuple[int, int, int]]:
    """(gradient value, index of its producer, passes of its accumulation) per accumulated gradient
    (``_accumulation_seconds``); remembered for the last graph."""
    hit = _PASSES.get("last")
    if hit is not None and hit[0]() is graph:
        return hit[1]
    from .accumulate import SplitError, split_step
    a = analyze(graph)
    out = []
    try:
        boundary = split_step(graph).boundary
    except SplitError:        # no loss: nothing to accumulate (and no runtime pipeline either)
        boundary = []
    for vid in boundary:
        i = a.producer.get(vid)
        if i is None:
            continue
        j = i
        while _accumulate(graph.nodes[j].op) is Accumulate.SEE_THROUGH \
                and a.producer.get(graph.nodes[j].input_refs()[0].id) is not None:
            j = a.producer[graph.nodes[j].input_refs()[0].id]
        out.append((vid, i, 1 if _accumulate(graph.nodes[j].op) is Accumulate.MATMUL else 3))
    _PASSES["last"] = (weakref.ref(graph), out)
    return out


def _stage_work(graph, rp, st, rc, cluster, options, sa, stage, V, m) -> tuple:
    """Per (virtual) stage: forward and backward seconds per micro-batch, forward op count, and per step its
    gradient-reduction, parameter-gather and optimizer seconds. A micro-batch's matrix products are priced at
    its own smallest dimension (``_micro_min_dims``); its backward adds its gradients into the accumulators
    (``_accumulation_seconds``; every micro-batch but the first: ``(m - 1) / m`` of it per micro-batch)."""
    a = analyze(graph)
    mesh = rp.plan.mesh
    dims = _micro_min_dims(graph, m, options.profile)
    f_mb, b_mb, f_full = [0.0] * V, [0.0] * V, [0.0] * V
    grad, pref, opt = [0.0] * V, [0.0] * V, [0.0] * V
    ops = [0] * V
    for i, (node, cost) in enumerate(zip(graph.nodes, st.nodes)):
        where = sa.update_stages.get(node.name, ()) if cost.optimizer or stage[i] < 0 else (stage[i],)
        for s in where:
            grad[s] += cost.comm if cost.kind == "gradient" else 0.0
            pref[s] += cost.comm if cost.kind == "prefetch" else 0.0
            opt[s] += cost.compute if cost.optimizer or stage[i] < 0 else 0.0
        if cost.optimizer or stage[i] < 0:
            continue
        s = stage[i]
        t = node_compute(graph, node, rp.plan.strategies.get(node.name), mesh, cluster.device,
                         allow_tf32=options.allow_tf32, profile=options.profile, extra_scale=1.0 / m,
                         min_dim=dims.get(node.name)).seconds if cost.compute else 0.0
        t += cost.comm / m if cost.kind == "blocking" else 0.0
        if a.is_forward(i):
            f_mb[s] += t
            f_full[s] += cost.compute
            ops[s] += 1
        else:
            b_mb[s] += t
    total_f = sum(f_full) or 1.0
    acc = _accumulation_seconds(graph, rp, stage, V, cluster, options.profile) if m > 1 else [0.0] * V
    for s in range(V):   # the recomputed forward runs before each stage's backward
        b_mb[s] += (rc.extra_seconds + rc.extra_comm_seconds) * f_full[s] / total_f / m + acc[s] * (m - 1) / m
    return f_mb, b_mb, ops, grad, pref, opt


def _single_stage(graph, rp, st, mem, rc, cluster, m, schedule, options, accumulators) -> PipelineTime:
    """pp = 1: the step of ``step.step_time`` (m = 1), or m micro-batches accumulated then one update."""
    counted = m > 1 and accumulators is not None and len(mem.window_peaks) == 2
    at_peak = scaled_memory(mem, rc, 1, m, schedule, accumulators, update=accumulation_update(graph, rp) if counted
                            else None)
    peak = sum(at_peak.values())
    if m == 1:
        extra = rc.extra_seconds + rc.extra_comm_seconds
        return PipelineTime(st.step_seconds + extra, st.compute_seconds + rc.extra_seconds,
                            st.exposed_comm_seconds + rc.extra_comm_seconds, st.comm_seconds + rc.extra_comm_seconds,
                            0.0, rc.extra_seconds, rc.extra_flops, peak, at_peak)
    mesh = rp.plan.mesh
    fb_mb = 0.0
    for node, cost in zip(graph.nodes, st.nodes):
        if cost.optimizer or cost.compute == 0.0:
            continue
        fb_mb += node_compute(graph, node, rp.plan.strategies.get(node.name), mesh, cluster.device,
                              allow_tf32=options.allow_tf32, profile=options.profile, extra_scale=1.0 / m).seconds
    fb_mb += rc.extra_seconds / m
    blocking_mb = (st.comm_by_kind.get("blocking", 0.0) + rc.extra_comm_seconds) / m
    pipe = m * (fb_mb + blocking_mb)
    # gradient accumulation on one stage (runtime.rank_step) reduces in the update program, after the last
    # micro-batch's backward: nothing to hide behind
    grad = st.comm_by_kind.get("gradient", 0.0)
    prefetch = st.comm_by_kind.get("prefetch", 0.0) * m
    pref_exposed = max(0.0, prefetch - pipe) if options.prefetch_parameters else prefetch
    step = pipe + st.optimizer_compute + grad + pref_exposed
    compute = m * fb_mb + st.optimizer_compute
    comm_total = m * blocking_mb + grad + prefetch
    return PipelineTime(step, compute, max(0.0, step - compute), comm_total, 0.0, rc.extra_seconds,
                        rc.extra_flops, peak, at_peak, [])
