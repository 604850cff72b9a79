"""MODeL as a baseline: operator order and tensor addresses in one time-indexed integer program (CP-SAT).

MODeL (Steiner, Elhoushi, Kahn, Hegarty: "MODeL: Memory Optimizations for Deep Learning", ICML 2023;
code: facebookresearch/OLLA, ``training_graph_optimizer.py`` with ``account_for_fragmentation``) decides
when each tensor is created and kept, and where it lives, in one integer program solved by Gurobi. Here
the same formulation is written for CP-SAT and for this package's lifetime contract (``problem.py``).

Formulation. Steps ``t = 0..n-1``, exactly one op per step; ``asap(o)`` = number of ancestors of op
``o``, ``alap(o) = n - 1 -`` number of its descendants (outside ``[asap, alap]`` no variable exists).
Sizes are in units of the gcd of all sizes (offsets stay multiples of it).

- Variables: ``run[o,t]`` (op ``o`` runs at step ``t``; MODeL's ``generate[e,t]`` of each output ``e``
  of ``o`` is this variable); ``keep[e,t]`` (MODeL's ``preserve``: tensor ``e`` is in memory at ``t``,
  made at an earlier step); ``addr[e]`` (integer offset) for every tensor of non-zero size; ``H``
  (integer, the arena height); per pair of tensors that may be live at a common step, ``below[e,f]``,
  ``below[f,e]`` and ``both[e,f]`` (booleans).
- Constraints: ``sum_t run[o,t] = 1`` and ``sum_o run[o,t] = 1`` (an order); ``keep[e,t] <=
  keep[e,t-1] + gen[e,t-1]`` and ``keep[e,t] + gen[e,t] <= 1`` (only what exists is kept); ``run[c,t] <=
  keep[e,t]`` for every input ``e`` of ``c`` (inputs are in memory when an op runs); ``after`` edges and
  zero-size tensors: ``run[v,t] <= sum_{t' < t} run[u,t']`` (MODeL's control edges); the contract's
  long-lived tensors: an OUTPUT is kept from its creation to the end (``keep[e,t] >= keep[e,t-1] +
  gen[e,t-1]``), an INPUT is kept at step 0 and never made again (``also_output``: kept at every step);
  ``addr[e] + size[e] <= H``; ``below[e,f] => addr[e] + size[e] <= addr[f]``; ``both[e,f] >= live[e,t]
  + live[f,t] - 1``, ``live = gen + keep``; ``below[e,f] + below[f,e] >= both[e,f]``
  (live together means disjoint addresses); redundant, as in MODeL with a memory limit: ``sum_e
  size[e] * live[e,t] <= H``.
- Objective: minimise ``H``; its lower end is the order lower bound (``order_graph.IndexedProblem``),
  so a plan that reaches it stops the search.

Simplified, and why: no rematerialisation and no spilling (MODeL's ``fetch`` variables; this package
plans neither); one op per step with ``n`` steps instead of MODeL's ~1.01 x longest-path steps with
several nodes per step (the lifetime contract is per op step; several nodes per step could only
over-count memory); MODeL's big-M disjunctions are CP-SAT enforcement literals (same solutions);
``both`` is bounded at the steps where one of the two is made, not at every common step (live steps
are contiguous, so two tensors that share a step share the later one's creation step: the same
solutions with far fewer constraints); pairs the dependencies keep apart (MODeL's
``can_overlap_in_time``) get no variables; variables that the precedence fixes (``keep`` = 1 between ``alap`` of the producer and ``asap`` of a
reader, and the mandatory disjunction of two tensors live together for certain) are constants; no
hint from Rhino's plan (a baseline does not start from it): the hint, when on, is the problem's own
program order with a best-fit layout (``ModelOptions.hint_program_order``). The model lives in memory: above ``max_size``
(booleans plus pair-step constraints) it is not built and the result says so.

Every plan found is checked independently (``simulate.check_order``, ``layout.validate_layout`` with
the lifetimes of ``problem.lifetimes``, which the model's ``live`` sets contain).
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from .layout import Buffer, GreedyOrder, greedy_layout, validate_layout
from .order_graph import IndexedProblem
from .problem import MemProblem, TensorKind, buffers
from .simulate import check_order

__all__ = ["ModelOptions", "ModelResult", "solve_model"]


@dataclass(frozen=True)
class ModelOptions:
    """Named knobs of the MODeL baseline."""

    workers: int = 2  # CP-SAT workers (the development machine has two cores)
    # largest model built (booleans + pair-step constraints). Measured: AlexNet b1 of benchmarks/roam.py
    # (255 ops, size 4.3e6) was not built within 60 s on 2 loaded cores, 0.6 GB RSS at that point
    max_size: int = 6_000_000
    start_at_bound: bool = True  # H's lower end = the order lower bound (stops the search when reached)
    # hint CP-SAT with the problem's own program order and its best-fit layout (the input a MODeL user
    # has too; Gurobi finds a first solution by itself, CP-SAT often does not on 40+ ops; measured in
    # tests/test_model_ilp.py::test_hint_gives_a_plan)
    hint_program_order: bool = True


@dataclass
class ModelResult:
    """Outcome of one MODeL solve. ``order``/``offsets``/``height`` are set when a plan was found."""

    status: str  # "optimal", "feasible", "no solution" (time ran out), "too large", "infeasible"
    order: list[int] | None
    offsets: dict[int, int] | None  # tensor id -> byte offset (zero-size tensors at 0)
    height: int | None  # max over tensors of offset + size, under ``problem.lifetimes`` of ``order``
    bound: int  # no plan of the problem is lower (CP-SAT's objective bound, at least the order bound)
    seconds: float
    size: int  # booleans + pair-step constraints of the model (estimated when not built)
    valid: bool = False  # check_order and validate_layout pass
    reason: str = ""
    stats: dict[str, float] = field(default_factory=dict)


class _OutOfTime(Exception):
    """Raised inside model building when the deadline passes."""


class _Data:
    """Op windows and tensor windows of the problem (indices: ``IndexedProblem``)."""

    def __init__(self, g: IndexedProblem, deadline: float) -> None:
        self.g = g
        n = g.n
        anc = [0] * n
        for i in range(n):  # program order is topological
            m = 0
            for p in g.preds[i]:
                m |= anc[p] | (1 << p)
            anc[i] = m
            _tick(deadline)
        desc = [0] * n
        for i in range(n - 1, -1, -1):
            m = 0
            for s in g.succs[i]:
                m |= desc[s] | (1 << s)
            desc[i] = m
            _tick(deadline)
        self.anc = anc
        self.asap = [a.bit_count() for a in anc]
        self.alap = [n - 1 - d.bit_count() for d in desc]
        unit = 0
        for s in g.size:
            unit = math.gcd(unit, s)
        self.unit = max(unit, 1)
        # per tensor index: the steps at which it may be live, [lo, hi]
        self.lo, self.hi = [0] * g.m, [0] * g.m
        for j in range(g.m):
            p = g.prod[j]
            self.lo[j] = 0 if p < 0 else self.asap[p]
            last = max((self.alap[c] for c in g.cons[j]), default=-1)
            if g.keep[j]:
                self.hi[j] = n - 1
            elif p < 0:
                self.hi[j] = max(last, 0)
            else:
                self.hi[j] = max(last, self.alap[p])
        self.mem = [j for j in range(g.m) if g.size[j] > 0]

    def pairs(self, cap: int, deadline: float) -> tuple[list[tuple[int, int]] | None, int]:
        """Tensor pairs (non-zero sizes) whose windows share a step and that the dependencies do not keep
        apart (MODeL's ``can_overlap_in_time``), and the model's size (booleans and pair-step constraints);
        no pairs, and a size just above ``cap``, once the size passes ``cap``."""
        g = self.g
        size = sum(self.alap[i] - self.asap[i] + 1 for i in range(g.n))
        size += sum(self.hi[j] - self.lo[j] + 1 for j in self.mem)
        by_lo = sorted(self.mem, key=lambda j: self.lo[j])
        los = [self.lo[j] for j in by_lo]
        out: list[tuple[int, int]] = []
        for a, j in enumerate(by_lo):
            end = bisect.bisect_right(los, self.hi[j], lo=a + 1)
            for k in by_lo[a + 1:end]:
                if not (self.dead_before(j, k) or self.dead_before(k, j)):
                    out.append((j, k))
                    size += 3 + self.made(j, k) + self.made(k, j)
            if size > cap:
                return None, size
            _tick(deadline)
        return out, size

    def made(self, e: int, f: int) -> int:
        """Steps at which ``f`` may be made while ``e`` may be live (the clauses of ``_Model.made_while_live``)."""
        p = self.g.prod[f]
        return 0 if p < 0 else max(0, min(self.alap[p], self.hi[e]) - max(self.asap[p], self.lo[e]) + 1)

    def dead_before(self, e: int, f: int) -> bool:
        """Tensor ``e`` is freed before ``f`` is made in every order: each op that ends ``e``'s lifetime (its
        readers, or its producer when nobody reads it) is an ancestor of ``f``'s producer."""
        g = self.g
        if g.keep[e] or g.prod[f] < 0:
            return False
        ends = g.cons[e] or ((g.prod[e],) if g.prod[e] >= 0 else ())
        a = self.anc[g.prod[f]]
        return bool(ends) and all(a >> c & 1 for c in ends)


