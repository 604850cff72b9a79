"""Pipelined training steps: one rank's part of a step of a plan with ``plan.stages = S > 1`` stages.

**Ranks.** The job has ``S * W`` ranks, ``W = plan.mesh.world``; stage-major: rank ``r`` is local rank
``r % W`` of stage ``r // W`` (the mesh ``("pp",) + plan.mesh.names``). Each stage runs the plan on its
own ``W``-rank mesh (dp / tp / ZeRO inside a stage); boundary values go from local rank ``i`` of one stage
to local rank ``i`` of another by point-to-point messages, in the sharding they were made in.

**Programs** (cut from the step captured at batch B/m, as ``RankStep``'s micro-batch programs; with
m = 1 the step itself): ``cost.accumulate.split_step`` gives the gradient part and the update part;
``ir.stages.assign_stages`` (from ``plan.stage_of``, or ``ir.stages.contiguous_cut`` when the plan has none)
gives every gradient-part node a stage. Stage ``s`` runs

- ``F_s``: its forward nodes, per micro-batch (its loss on the last stage, its buffers' new values);
- ``B_s``: its backward nodes, per micro-batch; gradients (``split_step``'s boundary values) made by
  ``F_s`` or ``B_s`` are kept from micro-batch 1 and added into in place by the later ones, then divided
  by m;
- ``U_s`` once per step: the update nodes the new values of its held state need (``StageAssignment.holders``;
  a tied weight is held, and updated from the same summed gradient, on every stage using it).

**Transfers.** A value ``F_a`` or ``B_a`` makes and stage ``b != a`` reads is sent when made, once per
(value, receiver) and micro-batch; ``b`` receives it right before its first program reading it (``F_b``,
else ``B_b``) and keeps what ``F_b`` made or received for its ``B_b`` (a stash per micro-batch in flight).
Gradients ``U_b`` reads from another stage are sent after the sender's last micro-batch. Sends never
block; the rules of ``ir.stages`` make the schedules deadlock-free.

**Schedules** (``plan.schedule``, ``ir.stages.schedule_order``): GPipe (``F`` of every micro-batch, then
``B`` of every micro-batch); 1F1B (PipeDream-Flush: stage ``s`` runs ``min(S - 1 - s, m)`` forwards, then
alternates one forward and one backward, then the remaining backwards); interleaved 1F1B (Megatron-LM,
``plan.chunks = v``: the cut has ``S * v`` virtual stages, virtual stage ``c * S + s`` is chunk ``c`` of
stage ``s``; the rank runs its chunks' programs in Megatron's order, a value between two chunks of one
rank is handed over locally, the update runs every chunk's update program on the state before any of them,
so a weight two chunks hold is updated once from the same summed gradient). The loss of the step is ``sum_k loss_k / m`` from the last
stage, broadcast to every rank. The step's result equals ``RankStep``'s (and PyTorch's accumulation loop).

``PipelineStep.schedule`` yields actions (``Run``, ``Send``, ``Recv``); ``run`` executes them with
``torch.distributed`` (``isend``/``irecv``) and records the time spent running programs (busy) and the
rest of the step (idle: waiting for boundary values, the bubble); ``runtime.pipeline_sim`` executes every
rank's actions in one process.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Generator

import torch
import torch.distributed as dist

from ..capture import Captured
from ..capture.to_ir import torch_dtype
from ..cost.accumulate import SplitError, StepSplit, split_step
from ..cost.pipeline import stage_refusal
from ..ir.analysis import analyze
from ..cost.remat import remat, remat_plan
from ..ir.graph import Graph, Ref, Role
from ..ir.stages import StageAssignment, assign_stages, contiguous_cut, schedule_order
from ..lower.overlap import release_inputs
from ..lower.spmd import Part, SpmdProgram, lower_rank
from ..sharding.placement import Partial, ReduceOp, replicated
from ..sharding.plan import PlanError, ResolvedPlan, ShardingPlan, resolve
from ..sharding.rebatch import rebatch_plan
from ..sharding.vocab import Recompute
from .collectives import resolved
from .pipeline_messages import message_events, send_releases

__all__ = ["Run", "Send", "Recv", "StageSpec", "PipelineSpec", "pipeline_spec", "PipelineStep", "stage_order",
           "StepTimes", "PIPELINE_MEMORY_PLAN", "staged_recompute"]

#: why ``--memory-plan`` refuses pipelines: the arena planner (``runtime.arena_step``) plans one program per
#: step, while a stage runs forward and backward programs per micro-batch with values stashed between them
PIPELINE_MEMORY_PLAN = ("--memory-plan does not run pipeline stages: a memory plan per rank covers one program per "
                        "step, and a stage runs separate forward and backward programs per micro-batch; drop "
                        "--memory-plan or the pp key")


# -- actions ------------------------------------------------------------------------------------------
@dataclass
class Run:
    program: SpmdProgram
    args: list
    key: tuple                # (phase, micro-batch) or ("U", 0): which program of the stage


@dataclass
class Send:
    dst: int                  # stage
    tag: int
    tensor: torch.Tensor


@dataclass
class Recv:
    src: int                  # stage
    tag: int
    shape: tuple[int, ...]
    dtype: torch.dtype


# -- which nodes and values each stage program has (pure graph logic) -------------------------------------------
@dataclass
class ProgramSpec:
    """One program of one stage. ``inputs``: ("state", name) | ("batch", index) | ("value", vid);
    ``outputs``: ("loss", vid) | ("buffer", name) | ("export", vid); ``grads``: boundary values it makes
    (first micro-batch: extra outputs; later ones: accumulated in place)."""

    nodes: set[str]
    inputs: list[tuple] = field(default_factory=list)
    outputs: list[tuple] = field(default_factory=list)
    grads: list[int] = field(default_factory=list)
    recvs: list[tuple[int, int, int]] = field(default_factory=list)   # (vid, src stage, transfer index)
    sends: list[tuple[int, int, int]] = field(default_factory=list)   # (vid, dst stage, transfer index)


@dataclass
class StageSpec:
    forward: ProgramSpec
    backward: ProgramSpec
    update: ProgramSpec
    held: list[str]                       # state inputs this stage holds (graph input order)


@dataclass
class PipelineSpec:
    graph: Graph                          # the step at batch B/m (the step itself for m = 1)
    split: StepSplit
    assignment: StageAssignment
    stages: list[StageSpec]               # per virtual stage (``plan.stages * plan.chunks``)
    transfers: int                        # number of (value, receiver) pairs: tags are per transfer
    chunks: int = 1                       # virtual stages per device: ``c * devices + d`` on device ``d``

    def device_stages(self, device: int) -> list[int]:
        """The virtual stages device (pipeline rank) ``device`` runs, chunk order."""
        devices = len(self.stages) // self.chunks
        return [c * devices + device for c in range(self.chunks)]

    def device_held(self, device: int) -> list[str]:
        """The state inputs any of ``device``'s chunks holds (graph input order)."""
        return list(dict.fromkeys(n for v in self.device_stages(device) for n in self.stages[v].held))


