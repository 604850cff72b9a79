"""O2: one integer program over the strategies of all cone classes, solved with OR-Tools CP-SAT.

Formulation (plain data from ``problem.Problem``; seconds and bytes are rounded to integers):

Variables
  ``x[k, c]`` in {0, 1}: cone class ``k`` takes candidate ``c``.
  per term (a value crossing cones) and needed sharding ``tau``: ``e[tau] >= 0``, the time to bring
  the value to ``tau``; pair variables ``y`` (below) or, in the big-M form, ``need[tau]`` in {0, 1}.
  ``T >= 0``: the step time.

Constraints
  ``one_strategy_per_cone``: ``sum_c x[k, c] = 1`` for every class ``k``.
  ``consumer_needs_sharding``: ``need[tau] >= x[u, t]`` whenever candidate ``t`` of consumer class
  ``u`` needs the value as ``tau`` (fixed needs, such as the replicated loss, are 1).
  ``redistribution_cost``: with ``z[sigma] = sum of x[p, c]`` over the producer's candidates that make
  the value ``sigma`` and ``w_u[tau]`` the same for consumer ``u``: pair variables ``y_u[sigma, tau]``
  in {0, 1} whose marginals are ``z`` and ``w_u`` (``sum_tau y_u = z[sigma]``, ``sum_sigma y_u =
  w_u[tau]``) and ``e[tau] >= sum_sigma R[sigma][tau] y_u[sigma, tau]`` for every consumer ``u``: the
  redistribution to ``tau`` is paid once however many consumers need it. Where the pairs would be
  too many (``MARGINAL_PAIRS``), the big-M form ``e[tau] >= sum_sigma R[sigma][tau] z[sigma] -
  M_tau (1 - need[tau])`` with ``M_tau = max_sigma R[sigma][tau]``.
  ``memory_per_device``: at every checked node, ``sum_{k,c} bytes[k, c] x[k, c] + sum copies + const
  <= capacity`` (the bytes of the storages live there, from the liveness model; more rows are added
  when the plan's full memory estimate finds another peak over capacity).
  ``copies_alive``: a redistributed copy of a value to ``tau`` is alive at a checked node when a use at
  or before it and a use at or after it both need ``tau`` and the producer did not make ``tau``:
  ``copy[tau] >= before[tau] + after[tau] - 1 - z[tau]`` (``before``/``after``: an expression, or a
  variable implied by each consumer candidate needing ``tau``).
  ``step_time`` (the overlap model of ``cost.step``, linearised): with per-class multiplicities,
  ``C`` all compute and ``B, G, P, S`` the blocking, gradient, prefetch and state-update
  communication,
  ``T >= C + B + G + S``  (the compute stream waits for blocking collectives; ``cost.step`` queues
  collectives in program order on one stream and the optimizer nodes, which wait for the gradients,
  come after the whole backward pass, so gradient reductions end up on the critical path),
  ``T >= B + G + P + S``  (one communication stream; prefetched parameter gathers overlap compute).

Objective
  ``minimise T + HIDDEN_COMM_WEIGHT * P``: the step time, and among equal step times the plan that
  moves less (hidden communication still takes link bandwidth).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum

from ortools.sat.python import cp_model

from .problem import KINDS, Problem, copy_bytes

__all__ = ["Solution", "SolveStatus", "solve_ilp", "HIDDEN_COMM_WEIGHT", "TIME_UNIT", "MEMORY_UNIT", "objective_of",
           "memory_over", "memory_excess", "row_bytes"]

#: Weight of overlapped communication in the objective (assumed: a tie-breaker, 1% of its time).
HIDDEN_COMM_WEIGHT = 0.01
#: Seconds per integer time unit in the model (1 ns, coarser when the problem's costs would not fit
#: CP-SAT's integer range).
TIME_UNIT = 1e-9
#: CP-SAT subsolvers, in order of use for the first workers: on these problems an LP-heavy search and
#: the core-based (lower-bound) search close the gap fastest (measured on the GPT example: optimal in
#: 0.5 s with these two, not in 20 s with the default pair).
SUBSOLVERS = ("max_lp", "core")
#: Largest producer x consumer sharding pairs modelled with the marginal formulation (else big-M).
MARGINAL_PAIRS = 400
#: Bytes per integer memory unit in the model: capacity / 2**24, at least 1 (about 5 KB for an 80 GB
#: device); coefficients round up, the capacity down, so the rounding never admits an overfull plan.
MEMORY_UNIT = 2 ** 24


class SolveStatus(StrEnum):
    """CP-SAT's answer: proven optimal, feasible (time ran out), proven infeasible, or nothing found."""
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    UNKNOWN = "unknown"


