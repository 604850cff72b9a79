"""Axis-wise descent: the ILP of ``ilp.py`` solved one mesh axis at a time.

The joint ILP over all axes has a candidate per combination of per-axis entries (49 for a matmul on
two axes); CP-SAT closes its gap slowly. A *step* on axis ``a`` keeps every cone's entries on the
other axes as they are and lets only axis ``a`` vary; state cones (inputs and optimizer updates: their
sharding decides what ZeRO does) stay free on all axes. Each step is the same model restricted by
``allowed``, small enough to solve to optimality in a second or two, and never worse than where it
started (the start is a feasible hint of the restricted model).

Memory is a penalty in the steps (``soft_memory``): a start that does not fit is still a point to
descend from; the result says by how many bytes the checked nodes are over capacity, summed.

``descend``: from ``start`` (O1's plan in O2; all-replicated by default), a step per axis, outer axis
first, for ``rounds`` rounds or until a round changes nothing; the score is lexicographic (bytes over
capacity, model step time).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .coarsen import ConeKind
from .ilp import Solution, memory_excess, objective_of, solve_ilp
from .problem import Problem

__all__ = ["Descent", "descend", "axis_allowed", "score"]

#: Cones whose choice is a state sharding (``Problem.kinds`` holds ``ConeKind`` values).
STATE_KINDS = (ConeKind.INPUT, ConeKind.OPTIMIZER)


@dataclass
class Descent:
    choice: list[int]
    objective: float               # model step time (seconds)
    over: int                      # bytes over capacity at the worst checked node (0: fits the rows)
    steps: list[dict] = field(default_factory=list)   # per step: axis, status, objective, seconds


def score(p: Problem, choice: list[int]) -> tuple[float, float]:
    """(bytes over capacity summed over the memory rows, model step time): what the descent minimises,
    lexicographically."""
    return float(memory_excess(p, choice)), objective_of(p, choice)["T"]


def axis_allowed(p: Problem, cur: list[int], axis: int, free_state: bool = True) -> dict[int, list[int]]:
    """Candidates of each class that agree with ``cur`` on every axis but ``axis`` (state cones: all)."""
    out: dict[int, list[int]] = {}
    for k, keys in enumerate(p.axis_keys):
        if free_state and p.kinds and p.kinds[k] in STATE_KINDS:
            continue
        ck = keys[cur[k]]
        ok = [c for c, key in enumerate(keys) if all(key[b] == ck[b] for b in range(len(ck)) if b != axis)]
        if len(ok) < len(keys):
            out[k] = ok
    return out


def descend(p: Problem, *, start: list[int] | None = None, axes: list[int] | None = None, rounds: int = 2,
            step_time_limit: float = 5.0, deadline: float | None = None, workers: int = 2) -> Descent:
    """Axis-wise descent (module docstring) from ``start`` (all-replicated by default)."""
    cur = list(start) if start is not None else [0] * len(p.n_cands)
    ndim = len(p.axis_keys[0][0]) if p.axis_keys and p.axis_keys[0] else 1
    axes = list(range(ndim)) if axes is None else axes
    best = score(p, cur)
    steps: list[dict] = []
    for _ in range(rounds):
        changed = False
        for a in axes:
            left = step_time_limit if deadline is None else min(step_time_limit, deadline - time.perf_counter())
            if left <= 0.05:
                break
            sol: Solution = solve_ilp(p, time_limit=left, workers=workers, hint=cur,
                                      allowed=axis_allowed(p, cur, a), soft_memory=True)
            steps.append({"axis": a, "status": sol.status, "objective": sol.objective, "seconds": sol.seconds})
            if not sol.choice:
                continue
            new = score(p, sol.choice)
            if new < best:
                changed = changed or sol.choice != cur
                cur, best = sol.choice, new
        if not changed:
            break
    return Descent(cur, best[1], int(best[0]), steps)
