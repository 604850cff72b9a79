"""Fast evaluation and local search on a ``Problem`` (pure Python, no solver).

``Evaluator`` keeps the cost buckets of ``ilp`` (compute; blocking, gradient, prefetch and state
communication) and the memory rows for one choice, and prices changing one class's candidate by
updating only what touches that class. The score is lexicographic: first the bytes by which the
memory rows are over capacity (summed, so every row that improves counts), then the model's step time (``ilp.objective_of``).

``improve`` is iterated conditional modes: classes in program order each take their best candidate
given all the others, until a sweep changes nothing. ``local_search`` runs it twice: for time alone,
then with memory first (what was fastest is then made to fit at the least cost). ``seed_data_parallel`` starts from the batch
split on every axis it divides, which makes the program-order sweep a propagation of data
parallelism (the rule "data parallel first").
"""
from __future__ import annotations

from ..sharding.placement import Shard
from .ilp import HIDDEN_COMM_WEIGHT, row_bytes
from .coarsen import ConeKind
from .problem import KINDS, Problem, copy_bytes

__all__ = ["Evaluator", "improve", "local_search", "propagate", "seed_data_parallel", "term_cost"]

_BUCKETS = ("cf", "cb", "co", *KINDS)


def term_cost(term, choice: list[int]) -> float:
    """Seconds of one term under ``choice`` (each needed sharding paid once), times its multiplicity."""
    cost = term.cost[term.sigma[choice[term.producer]]]
    taus = set(term.fixed)
    for uc, need in term.uses:
        taus.update(need[choice[uc]])
    return term.mult * sum([cost[t] for t in taus])    # a list: same order and sum, no generator


def step_of(b: dict[str, float]) -> float:
    return max(b["cf"] + b["cb"] + b["co"] + b["blocking"] + b["gradient"] + b["state"],
               b["blocking"] + b["gradient"] + b["prefetch"] + b["state"]) + HIDDEN_COMM_WEIGHT * b["prefetch"]