@dataclass
class Solution:
    choice: list[int]
    objective: float             # the model's step time (seconds), or inf if infeasible
    status: SolveStatus
    seconds: float               # solver wall time
    bound: float = 0.0           # best lower bound on the objective (seconds)
    over: int = 0                # with soft memory: bytes over capacity at the worst checked node


def _mem_unit(capacity: int) -> int:
    return max(1, int(capacity) // MEMORY_UNIT)


class _Model:
    def __init__(self, p: Problem, fixed: dict[int, int] | None, allowed: dict[int, list[int]] | None,
                 soft_memory: bool = False) -> None:
        self.p = p
        self.soft_memory = soft_memory
        self.slacks: list = []
        self.aux: list = []     # (variable, function(choice) -> its value): completes a hint
        self.unit = max(TIME_UNIT, _upper_bound(p) / 2 ** 40)
        self.munit = _mem_unit(p.capacity)
        self.m = cp_model.CpModel()
        self.x: list[list] = []
        self.buckets: dict[str, list] = {k: [] for k in ("cf", "cb", "co", *KINDS)}
        fixed = fixed or {}
        allowed = allowed or {}
        for k, n in enumerate(p.n_cands):
            ok = [fixed[k]] if k in fixed else allowed.get(k, range(n))
            ok = set(ok)
            row = []
            for c in range(n):
                row.append(self.m.NewBoolVar(f"x{k}_{c}") if (c in ok and len(ok) > 1) else (1 if c in ok else 0))
            self.x.append(row)
        self.one_strategy_per_cone()
        self.cone_costs()
        for term in p.terms:
            self.redistribution_cost(term)
        for row in p.memory:
            self.memory_per_device(row)
        self.step_time()

    def _m(self, nbytes: int) -> int:
        return -(-int(nbytes) // self.munit)

    def _t(self, seconds: float) -> int:
        return int(round(seconds / self.unit))

    def expr(self, k: int, cands) -> object:
        """``sum x[k, c]`` over ``cands`` (ints stay ints where the choice is fixed)."""
        return sum(self.x[k][c] for c in cands)

    def one_strategy_per_cone(self) -> None:
        for row in self.x:
            vars_ = [v for v in row if not isinstance(v, int)]
            if vars_:
                self.m.AddExactlyOne(vars_)

    def cone_costs(self) -> None:
        p = self.p
        for k, n in enumerate(p.n_cands):
            mult = p.mult[k]
            for c in range(n):
                v = self.x[k][c]
                if isinstance(v, int) and v == 0:
                    continue
                f, b, o = p.compute[k][c]
                for name, secs in (("cf", f), ("cb", b), ("co", o), *p.comm[k][c].items()):
                    if secs:
                        self.buckets[name].append(self._t(secs * mult) * v)

    def consumer_needs_sharding(self, term) -> dict[int, object]:
        needs: dict[int, list] = {}
        for uc, need in term.uses:
            for c, taus in enumerate(need):
                v = self.x[uc][c]
                if isinstance(v, int) and v == 0:
                    continue
                for t in taus:
                    needs.setdefault(t, []).append(v)
        out: dict[int, object] = {t: 1 for t in term.fixed}
        single = len(term.uses) == 1 and all(len(t) == 1 for t in term.uses[0][1])
        for t, vs in needs.items():
            if t in out:
                continue
            if any(isinstance(v, int) for v in vs):
                out[t] = 1
            elif single:
                out[t] = sum(vs)
            else:
                n = self.m.NewBoolVar("need")
                for v in vs:
                    self.m.AddImplication(v, n)
                out[t] = n
                self.aux.append((n, lambda ch, term=term, t=t: int(t in _taus(term, ch))))
        return out

    def redistribution_cost(self, term) -> None:
        by_sigma: dict[int, list[int]] = {}
        for c, s in enumerate(term.sigma):
            v = self.x[term.producer][c]
            if isinstance(v, int) and v == 0:
                continue
            by_sigma.setdefault(s, []).append(c)
        uses = []
        for uc, need in term.uses:
            by_tau: dict[int, list[int]] = {}
            for c, taus in enumerate(need):
                v = self.x[uc][c]
                if not (isinstance(v, int) and v == 0):
                    for t in taus:
                        by_tau.setdefault(t, []).append(c)
            uses.append((uc, by_tau, all(len(t) == 1 for t in need), need))
        marginal = len(by_sigma) > 1 and all(
            one and len(bt) > 1 and len(by_sigma) * len(bt) <= MARGINAL_PAIRS for _, bt, one, _ in uses)
        if not marginal:
            for t, need in self.consumer_needs_sharding(term).items():
                self.add_linear_cost(term, by_sigma, t, need)
            return
        for t in term.fixed:
            self.add_linear_cost(term, by_sigma, t, 1)
        paid: dict[int, list] = {}
        for uc, by_tau, _, need in uses:
            for t, cost in self.marginal_redistribution_cost(term, by_sigma, uc, by_tau, need).items():
                paid.setdefault(t, []).append(cost)
        for t, costs in paid.items():
            if t in term.fixed:
                continue
            if len(costs) == 1:
                self.buckets[term.kind].append(costs[0])
                continue
            e = self.m.NewIntVar(0, max(self._t(term.cost[s][t] * term.mult) for s in by_sigma), "e")
            for cost in costs:
                self.m.Add(e >= cost)
            self.buckets[term.kind].append(e)
            self.aux.append((e, lambda ch, term=term, t=t: self._t(term.cost[term.sigma[ch[term.producer]]][t]
                                                                  * term.mult) if t in _taus(term, ch) else 0))

    def marginal_redistribution_cost(self, term, by_sigma, uc, by_tau, need) -> dict[int, object]:
        """``y[sigma, tau]`` = "the producer makes ``sigma`` and consumer ``uc`` needs ``tau``", with the
        two choices as its marginals (``sum_tau y = z[sigma]``, ``sum_sigma y = w[tau]``): a much tighter
        relaxation than big-M. Returns, per ``tau``, the cost expression ``sum_sigma R y``; a sharding
        several consumers need is paid once (``e[tau] >=`` each of theirs)."""
        y = {(s, t): self.m.NewBoolVar("y") for s in by_sigma for t in by_tau}
        for (s, t), v in y.items():
            self.aux.append((v, lambda ch, s=s, t=t: int(term.sigma[ch[term.producer]] == s and t in need[ch[uc]])))
        for s, cs in by_sigma.items():
            self.m.Add(sum(y[s, t] for t in by_tau) == self.expr(term.producer, cs))
        for t, cs in by_tau.items():
            self.m.Add(sum(y[s, t] for s in by_sigma) == self.expr(uc, cs))
        out = {}
        for t in by_tau:
            cost = [self._t(term.cost[s][t] * term.mult) * y[s, t] for s in by_sigma if term.cost[s][t] > 0]
            if cost:
                out[t] = sum(cost)
        return out

    def add_linear_cost(self, term, by_sigma, t: int, need) -> None:
        """``redistribution_cost`` for one needed sharding ``t`` (big-M where both sides vary)."""
        costs = {s: self._t(term.cost[s][t] * term.mult) for s in by_sigma}
        big = max(costs.values(), default=0)
        if big <= 0:
            return
        lin = sum(costs[s] * self.expr(term.producer, cs) for s, cs in by_sigma.items() if costs[s])
        if isinstance(need, int) or len(by_sigma) == 1:
            if len(by_sigma) == 1:
                (s,) = by_sigma
                self.buckets[term.kind].append(costs[s] * need)
            else:
                self.buckets[term.kind].append(lin)
            return
        e = self.m.NewIntVar(0, big, "e")
        self.m.Add(e >= lin - big * (1 - need))
        self.buckets[term.kind].append(e)
        self.aux.append((e, lambda ch: costs.get(term.sigma[ch[term.producer]], 0) if t in _taus(term, ch) else 0))

    def memory_per_device(self, row) -> None:
        terms = []
        const = self._m(row.const)
        for k, coefs in row.coef.items():
            for c, b in enumerate(coefs):
                v = self.x[k][c]
                if b and not (isinstance(v, int) and v == 0):
                    terms.append(self._m(b) * v)
        top = const + sum(max(self._m(b) for b in coefs) for coefs in row.coef.values())
        for ct in row.copies:
            terms += self.copies_alive(ct)
            top += self._m(ct.count * sum(ct.nbytes))
        cap = self.p.capacity // self.munit
        if self.soft_memory:
            slack = self.m.NewIntVar(0, max(0, top - cap), "over")
            self.m.Add(sum(terms) + const <= cap + slack)
            self.slacks.append(slack)
        else:
            self.m.Add(sum(terms) + const <= cap)

    def _needs(self, side, t: int):
        """1 if some use of ``side`` needs sharding ``t`` (an expression, a new variable or 0/1)."""
        exprs = []
        for uc, need in side:
            cs = [c for c, taus in enumerate(need) if t in taus and not (isinstance(self.x[uc][c], int)
                                                                         and self.x[uc][c] == 0)]
            if not cs:
                continue
            e = self.expr(uc, cs)
            if isinstance(e, int):
                return 1
            exprs.append((uc, cs))
        if not exprs:
            return 0
        if len(exprs) == 1:
            return self.expr(*exprs[0])
        o = self.m.NewBoolVar("needs")
        for uc, cs in exprs:
            for c in cs:
                self.m.AddImplication(self.x[uc][c], o)
        self.aux.append((o, lambda ch: int(any(t in need[ch[uc]] for uc, need in side))))
        return o

    def copies_alive(self, ct) -> list:
        """``copy[tau] >= before_needs[tau] + after_needs[tau] - 1 - z[tau]``: bytes of the redistributed
        copies alive at the row's node (``problem.CopyTerm``)."""
        out = []
        for t, nbytes in enumerate(ct.nbytes):
            if not nbytes:
                continue
            nb, na = self._needs(ct.before, t), self._needs(ct.after, t)
            if (isinstance(nb, int) and nb == 0) or (isinstance(na, int) and na == 0):
                continue
            same = [c for c, s in enumerate(ct.sigma) if s == t]
            z = self.expr(ct.producer, same) if same else 0
            if isinstance(z, int) and z == 1:
                continue
            a = self.m.NewBoolVar("copy")
            self.m.Add(a >= nb + na - 1 - z)
            self.aux.append((a, lambda ch, t=t: int(ct.sigma[ch[ct.producer]] != t
                                                    and any(t in need[ch[uc]] for uc, need in ct.before)
                                                    and any(t in need[ch[uc]] for uc, need in ct.after))))
            out.append(self._m(ct.count * nbytes) * a)
        return out

    def step_time(self) -> None:
        s = {k: sum(v) for k, v in self.buckets.items()}
        self.T = self.m.NewIntVar(0, 1 << 42, "T")
        self.m.Add(self.T >= s["cf"] + s["cb"] + s["co"] + s["blocking"] + s["gradient"] + s["state"])
        self.m.Add(self.T >= s["blocking"] + s["gradient"] + s["prefetch"] + s["state"])
        # soft memory: exceeding by the whole capacity costs 100 times the largest step time possible
        weight = -(-100 * round(1 / HIDDEN_COMM_WEIGHT) * int(_upper_bound(self.p) / self.unit)
                   // max(1, self.p.capacity // self.munit))
        over = weight * sum(self.slacks) if self.slacks else 0
        self.m.Minimize(round(1 / HIDDEN_COMM_WEIGHT) * self.T + s["prefetch"] + over)


def solve_ilp(p: Problem, *, time_limit: float = 10.0, workers: int = 2, hint: list[int] | None = None,
              fixed: dict[int, int] | None = None, allowed: dict[int, list[int]] | None = None,
              soft_memory: bool = False) -> Solution:
    """Solve the O2 model of ``p`` (module docstring) within ``time_limit`` seconds. ``fixed``/``allowed``
    restrict classes to one / some candidates; ``soft_memory`` turns the memory rows into penalties
    (``Solution.over`` then says by how many bytes the worst row is over)."""
    t0 = time.perf_counter()
    model = _Model(p, fixed, allowed, soft_memory)
    if hint is not None:
        for k, c in enumerate(hint):
            for cc, v in enumerate(model.x[k]):
                if not isinstance(v, int):
                    model.m.AddHint(v, 1 if cc == c else 0)
        for v, fn in model.aux:
            model.m.AddHint(v, fn(hint))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit))
    solver.parameters.num_workers = max(1, int(workers))
    solver.parameters.random_seed = 0
    for name in SUBSOLVERS[:max(1, int(workers))]:
        solver.parameters.subsolvers.append(name)
    status = solver.Solve(model.m)
    seconds = time.perf_counter() - t0
    names = {cp_model.OPTIMAL: SolveStatus.OPTIMAL, cp_model.FEASIBLE: SolveStatus.FEASIBLE,
             cp_model.INFEASIBLE: SolveStatus.INFEASIBLE}
    name = names.get(status, SolveStatus.UNKNOWN)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solution([], float("inf"), name, seconds)
    choice = []
    for row in model.x:
        pick = 0
        for c, v in enumerate(row):
            if (v == 1) if isinstance(v, int) else solver.BooleanValue(v):
                pick = c
                break
        choice.append(pick)
    over = max((solver.Value(v) for v in model.slacks), default=0) * model.munit
    return Solution(choice, solver.Value(model.T) * model.unit, name, seconds,
                    solver.BestObjectiveBound() * HIDDEN_COMM_WEIGHT * model.unit, over)


def _taus(term, choice: list[int]) -> set[int]:
    """Shardings the consumers of ``term`` need under ``choice`` (with the fixed ones)."""
    out = set(term.fixed)
    for uc, need in term.uses:
        out.update(need[choice[uc]])
    return out


def _upper_bound(p: Problem) -> float:
    """Seconds no bucket of the model can exceed: every class at its costliest candidate, every term
    paying its costliest redistribution for every sharding it may need."""
    total = 0.0
    for k, n in enumerate(p.n_cands):
        total += p.mult[k] * max(sum(p.compute[k][c]) + sum(p.comm[k][c].values()) for c in range(n))
    for term in p.terms:
        n_tau = len(set(term.fixed) | {t for _, need in term.uses for ts in need for t in ts})
        total += term.mult * n_tau * max(max(row) for row in term.cost)
    return total


def objective_of(p: Problem, choice: list[int]) -> dict[str, float]:
    """The model's cost buckets (seconds) and step time for a given choice (no solver)."""
    b = {k: 0.0 for k in ("cf", "cb", "co", *KINDS)}
    for k, c in enumerate(choice):
        f, bw, o = p.compute[k][c]
        b["cf"] += f * p.mult[k]
        b["cb"] += bw * p.mult[k]
        b["co"] += o * p.mult[k]
        for kind, secs in p.comm[k][c].items():
            b[kind] += secs * p.mult[k]
    for term in p.terms:
        s = term.sigma[choice[term.producer]]
        taus = set(term.fixed)
        for uc, need in term.uses:
            taus.update(need[choice[uc]])
        b[term.kind] += sum(term.cost[s][t] for t in taus) * term.mult
    b["T"] = max(b["cf"] + b["cb"] + b["co"] + b["blocking"] + b["gradient"] + b["state"],
                 b["blocking"] + b["gradient"] + b["prefetch"] + b["state"])
    return b


def memory_over(p: Problem, choice: list[int]) -> int:
    """Bytes by which the worst memory row exceeds capacity under ``choice`` (0 if all fit)."""
    worst = 0
    for row in p.memory:
        total = row_bytes(row, choice)
        worst = max(worst, total - p.capacity)
    return worst


def memory_excess(p: Problem, choice: list[int]) -> int:
    """Bytes over capacity summed over the memory rows (what the soft-memory objective penalises)."""
    return sum(max(0, row_bytes(row, choice) - p.capacity) for row in p.memory)


def row_bytes(row, choice: list[int]) -> int:
    """Bytes of one memory row under ``choice``."""
    return row.const + sum(coefs[choice[k]] for k, coefs in row.coef.items()) + \
        sum(copy_bytes(ct, choice) for ct in row.copies)
