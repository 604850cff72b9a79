"""Exact reordering of a window of an order with CP-SAT (the ROAM/MODeL time-indexed model).

A *window* is the run of ops at positions ``[a, b)`` of the current order. Ops before and after it
stay where they are, so only the window's own live bytes change: a tensor live across the whole
window whatever its order (produced before it and read after it, or kept to the end) is a constant
``base[t]``; so are tensors that touch no op of the window. The window is solved exactly, which for a
window between two key points (or the whole problem) is the exact optimum of that part.

Formulation (``k`` ops, steps ``t = 0..k-1``; ``asap(o)`` / ``alap(o)`` are the number of window
ancestors of ``o`` and ``k - 1 -`` its number of window descendants, outside which no variable exists):

- Variables: ``run[o,t]`` (bool) — op ``o`` runs at step ``t``; ``started[o,t]`` (bool) — ``o`` has run
  at or before ``t`` (``started[o,t] = started[o,t-1] + run[o,t]``, fixed to 0 before ``asap`` and 1
  from ``alap`` on); ``live[e,t]`` (bool) for a tensor read inside the window that is neither produced
  after ``t`` for certain nor certainly dead; ``peak`` (int).
- Constraints, each added by the function of that name:
  ``one_step_per_op`` (``sum_t run[o,t] = 1``, with the ``started`` link),
  ``one_op_per_step`` (``sum_o run[o,t] = 1``),
  ``precedence`` (``started[v,t] <= started[u,t-1]`` for every edge ``u -> v`` inside the window),
  ``liveness`` (``live[e,t] >= started[p,t] - started[c,t-1]`` for the producer ``p`` of ``e`` — 1 when
  it runs before the window — and each window reader ``c``; a tensor read after the window or kept to
  the end is live exactly when ``started[p,t]``; one nobody reads only when ``run[p,t]``),
  ``peak_bound`` (``base[t] + sum_e size(e) * live[e,t] <= peak`` for every step, ``peak <= bound``).
- Objective: minimise ``peak``. Sizes are divided by their greatest common divisor. The current order
  is the hint (``AddHint``), so a time-out returns at least as good a window when the bound allows it.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from .order_graph import IndexedProblem

__all__ = ["Window", "WindowResult", "solve_window", "window_booleans"]


@dataclass
class WindowResult:
    """Outcome of one window solve; ``order`` and ``live`` are set only when a solution was found."""

    status: str  # "optimal", "feasible", "infeasible" (nothing at or below ``bound``), "unknown"
    order: list[int] | None  # the window's ops in their new order (op indices)
    live: list[int] | None  # live bytes at each window step under the new order
    peak: int | None
    seconds: float
    booleans: int


def window_booleans(g: IndexedProblem, order: Sequence[int], a: int, b: int) -> int:
    """Run/started variables the model of window ``[a, b)`` would get (its ops' slack between ASAP and
    ALAP, twice), without building it."""
    loc = {op: t for t, op in enumerate(order[a:b])}
    k = b - a
    anc = [0] * k
    for u, op in enumerate(order[a:b]):
        m = 0
        for p in g.preds[op]:
            q = loc.get(p)
            if q is not None:
                m |= anc[q] | (1 << q)
        anc[u] = m
    desc = [0] * k
    for u in range(k - 1, -1, -1):
        for p in g.preds[order[a + u]]:
            q = loc.get(p)
            if q is not None:
                desc[q] |= desc[u] | (1 << u)
    return sum(2 * (k - 1 - desc[u].bit_count() - anc[u].bit_count()) + 1 for u in range(k))


class Window:
    """The data of one window: ops, bounds, tensors and the part of the live bytes its order cannot change
    (``base``). Slot ``u`` is the op at position ``a + u`` of the order; ``tensors`` holds
    ``(size, producer slot or None, reader slots, to_end)`` for every tensor the window's order affects."""

    def __init__(self, g: IndexedProblem, order: Sequence[int], live: Sequence[int], a: int, b: int) -> None:
        self.ops = list(order[a:b])
        k = self.k = len(self.ops)
        loc = self.loc = {op: t for t, op in enumerate(self.ops)}
        pos = g.positions(order)
        self.preds = [[loc[p] for p in g.preds[op] if p in loc] for op in self.ops]
        anc = [0] * k
        for u in range(k):  # the current window order is topological
            m = 0
            for p in self.preds[u]:
                m |= anc[p] | (1 << p)
            anc[u] = m
        desc = [0] * k
        succs: list[list[int]] = [[] for _ in range(k)]
        for u in range(k):
            for p in self.preds[u]:
                succs[p].append(u)
        for u in range(k - 1, -1, -1):
            m = 0
            for s in succs[u]:
                m |= desc[s] | (1 << s)
            desc[u] = m
        self.asap = [anc[u].bit_count() for u in range(k)]
        self.alap = [k - 1 - desc[u].bit_count() for u in range(k)]
        # tensors touching the window: (size, producer slot or None, reader slots, to_end)
        self.tensors: list[tuple[int, int | None, list[int], bool]] = []
        touched: dict[int, None] = {}
        for op in self.ops:
            touched.update(dict.fromkeys(g.op_in[op]))
            touched.update(dict.fromkeys(g.op_out[op]))
        n = g.n
        self.base = [live[a + t] for t in range(k)]
        for j in touched:
            if g.size[j] == 0:
                continue
            p = g.prod[j]
            slot = loc.get(p) if p >= 0 else None
            readers = [loc[c] for c in g.cons[j] if c in loc]
            to_end = g.keep[j] or any(pos[c] >= b for c in g.cons[j])
            if slot is None and to_end:
                continue  # live over the whole window whatever its order: stays in base
            self.tensors.append((g.size[j], slot, readers, to_end))
            last = max((pos[c] for c in g.cons[j]), default=-1)
            if p < 0:
                lo, hi = 0, max(n if g.keep[j] else last + 1, 1)
            else:
                lo = pos[p]
                hi = n if g.keep[j] else max(last, lo) + 1
            for s in range(max(lo, a), min(hi, b)):
                self.base[s - a] -= g.size[j]
        assert min(self.base, default=0) >= 0

    def live_of(self, seq: Sequence[int]) -> list[int]:
        """Live bytes at each window step when the window runs its slots in the order ``seq``."""
        k = self.k
        at = [0] * k
        for t, u in enumerate(seq):
            at[u] = t
        out = list(self.base)
        for size, slot, readers, to_end in self.tensors:
            lo = 0 if slot is None else at[slot]
            if to_end:
                hi = k
            elif readers:
                hi = max(lo, max(at[c] for c in readers)) + 1
            else:
                hi = lo + 1
            for t in range(lo, hi):
                out[t] += size
        return out


