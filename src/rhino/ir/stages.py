"""Pipeline stages of a training step (pure Python): the stage of every node, what each stage holds, and
the values that cross stage boundaries, from a stage per *forward* node.

Input: ``S`` stages and ``stage_of``: a stage in ``[0, S)`` for every forward node (``ir.analysis`` roles
FORWARD and LOSS). ``assign_stages`` derives (node roles and values from ``ir.analysis.analyze``):

- **Forward nodes** keep their given stage. Checked: ``stage(u) <= stage(v)`` on every forward edge
  (``u`` defines a value ``v`` reads); the loss node is in the last stage; every stage has a forward node.
- **Backward nodes** (in program order) follow the forward op whose gradient they compute. A forward value
  ``x`` is *available* at the stage that made it and at the stages of its forward readers (it was sent
  there). Node ``v`` reading forward values ``X`` and backward values made by constrained nodes ``P``
  gets ``stage(v) = max{s in avail(X) : s <= min stage(P)}`` (``avail(X)``: the stages where every
  ``x in X`` is available, all stages when ``X`` is empty; ``min stage(P) = S - 1`` when ``P`` is empty);
  when that set is empty, ``min(min stage(P), min stage(producer(x)))``. A weight gradient
  ``mm(grad_out, x)`` therefore runs where its matmul ran even when ``x`` came from the stage before.
  A node that also reads a state input (a parameter) takes the max over the stages of that set whose
  forward nodes read the state, when there are some: a ``convolution_backward`` reads its weight, and
  its input may have been sent on to the next stage too, where the max alone would put it and hold
  the weight (and its optimizer state) on both stages.
  A backward node that ``stage_of`` names (a recomputed forward op: its original's stage) gets that stage
  instead of the max when it is in the set, and its outputs are then available there as a forward value's.
  A backward node reading no forward value is *free*: with ``ub(v)`` the smallest bound of its backward
  producers (their stage, or their own bound for free ones; ``S - 1`` when none), it gets
  ``min(ub(v), max(wanted))`` (``ub(v)`` when nothing is wanted), in reverse program order, where each
  backward reader wants its stage and each optimizer reader the first forward stage reading a state
  whose new value it feeds (a bias gradient ``sum(grad_out)`` runs with its parameter). Both choices keep rule 2
  below: a reader's stage never exceeds either term. A free node that ``stage_of`` names gets that stage when
  it lies between ``max(wanted)`` and ``ub(v)``.
- **Holders**: a state input (parameter, buffer, optimizer state) is held by every stage whose forward or
  backward nodes read it (a tied embedding/head weight: both stages), and by every stage whose update
  reads it. **Optimizer nodes** (OPTIMIZER role) run on every stage holding a state whose new value they
  feed (a tied weight's update runs on both stages, from the same summed gradient, so both copies stay
  equal); holders and update stages are grown together to a fixpoint. A state nobody reads is held by
  the stage whose forward makes its new value (a buffer written through ``out=``), else by stage 0.
- **Crossings**: a value made on stage ``a`` and read on stage ``b != a``: in the forward phase (a forward
  value; sent when made), the backward phase (a backward value; ``a > b``) or the update phase (a
  batch-dependent value, e.g. a gradient, read by an optimizer node on ``b``: sent once after the last
  micro-batch, accumulated; a tied weight's gradient, summed on one stage, reaches the other this way).

**Deadlock freedom.** The rules the derivation guarantees (and ``assign_stages`` checks): (1) forward
edges never go to a lower stage, (2) backward edges never go to a higher stage, (3) forward values may go
to any stage's backward. Let every stage run its micro-batches' forward (F) and backward (B) programs in
GPipe or 1F1B order, send every crossing value without blocking as soon as it is made and block only to
receive one right before the program that reads it. In the synchronous timetable of either schedule
(``t(F_s(k))`` grows with ``s`` and ``k``; ``t(B_s(k))`` grows as ``s`` falls and with ``k``; every
``F_s(k)`` precedes every ``B_s'(k)``) each stage's order is increasing in ``t`` and, by (1)-(3), every
crossing goes from an earlier to a later slot; update-phase values are sent after a stage's last program
and received after the receiver's. So every receive is matched by a send that does not wait on it:
induction on ``t`` shows that every program runs. The interleaved schedule (``schedule_order``) is the same
argument over ``S * v`` virtual stages, each device running its chunks' programs in Megatron-LM's order,
which is increasing in the same timetable; a value between two chunks of one device is handed over
locally, made before it is read (tested with ``runtime.pipeline_sim``, which raises on a deadlock).

**Default cut** (``contiguous_cut``, named option ``slack``): the forward nodes in program order (a
topological order, so rule 1 holds for any contiguous cut) are cut into ``S`` contiguous ranges balanced
by forward FLOPs: cut ``s`` lies where the FLOP prefix is within ``slack * total / S`` of ``s * total / S``
and, among such positions, where the fewest bytes of forward values cross; no candidate: the closest
position. No hints from the user; ``search`` replaces it with its own stage ILP.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping

from .analysis import NodeRole, analyze, batch_dependent
from .graph import STATE_ROLES, Graph, Role
from .registry import call_of, flops_of

__all__ = ["Phase", "Schedule", "SCHEDULES", "StageError", "Crossing", "StageAssignment", "assign_stages",
           "contiguous_cut", "DEFAULT_SLACK", "check_stage_fields", "schedule_order"]

#: ``contiguous_cut``'s balance window: TePDist's stage ILP allows 8% FLOP imbalance per stage (design.md,
#: "Facts from the sources").
DEFAULT_SLACK = 0.08


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


class Schedule(str, Enum):
    """Pipeline schedules: GPipe (all forwards, then all backwards), 1F1B (PipeDream-Flush: at most
    ``S - s`` micro-batches in flight on stage ``s``) and interleaved 1F1B (Megatron-LM, arXiv 2104.04473
    section 2.2.2: each device runs ``v`` model chunks, ``schedule_order``)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