def _reads(graph: Graph, nodes: set[str]) -> list[int]:
    """Values ``nodes`` read that they do not make, in first-read order."""
    made = {v for n in graph.nodes if n.name in nodes for v in n.outputs if v is not None}
    out: dict[int, None] = {}
    for n in graph.nodes:
        if n.name in nodes:
            for r in n.input_refs():
                if r.id not in made:
                    out.setdefault(r.id)
    return list(out)


def _update_nodes(graph: Graph, split: StepSplit, outputs: list[int]) -> set[str]:
    """The update nodes the values ``outputs`` are computed from."""
    producer = {v: n for n in graph.nodes if n.name in set(split.update_nodes) for v in n.outputs if v is not None}
    out: set[str] = set()
    stack = list(outputs)
    while stack:
        n = producer.get(stack.pop())
        if n is not None and n.name not in out:
            out.add(n.name)
            stack.extend(r.id for r in n.input_refs())
    return out


def pipeline_spec(graph: Graph, plan: ShardingPlan, full_graph: Graph | None = None) -> PipelineSpec:
    """Every stage's programs and transfers (module docstring) for the step ``graph`` at batch B/m;
    ``full_graph``: the step at batch B, for the default cut when ``plan.stage_of`` is empty."""
    S = plan.stages * plan.chunks
    stage_of = plan.stage_of or contiguous_cut(full_graph or graph, S)
    sa = assign_stages(graph, stage_of, S)
    try:
        split = split_step(graph)
    except SplitError as exc:   # (its advice is gradient accumulation's: fewer micro-batches)
        raise SplitError(f"a pipeline runs the step's gradient part per micro-batch and its optimizer update once "
                         f"after them, which this step does not allow ({exc.reason})", "use pp=1") from None
    a = analyze(graph)
    grad_nodes = set(split.grad_nodes)
    out_value = {o.name: o.value for o in graph.outputs}
    specs = []
    for s in range(S):
        fwd = {n for n in grad_nodes if sa.node_stage[n] == s and a.is_forward(_index(graph, n))}
        bwd = {n for n in grad_nodes if sa.node_stage[n] == s} - fwd
        held = sa.held_by(s)
        upd_outs = [n for n in split.update_state_outputs if n in held]
        upd = ProgramSpec(_update_nodes(graph, split, [out_value[n] for n in upd_outs]))
        specs.append(StageSpec(ProgramSpec(fwd), ProgramSpec(bwd), upd, held))
    refusal = stage_refusal(graph, sa)     # a buffer renewed on another stage than the one holding it
    if refusal is not None:
        raise PlanError(refusal)
    spec = PipelineSpec(graph, split, sa, specs, 0, plan.chunks)
    _wire(spec, a, out_value)
    return spec


