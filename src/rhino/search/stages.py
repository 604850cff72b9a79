"""Pipeline stage partitioning on the DAG: an integer stage per forward unit, balanced, cut bytes minimised.

**Units** (``graph_units``): each forward node (no ``cones``; the search's default, rule ``stage_cut_cones``
off), or the coarsened graph of ``coarsen``: the forward members of each cone form a
unit (a matmul with the views, element-wise ops and norms hanging below it); cones that reach each
other both ways are merged (strongly connected parts), so the units form a DAG. Each unit carries

- ``time``: its forward nodes' compute and blocking communication, plus the backward nodes attributed
  to it (a backward node to the earliest unit among the values it reads, as ``cost.pipeline.node_stages``
  puts it on the smallest stage), on the stage mesh under the SPMD plan (``cost.step``'s node pricing);
- ``state``: the bytes of the parameters its forward nodes read first (with their gradients) and of
  their optimizer state; ``act``: the bytes of the activations its forward nodes save, per micro-batch;
- edges (``u`` before ``v``) and values (producer unit, reader units, per-micro-batch bytes).

Identical layers (``coarsen``'s classes) give units of identical costs, so the balanced cut treats
repeated layers alike.

**Formulation** (after TePDist: an integer stage per op, FLOP-balanced windows, cut bytes as the
objective; design.md "Facts from the sources"). Variables: ``x[u,k]`` in {0,1} (unit ``u`` on stage
``k``, one per unit), ``s[u] = sum_k k x[u,k]``, ``far[v]`` (the last stage reading value ``v``), ``L``.

- ``add_one_stage_each``: ``sum_k x[u,k] = 1``; ``add_stages_nonempty``: ``sum_u x[u,k] >= 1``, and the
  loss's unit on the last stage (``ir.stages`` runs the backward from there);
- ``add_monotone``: ``s[u] <= s[v]`` on every edge ``u -> v`` (no linear order assumed);
- ``add_memory``: ``sum_u x[u,k] (state[u] + act[u] * flight[k]) <= capacity`` with ``flight[k]`` the
  micro-batches stage ``k`` holds in flight (1F1B: ``min(pp - k, m)``; GPipe: ``m``);
- ``add_balance``: ``load[k] = sum_u x[u,k] time[u] <= L``;
- phase 1 minimises ``L`` (the bottleneck stage); phase 2 fixes ``L <= (1 + tolerance) L*`` (rule
  ``stage_tolerance``, TePDist's 8%) and minimises the cut bytes ``sum_v bytes[v] (far[v] - s[prod v])``
  with ``far[v] >= s[w]`` for each reader ``w`` (a value crossing several boundaries counts at each).

**Solvers**: CP-SAT (OR-Tools) on this model when ``units * pp <= stage_ilp_limit`` (rule, named in
``SearchOptions``), hinted with the DP's answer; otherwise, and as the hint, a dynamic program over
contiguous windows of one topological order of the units (``solve_contiguous``: phase 1 by bisection on
``L`` with greedy packing, phase 2 by a DP whose windows are ranges, so any DAG gets a monotone cut; the
DP's minimum over window starts is a sliding-window minimum, O(pp n) in all).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from ..cost.pipeline import Schedule, in_flight, value_bytes
from ..ir.analysis import analyze
from ..ir.graph import Graph, Role
from .coarsen import Cones

__all__ = ["StageProblem", "StageSolution", "graph_units", "solve_stages", "solve_contiguous", "solve_cpsat",
           "brute_force", "stage_cut", "STAGE_TOLERANCE", "STAGE_ILP_LIMIT"]

#: Balance tolerance of phase 2: stage loads within 8% of the bottleneck (TePDist's FLOP-balanced windows).
STAGE_TOLERANCE = 0.08
#: CP-SAT on the DAG only up to this many ``x[u,k]`` variables (measured: a few seconds on two cores).
STAGE_ILP_LIMIT = 4000


@dataclass
class StageProblem:
    """Plain data (module docstring). ``order``: a topological order of the units."""
    time: list[float]
    state: list[float]
    act: list[float]
    edges: list[tuple[int, int]]
    values: list[tuple[int, list[int], float]]    # (producer unit, reader units, bytes)
    pp: int
    flight: list[int] = field(default_factory=list)   # per stage; empty: 1 each
    capacity: float | None = None
    tolerance: float = STAGE_TOLERANCE
    order: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)     # units pinned to the last stage (the loss's)

    def __post_init__(self) -> None:
        n = len(self.time)
        if not self.flight:
            self.flight = [1] * self.pp
        if not self.order:
            self.order = _topological(n, self.edges)
        if self.pp < 1 or n < self.pp:
            raise ValueError(f"{self.pp} pipeline stages need at least as many forward units; the graph has {n}")


@dataclass
class StageSolution:
    stage: list[int]                 # per unit
    bottleneck: float                # largest stage load
    cut: float                       # bytes crossing stage boundaries (at each boundary crossed)
    method: str                      # "cp-sat" | "contiguous"
    optimal: bool = False            # CP-SAT proved both phases optimal
    least: float = 0.0               # phase 1's bottleneck (the cut's loads stay within the tolerance of it)


def _topological(n: int, edges: list[tuple[int, int]]) -> list[int]:
    succ: list[list[int]] = [[] for _ in range(n)]
    deg = [0] * n
    for u, v in edges:
        succ[u].append(v)
        deg[v] += 1
    ready = [u for u in range(n) if deg[u] == 0]
    heapq.heapify(ready)
    out = []
    while ready:         # the smallest ready unit first: program order where the edges allow
        u = heapq.heappop(ready)
        out.append(u)
        for v in succ[u]:
            deg[v] -= 1
            if deg[v] == 0:
                heapq.heappush(ready, v)
    if len(out) != n:
        raise ValueError("the stage problem's edges have a cycle")
    return out


def loads(p: StageProblem, stage: list[int]) -> list[float]:
    out = [0.0] * p.pp
    for u, s in enumerate(stage):
        out[s] += p.time[u]
    return out


def cut_bytes(p: StageProblem, stage: list[int]) -> float:
    return sum(b * (max((stage[w] for w in readers), default=stage[u]) - stage[u]) for u, readers, b in p.values
               if readers and max(stage[w] for w in readers) > stage[u])


def memory_ok(p: StageProblem, stage: list[int]) -> bool:
    if p.capacity is None:
        return True
    mem = [0.0] * p.pp
    for u, s in enumerate(stage):
        mem[s] += p.state[u] + p.act[u] * p.flight[s]
    return max(mem) <= p.capacity


def _valid(p: StageProblem, stage: list[int]) -> bool:
    return len(set(stage)) == p.pp and all(stage[u] <= stage[v] for u, v in p.edges) and \
        all(stage[u] == p.pp - 1 for u in p.last)


# -- contiguous windows of a topological order ---------------------------------------------------------------

def _prefix_cuts(p: StageProblem, pos: list[int]) -> list[float]:
    """cross[j]: bytes of values crossing the cut after the first j units of the order."""
    n = len(p.time)
    delta = [0.0] * (n + 1)
    for u, readers, b in p.values:
        last = max((pos[w] for w in readers), default=pos[u])
        if last > pos[u]:
            delta[pos[u] + 1] += b
            delta[last + 1] -= b
    cross, acc = [0.0] * (n + 1), 0.0
    for j in range(n + 1):
        acc += delta[j]
        cross[j] = acc
    return cross


def _greedy_stages(p: StageProblem, seq: list[int], limit: float) -> int:
    """Fewest windows packing ``seq`` in order with loads <= limit and memory within capacity."""
    k, load, mem = 0, 0.0, 0.0
    for u in seq:
        t, m = p.time[u], p.state[u] + p.act[u] * p.flight[min(k, p.pp - 1)]
        over_mem = p.capacity is not None and mem + m > p.capacity
        if load + t > limit or over_mem:
            if load == 0.0 and mem == 0.0:
                return p.pp + len(seq)   # one unit alone does not fit
            k += 1
            load, mem = 0.0, 0.0
            m = p.state[u] + p.act[u] * p.flight[min(k, p.pp - 1)]
            if t > limit or (p.capacity is not None and m > p.capacity):
                return p.pp + len(seq)
        load += t
        mem += m
    return k + 1


def solve_contiguous(p: StageProblem) -> StageSolution:
    """The module docstring's two phases over contiguous windows of ``p.order``."""
    seq = p.order
    n = len(seq)
    total = sum(p.time)
    lo, hi = max(max(p.time), total / p.pp), total
    if _greedy_stages(p, seq, hi) > p.pp:     # memory: no packing into pp windows; balance time only
        p = StageProblem(p.time, p.state, p.act, p.edges, p.values, p.pp, p.flight, None, p.tolerance, p.order,
                         p.last)
    for _ in range(60):
        mid = (lo + hi) / 2
        if _greedy_stages(p, seq, mid) <= p.pp:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * max(hi, 1e-30):
            break
    limit = hi * (1 + p.tolerance)
    pos = [0] * n
    for k, u in enumerate(seq):
        pos[u] = k
    cross = _prefix_cuts(p, pos)
    stage = _window_dp(p, seq, limit, cross)
    while stage is None:     # the pinned loss unit (or memory) needs a looser limit than the greedy packing
        if limit > total * (1 + 1e-9):
            raise ValueError(f"no cut into {p.pp} stages keeps the loss on the last stage within memory")
        hi, limit = hi * 1.05, limit * 1.05
        stage = _window_dp(p, seq, limit, cross)
    return StageSolution(stage, max(loads(p, stage)), cut_bytes(p, stage), "contiguous", least=hi)