def _tick(deadline: float) -> None:
    """Raise ``_OutOfTime`` past the deadline (called once per op, tensor or pair while building)."""
    if time.perf_counter() > deadline:
        raise _OutOfTime


def _is_one(terms: list[object]) -> bool:
    """A live expression that is the constant 1."""
    return len(terms) == 1 and isinstance(terms[0], int) and terms[0] == 1


class _Model:
    """The CP-SAT model of the module docstring; one method per constraint family."""

    def __init__(self, d: _Data, deadline: float) -> None:
        self.d, self.g, self.deadline = d, d.g, deadline
        self.m = cp_model.CpModel()
        self.run: list[dict[int, cp_model.IntVar]] = []
        self.keep: dict[int, dict[int, object]] = {}  # tensor -> step -> 0/1 or variable
        self.certain: dict[int, tuple[int, int]] = {}  # tensor -> the steps at which it is live in every order
        self.pair_vars: list[tuple[int, int, cp_model.IntVar, cp_model.IntVar, cp_model.IntVar | None]] = []

    def gen(self, j: int, t: int) -> object:
        """1 when tensor ``j`` is made at step ``t``: its producer's ``run`` (0 outside its window)."""
        p = self.g.prod[j]
        return 0 if p < 0 else self.run[p].get(t, 0)

    def kept(self, j: int, t: int) -> object:
        return self.keep.get(j, {}).get(t, 0)

    def live(self, j: int, t: int) -> list[object]:
        return [x for x in (self.gen(j, t), self.kept(j, t)) if not (isinstance(x, int) and x == 0)]

    def order_vars(self) -> None:
        """``run[o,t]``: each op at one step, each step one op."""
        d, m = self.d, self.m
        at: list[list[cp_model.IntVar]] = [[] for _ in range(self.g.n)]
        for i in range(self.g.n):
            row = {t: m.new_bool_var(f"run{i}_{t}") for t in range(d.asap[i], d.alap[i] + 1)}
            self.run.append(row)
            m.add_exactly_one(row.values())
            for t, v in row.items():
                at[t].append(v)
            _tick(self.deadline)
        for vs in at:
            m.add_exactly_one(vs)

    def precedence(self) -> None:
        """``after`` edges and zero-size tensors: ``run[v,t] <= sum_{t' < t} run[u,t']``."""
        g, d, m = self.g, self.d, self.m
        edges = {(u, v) for v in range(g.n) for u in g.preds[v]}
        data = {(g.prod[j], c) for j in range(g.m) if g.size[j] > 0 and g.prod[j] >= 0 for c in g.cons[j]}
        for k, (u, v) in enumerate(sorted(edges - data)):
            for t in range(d.asap[v], min(d.alap[v], d.alap[u]) + 1):
                m.add(self.run[v][t] <= sum(self.run[u][s] for s in range(d.asap[u], t)))
            _tick(self.deadline)

    def keep_vars(self) -> None:
        """``keep[e,t]`` with the contract's constants, creation before keeping, and inputs kept for readers."""
        g, d, m = self.g, self.d, self.m
        for k, j in enumerate(d.mem):
            p = g.prod[j]
            must_to = max((d.asap[c] for c in g.cons[j]), default=-1)
            row: dict[int, object] = {}
            first = d.lo[j] if p < 0 else d.lo[j] + 1
            last = d.hi[j] if g.cons[j] or g.keep[j] else first - 1 + int(p < 0)  # unread: made and gone
            for t in range(first, last + 1):
                certain = (g.keep[j] or t <= must_to) and (p < 0 or t > d.alap[p])
                if p < 0 and (t == 0 or g.keep[j]):
                    certain = True
                row[t] = 1 if certain else m.new_bool_var(f"keep{j}_{t}")
            self.keep[j] = row
            ones = [t for t, x in row.items() if isinstance(x, int)]  # contiguous by construction
            if ones:
                self.certain[j] = (ones[0], ones[-1])
            for t, x in row.items():
                before = [y for y in (self.kept(j, t - 1), self.gen(j, t - 1)) if not isinstance(y, int)]
                if t > 0 and not (isinstance(self.kept(j, t - 1), int) and self.kept(j, t - 1) == 1):
                    m.add(x <= sum(before))  # a certain step (x = 1) forces the steps before it too
                if isinstance(x, int):
                    continue
                if p >= 0:
                    m.add(x + self.gen(j, t) <= 1)
                if g.keep[j]:
                    m.add(x >= self.kept(j, t - 1) + self.gen(j, t - 1))
            for c in g.cons[j]:
                for t, r in self.run[c].items():
                    x = self.kept(j, t)
                    if not (isinstance(x, int) and x == 1):
                        m.add(r <= x)
            _tick(self.deadline)

    def memory(self, lower: int, upper: int) -> cp_model.IntVar:
        """``H``, the addresses below it, and the redundant live-bytes bound at every step."""
        g, d, m, u = self.g, self.d, self.m, self.d.unit
        h = m.new_int_var(lower, upper, "H")
        self.addr = {j: m.new_int_var(0, upper - g.size[j] // u, f"addr{j}") for j in d.mem}
        for j, a in self.addr.items():
            m.add(a + g.size[j] // u <= h)
        at: list[list[tuple[int, object]]] = [[] for _ in range(g.n)]
        for k, j in enumerate(d.mem):
            for t in range(d.lo[j], d.hi[j] + 1):
                for x in self.live(j, t):
                    at[t].append((g.size[j] // u, x))
            _tick(self.deadline)
        for terms in at:
            m.add(sum(s * x for s, x in terms) <= h)
        m.minimize(h)
        return h

    def disjoint(self, pairs: list[tuple[int, int]]) -> None:
        """Two tensors live at a common step get disjoint addresses (``below``/``both`` of the docstring)."""
        g, m, u = self.g, self.m, self.d.unit
        for e, f in pairs:
            ef, fe = m.new_bool_var(f"b{e}_{f}"), m.new_bool_var(f"b{f}_{e}")
            m.add(self.addr[e] + g.size[e] // u <= self.addr[f]).only_enforce_if(ef)
            m.add(self.addr[f] + g.size[f] // u <= self.addr[e]).only_enforce_if(fe)
            ce, cf = self.certain.get(e), self.certain.get(f)
            both = None
            if ce and cf and max(ce[0], cf[0]) <= min(ce[1], cf[1]):
                m.add_bool_or([ef, fe])  # live together in every order
            else:
                both = m.new_bool_var(f"both{e}_{f}")
                self.made_while_live(e, f, both)
                self.made_while_live(f, e, both)
                m.add_bool_or([ef, fe]).only_enforce_if(both)
            self.pair_vars.append((e, f, ef, fe, both))
            _tick(self.deadline)

    def made_while_live(self, e: int, f: int, both: cp_model.IntVar) -> None:
        """``both >= gen[f,t] + live[e,t] - 1`` at every step ``f`` may be made. Live steps are contiguous, so two
        tensors live at a common step are live together where the later one is made: these steps say as
        much as MODeL's every-step constraints. Written as clauses into the model's proto (``gen`` and
        ``keep`` exclude each other): the API call per clause was most of the building time."""
        g, d = self.g, self.d
        p = g.prod[f]
        if p < 0:
            return
        cons = self.m.proto.constraints
        for t, r in self.run[p].items():
            if d.lo[e] <= t <= d.hi[e]:
                for x in self.live(e, t):
                    lits = [both.index, -r.index - 1]
                    if not isinstance(x, int):
                        lits.append(-x.index - 1)
                    cons.add().bool_or.literals.extend(lits)

    def hint(self, h: cp_model.IntVar) -> None:
        """A complete solution: program order (op ``i`` at step ``i``), its lifetimes, a best-fit layout."""
        g, d, m, u = self.g, self.d, self.m, self.d.unit
        life = g.intervals(range(g.n))
        offs = greedy_layout([Buffer(j, *life[j], g.size[j]) for j in d.mem], order=GreedyOrder.SIZE)
        for i, row in enumerate(self.run):
            for t, v in row.items():
                m.add_hint(v, t == i)
        for j, row in self.keep.items():
            for t, x in row.items():
                if not isinstance(x, int):
                    m.add_hint(x, life[j][0] < t < life[j][1])
        for j, a in self.addr.items():
            m.add_hint(a, offs[j] // u)
        m.add_hint(h, max((offs[j] + g.size[j] for j in d.mem), default=0) // u)
        for e, f, ef, fe, both in self.pair_vars:
            m.add_hint(ef, offs[e] + g.size[e] <= offs[f])
            m.add_hint(fe, offs[f] + g.size[f] <= offs[e])
            if both is not None:
                m.add_hint(both, life[e][0] < life[f][1] and life[f][0] < life[e][1])


def solve_model(problem: MemProblem, time_limit: float = 60.0, options: ModelOptions | None = None) -> ModelResult:
    """MODeL's joint order-and-address program for ``problem``, solved by CP-SAT within ``time_limit`` seconds
    (building, solving and checking included)."""
    t0 = time.perf_counter()
    opts = options or ModelOptions()
    deadline = t0 + time_limit
    g = IndexedProblem(problem)
    lb = g.lower_bound()
    if g.n == 0:
        return ModelResult("optimal", [], {t: 0 for t in problem.tensors}, 0, 0, 0.0, 0, True)

    def done(status: str, size: int, reason: str, bound: int = lb) -> ModelResult:
        return ModelResult(status, None, None, None, bound, time.perf_counter() - t0, size, reason=reason)

    try:
        d = _Data(g, deadline)
        pairs, size = d.pairs(opts.max_size, deadline)
        if pairs is None:
            return done("too large", size, f"the model has more than {opts.max_size:,} booleans and pair-step "
                                           f"constraints (ModelOptions.max_size)")
        md = _Model(d, deadline)
        md.order_vars()
        md.precedence()
        md.keep_vars()
        upper = sum(g.size) // d.unit
        lower = -(-lb // d.unit) if opts.start_at_bound else 0
        h = md.memory(min(lower, upper), upper)
        md.disjoint(pairs)
        if opts.hint_program_order:
            md.hint(h)
    except _OutOfTime:
        return done("no solution", 0, f"the model was not built within {time_limit:g} s")
    build = time.perf_counter() - t0
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = max(1, opts.workers)
    solver.parameters.random_seed = 0
    # leave time to read the solution and check it (both linear in the model)
    solver.parameters.max_time_in_seconds = max(0.01, deadline - time.perf_counter() - 0.1 - 2e-7 * size)
    st = solver.solve(md.m)
    bound = max(lb, int(math.ceil(solver.best_objective_bound - 1e-9)) * d.unit) if st != cp_model.UNKNOWN else lb
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        status = "infeasible" if st == cp_model.INFEASIBLE else "no solution"
        return done(status, size, f"CP-SAT found no plan within {time_limit:g} s", bound)
    steps = [next(t for t, v in md.run[i].items() if solver.value(v)) for i in range(g.n)]
    order = g.to_ids(sorted(range(g.n), key=lambda i: steps[i]))
    offsets = {t: 0 for t in problem.tensors}
    offsets.update({g.tensor_ids[j]: solver.value(a) * d.unit for j, a in md.addr.items()})
    res = ModelResult("optimal" if st == cp_model.OPTIMAL else "feasible", order, offsets, 0, bound, 0.0, size,
                      stats={"build_seconds": build, "solve_seconds": solver.wall_time})
    res.valid, res.height, res.reason = _check(problem, order, offsets)
    res.seconds = time.perf_counter() - t0
    return res


def _check(problem: MemProblem, order: list[int], offsets: dict[int, int]) -> tuple[bool, int, str]:
    """(valid, height, first problem found) under the independent checkers."""
    try:
        check_order(problem, order)
    except ValueError as exc:
        return False, 0, f"order: {exc}"
    bufs = buffers(problem, order)
    errors = validate_layout(bufs, offsets)
    height = max((offsets[b.id] + b.size for b in bufs), default=0)
    return not errors, height, f"layout: {errors[0]}" if errors else ""
