"""From a graph, a mesh and a cluster to the plain-data problem the solvers take, and back to a plan.

For every cone class (``coarsen``) and every candidate strategy of its representative, the members'
strategies are derived (``Space``) and priced with the cost model's own functions:

- compute: ``cost.compute.op_time`` of each member on the rank's share (``cost.step.node_scale``),
  split into forward, backward and optimizer time;
- communication inside the cone: ``plan_redistribution`` + ``collectives.steps_seconds`` for every
  member input that arrives in another sharding than it needs, the row all-reduces of the
  vocabulary-parallel custom lowerings, and new state brought back to its input's sharding;
- per value that crosses cones, a *term*: the producer cone class's choice gives the value's sharding
  ``sigma``, each consumer cone class's choice the shardings ``tau`` it needs; ``cost[sigma][tau]``
  is the redistribution time (on multi-axis meshes ``transfer.quick_steps``; with
  ``exact_redistribution`` the exact planner's steps, and with ``reuse_redistribution_plans`` the
  steps planned for one tensor are priced again for others of the same rank and shardings), paid
  once per distinct ``tau`` (the lowering keeps one copy per value and sharding). Identical terms
  of tied layers are merged with a multiplicity;
- memory rows (``memrows``): at chosen nodes, the bytes of every storage and redistributed copy
  live there, as a function of the choices of the cone classes.

Communication kinds follow ``cost.step``'s overlap model: ``blocking`` (on the critical path),
``gradient`` (a value made after the loss and read by an optimizer cone), ``prefetch`` (a state input
gathered as it is: may start any time), ``state`` (new state brought back at the end).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from ..cost.cluster import Cluster, axis_links
from ..cost.collectives import step_seconds, steps_seconds
from ..cost.compute import op_time
from ..cost.step import custom_reduce_bytes, custom_reduces, node_scale
from ..ir.analysis import analyze
from ..ir.graph import Graph, Role
from ..sharding.mesh import Mesh
from ..sharding.placement import ReduceOp, Sharding, local_shape, replicated
from ..sharding.plan import ResolvedPlan, ShardingPlan
from ..sharding.redistribute import plan_redistribution
from ..sharding.vocab import is_split, split_letter
from ..sharding.steps import AllReduce
from .coarsen import Cone, ConeKind, Cones, build_cones
from .memrows import CopyTerm, MemoryRows, MemRow, copy_bytes
from .options import SearchOptions
from .space import Space, normalize
from .transfer import quick_steps, volume

__all__ = ["KINDS", "Derived", "Term", "CopyTerm", "MemRow", "Problem", "Builder", "copy_bytes", "quick_steps"]
# (CopyTerm, MemRow, copy_bytes: memrows.py; quick_steps: transfer.py -- re-exported for the solvers)

KINDS = ("blocking", "gradient", "prefetch", "state")


@dataclass
class Derived:
    """One candidate of a cone class, on its representative."""

    strategies: list[tuple]                  # per member position
    produced: dict[tuple, Sharding]          # ("in", q) | ("m", pos, out) -> sharding
    required: dict[tuple, Sharding]          # ("m", pos, slot) -> sharding the member needs
    compute: tuple[float, float, float]      # forward, backward, optimizer seconds
    comm: dict[str, float]                   # kind -> seconds inside the cone


@dataclass
class Term:
    producer: int                            # class
    sigma: list[int]                         # producer candidate -> sharding index
    uses: list[tuple[int, list[tuple[int, ...]]]]  # (consumer class, candidate -> needed sharding indices)
    fixed: list[int]                         # sharding indices always needed (loss: replicated)
    cost: list[list[float]]                  # [sigma][tau] seconds
    kind: str
    mult: int
    shape: tuple = ()
    shardings: list = field(default_factory=list)   # index -> Sharding (sigma and tau share one list)


@dataclass
class Problem:
    """Plain data for the solvers: choose one candidate per class."""

    n_cands: list[int]
    mult: list[int]                          # cones per class
    compute: list[list[tuple[float, float, float]]]   # class -> candidate -> (fwd, bwd, opt) per cone
    comm: list[list[dict[str, float]]]       # class -> candidate -> kind -> seconds per cone
    terms: list[Term]
    memory: list[MemRow]
    capacity: int
    names: list[str] = field(default_factory=list)    # class -> a readable name
    # class -> candidate -> its component on each mesh axis (a strategy entry or a placement): lets a
    # solver change one axis at a time
    axis_keys: list[list[tuple]] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)    # class -> ConeKind value
    positions: list[int] = field(default_factory=list)  # class -> program position of its first node (-1: input)
    batch_classes: list[int] = field(default_factory=list)  # classes of batch inputs
    nodes: int = 0                                     # nodes of the graph (a size for time budgets)

    def size(self) -> dict[str, int]:
        return {"classes": len(self.n_cands), "candidates": sum(self.n_cands), "terms": len(self.terms),
                "memory_rows": len(self.memory)}


class Builder(MemoryRows):
    """Builds the ``Problem`` of ``graph`` on ``mesh`` and ``cluster``; turns a choice into a plan."""

    def __init__(self, graph: Graph, mesh: Mesh, cluster: Cluster, options: SearchOptions = SearchOptions(),
                 *, cones: Cones | None = None, space: Space | None = None, fingerprint: str = "",
                 recompute: str = "none", shared: dict | None = None) -> None:
        """``shared``: a dict of mesh-independent facts (liveness, uses, ...) reused across meshes."""
        self.graph, self.mesh, self.cluster, self.options = graph, mesh, cluster, options
        self.shared = shared if shared is not None else {}
        self.recompute = recompute
        self.device = cluster.device
        self.links = axis_links(cluster, mesh)
        self.space = space or Space(graph, mesh, options)
        self.cones = cones or build_cones(graph, self.space, options)
        self.fingerprint = fingerprint
        self.analysis = analyze(graph)
        self.inputs = {i.name: i for i in graph.inputs}
        self.state_out: dict[int, list[str]] = {}
        self.other_out: dict[int, int] = {}
        for o in graph.outputs:
            if o.name in self.inputs and o.role is not Role.LOSS:
                self.state_out.setdefault(o.value, []).append(o.name)
            else:
                self.other_out[o.value] = self.other_out.get(o.value, 0) + 1
        self._redist: dict[tuple, float] = {}
        self._sids: dict = {}
        self._steps: dict[tuple, list] = {}     # (rank, src id, dst id) -> a planned step list
        self._time: dict[tuple, float] = {}
        self.derived: list[list[Derived]] = []
        self.candidates: list[list] = []
        self.problem: Problem | None = None

    # -- pricing -------------------------------------------------------------------------------
    def sid(self, sh: Sharding) -> int:
        """A small integer for a sharding (cheap cache keys)."""
        k = self._sids.get(sh)
        if k is None:
            k = self._sids[sh] = len(self._sids)
        return k

    def redist(self, vid: int, src: Sharding, dst: Sharding, s: int | None = None, d: int | None = None) -> float:
        """Seconds to bring value ``vid`` from ``src`` to ``dst`` (``s``, ``d``: their ``sid``s if known)."""
        if src is dst or src == dst:
            return 0.0
        t = self.graph.types[vid]
        if s is None:
            s, d = self.sid(src), self.sid(dst)
        key = (t.shape, t.dtype.itemsize, s, d)
        hit = self._redist.get(key)
        if hit is None:
            hit = None
            if self.mesh.ndim > 1 and not self.options.exact_redistribution:
                best = None
                local = prod(local_shape(t.shape, src, self.mesh))
                for steps in quick_steps(src, dst, self.mesh):
                    try:
                        secs = steps_seconds(steps, t.shape, t.dtype.itemsize, src, self.mesh, self.links)
                    except ValueError:
                        continue
                    # as the exact planner: fewest bytes, then fewest steps (then the faster)
                    rank = (round(volume(steps, local, self.mesh.sizes), 6), len(steps), secs)
                    if best is None or rank < best:
                        best = rank
                hit = best[2] if best is not None else None
            if hit is None and self.options.reuse_redistribution_plans:
                steps = self._steps.get((len(t.shape), s, d))
                if steps is not None:
                    try:
                        hit = steps_seconds(steps, t.shape, t.dtype.itemsize, src, self.mesh, self.links)
                    except ValueError:
                        hit = None
            if hit is None:
                steps = plan_redistribution(t.shape, src, dst, self.mesh)
                self._steps.setdefault((len(t.shape), s, d), steps)
                hit = steps_seconds(steps, t.shape, t.dtype.itemsize, src, self.mesh, self.links)
            self._redist[key] = hit
        return hit

    def op_seconds(self, i: int, strategy: tuple) -> float:
        scale = node_scale(strategy, self.mesh)
        inf = self.space.info(i)
        key = (inf.sig, scale)
        hit = self._time.get(key)
        if hit is None:
            hit = self._time[key] = op_time(inf.call, self.device, scale=scale).seconds
        return hit

    def custom_comm(self, i: int, strategy: tuple, required: Sharding) -> float:
        """Row all-reduces of the custom SPMD lowerings (``cost.step``)."""
        node = self.graph.nodes[i]
        count = custom_reduces(node.op)
        ann = self.space.info(i).ann
        if not count or ann is None:
            return 0.0
        axes = [a for a, e in enumerate(strategy)
                if is_split(e) and split_letter(e)[0] in ann.custom]
        if not axes:
            return 0.0
        ref = node.input_refs()[0]
        t = self.graph.types[ref.id]
        nbytes = custom_reduce_bytes(node.op, local_shape(t.shape, required, self.mesh), t.dtype.itemsize)
        return count * sum(step_seconds(AllReduce(a, ReduceOp.SUM), nbytes, self.mesh, self.links) for a in axes)

    # -- candidates of one cone -------------------------------------------------------------------
    def choices(self, cone: Cone) -> list:
        """What the cone chooses: its driver's strategies, or its (optimizer-)state's shardings."""
        graph = self.graph
        if cone.kind is ConeKind.NODE:
            return self.space.candidates(cone.members[0])
        if cone.kind is ConeKind.INPUT:
            inp = self.inputs[cone.owned[0]]
            return self.space.input_candidates(graph.types[inp.value].shape, inp.role)
        shape = self.reference_shape(cone)
        return self.space.input_candidates(shape, Role.OPT_STATE)

    def reference_shape(self, cone: Cone) -> tuple:
        graph = self.graph
        for name in cone.owned:
            return graph.types[self.inputs[name].value].shape
        for i in cone.members:
            for v in graph.nodes[i].outputs:
                if v in self.state_out:
                    return graph.types[v].shape
        return ()

    def derive(self, cone: Cone, choice) -> Derived | None:
        """Members' strategies for one choice, their shardings and costs; None if the choice is illegal."""
        graph, space, mesh = self.graph, self.space, self.mesh
        produced: dict[tuple, Sharding] = {}
        where: dict[int, tuple] = {}     # value id -> slot key inside the cone
        strategies: list[tuple] = []
        required: dict[tuple, Sharding] = {}
        comm = {k: 0.0 for k in KINDS}
        fwd = bwd = opt = 0.0
        ref_shape = self.reference_shape(cone) if cone.kind is ConeKind.OPTIMIZER else None
        for q, name in enumerate(cone.owned):
            vid = self.inputs[name].value
            if cone.kind is ConeKind.INPUT:
                sh = choice
            else:
                sh = choice if graph.types[vid].shape == ref_shape else replicated(mesh)
            produced[("in", q)] = sh
            where[vid] = ("in", q)
        moved: set = set()
        for pos, i in enumerate(cone.members):
            node = graph.nodes[i]
            refs = space.info(i).refs
            how = cone.recipe.get(pos)
            if how is None:
                strategy = choice
            elif how[0] == "in":
                strategy = space.follow(i, how[1], produced[where[refs[how[1]].id]])
            else:
                strategy = space.producing(i, choice)
            ns = space.shardings(i, strategy)
            if ns is None:
                if how is None:
                    return None
                strategy = space.none
                ns = space.shardings(i, strategy)
            strategies.append(strategy)
            for k, (ref, req) in enumerate(zip(refs, ns.inputs)):
                required[("m", pos, k)] = req
                slot = where.get(ref.id)
                if slot is not None and (ref.id, req) not in moved:
                    moved.add((ref.id, req))
                    comm["blocking"] += self.redist(ref.id, produced[slot], req)
            for j, (vid, sh) in enumerate(zip(node.outputs, ns.outputs)):
                if vid is None:
                    continue
                produced[("m", pos, j)] = sh
                where[vid] = ("m", pos, j)
                for name in self.state_out.get(vid, ()):
                    q = cone.owned.index(name) if name in cone.owned else -1
                    if q >= 0:
                        comm["state"] += self.redist(vid, sh, produced[("in", q)])
            t = self.op_seconds(i, strategy)
            if i in self.cones.optimizer:
                opt += t
            elif self.analysis.is_forward(i):
                fwd += t * (1 + self._recomputed(i))
            else:
                bwd += t
            if custom_reduces(node.op) and ns.inputs:
                comm["blocking"] += self.custom_comm(i, strategy, ns.inputs[0])
        return Derived(strategies, produced, required, (fwd, bwd, opt), comm)

    # -- the problem ------------------------------------------------------------------------------
    def build(self) -> Problem:
        cones = self.cones
        reps = [cones.cones[members[0]] for members in cones.classes]
        self.derived, self.candidates = [], []
        for rep in reps:
            ders, chs = [], []
            for ch in self.choices(rep):
                d = self.derive(rep, ch)
                if d is None:
                    continue
                ders.append(d)
                chs.append(ch)
            assert ders, f"cone {rep.name} has no legal strategy (the replicated one always is)"
            self.derived.append(ders)
            self.candidates.append(chs)
        mult = [len(m) for m in cones.classes]
        compute = [[d.compute for d in ders] for ders in self.derived]
        comm = [[dict(d.comm) for d in ders] for ders in self.derived]
        terms = self._terms(comm)
        names = [self._class_name(rep) for rep in reps]
        capacity = int(self.device.memory_bytes * self.options.memory_fraction)
        self.problem = Problem([len(d) for d in self.derived], mult, compute, comm, terms, [], capacity, names,
                               [[tuple(ch) for ch in chs] for chs in self.candidates],
                               [rep.kind.value for rep in reps],
                               [min(rep.members) if rep.members else -1 for rep in reps],
                               [k for k, rep in enumerate(reps) if rep.kind is ConeKind.INPUT
                                and self.inputs[rep.owned[0]].role is Role.BATCH])
        self.problem.nodes = len(self.graph.nodes)
        for i in self.initial_checkpoints():
            self.problem.memory.append(self.memory_row(i))
        return self.problem

    def _class_name(self, cone: Cone) -> str:
        if cone.kind is ConeKind.NODE:
            return self.graph.nodes[cone.members[0]].name
        return cone.owned[0] if cone.owned else self.graph.nodes[cone.members[0]].name

    def slot_of_value(self, vid: int) -> tuple[int, tuple] | None:
        """(cone, slot key) producing value ``vid``."""
        cones = self.cones
        inp = self._input_by_value().get(vid)
        if inp is not None:
            c = cones.cone_of_input[inp]
            return c, ("in", cones.cones[c].owned.index(inp))
        p = self._producer().get(vid)
        if p is None:
            return None
        i, j = p
        return cones.cone_of_node[i], ("m", cones.pos_of_node[i], j)

    def _input_by_value(self) -> dict[int, str]:
        if "ibv" not in self.shared:
            self.shared["ibv"] = {i.value: i.name for i in self.graph.inputs}
        return self.shared["ibv"]

    def _producer(self) -> dict[int, tuple[int, int]]:
        if "prod" not in self.shared:
            self.shared["prod"] = {v: (i, j) for i, n in enumerate(self.graph.nodes) for j, v in enumerate(n.outputs)
                                   if v is not None}
        return self.shared["prod"]

    def _terms(self, comm: list[list[dict[str, float]]]) -> list[Term]:
        graph, cones = self.graph, self.cones
        cls = [c.cls for c in cones.cones]
        uses_of: dict[int, list[tuple[int, tuple]]] = {}
        for i, node in enumerate(graph.nodes):
            c = cones.cone_of_node[i]
            for k, r in enumerate(self.space.info(i).refs):
                uses_of.setdefault(r.id, []).append((c, ("m", cones.pos_of_node[i], k)))
        agg: dict[tuple, list] = {}
        for vid in list(self._input_by_value()) + list(self._producer()):
            if vid in graph.constants:
                continue
            src = self.slot_of_value(vid)
            if src is None:
                continue
            cp, pslot = src
            uses = [(cls[c], slot) for c, slot in uses_of.get(vid, ()) if c != cp]
            for name in self.state_out.get(vid, ()):
                ci = cones.cone_of_input[name]
                if ci != cp:
                    uses.append((cls[ci], ("in", cones.cones[ci].owned.index(name))))
            fixed = 1 if vid in self.other_out else 0
            if not uses and not fixed:
                continue
            key = (cls[cp], pslot, tuple(sorted(uses)), fixed)
            entry = agg.get(key)
            if entry is None:
                agg[key] = [vid, 1]
            else:
                entry[1] += 1
        terms = []
        for (pc, pslot, uses, fixed), (vid, count) in agg.items():
            term = self._term(vid, pc, pslot, uses, fixed, count, comm)
            if term is not None:
                terms.append(term)
        return terms

    def _use_kind(self, vid: int, pc: int, pslot: tuple, uc: int, uslot: tuple) -> str:
        rep_u = self.cones.cones[self.cones.classes[uc][0]]
        if uslot[0] == "in":
            return "state"
        inp = self._input_by_value().get(vid)
        if pslot[0] == "in" and inp is not None and self.inputs[inp].role is not Role.BATCH:
            return "prefetch"   # a state input gathered as it is (cost.step: may start any time)
        p = self._producer().get(vid)
        if rep_u.kind is ConeKind.OPTIMIZER and p is not None and not self.analysis.is_forward(p[0]):
            return "gradient"
        return "blocking"

    def _term(self, vid, pc, pslot, uses, fixed, count, comm) -> Term | None:
        shardings: list = []
        index: dict = {}

        def idx(sh) -> int:   # shardings are normalized where they are made (Space, input candidates)
            k = index.get(sh)
            if k is None:
                k = index[sh] = len(shardings)
                shardings.append(sh)
            return k

        sigma = [idx(d.produced[pslot]) for d in self.derived[pc]]
        sigma_set = set(sigma)
        fixed_idx = [idx(replicated(self.mesh))] if fixed else []
        use_list = []
        kinds = set()
        for uc, uslot in uses:
            kinds.add(self._use_kind(vid, pc, pslot, uc, uslot))
            need = []
            for d in self.derived[uc]:
                sh = d.produced[uslot] if uslot[0] == "in" else d.required[uslot]
                need.append((idx(sh),))
            use_list.append((uc, need))
        kind = kinds.pop() if len(kinds) == 1 else "blocking"
        taus = set(fixed_idx) | {t for _, need in use_list for n in need for t in n}
        ids = [self.sid(sh) for sh in shardings]
        cost = [[self.redist(vid, shardings[s], shardings[t], ids[s], ids[t]) if t in taus and s in sigma_set
                 else 0.0 for t in range(len(shardings))] for s in range(len(shardings))]
        # a use by the producer's own class (another cone of a tied layer) takes the same candidate:
        # its cost is a function of that one choice
        rest = []
        for uc, need in use_list:
            if uc == pc:
                for c, taus in enumerate(need):
                    comm[pc][c][kind] += count * sum(cost[sigma[c]][t] for t in taus) / len(self.cones.classes[pc])
            else:
                rest.append((uc, need))
        if not rest and not fixed_idx:
            return None
        if all(cost[s][t] == 0 for s in set(sigma) for t in fixed_idx + [t for _, need in rest for n in need for t in n]):
            return None
        return Term(pc, sigma, rest, fixed_idx, cost, kind, count, self.graph.types[vid].shape, shardings)

    # -- back to a plan ------------------------------------------------------------------------------
    def resolved(self, plan: ShardingPlan) -> ResolvedPlan:
        """``sharding.plan.resolve(graph, plan)`` for a plan this builder assembled, from the cached
        per-signature shardings (the same rules and checks, without re-annotating every node)."""
        graph, mesh, space = self.graph, self.mesh, self.space
        value: dict = {}
        for inp in graph.inputs:
            value[inp.value] = normalize(plan.inputs.get(inp.name, replicated(mesh)), mesh)
        for vid in graph.constants:
            value[vid] = replicated(mesh)
        nodes = {}
        for i, node in enumerate(graph.nodes):
            ns = space.shardings(i, tuple(plan.strategies.get(node.name, space.none)))
            assert ns is not None, f"assembled an illegal strategy for {node.name}"
            for vid, sh in zip(node.outputs, ns.outputs):
                if vid is not None:
                    value[vid] = sh
            nodes[node.name] = ns
        return ResolvedPlan(plan, graph, value, nodes)

    def assemble(self, choice: list[int], strategy_string: str = "search") -> ShardingPlan:
        """The plan in which every cone of class ``k`` takes candidate ``choice[k]``."""
        graph, cones = self.graph, self.cones
        inputs: dict[str, Sharding] = {}
        strategies: dict[str, tuple] = {}
        for cone in cones.cones:
            d = self.derived[cone.cls][choice[cone.cls]]
            for q, name in enumerate(cone.owned):
                inputs[name] = d.produced[("in", q)]
            for pos, i in enumerate(cone.members):
                s = d.strategies[pos]
                if any(e is not None for e in s):
                    strategies[graph.nodes[i].name] = s
        return ShardingPlan(self.mesh, inputs, strategies, self.fingerprint, strategy_string)
