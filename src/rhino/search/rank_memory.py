"""A rank's memory problem built from the IR graph and a resolved plan, without torch (option ``fit_memory``).

``rank_ir_graph(rp)`` mirrors what the SPMD lowering (``lower.spmd.lower_rank``) emits for one rank, as an IR
``Graph`` with this rank's local shapes (``sharding.placement.local_shape``, the cost model's sizes):

- every input with its local type, every constant as it is (the lowering embeds them whole);
- before each node, every input whose required sharding differs from the value's own is redistributed with
  the steps of ``sharding.redistribute.plan_redistribution``, one node of op ``COMM_OP`` per step whose
  output (the communication buffer) has the local shape after that step; one chain per (value, target
  sharding), reused by every later reader (the lowering's cache);
- the node itself, on the redistributed inputs, its outputs with their local shapes (a view op that the
  lowering replaces by its registry ``local_op`` takes that op, as the lowering does);
- at the end the loss made replicated and each new state value brought back to its input's sharding (more
  ``COMM_OP`` chains), as ``lower.spmd.whole_step`` asks.

``rank_problem_ir`` turns it into a ``memory.MemProblem`` (``memory.from_graph.problem_from_graph``) with the
collective-order constraint of ``lower.rank_graph.rank_problem`` (the communication nodes keep their program
order). ``planned_peak`` plans it (``memory.plan.plan_memory``) and returns the arena plus the state outside
it (``GraphMemory.state_bytes``: parameters, optimizer state, buffers and constants at local sizes).

What differs from the lowered rank program (``lower.rank_graph``), and why the peaks stay close: custom
lowerings (``ir.registry`` ``lowering`` facts: a vocabulary-split embedding's masks, a mean ``nll_loss`` over
a split batch made a local sum plus all-reduces, batch norm's statistics) are one node here and several aten
calls with small extra temporaries there. The local shapes are the same on every rank (splits are even), so
one problem stands for every rank. tests/test_planned_fit.py compares the two planned peaks on the examples.
"""
from __future__ import annotations

import dataclasses
import time

from ..cost.estimate import Estimate
from ..ir.graph import STATE_ROLES, Graph, GraphInput, GraphOutput, Node, Ref, Role
from ..ir.registry import lookup
from ..ir.types import TensorType
from ..memory.from_graph import GraphMemory, problem_from_graph
from ..memory.order import OptLevel
from ..memory.order_graph import IndexedProblem
from ..memory.plan import MemoryPlan, plan_memory
from ..memory.problem import MemProblem
from ..sharding.placement import Sharding, local_shape, replicated
from ..sharding.plan import ResolvedPlan
from ..sharding.redistribute import plan_redistribution
from ..sharding.steps import after_step
from .options import FitMemory, SearchOptions

__all__ = ["COMM_OP", "rank_ir_graph", "rank_problem_ir", "collective_order", "PlannedPeak", "planned_peak",
           "planned_fit"]

#: the op of a communication step: the name ``lower.rank_graph.COMM_OP`` gives it (tested equal)
COMM_OP = "rhino.redistribute.default"