SCHEDULES = tuple(s.value for s in Schedule)


class StageError(ValueError):
    """A stage assignment that breaks the rules of the module docstring; the message names the node."""


@dataclass(frozen=True)
class Crossing:
    value: int      # value id
    src: int        # the stage that makes it
    dst: int        # a stage that reads it
    phase: Phase
    nbytes: int     # global bytes (unsharded)


@dataclass(frozen=True)
class StageAssignment:
    """The result of ``assign_stages`` (module docstring); node keys are node names."""

    stages: int
    node_stage: dict[str, int]                 # every forward, loss and backward node
    update_stages: dict[str, frozenset[int]]   # every optimizer node -> the stages running it
    holders: dict[str, frozenset[int]]         # every state input name -> the stages holding it
    crossings: tuple[Crossing, ...]

    def held_by(self, stage: int) -> list[str]:
        """The state inputs ``stage`` holds, in ``holders`` order."""
        return [n for n, h in self.holders.items() if stage in h]

    def boundary_bytes(self) -> dict[tuple[int, int, Phase], int]:
        """Global bytes per (src, dst, phase) per micro-batch (UPDATE: per step)."""
        out: dict[tuple[int, int, Phase], int] = {}
        for c in self.crossings:
            key = (c.src, c.dst, c.phase)
            out[key] = out.get(key, 0) + c.nbytes
        return out