class _Model:
    """CP-SAT model of a window (see the module docstring); each constraint family has its function."""

    def __init__(self, w: Window, scale: int) -> None:
        self.w = w
        self.scale = scale
        self.m = cp_model.CpModel()
        self.run: list[dict[int, cp_model.IntVar]] = []
        self.started: list[dict[int, cp_model.IntVar]] = []
        self.live: list[tuple[int, cp_model.IntVar]] = []
        self.booleans = 0

    # started[u, t] as 0, 1 or a variable
    def s(self, u: int, t: int) -> int | cp_model.IntVar:
        if t < self.w.asap[u]:
            return 0
        if t >= self.w.alap[u]:
            return 1
        return self.started[u][t]

    def r(self, u: int, t: int) -> int | cp_model.IntVar:
        if t < self.w.asap[u] or t > self.w.alap[u]:
            return 0
        return self.run[u][t]

    def variables(self) -> None:
        w, m = self.w, self.m
        for u in range(w.k):
            lo, hi = w.asap[u], w.alap[u]
            self.run.append({t: m.NewBoolVar(f"run_{u}_{t}") for t in range(lo, hi + 1)})
            self.started.append({t: m.NewBoolVar(f"started_{u}_{t}") for t in range(lo, hi)})
            self.booleans += (hi - lo + 1) + (hi - lo)

    def one_step_per_op(self) -> None:
        """Each op runs at exactly one step; ``started`` is the running sum of ``run``."""
        w, m = self.w, self.m
        for u in range(w.k):
            lo, hi = w.asap[u], w.alap[u]
            m.AddExactlyOne(self.run[u].values())
            for t in range(lo, hi + 1):
                prev = self.s(u, t - 1)
                m.Add(self.s(u, t) == prev + self.run[u][t])

    def one_op_per_step(self) -> None:
        """Each step runs exactly one op."""
        w, m = self.w, self.m
        at: list[list[cp_model.IntVar]] = [[] for _ in range(w.k)]
        for u in range(w.k):
            for t, v in self.run[u].items():
                at[t].append(v)
        for t in range(w.k):
            m.AddExactlyOne(at[t])

    def precedence(self) -> None:
        """An op starts only after each of its window predecessors has run at an earlier step."""
        w, m = self.w, self.m
        for v in range(w.k):
            for u in w.preds[v]:
                for t in range(w.asap[v], w.alap[u] + 2):
                    sv, su = self.s(v, t), self.s(u, t - 1)
                    if isinstance(sv, int) and isinstance(su, int):
                        assert sv <= su
                        continue
                    m.Add(sv <= su)

    def liveness(self) -> list[list[tuple[int, object]]]:
        """Bytes of each step as (size, 0/1 term) pairs; adds ``live[e,t] >= started[p,t] - started[c,t-1]``."""
        w, m = self.w, self.m
        terms: list[list[tuple[int, object]]] = [[] for _ in range(w.k)]
        for e, (size, slot, readers, to_end) in enumerate(w.tensors):
            size //= self.scale
            for t in range(w.k):
                st = 1 if slot is None else self.s(slot, t)
                if isinstance(st, int) and st == 0:
                    continue
                if to_end:
                    terms[t].append((size, st))
                    continue
                if not readers:
                    terms[t].append((size, self.r(slot, t)))  # type: ignore[arg-type]
                    continue
                pending = [self.s(c, t - 1) for c in readers]  # started before t: done reading
                if all(isinstance(x, int) and x == 1 for x in pending):
                    continue
                if isinstance(st, int) and any(isinstance(x, int) and x == 0 for x in pending):
                    terms[t].append((size, 1))
                    continue
                lv = m.NewBoolVar(f"live_{e}_{t}")
                self.booleans += 1
                self.live.append((e, lv))
                for c in readers:
                    sc = self.s(c, t - 1)
                    if isinstance(sc, int) and sc == 1:
                        continue
                    m.Add(lv >= st - sc)
                terms[t].append((size, lv))
        return terms

    def peak_bound(self, terms: list[list[tuple[int, object]]], bound: int, lower: int = 0) -> cp_model.IntVar:
        """``base[t] + sum size * live <= peak`` at every step, and ``lower <= peak <= bound``."""
        w, m = self.w, self.m
        lo = max(lower, max(b // self.scale for b in w.base))
        peak = m.NewIntVar(lo, max(lo, bound), "peak")
        for t in range(w.k):
            const = w.base[t] // self.scale
            expr = []
            for size, x in terms[t]:
                if isinstance(x, int):
                    const += size * x
                else:
                    expr.append(size * x)
            m.Add(sum(expr) + const <= peak)
        m.Minimize(peak)
        return peak

    def hint(self, seq: Sequence[int]) -> None:
        """The current order of the window (slot ``u`` at step ``u``)."""
        w, m = self.w, self.m
        for u in range(w.k):
            for t, v in self.run[u].items():
                m.AddHint(v, int(t == seq[u]))
            for t, v in self.started[u].items():
                m.AddHint(v, int(t >= seq[u]))


def solve_window(g: IndexedProblem, order: Sequence[int], live: Sequence[int], a: int, b: int,
                 time_limit: float, bound: int | None = None, lower: int = 0, workers: int = 2) -> WindowResult:
    """Reorder positions ``[a, b)`` of ``order`` to minimise their peak, at most ``bound`` bytes.

    ``live`` is ``g.profile(order)``; ``lower`` is a known lower bound on the window's peak (the solver
    stops when it reaches it). The result's ``live`` replaces ``live[a:b]``; the rest of the
    profile is unchanged by construction.
    """
    t0 = time.perf_counter()
    w = Window(g, order, live, a, b)
    scale = 0
    for size, *_ in w.tensors:
        scale = math.gcd(scale, size)
    for x in w.base:
        scale = math.gcd(scale, x)
    scale = max(scale, 1)
    cur = max(w.live_of(range(w.k)))
    if bound is None:
        bound = cur
    md = _Model(w, scale)
    md.variables()
    md.one_step_per_op()
    md.one_op_per_step()
    md.precedence()
    terms = md.liveness()
    assert cur == max(live[a:b]), "window bookkeeping disagrees with the profile"
    if bound < max(lower, max(w.base)):
        return WindowResult("infeasible", None, None, None, time.perf_counter() - t0, 0)
    md.peak_bound(terms, bound // scale, -(-lower // scale))
    md.hint(list(range(w.k)))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = max(1, workers)
    solver.parameters.max_time_in_seconds = max(0.05, time_limit)
    solver.parameters.random_seed = 0
    st = solver.Solve(md.m)
    secs = time.perf_counter() - t0
    if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        slots = sorted(range(w.k), key=lambda u: next(t for t, v in md.run[u].items() if solver.Value(v)))
        wl = w.live_of(slots)
        return WindowResult("optimal" if st == cp_model.OPTIMAL else "feasible",
                            [w.ops[u] for u in slots], wl, max(wl), secs, md.booleans)
    return WindowResult("infeasible" if st == cp_model.INFEASIBLE else "unknown", None, None, None, secs,
                        md.booleans)