def _index(graph: Graph, name: str) -> int:
    cache = graph.__dict__.setdefault("_rhino_index", {})
    if len(cache) != len(graph.nodes):
        cache.clear()
        cache.update({n.name: i for i, n in enumerate(graph.nodes)})
    return cache[name]


def _wire(spec: PipelineSpec, a, out_value: dict[str, int]) -> None:
    """Inputs, outputs, receives and sends of every program."""
    graph, split, sa = spec.graph, spec.split, spec.assignment
    home: dict[int, tuple[int, str]] = {}      # value -> (stage, "F" | "B") of the program making it
    for s, st in enumerate(spec.stages):
        for key, prog in (("F", st.forward), ("B", st.backward)):
            for n in graph.nodes:
                if n.name in prog.nodes:
                    home.update({v: (s, key) for v in n.outputs if v is not None})
    inputs = {i.value: i for i in graph.inputs}
    batch_index = {i.value: k for k, i in enumerate(x for x in graph.inputs if x.role is Role.BATCH)}
    boundary = set(split.boundary)
    transfers: dict[tuple[int, int, bool], int] = {}

    def transfer(vid: int, src: int, dst: int, sender: ProgramSpec, receiver: ProgramSpec) -> None:
        key = (vid, dst, receiver is spec.stages[dst].update)
        if key not in transfers:
            transfers[key] = len(transfers)
            sender.sends.append((vid, dst, transfers[key]))
            receiver.recvs.append((vid, src, transfers[key]))

    for s, st in enumerate(spec.stages):
        have: set[int] = set()                 # values F_s made or received (stashed for B_s)
        for key, prog in (("F", st.forward), ("B", st.backward)):
            for vid in _reads(graph, prog.nodes):
                if vid in inputs:
                    inp = inputs[vid]
                    if inp.role is Role.BATCH:
                        prog.inputs.append(("batch", batch_index[vid]))
                    else:
                        if inp.name not in st.held:
                            raise AssertionError(f"stage {s} reads {inp.name} it does not hold")
                        prog.inputs.append(("state", inp.name))
                    continue
                if vid not in home:
                    continue                   # a constant: lowered into the program
                src, src_key = home[vid]
                prog.inputs.append(("value", vid))
                if vid in have:
                    continue
                assert src != s, (vid, s)
                sender = spec.stages[src].forward if src_key == "F" else spec.stages[src].backward
                transfer(vid, src, s, sender, prog)
                have.add(vid)
            if key == "F":
                have |= {v for n in graph.nodes if n.name in prog.nodes for v in n.outputs if v is not None}
    loss = next(o.value for o in graph.outputs if o.role is Role.LOSS)
    for s, st in enumerate(spec.stages):       # what each forward/backward program returns
        for key, prog in (("F", st.forward), ("B", st.backward)):
            made = [v for n in graph.nodes if n.name in prog.nodes for v in n.outputs if v is not None]
            needed = {v for v, _, _ in prog.sends}
            if loss in made:   # the loss output may be a view made after the loss node
                prog.outputs.append(("loss", loss))
            if key == "F":
                needed |= {v for kind, v in st.backward.inputs if kind == "value"}
                prog.outputs += [("buffer", n) for n in split.grad_state_outputs if out_value[n] in made]
            prog.outputs += [("export", v) for v in made if v in needed]
            prog.grads = [v for v in split.boundary if v in made]
    for s, st in enumerate(spec.stages):       # the update: held state and gradients, some from other stages
        upd = st.update
        reads = _reads(graph, upd.nodes) + [out_value[n] for n in split.update_state_outputs if n in st.held]
        for vid in dict.fromkeys(reads):
            if vid in inputs and inputs[vid].role is not Role.BATCH:
                if inputs[vid].name not in st.held:
                    raise PlanError(f"the update on stage {s} reads {inputs[vid].name}, which stage {s} does not hold")
                upd.inputs.append(("state", inputs[vid].name))
            elif vid in boundary:
                upd.inputs.append(("value", vid))
                src = home[vid][0]
                if src != s:
                    transfer(vid, src, s, spec.stages[src].update, upd)   # sent in the update phase
        upd.outputs = [("state", n) for n in split.update_state_outputs if n in st.held]
    spec.transfers = len(transfers)