class Evaluator:
    def __init__(self, p: Problem, choice: list[int], ignore_memory: bool = False) -> None:
        self.p = p
        self.ignore_memory = ignore_memory
        self.choice = list(choice)
        self.inc: list[list[int]] = [[] for _ in p.n_cands]
        for i, term in enumerate(p.terms):
            classes = {term.producer} | {uc for uc, _ in term.uses}
            for k in classes:
                self.inc[k].append(i)
        self.rows_of: list[list[int]] = [[] for _ in p.n_cands]
        self.copies_of: list[list[tuple[int, int]]] = [[] for _ in p.n_cands]   # (row, copy index)
        for r, row in enumerate(p.memory):
            for k in row.coef:
                self.rows_of[k].append(r)
            for j, ct in enumerate(row.copies):
                for k in {ct.producer} | {uc for uc, _ in ct.before} | {uc for uc, _ in ct.after}:
                    self.copies_of[k].append((r, j))
        self.tc = [term_cost(t, self.choice) for t in p.terms]
        self.b = {k: 0.0 for k in _BUCKETS}
        for k, c in enumerate(self.choice):
            for name, v in self._unary(k, c):
                self.b[name] += v
        for t, cost in zip(p.terms, self.tc):
            self.b[t.kind] += cost
        self.rows = [row_bytes(row, self.choice) for row in p.memory]
        self.cb = {(r, j): copy_bytes(ct, self.choice) for r, row in enumerate(p.memory)
                   for j, ct in enumerate(row.copies)}

    def _unary(self, k: int, c: int):
        m = self.p.mult[k]
        f, bw, o = self.p.compute[k][c]
        yield "cf", f * m
        yield "cb", bw * m
        yield "co", o * m
        for kind, v in self.p.comm[k][c].items():
            yield kind, v * m

    def _swap(self, b: dict[str, float], k: int, old: int, c: int) -> None:
        """``b`` with class ``k``'s unary terms moved from ``old`` to ``c`` (inlined ``_unary``: the same
        operations in the same order, so the same floats)."""
        m = self.p.mult[k]
        compute, comm = self.p.compute[k], self.p.comm[k]
        f, bw, o = compute[old]
        b["cf"] -= f * m
        b["cb"] -= bw * m
        b["co"] -= o * m
        for kind, v in comm[old].items():
            b[kind] -= v * m
        f, bw, o = compute[c]
        b["cf"] += f * m
        b["cb"] += bw * m
        b["co"] += o * m
        for kind, v in comm[c].items():
            b[kind] += v * m

    def score(self) -> tuple[float, float]:
        if self.ignore_memory:
            return (0.0, step_of(self.b))
        return (float(sum(max(0, r - self.p.capacity) for r in self.rows)), step_of(self.b))

    def try_(self, k: int, c: int) -> tuple[float, float]:
        """The score if class ``k`` took candidate ``c`` (nothing changes)."""
        old = self.choice[k]
        if c == old:
            return self.score()
        b = dict(self.b)
        self._swap(b, k, old, c)
        self.choice[k] = c
        terms, tc, choice = self.p.terms, self.tc, self.choice
        for i in self.inc[k]:
            t = terms[i]
            b[t.kind] += term_cost(t, choice) - tc[i]
        if self.ignore_memory:
            self.choice[k] = old
            return (0.0, step_of(b))
        rows = self._rows_if(k, old, c)
        self.choice[k] = old
        over = float(sum(max(0, r - self.p.capacity) for r in rows))
        return (over, step_of(b))

    def _rows_if(self, k: int, old: int, c: int) -> list[int]:
        """Row totals with class ``k`` at ``c`` (``self.choice[k]`` must already be ``c``)."""
        rows = list(self.rows)
        for r in self.rows_of[k]:
            coefs = self.p.memory[r].coef[k]
            rows[r] += coefs[c] - coefs[old]
        for r, j in self.copies_of[k]:
            rows[r] += copy_bytes(self.p.memory[r].copies[j], self.choice) - self.cb[r, j]
        return rows

    def set(self, k: int, c: int) -> None:
        old = self.choice[k]
        if c == old:
            return
        self._swap(self.b, k, old, c)
        self.choice[k] = c
        for i in self.inc[k]:
            t = self.p.terms[i]
            new = term_cost(t, self.choice)
            self.b[t.kind] += new - self.tc[i]
            self.tc[i] = new
        for r in self.rows_of[k]:
            coefs = self.p.memory[r].coef[k]
            self.rows[r] += coefs[c] - coefs[old]
        for r, j in self.copies_of[k]:
            new = copy_bytes(self.p.memory[r].copies[j], self.choice)
            self.rows[r] += new - self.cb[r, j]
            self.cb[r, j] = new


def improve(p: Problem, start: list[int], *, order: list[int] | None = None, sweeps: int = 4,
            allowed: dict[int, list[int]] | None = None, ignore_memory: bool = False
            ) -> tuple[list[int], tuple[float, float]]:
    """Iterated conditional modes from ``start`` (module docstring); ``ignore_memory``: time only."""
    ev = Evaluator(p, start, ignore_memory)
    order = order if order is not None else list(range(len(p.n_cands)))
    for _ in range(sweeps):
        changed = False
        for k in order:
            cands = allowed.get(k, range(p.n_cands[k])) if allowed else range(p.n_cands[k])
            best_c, best = ev.choice[k], ev.score()
            for c in cands:
                s = ev.try_(k, c)
                if s < best:
                    best_c, best = c, s
            if best_c != ev.choice[k]:
                ev.set(k, best_c)
                changed = True
        if not changed:
            break
    return ev.choice, ev.score()