def _window_dp(p: StageProblem, seq: list[int], limit: float, cross: list[float]) -> list[int] | None:
    """Exactly pp windows, loads <= limit, memory within capacity, least sum of cross at the cuts.

    ``best[k][j]`` = min over ``i`` of ``best[k-1][i] + cross[i]`` for windows ``seq[i:j]`` within the time
    limit and memory; both bounds hold on a suffix ``i >= lo(j)`` with ``lo`` nondecreasing in ``j`` (the
    prefix sums are nondecreasing), so a monotone deque gives each minimum in O(1): O(pp n) in all."""
    n, pp, inf = len(seq), p.pp, math.inf
    first_last = min((k for k, u in enumerate(seq) if u in set(p.last)), default=n)
    pre_t, pre_s, pre_a = [0.0], [0.0], [0.0]
    for u in seq:
        pre_t.append(pre_t[-1] + p.time[u])
        pre_s.append(pre_s[-1] + p.state[u])
        pre_a.append(pre_a[-1] + p.act[u])
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    back = [[-1] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    cap = p.capacity
    for k in range(1, pp + 1):
        fl, prev, row, brow = p.flight[k - 1], best[k - 1], best[k], back[k]
        lo, nxt, dq = k - 1, k - 1, []        # dq: candidate i's, increasing f(i), as a list with a head index
        head = 0
        for j in range(k, n - (pp - k) + 1):
            if k < pp and j > first_last:
                break          # a pinned unit would leave the last window
            while nxt < j:     # i = j - 1 becomes a candidate
                f = prev[nxt] + (cross[nxt] if k > 1 else 0.0)
                while len(dq) > head and dq[-1][0] >= f:
                    dq.pop()
                dq.append((f, nxt))
                nxt += 1
            while lo < j - 1 and (pre_t[j] - pre_t[lo] > limit * (1 + 1e-12) or cap is not None and
                                  pre_s[j] - pre_s[lo] + fl * (pre_a[j] - pre_a[lo]) > cap):
                lo += 1
            if pre_t[j] - pre_t[lo] > limit * (1 + 1e-12) or cap is not None and \
                    pre_s[j] - pre_s[lo] + fl * (pre_a[j] - pre_a[lo]) > cap:
                continue       # unit seq[j-1] alone breaks a bound
            while head < len(dq) and dq[head][1] < lo:
                head += 1
            if head < len(dq) and dq[head][0] < row[j]:
                row[j], brow[j] = dq[head]
    if best[pp][n] == inf:
        return None
    stage, j = [0] * n, n
    for k in range(pp, 0, -1):
        i = back[k][j]
        for q in range(i, j):
            stage[seq[q]] = k - 1
        j = i
    return stage


# -- CP-SAT on the DAG ----------------------------------------------------------------------------------------

def _scale(xs: list[float], target: float = 1e6) -> float:
    """Units per integer step: 1 when the data are small integers, else total / target."""
    total = sum(xs)
    if all(float(x).is_integer() for x in xs) and total <= 10 * target:
        return 1.0
    return max(total / target, 1e-30)


class _Model:
    def __init__(self, p: StageProblem) -> None:
        self.p, self.m = p, cp_model.CpModel()
        n, pp = len(p.time), p.pp
        self.tu, self.bu = _scale(p.time), _scale([b for _, _, b in p.values] or [1.0])
        self.t = [int(math.ceil(x / self.tu)) for x in p.time]
        self.x = [[self.m.NewBoolVar(f"x{u}_{k}") for k in range(pp)] for u in range(n)]
        self.s = [self.m.NewIntVar(0, pp - 1, f"s{u}") for u in range(n)]
        self.L = self.m.NewIntVar(0, sum(self.t), "L")
        self.add_one_stage_each()
        self.add_stages_nonempty()
        self.add_monotone()
        self.add_memory()
        self.add_balance()

    def add_one_stage_each(self) -> None:
        for u, row in enumerate(self.x):
            self.m.AddExactlyOne(row)
            self.m.Add(self.s[u] == sum(k * v for k, v in enumerate(row)))

    def add_stages_nonempty(self) -> None:
        for k in range(self.p.pp):
            self.m.Add(sum(row[k] for row in self.x) >= 1)
        for u in self.p.last:          # the loss's unit on the last stage
            self.m.Add(self.x[u][self.p.pp - 1] == 1)

    def add_monotone(self) -> None:
        for u, v in self.p.edges:
            self.m.Add(self.s[u] <= self.s[v])

    def add_memory(self) -> None:
        p = self.p
        if p.capacity is None:
            return
        unit = max(p.capacity / 1e7, 1.0)
        for k in range(p.pp):
            self.m.Add(sum(int(math.ceil((p.state[u] + p.act[u] * p.flight[k]) / unit)) * self.x[u][k]
                           for u in range(len(p.time))) <= int(p.capacity // unit))

    def add_balance(self) -> None:
        for k in range(self.p.pp):
            self.m.Add(sum(t * row[k] for t, row in zip(self.t, self.x)) <= self.L)

    def cut_objective(self):
        terms = []
        for j, (u, readers, b) in enumerate(self.p.values):
            if not readers:
                continue
            far = self.m.NewIntVar(0, self.p.pp - 1, f"far{j}")
            for w in readers:
                self.m.Add(far >= self.s[w])
            terms.append(int(math.ceil(b / self.bu)) * (far - self.s[u]))
        return sum(terms)

    def hint(self, stage: list[int]) -> None:
        for u, s in enumerate(stage):
            for k, v in enumerate(self.x[u]):
                self.m.AddHint(v, int(k == s))


def _run(model: _Model, seconds: float, workers: int):
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, seconds)
    solver.parameters.num_workers = max(1, workers)
    return solver, solver.Solve(model.m)


def solve_cpsat(p: StageProblem, *, seconds: float = 10.0, workers: int = 2,
                hint: list[int] | None = None) -> StageSolution | None:
    """The module docstring's two phases with CP-SAT on the DAG; None when it finds no solution in time."""
    model = _Model(p)
    if hint is not None:
        model.hint(hint)
    model.m.Minimize(model.L)
    solver, st = _run(model, seconds / 2, workers)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    best_l = solver.Value(model.L)
    first_optimal = st == cp_model.OPTIMAL
    stage1 = [solver.Value(s) for s in model.s]
    model.m.Add(model.L <= int(math.floor(best_l * (1 + p.tolerance))))
    model.m.ClearHints()
    model.hint(stage1)
    model.m.Minimize(model.cut_objective())
    solver, st = _run(model, seconds / 2, workers)
    stage = [solver.Value(s) for s in model.s] if st in (cp_model.OPTIMAL, cp_model.FEASIBLE) else stage1
    assert _valid(p, stage)
    return StageSolution(stage, max(loads(p, stage)), cut_bytes(p, stage), "cp-sat",
                         optimal=first_optimal and st == cp_model.OPTIMAL, least=best_l * model.tu)


def solve_stages(p: StageProblem, *, ilp_limit: int = STAGE_ILP_LIMIT, seconds: float = 10.0,
                 workers: int = 2) -> StageSolution:
    """The contiguous DP, then CP-SAT from it when the model is small enough (rule ``stage_ilp_limit``);
    the better answer by (bottleneck beyond the tolerance, cut bytes)."""
    dp = solve_contiguous(p)
    if len(p.time) * p.pp > ilp_limit:
        return dp
    ilp = solve_cpsat(p, seconds=seconds, workers=workers, hint=dp.stage)
    if ilp is None or not memory_ok(p, ilp.stage) and memory_ok(p, dp.stage):
        return dp
    limit = min(dp.least, ilp.least) * (1 + p.tolerance)

    def key(s: StageSolution) -> tuple:
        return (s.bottleneck > limit * (1 + 1e-9), s.cut, s.bottleneck)
    return min((ilp, dp), key=key)


def brute_force(p: StageProblem) -> tuple[float, float]:
    """(least bottleneck, least cut within the tolerance of it) over every valid assignment (tiny problems:
    the tests' independent check)."""
    import itertools
    sols = [list(a) for a in itertools.product(range(p.pp), repeat=len(p.time))]
    sols = [s for s in sols if _valid(p, s) and memory_ok(p, s)]
    best = min(max(loads(p, s)) for s in sols)
    return best, min(cut_bytes(p, s) for s in sols if max(loads(p, s)) <= best * (1 + p.tolerance) + 1e-9)


# -- from a graph --------------------------------------------------------------------------------------------

def _merge_cycles(k: int, edges: set[tuple[int, int]]) -> list[int]:
    """Strongly connected parts of the unit graph (Kosaraju), numbered by their smallest unit."""
    succ: list[list[int]] = [[] for _ in range(k)]
    pred: list[list[int]] = [[] for _ in range(k)]
    for u, v in edges:
        succ[u].append(v)
        pred[v].append(u)
    seen, finish = [False] * k, []
    for r in range(k):
        if seen[r]:
            continue
        seen[r] = True
        stack = [(r, iter(succ[r]))]
        while stack:
            u, it = stack[-1]
            nxt = next((v for v in it if not seen[v]), None)
            if nxt is None:
                finish.append(u)
                stack.pop()
            else:
                seen[nxt] = True
                stack.append((nxt, iter(succ[nxt])))
    comp = [-1] * k
    for r in reversed(finish):
        if comp[r] >= 0:
            continue
        comp[r], todo = r, [r]
        while todo:
            u = todo.pop()
            for v in pred[u]:
                if comp[v] < 0:
                    comp[v] = r
                    todo.append(v)
    lowest: dict[int, int] = {}
    for u in range(k):
        lowest[comp[u]] = min(lowest.get(comp[u], u), u)
    names = {c: j for j, c in enumerate(sorted(lowest, key=lowest.get))}
    return [names[comp[u]] for u in range(k)]


@dataclass
class GraphUnits:
    problem: StageProblem
    unit_of: list[int]               # node index -> unit (forward nodes), -1 elsewhere


def _forward_units(graph: Graph, a, cones: Cones | None) -> tuple[list[int], list]:
    """A unit per cone's forward members, cycles merged; (unit of each node or -1, unit edges)."""
    n = len(graph.nodes)
    unit_of, ids = [-1] * n, {}
    for i in range(n):
        if a.is_forward(i):
            unit_of[i] = ids.setdefault(cones.cone_of_node[i] if cones is not None else i, len(ids))
    edges = set()
    for i, node in enumerate(graph.nodes):
        if unit_of[i] < 0:
            continue
        for r in node.input_refs():
            p = a.producer.get(r.id)
            if p is not None and unit_of[p] >= 0 and unit_of[p] != unit_of[i]:
                edges.add((unit_of[p], unit_of[i]))
    merged = _merge_cycles(len(ids), edges)
    unit_of = [merged[u] if u >= 0 else -1 for u in unit_of]
    return unit_of, sorted({(merged[u], merged[v]) for u, v in edges if merged[u] != merged[v]})


def graph_units(graph: Graph, rp, st, mem, pp: int, m: int, *, cones: Cones | None = None,
                schedule: Schedule = Schedule.ONE_F_ONE_B, capacity: float | None = None,
                tolerance: float = STAGE_TOLERANCE) -> GraphUnits:
    """The stage problem of ``graph`` under the resolved plan ``rp`` priced by ``st`` (``cost.step.StepTime``)
    and ``mem`` (``cost.memory.MemoryEstimate``) with ``m`` micro-batches (module docstring). What does not
    depend on ``m`` is remembered for the last (graph, cones) and (``rp``, ``st``): the search prices one plan
    and degree at several micro-batch counts, and one graph at several plans and degrees."""
    a = analyze(graph)
    base = _unit_base(graph, a, cones)
    time, state, value_bytes_ = _unit_costs(graph, rp, st, base)
    k = len(base.order)
    act = [0.0] * k
    unit_of = base.unit_of
    for p, _, b in mem.activation_spans:
        if unit_of[p] >= 0:
            act[unit_of[p]] += b / m
    values = [(u, us, vb / m * f) for (u, us), (vb, f) in zip(base.values, value_bytes_)]
    flight = [in_flight(schedule, pp, m, s) for s in range(pp)]
    problem = StageProblem(list(time), list(state), act, base.edges, values, pp, flight, capacity, tolerance,
                           order=list(base.order), last=list(base.last))
    return GraphUnits(problem, unit_of)


@dataclass
class _UnitBase:
    """What ``graph_units`` takes from the graph (and cones) alone."""
    unit_of: list[int]
    edges: list[tuple[int, int]]
    order: list[int]                 # the units in topological order
    node_unit: list[int]             # every node's unit (module docstring: time attributed there)
    state_unit: list[tuple]          # (input, its unit) for each state input read in some unit
    values: list[tuple[int, list[int]]]   # (producer unit, reader units) per value read in another unit
    value_ids: list[int]
    last: list[int]


_BASE: dict = {}
_COSTS: dict = {}


def _unit_base(graph: Graph, a, cones: Cones | None) -> _UnitBase:
    hit = _BASE.get("last")
    if hit is not None and hit[0] is a and hit[1] is cones:
        return hit[2]
    unit_of, edges = _forward_units(graph, a, cones)
    k = max(unit_of) + 1
    order = _topological(k, edges)
    pos = {u: j for j, u in enumerate(order)}
    value_unit: dict[int, int] = {}
    for inp in graph.inputs:     # a state input: the earliest unit reading it
        readers = [unit_of[u] for u in a.readers.get(a.root.get(inp.value, inp.value), ()) if unit_of[u] >= 0]
        if readers:
            value_unit[inp.value] = min(readers, key=pos.get)
    node_unit = list(unit_of)
    for i, node in enumerate(graph.nodes):
        if node_unit[i] < 0:
            staged = [value_unit[r.id] for r in node.input_refs() if r.id in value_unit]
            node_unit[i] = min(staged, key=pos.get) if staged else max(range(k), key=pos.get)
        for v in node.outputs:
            if v is not None:
                value_unit[v] = node_unit[i]
    state_unit = []
    for inp in graph.inputs:
        if inp.role in (Role.PARAM, Role.FROZEN, Role.BUFFER) and inp.value in value_unit:
            state_unit.append((inp, value_unit[inp.value]))
        elif inp.role is Role.OPT_STATE:
            readers = [node_unit[u] for u in a.readers.get(inp.value, ())]
            if readers:
                state_unit.append((inp, min(readers, key=pos.get)))
    ids, values = _unit_values(graph, a, unit_of)
    loss = [unit_of[a.loss_node]] if a.loss_node is not None and unit_of[a.loss_node] >= 0 else []
    base = _UnitBase(unit_of, edges, sorted(range(k), key=pos.get), node_unit, state_unit, values, ids, loss)
    _BASE["last"] = (a, cones, base)
    return base


def _unit_costs(graph: Graph, rp, st, base: _UnitBase) -> tuple:
    """(time, state, (bytes, factor) per value) of the units under ``rp`` and ``st``, remembered for the last."""
    hit = _COSTS.get("last")
    if hit is not None and hit[0] is rp and hit[1] is st and hit[2] is base:
        return hit[3]
    k = len(base.order)
    time, state = [0.0] * k, [0.0] * k
    node_unit = base.node_unit
    for i, c in enumerate(st.nodes):
        if not c.optimizer:
            time[node_unit[i]] += c.compute + (c.comm if c.kind == "blocking" else 0.0)
    for inp, u in base.state_unit:
        if inp.role is Role.OPT_STATE:
            state[u] += value_bytes(graph, rp, inp.value)
        else:
            state[u] += value_bytes(graph, rp, inp.value) * (2 if inp.role is Role.PARAM else 1)
    vb = [(value_bytes(graph, rp, v), 2 if graph.types[v].dtype.is_floating else 1) for v in base.value_ids]
    out = (time, state, vb)
    _COSTS["last"] = (rp, st, base, out)
    return out


def _unit_values(graph: Graph, a, unit_of: list[int]) -> tuple[list[int], list[tuple[int, list[int]]]]:
    """Forward values read in another unit: their ids, and (producer unit, reader units) of each (their bytes
    per micro-batch, both ways for floating values: ``_unit_costs``, ``graph_units``)."""
    readers: dict[int, set[int]] = {}
    for i, node in enumerate(graph.nodes):
        if unit_of[i] >= 0:
            for r in node.input_refs():
                p = a.producer.get(r.id)
                if p is not None and unit_of[p] >= 0 and unit_of[p] != unit_of[i]:
                    readers.setdefault(r.id, set()).add(unit_of[i])
    return list(readers), [(unit_of[a.producer[v]], sorted(us)) for v, us in readers.items()]


def stage_cut(*, cones: Cones | None = None, schedule: Schedule = Schedule.ONE_F_ONE_B,
              ilp_limit: int = STAGE_ILP_LIMIT, tolerance: float = STAGE_TOLERANCE, seconds: float = 10.0,
              workers: int = 2, capacity: float | None = None, solutions: list | None = None,
              reuse: bool = False):
    """A ``cost.estimate.Cut`` callback: the forward nodes' stages of this module's partition (the
    solutions are appended to ``solutions`` when given).

    ``reuse`` (rule ``pipeline_reuse_cut``): the unit times and the cut bytes do not depend on the
    micro-batch count ``m`` (bytes scale by ``1/m`` alike), only the memory rows do, and they tighten as
    ``m`` falls (``act * min(pp - k, m) / m``, temporaries ``/ m``). So a cut solved for the same plan and
    ``pp`` at a larger ``m`` is kept for a smaller one when it still fits its memory rows (price the counts
    largest first); it is re-solved otherwise."""
    last: dict = {}

    def cut(graph: Graph, rp, st, mem, pp: int, m: int) -> list[int]:
        cap = capacity
        if cap is not None:   # what every stage holds besides its units: a micro-batch's temporaries and batch
            cap -= (mem.breakdown.get("temporaries", 0) + mem.breakdown.get("batch", 0)) / m
        gu = graph_units(graph, rp, st, mem, pp, m, cones=cones, schedule=schedule, capacity=cap,
                         tolerance=tolerance)
        kept = last.get("cut")     # (rp, st, pp, m, solution) of the last solve
        if reuse and kept is not None and kept[0] is rp and kept[1] is st and kept[2] == pp and kept[3] > m \
                and memory_ok(gu.problem, kept[4].stage):
            sol = kept[4]
        else:
            sol = solve_stages(gu.problem, ilp_limit=ilp_limit, seconds=seconds, workers=workers)
            last["cut"] = (rp, st, pp, m, sol)
        if solutions is not None:
            solutions.append(sol)
        return [sol.stage[u] if u >= 0 else -1 for u in gu.unit_of]
    return cut