def check_stage_fields(stages, schedule, stage_of: Mapping[str, int], chunks=1) -> None:
    """``StageError`` unless ``stages`` and ``chunks`` are positive ints, ``schedule`` one of ``SCHEDULES``
    (``chunks > 1`` only with the interleaved one) and every ``stage_of`` value a (virtual) stage in
    ``[0, stages * chunks)``."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise StageError(f"pipeline stages must be a positive integer, got {stages!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise StageError(f"pipeline chunks must be a positive integer, got {chunks!r}")
    if schedule not in SCHEDULES:
        raise StageError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if chunks > 1 and schedule != Schedule.INTERLEAVED.value:
        raise StageError(f"chunks={chunks} needs schedule=interleaved (got schedule={schedule})")
    virtual = stages * chunks
    for name, s in stage_of.items():
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < virtual:
            raise StageError(f"node {name} has stage {s!r}; stages are 0..{virtual - 1}")


def schedule_order(schedule: str, device: int, devices: int, microbatches: int,
                   chunks: int = 1) -> list[tuple[str, int, int]]:
    """Device ``device``'s programs in order: ("F" | "B", virtual stage, micro-batch). Virtual stage
    ``c * devices + device`` is the device's chunk ``c`` (``chunks = 1``: the stage is the device).

    GPipe: every forward, then every backward. 1F1B: ``min(devices - 1 - device, m)`` warm-up forwards, then
    one forward and one backward alternately, then the remaining backwards. Interleaved (Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``): the ``m * v`` chunk-micro-batches in groups of
    ``devices`` micro-batches, forward sub-step ``i`` on chunk ``(i mod devices*v) // devices`` and
    micro-batch ``(i // (devices*v)) * devices + i mod devices`` (backward: chunks in reverse),
    ``min((devices - 1 - device) * 2 + (v - 1) * devices, m v)`` warm-up forwards, then 1F1B over
    sub-steps; needs ``m`` a multiple of ``devices``."""
    m, pp, v = microbatches, devices, chunks
    if Schedule(schedule) is Schedule.GPIPE:
        return [("F", device, k) for k in range(m)] + [("B", device, k) for k in range(m)]
    if Schedule(schedule) is Schedule.ONE_F_ONE_B or v == 1:
        warm = min(pp - 1 - device, m)
        out = [("F", device, k) for k in range(warm)]
        for k in range(m - warm):
            out += [("F", device, warm + k), ("B", device, k)]
        return out + [("B", device, k) for k in range(m - warm, m)]
    if m % pp:
        raise StageError(f"the interleaved schedule needs microbatches to be a multiple of pp={pp}, got {m}")
    total = m * v

    def sub(i: int, kind: str) -> tuple[str, int, int]:
        chunk = (i % (pp * v)) // pp
        chunk = chunk if kind == "F" else v - 1 - chunk
        return kind, chunk * pp + device, (i // (pp * v)) * pp + i % pp

    warm = min((pp - 1 - device) * 2 + (v - 1) * pp, total)
    out = [sub(i, "F") for i in range(warm)]
    for j in range(total - warm):
        out += [sub(warm + j, "F"), sub(j, "B")]
    return out + [sub(j, "B") for j in range(total - warm, total)]


def assign_stages(graph: Graph, stage_of: Mapping[str, int], stages: int) -> StageAssignment:
    """Every node's stage, the holders and the crossings (module docstring) from ``stage_of``."""
    check_stage_fields(stages, Schedule.ONE_F_ONE_B.value, stage_of)
    a = analyze(graph)
    if a.loss_node is None:
        raise StageError("the step has no loss, so it cannot be cut into pipeline stages")
    node_stage = _forward_stages(graph, a, stage_of, stages)
    _backward_stages(graph, a, node_stage, stages, stage_of)
    holders, update = _holders_and_updates(graph, a, node_stage)
    return StageAssignment(stages, node_stage, update, holders, tuple(_crossings(graph, a, node_stage, update)))


def _forward_stages(graph: Graph, a, stage_of: Mapping[str, int], stages: int) -> dict[str, int]:
    """The given forward stages, checked (rule 1, loss last, no empty stage)."""
    nodes = graph.nodes
    out: dict[str, int] = {}
    for i in range(a.boundary + 1):
        name = nodes[i].name
        if name not in stage_of:
            raise StageError(f"forward node {name} ({nodes[i].op}) has no pipeline stage; give every forward "
                             f"node one (or none, for the default cut)")
        out[name] = stage_of[name]
        for r in nodes[i].input_refs():
            p = a.producer.get(r.id)
            if p is not None and out[nodes[p].name] > out[name]:
                raise StageError(f"forward node {name} on stage {out[name]} reads {nodes[p].name} from the later "
                                 f"stage {out[nodes[p].name]}; stages must not decrease along forward edges")
    loss = nodes[a.boundary].name
    if out[loss] != stages - 1:
        raise StageError(f"the loss node {loss} is on stage {out[loss]}; it must be on the last stage {stages - 1}")
    empty = sorted(set(range(stages)) - set(out.values()))
    if empty:
        raise StageError(f"pipeline stage {empty[0]} has no forward node; use fewer stages or another cut")
    return out


def _backward_stages(graph: Graph, a, node_stage: dict[str, int], stages: int,
                     prefer: Mapping[str, int] | None = None) -> None:
    """Backward nodes' stages (module docstring), added to ``node_stage``."""
    nodes = graph.nodes
    avail = _available(graph, a, node_stage)
    state_read = _state_readers(graph, a, node_stage)
    ub: dict[int, int] = {}     # backward node -> upper bound (anchored nodes: their stage)
    free: list[int] = []
    for i in range(a.boundary + 1, a.n):
        if a.roles[i] is not NodeRole.BACKWARD:
            continue
        refs = nodes[i].input_refs()
        fwd = [r.id for r in refs if r.id in avail]
        ub[i] = min([ub[p] for r in refs if (p := a.producer.get(r.id)) is not None and p in ub],
                    default=stages - 1)
        if not fwd:
            free.append(i)
            continue
        common = set(range(stages)).intersection(*(avail[x] for x in fwd))
        below = [s for s in common if s <= ub[i]]
        homes = [state_read[r.id] for r in refs if r.id in state_read]
        at_home = [s for s in below if all(s in h for h in homes)] if homes else []
        below = at_home or below
        if prefer and prefer.get(nodes[i].name) in below:
            below = [prefer[nodes[i].name]]
        ub[i] = max(below) if below else min([ub[i]] + [node_stage[nodes[a.producer[x]].name] for x in fwd])
        node_stage[nodes[i].name] = ub[i]
        if prefer and nodes[i].name in prefer:    # a recomputed forward value: anchors its readers as one
            avail.update((v, {ub[i]}) for v in nodes[i].outputs if v is not None)
    readers = _facts(graph, a)[1]
    home = _parameter_homes(graph, a, state_read)
    for i in reversed(free):
        want = []
        for u in (u for v in nodes[i].outputs if v is not None for u in readers.get(v, ())):
            if nodes[u].name in node_stage:
                want.append(node_stage[nodes[u].name])
            elif u in home:   # a gradient feeding the update: its parameter's stage
                want.append(home[u])
        node_stage[nodes[i].name] = min(ub[i], max(want, default=ub[i]))
        if prefer and max(want, default=0) <= prefer.get(nodes[i].name, -1) <= ub[i]:
            node_stage[nodes[i].name] = prefer[nodes[i].name]
    for i in ub:   # rule 2 (an internal invariant of the derivation)
        for r in nodes[i].input_refs():
            p = a.producer.get(r.id)
            assert p is None or p not in ub or node_stage[nodes[p].name] >= node_stage[nodes[i].name], nodes[i].name


def _available(graph: Graph, a, node_stage: dict[str, int]) -> dict[int, set[int]]:
    """Forward value -> the stages where it is available: its producer's and its forward readers'."""
    out: dict[int, set[int]] = {}
    for i in range(a.boundary + 1):
        node = graph.nodes[i]
        s = node_stage[node.name]
        for v in node.outputs:
            if v is not None:
                out.setdefault(v, set()).add(s)
        for r in node.input_refs():
            if r.id in a.producer:
                out[r.id].add(s)
    return out


def _state_readers(graph: Graph, a, node_stage: dict[str, int]) -> dict[int, set[int]]:
    """State input value -> the stages of the forward nodes reading it (absent: no forward reader)."""
    state_ids = {i.value for i in graph.inputs if i.role in STATE_ROLES}
    out: dict[int, set[int]] = {}
    for node in graph.nodes[:a.boundary + 1]:
        for r in node.input_refs():
            if r.id in state_ids:
                out.setdefault(r.id, set()).add(node_stage[node.name])
    return out


def _parameter_homes(graph: Graph, a, state_read: dict[int, set[int]]) -> dict[int, int]:
    """Optimizer node -> the first forward stage reading a state whose new value it feeds (absent: none);
    ``state_read``: ``_state_readers``."""
    by_name = {i.name: i.value for i in graph.inputs if i.role in STATE_ROLES}
    first = {v: min(stages) for v, stages in state_read.items()}
    out: dict[int, int] = {}
    for name, ids in _facts(graph, a)[0].items():
        if by_name.get(name) in first:
            for i in ids:
                out[i] = min(out.get(i, first[by_name[name]]), first[by_name[name]])
    return out


_FACTS: dict = {}


def _facts(graph: Graph, a) -> tuple:
    """(``_optimizer_ancestors``, ``_direct_readers``, ``batch_dependent``) of ``graph``, facts of the graph
    alone, remembered for its last analysis ``a`` (a new one when the graph changes): the search assigns
    stages to many cuts of one graph. Read-only."""
    hit = _FACTS.get("last")
    if hit is not None and hit[0] is a:
        return hit[1]
    facts = (_optimizer_ancestors(graph, a), _direct_readers(graph), batch_dependent(graph))
    _FACTS["last"] = (a, facts)
    return facts


def _direct_readers(graph: Graph) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        for r in node.input_refs():
            lst = out.setdefault(r.id, [])
            if not lst or lst[-1] != i:
                lst.append(i)
    return out


def _optimizer_ancestors(graph: Graph, a) -> dict[str, set[int]]:
    """State output name -> the optimizer nodes its new value is computed from (through optimizer nodes)."""
    nodes = graph.nodes
    out: dict[str, set[int]] = {}
    for o in graph.outputs:
        if o.role not in STATE_ROLES:
            continue
        seen: set[int] = set()
        stack = [a.producer.get(o.value)]
        while stack:
            p = stack.pop()
            if p is None or p in seen or p not in a.optimizer:
                continue
            seen.add(p)
            stack.extend(a.producer.get(r.id) for r in nodes[p].input_refs())
        out[o.name] = seen
    return out


def _holders_and_updates(graph: Graph, a, node_stage: dict[str, int]):
    """(holders, update stages) grown together to their fixpoint (module docstring)."""
    nodes = graph.nodes
    state = {i.value: i.name for i in graph.inputs if i.role in STATE_ROLES}
    holders: dict[str, set[int]] = {n: set() for n in state.values()}
    for node in nodes:
        if node.name in node_stage:
            for r in node.input_refs():
                if r.id in state:
                    holders[state[r.id]].add(node_stage[node.name])
    anc = _facts(graph, a)[0]
    update: dict[int, set[int]] = {i: set() for i in a.optimizer}
    _grow(nodes, state, holders, anc, update)
    renewer = _renewing_stages(graph, a, node_stage)
    for name, h in holders.items():
        if not h:   # read by nobody: held where the forward renews it (a buffer written through out=), else stage 0
            h.add(renewer.get(name, 0))
    _grow(nodes, state, holders, anc, update)
    return ({n: frozenset(h) for n, h in holders.items()},
            {nodes[i].name: frozenset(s) for i, s in sorted(update.items())})


def _renewing_stages(graph: Graph, a, node_stage: dict[str, int]) -> dict[str, int]:
    """Buffer name -> stage of the forward node making its new value."""
    names = ((b, graph.nodes[p].name) for b, p in _forward_renewers(graph, a).items())
    return {b: node_stage[n] for b, n in names if n in node_stage}


def _forward_renewers(graph: Graph, a) -> dict[str, int]:
    """Buffer name -> position of the forward node making its new value, per buffer the forward renews."""
    buffers = {i.name for i in graph.inputs if i.role is Role.BUFFER}
    out = {}
    for o in graph.outputs:
        p = a.producer.get(o.value)
        if o.role is Role.BUFFER and o.name in buffers and p is not None and a.is_forward(p):
            out[o.name] = p
    return out


def _grow(nodes, state: dict[int, str], holders: dict[str, set[int]], anc: dict[str, set[int]],
          update: dict[int, set[int]]) -> None:
    """Grow holders and update stages together to their fixpoint."""
    changed = True
    while changed:
        changed = False
        for name, ids in anc.items():
            for i in ids:
                if not holders.get(name, set()) <= update[i]:
                    update[i] |= holders[name]
                    changed = True
        for i, ss in update.items():
            for r in nodes[i].input_refs():
                if r.id in state and not ss <= holders[state[r.id]]:
                    holders[state[r.id]] |= ss
                    changed = True


def _crossings(graph: Graph, a, node_stage: dict[str, int], update: dict[str, frozenset[int]]) -> list[Crossing]:
    nodes = graph.nodes
    dep = _facts(graph, a)[2]
    seen: set[tuple[int, int, Phase]] = set()
    out: list[Crossing] = []

    def add(v: int, src: int, dst: int, phase: Phase) -> None:
        if src != dst and (v, dst, phase) not in seen:
            seen.add((v, dst, phase))
            out.append(Crossing(v, src, dst, phase, graph.types[v].nbytes))

    for i, node in enumerate(nodes):
        dsts = [node_stage[node.name]] if node.name in node_stage else sorted(update.get(node.name, ()))
        for r in node.input_refs():
            p = a.producer.get(r.id)
            if p is None or nodes[p].name not in node_stage:
                continue
            src = node_stage[nodes[p].name]
            if node.name in node_stage:
                phase = Phase.FORWARD if a.is_forward(p) else Phase.BACKWARD
            elif r.id in dep:
                phase = Phase.UPDATE
            else:
                continue   # a batch-free value the update computes itself
            for dst in dsts:
                add(r.id, src, dst, phase)
    return out


def contiguous_cut(graph: Graph, stages: int, slack: float = DEFAULT_SLACK) -> dict[str, int]:
    """The default cut (module docstring): forward node name -> stage."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise StageError(f"pipeline stages must be a positive integer, got {stages!r}")
    a = analyze(graph)
    if a.loss_node is None:
        raise StageError("the step has no loss, so it cannot be cut into pipeline stages")
    fwd = list(range(a.boundary + 1))
    if len(fwd) < stages:
        raise StageError(f"the step has {len(fwd)} forward nodes, fewer than {stages} pipeline stages")
    weight = [flops_of(call_of(graph, graph.nodes[i])) for i in fwd]
    if sum(weight) == 0:
        weight = [1] * len(fwd)
    prefix = [0]
    for w in weight:
        prefix.append(prefix[-1] + w)
    total = prefix[-1]
    cross = _cross_bytes(graph, a)
    spans = _renewed_spans(graph, a)
    cuts = [0]
    for s in range(1, stages):
        lo, hi = cuts[-1] + 1, len(fwd) - (stages - s)   # cut before position c: both sides non-empty
        target, window = total * s / stages, slack * total / stages
        # a cut inside a renewed buffer's span would read it on one stage and renew it on another
        legal = [c for c in range(lo, hi + 1) if not any(first < c <= last for first, last in spans)]
        cands = [c for c in legal if abs(prefix[c] - target) <= window]
        if cands:
            best = min(cands, key=lambda c: (cross[c], abs(prefix[c] - target), c))
        else:
            best = min(legal or range(lo, hi + 1), key=lambda c: (abs(prefix[c] - target), c))
        cuts.append(best)
    cuts.append(len(fwd))
    return {graph.nodes[fwd[p]].name: s for s in range(stages) for p in range(cuts[s], cuts[s + 1])}


def _renewed_spans(graph: Graph, a) -> list[tuple[int, int]]:
    """(first, last) forward position of each buffer the forward renews (a BatchNorm's running statistics, an
    EMA codebook): its forward readers and the node making its new value, which a pipeline must keep on one
    stage (``cost.pipeline.stage_refusal``)."""
    buffers = {i.name: i.value for i in graph.inputs if i.role is Role.BUFFER}
    readers = _direct_readers(graph)
    out = []
    for name, p in _forward_renewers(graph, a).items():
        at = [u for u in readers.get(buffers[name], ()) if a.is_forward(u)] + [p]
        out.append((min(at), max(at)))
    return out


def _cross_bytes(graph: Graph, a) -> list[int]:
    """``out[c]``: bytes of forward values made before forward position ``c`` and read by a forward node
    at or after it."""
    n = a.boundary + 1
    diff = [0] * (n + 2)
    readers = _direct_readers(graph)
    for p in range(n):
        for v in graph.nodes[p].outputs:
            if v is None:
                continue
            last = max((u for u in readers.get(v, ()) if u < n), default=p)
            if last > p:
                diff[p + 1] += graph.types[v].nbytes
                diff[last + 1] -= graph.types[v].nbytes
    out, run = [], 0
    for c in range(n + 1):
        run += diff[c]
        out.append(run)
    return out