class _Builder:
    """The rank graph of ``rp`` (module docstring), built node by node."""

    def __init__(self, rp: ResolvedPlan) -> None:
        self.rp, self.mesh = rp, rp.plan.mesh
        src = rp.graph
        self.g = Graph(meta={"workload": src.meta.get("workload", ""), "rank": 0})
        self.new: dict[int, int] = {}                       # source value -> rank graph value
        self.moved: dict[tuple, int] = {}                   # (source value, sharding) -> rank graph value
        self.n_comm = 0

    def local(self, vid: int) -> int:
        t = self.rp.graph.types[vid]
        shape = local_shape(t.shape, self.rp.value[vid], self.mesh) if vid in self.rp.value else t.shape
        return self.g.new_value(dataclasses.replace(t, shape=tuple(shape)))

    def move(self, vid: int, want: Sharding) -> int:
        """The rank graph value holding source value ``vid`` in sharding ``want`` (a cached chain of steps)."""
        have = self.rp.value[vid]
        if tuple(have) == tuple(want):
            return self.new[vid]
        key = (vid, tuple(want))
        if key not in self.moved:
            t = self.rp.graph.types[vid]
            x = self.new[vid]
            shape = tuple(local_shape(t.shape, have, self.mesh))
            for step in plan_redistribution(t.shape, have, want, self.mesh):
                shape = after_step(shape, step, self.mesh.sizes)
                y = self.g.new_value(dataclasses.replace(t, shape=shape))
                self.g.nodes.append(Node(f"comm_{self.n_comm}", COMM_OP, [Ref(x), type(step).__name__, step.axis],
                                         {}, [y]))
                self.n_comm += 1
                x = y
            self.moved[key] = x
        return self.moved[key]

    def node(self, node: Node) -> None:
        need = dict(zip((r.id for r in node.input_refs()), self.rp.node[node.name].inputs))

        def arg(a):
            if isinstance(a, Ref):
                return Ref(self.move(a.id, need[a.id]) if need.get(a.id) is not None else self.new[a.id])
            if isinstance(a, (list, tuple)):
                return type(a)(arg(x) for x in a)
            if isinstance(a, dict):
                return {k: arg(v) for k, v in a.items()}
            return a
        args, kwargs = arg(node.args), arg(node.kwargs)
        outs = []
        for v in node.outputs:
            if v is not None:
                self.new[v] = self.local(v)
            outs.append(self.new[v] if v is not None else None)
        opdef = lookup(node.op)
        op = opdef.local_op if opdef is not None and opdef.local_op else node.op
        self.g.nodes.append(Node(node.name, op, args, kwargs, outs, node.multi))

    def build(self) -> Graph:
        src = self.rp.graph
        for inp in src.inputs:
            self.new[inp.value] = self.local(inp.value)
            self.g.inputs.append(GraphInput(inp.name, inp.role, self.new[inp.value]))
        for v, data in src.constants.items():
            self.new[v] = self.g.new_value(src.types[v])
            self.g.constants[self.new[v]] = data
        for node in src.nodes:
            self.node(node)
        state_in = {i.name: i.value for i in src.inputs if i.role in STATE_ROLES}
        for o in src.outputs:
            want = self.rp.value[state_in[o.name]] if o.name in state_in else replicated(self.mesh)
            role = o.role if o.name in state_in else Role.LOSS
            self.g.outputs.append(GraphOutput(o.name, role, self.move(o.value, want)))
        return self.g


def rank_ir_graph(rp: ResolvedPlan) -> Graph:
    """The IR graph of the program a rank runs under ``rp`` (blocking collectives), built without torch
    (module docstring). Raises ``ValueError`` for plans with several micro-batches (as ``lower.rank_graph``)."""
    if rp.plan.microbatches > 1:
        raise ValueError(f"a memory plan per rank needs one micro-batch; the plan has "
                         f"microbatches={rp.plan.microbatches}")
    return _Builder(rp).build()


def collective_order(problem: MemProblem, comm: list[int]) -> MemProblem:
    """``problem`` with an ``after`` edge from each communication op of ``comm`` (op ids, program order) to
    the one before: every rank issues its collectives in the same order whatever order the planner picks."""
    if len(comm) < 2:
        return problem
    ops = list(problem.ops)
    for prev, i in zip(comm, comm[1:]):
        ops[i] = dataclasses.replace(ops[i], after=tuple(sorted(set(ops[i].after) | {prev})))
    return MemProblem(ops, problem.tensors, problem.name)


def rank_problem_ir(rp: ResolvedPlan, *, inplace_state: bool = True) -> tuple[MemProblem, GraphMemory]:
    """The memory problem of ``rank_ir_graph(rp)`` with the collective-order constraint."""
    g = rank_ir_graph(rp)
    problem, mapping = problem_from_graph(g, inplace_state=inplace_state,
                                          name=f"{g.meta.get('workload', '')} rank program")
    problem = collective_order(problem, [i for i, n in enumerate(g.nodes) if n.op == COMM_OP])
    problem.validate()
    return problem, mapping