def seed_data_parallel(p: Problem, batch_classes: list[int], shardings: list[list]) -> list[int]:
    """All replicated, except the batch inputs: split on their first dim along as many axes as divide it
    (``shardings[k][c]`` is the sharding of candidate ``c`` of class ``k``)."""
    choice = [0] * len(p.n_cands)
    for k in batch_classes:
        best, best_n = 0, 0
        for c, sh in enumerate(shardings[k]):
            n = sum(1 for x in sh if isinstance(x, Shard) and x.dim == 0)
            if n > best_n and all(isinstance(x, Shard) and x.dim == 0 for x in sh if not _is_rep(x)):
                best, best_n = c, n
        choice[k] = best
    return choice


def _is_rep(x) -> bool:
    return type(x).__name__ == "Replicate"


def propagate(p: Problem, seed: list[int], frozen: list[int], order: list[int], follow: bool = False) -> list[int]:
    """Greedy propagation (one pass): classes in ``order`` each take the candidate that is cheapest
    given the classes already visited -- their own time plus the redistributions on values shared
    with visited classes -- ignoring the classes not visited yet (they adapt when their turn comes).
    Graph inputs other than the batch are visited lazily, after their first consumer, so a weight
    takes the sharding its matmul wants. Memory is ignored (``local_search`` repairs it).
    ``follow``: the redistributions first, then the time (lexicographically), counting a value's
    redistributions for the uses placed so far as soon as its producer is placed: each class takes its
    inputs as they arrive wherever a candidate can, so the seed's splits propagate as far as they go."""
    choice = list(seed)
    visited = set(frozen)
    consumers: dict[int, set[int]] = {}
    inc: list[list[int]] = [[] for _ in p.n_cands]
    for i, term in enumerate(p.terms):
        for k in {term.producer} | {uc for uc, _ in term.uses}:
            inc[k].append(i)
        for uc, _ in term.uses:
            consumers.setdefault(term.producer, set()).add(uc)
    lazy = {k for k in range(len(p.n_cands)) if p.kinds and p.kinds[k] == ConeKind.INPUT and k not in frozen}
    waiting: dict[int, list[int]] = {}
    seq: list[int] = []
    for k in order:
        if k in lazy and consumers.get(k):
            continue
        seq.append(k)
    for k in lazy:
        if consumers.get(k):
            first = min(consumers[k], key=lambda c: seq.index(c) if c in seq else len(seq))
            waiting.setdefault(first, []).append(k)
    full: list[int] = []
    for k in seq:
        full.append(k)
        full += waiting.get(k, [])
    for k in full:
        if k in visited:
            continue
        m = p.mult[k]
        best_c, best = choice[k], None
        for c in range(p.n_cands[k]):
            f, bw, o = p.compute[k][c]
            own = m * (f + bw + o + sum(p.comm[k][c].values()))
            cost = 0.0
            choice[k] = c
            for i in inc[k]:
                term = p.terms[i]
                involved = {term.producer} | {uc for uc, _ in term.uses}
                # following: a value is priced as soon as its producer is placed, for the uses placed
                if (term.producer == k or term.producer in visited) if follow else \
                        all(j == k or j in visited for j in involved):
                    sig = term.sigma[choice[term.producer]]
                    taus = set(term.fixed)
                    for uc, need in term.uses:
                        if uc == k or uc in visited:
                            taus.update(need[choice[uc]])
                    cost += term.mult * sum(term.cost[sig][t] for t in taus)
            key = (cost, own) if follow else (cost + own, 0.0)
            if best is None or key < best:
                best_c, best = c, key
        choice[k] = best_c
        visited.add(k)
    return choice


def local_search(p: Problem, start: list[int], order: list[int] | None = None, frozen: list[int] = (),
                 follow: bool = False) -> tuple[list[int], tuple[float, float]]:
    """``propagate`` from ``start`` (the ``frozen`` classes kept; ``follow`` as there), then ``improve``
    for time alone, then for (memory over capacity, time)."""
    order = order if order is not None else list(range(len(p.n_cands)))
    choice = propagate(p, start, list(frozen), order, follow)
    choice, sc = improve(p, choice, order=order, ignore_memory=True)
    ev = Evaluator(p, choice)
    if ev.score()[0] <= 0:
        return choice, ev.score()
    return improve(p, choice, order=order)