# -- recomputation inside stages ------------------------------------------------------------------------------
def staged_recompute(graph: Graph, plan: ShardingPlan, full: Graph) -> tuple[Graph, ShardingPlan]:
    """The step and plan a pipeline runs for ``plan.recompute`` (identity for ``none``): ``cost.remat.remat``'s
    rewrite (the program the cost model prices) kept inside stages. A value that crosses stages in the
    forward is received and stashed by its reader's stage anyway, so the backward reads it instead of its
    recomputed copy (copies left unread are dropped); every copy is asked to run on its original's stage
    (``ir.stages``: a backward node named in ``stage_of``). ``full``: the step at batch B, for the default cut."""
    if Recompute(plan.recompute) is Recompute.NONE:
        return graph, plan
    stage_of = dict(plan.stage_of or contiguous_cut(full, plan.stages * plan.chunks))
    new, origin = remat(graph, plan.recompute)
    new = _read_crossing_values(new, graph, origin, stage_of)
    kept = {n.name for n in new.nodes}
    origin = {c: o for c, o in origin.items() if c in kept}
    stage_of.update({c: stage_of[o] for c, o in origin.items() if o in stage_of})
    return new, dataclasses.replace(remat_plan(plan, origin), stage_of=stage_of)


def _read_crossing_values(new: Graph, old: Graph, origin: dict[str, str], stage_of: dict[str, int]) -> Graph:
    """``new`` whose backward reads every forward value crossing stages (under ``stage_of``) itself rather than
    its recomputed copy; copies nobody reads any more removed."""
    a = analyze(old)
    crossing = set()
    for n in old.nodes[:a.boundary + 1]:
        for r in n.input_refs():
            p = a.producer.get(r.id)
            if p is not None and stage_of[old.nodes[p].name] != stage_of[n.name]:
                crossing.add(r.id)
    old_nodes = {n.name: n for n in old.nodes}
    defined = {v for n in new.nodes for v in n.outputs if v is not None}
    swap = {cv: ov for n in new.nodes if n.name in origin
            for cv, ov in zip(n.outputs, old_nodes[origin[n.name]].outputs)
            if cv is not None and ov in crossing and ov in defined}
    if not swap:
        return new
    nodes = [dataclasses.replace(n, args=_swap_refs(n.args, swap), kwargs=_swap_refs(n.kwargs, swap)) for n in new.nodes]
    read = {o.value for o in new.outputs}
    kept = []
    for n in reversed(nodes):                 # readers come after producers
        if n.name in origin and not any(v in read for v in n.outputs if v is not None):
            continue
        read.update(r.id for r in n.input_refs())
        kept.append(n)
    return dataclasses.replace(new, nodes=kept[::-1], meta=dict(new.meta))