@dataclasses.dataclass
class PlannedPeak:
    """A rank's planned memory: ``arena`` (the plan's height) + ``state`` (outside the arena) = ``peak``;
    ``plan`` is None when the order lower bound + state was already over ``capacity`` (``arena`` is then
    that bound: no order fits, nothing was planned)."""

    arena: int
    state: int
    plan: MemoryPlan | None
    seconds: float

    @property
    def peak(self) -> int:
        return self.arena + self.state


def planned_peak(rp: ResolvedPlan, *, level: OptLevel | str = OptLevel.O1, time_limit: float = 5.0,
                 capacity: int | None = None) -> PlannedPeak:
    """Plan the rank problem of ``rp`` (``rank_problem_ir``) with ``plan_memory`` within ``time_limit``
    seconds; the arena's height plus the state outside it. With ``capacity``, a problem whose order lower
    bound (``IndexedProblem.lower_bound``: bytes every order holds) plus the state is over it is not planned."""
    t0 = time.perf_counter()
    problem, mapping = rank_problem_ir(rp)
    state = int(mapping.state_bytes)
    if capacity is not None:
        bound = IndexedProblem(problem).lower_bound()
        if bound + state > capacity:
            return PlannedPeak(int(bound), state, None, time.perf_counter() - t0)
    plan = plan_memory(problem, level=level, time_limit=time_limit)
    return PlannedPeak(int(plan.height), state, plan, time.perf_counter() - t0)


def _plan_key(rp: ResolvedPlan) -> tuple:
    p = rp.plan
    return (p.mesh.names, p.mesh.sizes, tuple(sorted(p.inputs.items())), tuple(sorted(p.strategies.items())))


def planned_fit(rp: ResolvedPlan, est: Estimate, options: SearchOptions, cache: dict | None = None) -> Estimate:
    """The fit check of ``FitMemory.PLANNED``: ``est`` itself, unless the option is on, ``est`` does not fit,
    its peak is at most ``options.fit_memory_margin`` over capacity and the plan runs one stage, one
    micro-batch and no recomputation (what ``rank_ir_graph`` models); then the rank program is planned
    (``planned_peak``, O1, ``options.fit_memory_time_limit``) and, when the arena + state fits (less
    ``options.fit_memory_headroom``), ``est`` is
    returned with ``fits`` True and a note giving both peaks (else with a note why not). ``cache`` (plan
    key -> ``PlannedPeak``) saves planning a plan twice; ``rp.plan.meta["planned_peak_bytes"]`` is set."""
    cap, peak = est.capacity_bytes, est.memory_bytes["peak"]
    if options.fit_memory is not FitMemory.PLANNED or est.fits or est.pp > 1 or est.microbatches > 1 \
            or est.recompute != "none" or peak > (1 + options.fit_memory_margin) * cap:
        return est
    key = _plan_key(rp)
    pp = cache.get(key) if cache is not None else None
    if pp is None:
        pp = planned_peak(rp, time_limit=options.fit_memory_time_limit, capacity=cap)
        if cache is not None:
            cache[key] = pp
    if pp.plan is None:
        return dataclasses.replace(est, notes=est.notes + [
            f"fit_memory=planned: no order fits (order lower bound {pp.arena:,} B + state {pp.state:,} B)"])
    fits = pp.plan.valid and pp.peak <= (1 - options.fit_memory_headroom) * cap
    rp.plan.meta["planned_peak_bytes"] = pp.peak
    note = (f"fit_memory=planned: rank memory plan {pp.arena:,} B + state {pp.state:,} B = {pp.peak:,} B "
            f"{'fits' if fits else 'does not fit'} (program-order peak {peak:,} B)")
    return dataclasses.replace(est, fits=fits, notes=est.notes + [note])