def _swap_refs(obj, swap: dict[int, int]):
    if isinstance(obj, Ref):
        return Ref(swap.get(obj.id, obj.id))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swap_refs(x, swap) for x in obj)
    if isinstance(obj, dict):
        return {k: _swap_refs(v, swap) for k, v in obj.items()}
    return obj


# -- schedules ------------------------------------------------------------------------------------------
def stage_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s programs in order: ("F" | "B", micro-batch) (module docstring; one chunk)."""
    return [(key, k) for key, _, k in schedule_order(schedule, stage, stages, microbatches)]


# -- one rank ---------------------------------------------------------------------------------------------
@dataclass
class StepTimes:
    """One step on one rank: seconds running programs and dividing the accumulated gradients by m (busy) and
    the rest of the step (idle); ``waiting``:
    the part of idle blocked on messages (receives, the sends' completion, the loss broadcast): the schedule's
    fill and drain and transfers; ``posting``: the part of idle spent posting messages (``isend``, a receive's
    buffer and ``irecv``); the rest of idle is the runtime's own work between programs."""

    busy: float
    idle: float
    waiting: float = 0.0
    posting: float = 0.0
    sent_bytes: int = 0     # point-to-point bytes this rank sent (boundary values and their gradients)


def _part(spec: ProgramSpec, rp: ResolvedPlan, first: bool, state_in: dict[str, int], batch_values: list[int]) -> Part:
    graph, mesh = rp.graph, rp.plan.mesh
    names = {"state": lambda x: (x, state_in[x]), "batch": lambda x: (f"batch/{x}", batch_values[x]),
             "value": lambda x: (f"v{x}", x)}
    inputs = [names[kind](x) for kind, x in spec.inputs]
    outs = []
    for kind, x in spec.outputs:
        if kind == "loss":
            outs.append(("loss", x, replicated(mesh)))
        elif kind == "buffer":
            outs.append((x, next(o.value for o in graph.outputs if o.name == x), rp.value[state_in[x]]))
        elif kind == "state":
            outs.append((x, next(o.value for o in graph.outputs if o.name == x), rp.value[state_in[x]]))
        else:
            outs.append((f"v{x}", x, None))
    grads = [(f"grad/{v}", v) for v in spec.grads]
    if first:
        return Part(spec.nodes, inputs, outs + [(n, v, None) for n, v in grads])
    return Part(spec.nodes, inputs, outs, accumulate=grads)


class PipelineStep:
    """Rank ``rank``'s part of a pipelined step (module docstring). ``graph``: the Captured step (or its
    graph with ``micro_graph``, the step at batch B/m, given for m > 1)."""

    def __init__(self, graph: Graph | Captured, plan: ShardingPlan, rank: int, device: torch.device | str = "cpu",
                 micro_graph: Graph | None = None, overlap: bool = False, spec: PipelineSpec | None = None) -> None:
        from .rank_step import microbatch_graph, same_structure
        cap = graph if isinstance(graph, Captured) else None
        full = cap.graph if cap is not None else graph
        if plan.stages < 2:
            raise ValueError("PipelineStep runs plans with two or more stages; RankStep runs the others")
        if not 0 <= rank < plan.world:
            raise ValueError(f"rank {rank} is not in the pipeline's {plan.world} ranks")
        full_rp = resolve(full, plan)  # the plan is for this workload (fingerprint), every sharding checks
        m = plan.microbatches
        if m > 1 and micro_graph is None:
            if cap is None:
                raise ValueError(f"the plan has microbatches={m}: give PipelineStep the Captured step (or micro_graph)")
            micro_graph = microbatch_graph(cap, m)
        g = micro_graph if m > 1 else full
        if m > 1:
            same_structure(full, g, m)
        g, p = staged_recompute(g, rebatch_plan(full_rp, g) if m > 1 else plan, full)
        try:
            self.rp = rp = resolve(g, dataclasses.replace(p, fingerprint=""))
        except PlanError as exc:
            raise ValueError(f"microbatches={m}: a micro-batch cannot be split as the plan splits the batch ({exc}); "
                             f"use fewer micro-batches, a larger batch or fewer devices per stage") from None
        self.spec = spec or pipeline_spec(g, p, full)
        for vid in self.spec.split.boundary:
            if any(isinstance(p, Partial) and p.op is not ReduceOp.SUM for p in rp.value[vid]):
                raise ValueError("a gradient is Partial (not a sum) under this plan; it cannot be accumulated")
        self.plan, self.rank, self.device, self.microbatches = plan, rank, torch.device(device), m
        W = plan.mesh.world
        self.stage, self.local = divmod(rank, W)
        self.chunks = self.spec.device_stages(self.stage)      # this rank's virtual stages
        self.st = self.spec.stages[self.stage]
        self.state_names = self.spec.device_held(self.stage)
        state_in = {i.name: i.value for i in g.inputs}
        batch_values = [i.value for i in g.inputs if i.role is Role.BATCH]
        self.programs: dict[tuple[str, bool, int], SpmdProgram] = {}
        for v in self.chunks:
            st = self.spec.stages[v]
            for key, ps in (("F", st.forward), ("B", st.backward), ("U", st.update)):
                variants = (True, False) if key != "U" and ps.grads and m > 1 else (True,)
                for first in variants:
                    part = _part(ps, rp, first, state_in, batch_values)
                    self.programs[(key, first, v)] = lower_rank(rp, self.local, self.device, part, overlap=overlap)
        self.released = {id(self.programs[("U", True, v)]): release_inputs(self.programs[("U", True, v)])
                         for v in self.chunks}           # the update programs, handed the state they replace
        self.order = schedule_order(plan.schedule, self.stage, plan.stages, m, plan.chunks)
        events = {d: message_events(self.spec, plan.stages, m, schedule_order(plan.schedule, d, plan.stages, m,
                                                                              plan.chunks),
                                    self.spec.device_stages(d), d) for d in range(plan.stages)}
        self.releases = send_releases(events, self.stage)     # sends known received once a message arrives
        self.times: list[StepTimes] = []

    def local_batch(self, batch: tuple) -> tuple:
        """This rank's share of a global batch (``runtime.data.rank_batch`` on the stage mesh)."""
        from .data import rank_batch
        return rank_batch(tuple(batch), self.rp, self.local, self.microbatches, self.device)

    def _recv(self, vid: int, src: int, index: int, k: int) -> Recv:
        t = self.rp.graph.types[vid]
        return Recv(src, index * (self.microbatches + 1) + k, tuple(self.rp.local_shape(vid)), torch_dtype(t.dtype))

    def schedule(self, local_state: dict, local_batch: tuple) -> Generator:
        """The step as actions (``Run``: send its outputs back; ``Recv``: send the tensor back). Returns the
        loss (last stage: ``sum_k loss_k / m``; other stages: None). ``Send`` / ``Recv`` name stages
        (devices); a value between two virtual stages of this rank goes through ``local`` instead."""
        m, spec = self.microbatches, self.spec
        devices = self.plan.stages
        rows = [b.shape[0] // m if b.dim() else 0 for b in local_batch]
        stash: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        grads: dict[int, torch.Tensor] = {}
        accumulating: set[int] = set()                 # storages of ``grads``: later micro-batches add into them
        local: dict[int, torch.Tensor] = {}            # tag -> tensor sent from one of this rank's chunks to another
        later: list[list] = []                         # the arguments of update programs still to run
        self._in_flight = (stash, grads, local, later)  # what ``run_measured`` counts as held between programs
        loss = 0.0

        def recv(vid: int, src: int, index: int, k: int):
            if src % devices == self.stage:
                return local.pop(index * (m + 1) + k)
            return (yield self._recv(vid, src % devices, index, k))

        def send(dst: int, index: int, k: int, t: torch.Tensor):
            if dst % devices == self.stage:
                local[index * (m + 1) + k] = t.clone()
            elif k < m and _storage(t) in accumulating:
                # a view of a gradient accumulator, which the next micro-batch adds into while the send reads it
                yield Send(dst % devices, index * (m + 1) + k, t.clone())
            else:
                yield Send(dst % devices, index * (m + 1) + k, t)

        for key, v, k in self.order:
            st = spec.stages[v]
            ps = st.forward if key == "F" else st.backward
            box = stash.setdefault((v, k), {})
            for vid, src, index in ps.recvs:
                box[vid] = yield from recv(vid, src, index, k)
            first = k == 0 or not ps.grads
            args = [self._arg(kind, x, local_state, local_batch, box, rows, k) for kind, x in ps.inputs]
            outs = yield Run(self.programs[(key, first, v)],
                             args + ([] if first else [grads[u] for u in ps.grads]), (key, k))
            del args
            for (kind, x), t in zip(ps.outputs, outs):
                if kind == "loss":
                    loss += float(t)
                elif kind == "buffer":
                    local_state[x] = t
                else:
                    box[x] = t
            if first:
                sent = {_storage(box[vid]) for vid, _, _ in ps.sends}
                for u, t in zip(ps.grads, outs[len(ps.outputs):]):
                    # a sent tensor (or one sharing its storage) is never added into
                    grads[u] = t.clone() if u in box or _storage(t) in sent else t
                    accumulating.add(_storage(grads[u]))
            for vid, dst, index in ps.sends:
                yield from send(dst, index, k, box[vid])
            if key == "B":
                del stash[(v, k)]
        t0 = time.perf_counter()
        for t in grads.values():
            t.div_(m)
        self.divide_seconds = time.perf_counter() - t0     # compute outside a program: busy in ``run``
        updates = [spec.stages[v].update for v in self.chunks]
        for upd in updates:
            for vid, dst, index in upd.sends:
                yield from send(dst, index, m, grads[vid])
        runs = []
        for v, upd in zip(self.chunks, updates):
            for vid, src, index in upd.recvs:
                grads[vid] = yield from recv(vid, src, index, m)
            runs.append((v, upd, [local_state[x] if kind == "state" else grads[x] for kind, x in upd.inputs]))
        for _, upd, _ in runs:         # every chunk's update reads the state before any update; the state they
            for _, x in upd.outputs:   # replace is handed to them and dies at its last use there (``run``)
                local_state.pop(x, None)
        later[:] = [args for _, _, args in runs]
        for v, upd, _ in runs:
            args = later.pop(0)
            outs = yield Run(self.programs[("U", True, v)], args, ("U", 0))
            local_state.update((x, t) for (_, x), t in zip(upd.outputs, outs))
        del runs, args
        return loss / m if self.stage == self.plan.stages - 1 else None

    def run_measured(self, local_state: dict, local_batch: tuple) -> tuple[float, int]:
        """``run``, each program node by node, also returning this rank's peak of live tensor bytes
        (``LiveBytesMeter``): besides a program's own values, the state, the local batch, every micro-batch's
        stashed activations and received values, the gradient accumulators, values passed between this
        rank's chunks, sends not yet completed and the arguments of update programs still to run count as held (the
        state an update replaces is handed to it, as in ``run``: it dies at its last use there)."""
        from .measure import LiveBytesMeter
        peak = [0]

        def execute(act: Run, pending: list) -> list:
            stash, grads, local, later = self._in_flight
            held = [*local_state.values(), *local_batch, *(t for box in stash.values() for t in box.values()),
                    *grads.values(), *local.values(), *(t for _, t in pending), *(t for args in later for t in args)]
            meter = LiveBytesMeter(act.program.module, held)
            outs = meter.run(*act.args)
            peak[0] = max(peak[0], meter.peak)
            return outs
        loss = self.run(local_state, local_batch, execute)
        return loss, peak[0]

    @staticmethod
    def _arg(kind: str, x, local_state: dict, local_batch: tuple, stash: dict, rows: list[int], k: int):
        if kind == "state":
            return local_state[x]
        if kind == "batch":
            return local_batch[x].narrow(0, k * rows[x], rows[x])
        return stash[x]

    def run(self, local_state: dict, local_batch: tuple, execute=None) -> float:
        """One step with ``torch.distributed`` point-to-point messages (every rank of the job calls it);
        returns the loss (broadcast from the last stage) and appends this rank's ``StepTimes``.
        ``execute(run, pending)``: runs a ``Run`` action instead of calling its program (``run_measured``)."""
        W, busy, waiting, posting, sent = self.plan.mesh.world, 0.0, 0.0, 0.0, 0
        pending: dict[tuple[int, int], tuple] = {}       # (stage, tag) -> (work, tensor) of a send not waited on
        start = time.perf_counter()
        gen = self.schedule(local_state, local_batch)
        reply = None
        with torch.no_grad():
            while True:
                try:
                    act = gen.send(reply)
                except StopIteration as stop:
                    loss = stop.value
                    break
                reply = None
                if isinstance(act, Run):
                    if act.key[0] == "U" and pending:
                        # every message of the step is posted: the sends complete before the update, not after
                        # it, so their buffers are not held through it (gloo's Work never reports completion
                        # before wait()); the peers need nothing that comes after this to receive them
                        t0 = time.perf_counter()
                        for work, _ in pending.values():
                            work.wait()
                        pending.clear()
                        waiting += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    if execute is not None:
                        reply = execute(act, list(pending.values()))
                    elif act.key[0] == "U":   # empties act.args: the old state dies at its last use in the update
                        reply = self.released[id(act.program)].module(act.args)
                    else:
                        reply = act.program.module(*act.args)
                    busy += time.perf_counter() - t0
                elif isinstance(act, Send):
                    t0 = time.perf_counter()
                    t = _wire_tensor(act.tensor.contiguous())
                    pending[(act.dst, act.tag)] = (dist.isend(t, act.dst * W + self.local, tag=act.tag), t)
                    sent += t.numel() * t.element_size()
                    posting += time.perf_counter() - t0
                else:
                    t0 = time.perf_counter()
                    buf = torch.empty(act.shape, dtype=_wire_dtype(act.dtype), device=self.device)
                    work = dist.irecv(buf, act.src * W + self.local, tag=act.tag)
                    t1 = time.perf_counter()
                    work.wait()
                    posting += t1 - t0
                    for key in self.releases.get((act.src, act.tag), ()):   # received by the peer: done at once
                        pending.pop(key)[0].wait()
                    waiting += time.perf_counter() - t1
                    reply = buf.view(act.dtype) if act.dtype is torch.bool else buf
            t0 = time.perf_counter()
            for work, _ in pending.values():
                work.wait()
            out = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64, device=self.device)
            dist.broadcast(out, (self.plan.stages - 1) * W)
            waiting += time.perf_counter() - t0
        wall = time.perf_counter() - start
        busy += getattr(self, "divide_seconds", 0.0)
        self.times.append(StepTimes(busy, max(wall - busy, 0.0), waiting, posting, sent))
        return float(out[0])


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """Booleans travel as bytes (gloo sends no bool tensors)."""
    return torch.uint8 if dtype is torch.bool else dtype


def _wire_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor as sent: booleans as bytes, a complex view with lazy conjugation or negation resolved (the
    send views its memory as real, which torch refuses on such a view)."""
    if t.is_complex():
        return resolved(t)
    return t.view(torch.uint8) if t.dtype is torch.bool else t


def compare_stages(rp: ResolvedPlan, spec: PipelineSpec, results: dict[int, dict], ref, tol):
    """``runtime.compare.compare_ranks`` for a pipeline: every given global rank's losses and the shards of
    the state its stage holds (``results``: global rank -> {"losses", "local"})."""
    from .compare import Comparison, Reference, compare_ranks
    W = rp.plan.mesh.world
    out = Comparison(True, 0.0, None, 0)
    for r in sorted(results):
        stage, local = divmod(r, W)
        held = spec.device_held(stage)
        sub = Reference(ref.losses, {n: t for n, t in ref.state.items() if n in held}, ref.initial)
        c = compare_ranks(rp, {local: results[r]}, sub, tol)
        out.compared += c.compared
        out.max_abs_diff = max(out.max_abs_diff, c.max_abs_diff)
        if out.ok and not c.ok:
            out.ok, out.first_mismatch = False, f"stage {stage}, global rank {r}: {c.first_mismatch}"
    return out


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage: views of one tensor share it."""
    return t.untyped_storage().data_ptr()
