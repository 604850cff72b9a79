"""Memory layout for fixed lifetimes: an offset per buffer in one arena (pure Python + OR-Tools).

Problem: buffers ``i`` with half-open lifetimes ``[lower_i, upper_i)``, sizes ``s_i`` and alignments
``a_i``. Find offsets ``o_i`` (multiples of ``a_i``, ``o_i >= 0``) such that two buffers that are live
at the same time do not overlap in address: ``o_i + s_i <= o_j or o_j + s_j <= o_i``. Objective: the
height ``max_i o_i + s_i`` (minimised), or, with a capacity ``C``, any layout with height <= C.

Solvers (``solve_layout``):

1. Greedy best-fit in several orders (``GreedyOrder``): buffers are placed one by one, each at the
   lowest-waste gap among the buffers already placed that overlap it in time (XLA's and TFLite's
   greedy-by-size is ``SIZE``; ROAM's "long-lived first" baseline is ``LONG_LIVED_FIRST``).
2. Exact: CP-SAT with ``AddNoOverlap2D`` over (time, address) rectangles whose time intervals are
   fixed; variables ``k_i`` with ``o_i = a_i k_i``; constraint ``height >= o_i + s_i``; objective
   ``min height`` (or ``height <= C``), hinted with the best greedy layout, under a time limit.
   Without the time to prove anything the best layout found so far is returned (never nothing).

``lower_bound``: the most bytes live at one time; a height equal to it is optimal.
``validate_layout`` is the independent checker every result goes through.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Hashable, Sequence

__all__ = ["Buffer", "GreedyOrder", "LayoutStatus", "LayoutResult", "validate_layout", "lower_bound", "height",
           "greedy_layout", "solve_layout"]


@dataclass(frozen=True)
class Buffer:
    id: Hashable
    lower: int
    upper: int      # exclusive
    size: int
    alignment: int = 1

    def __post_init__(self) -> None:
        if self.upper <= self.lower:
            raise ValueError(f"buffer {self.id}: upper ({self.upper}) must be greater than lower ({self.lower})")
        if self.size < 0:
            raise ValueError(f"buffer {self.id}: size must be >= 0, got {self.size}")
        if self.alignment < 1:
            raise ValueError(f"buffer {self.id}: alignment must be >= 1, got {self.alignment}")


class GreedyOrder(str, Enum):
    SIZE = "size"                          # largest first (XLA / TFLite greedy-by-size)
    LONG_LIVED_FIRST = "long_lived_first"  # longest lifetime first (ROAM's heuristic baseline)
    AREA = "area"                          # largest size x lifetime first
    START = "start"                        # by start time (an allocator's view, first-fit in time)


class LayoutStatus(str, Enum):
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    UNKNOWN = "unknown"


@dataclass
class LayoutResult:
    status: LayoutStatus
    offsets: dict
    height: int
    lower_bound: int
    seconds: float
    solver: str
    notes: list[str] = field(default_factory=list)


def height(buffers: Sequence[Buffer], offsets: dict) -> int:
    return max((offsets[b.id] + b.size for b in buffers), default=0)


def lower_bound(buffers: Sequence[Buffer]) -> int:
    """The most bytes live at one time (no layout can be lower)."""
    events = sorted([(b.lower, b.size) for b in buffers] + [(b.upper, -b.size) for b in buffers],
                    key=lambda e: (e[0], e[1]))  # frees before allocations at equal times
    live = best = 0
    for _, d in events:
        live += d
        best = max(best, live)
    return best


def validate_layout(buffers: Sequence[Buffer], offsets: dict, capacity: int | None = None) -> list[str]:
    """Every violation: a missing, negative or misaligned offset, a buffer above the capacity, and
    every pair of buffers overlapping in both time and address. Empty when the layout is valid."""
    errors = []
    ok = []
    for b in buffers:
        o = offsets.get(b.id)
        if o is None:
            errors.append(f"buffer {b.id} has no offset")
            continue
        if o < 0:
            errors.append(f"buffer {b.id} has a negative offset {o}")
        if o % b.alignment:
            errors.append(f"buffer {b.id} offset {o} is not a multiple of its alignment {b.alignment}")
        if capacity is not None and o + b.size > capacity:
            errors.append(f"buffer {b.id} ends at {o + b.size}, above the capacity {capacity}")
        if b.size:
            ok.append(b)
    ok.sort(key=lambda b: b.lower)
    active: list[tuple[int, Buffer]] = []   # (upper, buffer), buffers still live
    for b in ok:
        active = [(u, a) for u, a in active if u > b.lower]
        ob = offsets[b.id]
        for _, a in active:
            oa = offsets[a.id]
            if ob < oa + a.size and oa < ob + b.size:
                errors.append(f"buffers {a.id} [{a.lower},{a.upper}) @ {oa}+{a.size} and {b.id} "
                              f"[{b.lower},{b.upper}) @ {ob}+{b.size} overlap in time and address")
        active.append((b.upper, b))
    return errors


def _key(order: GreedyOrder) -> Callable[[Buffer], tuple]:
    if order is GreedyOrder.SIZE:
        return lambda b: (-b.size, b.lower - b.upper, b.lower)
    if order is GreedyOrder.LONG_LIVED_FIRST:
        return lambda b: (b.lower - b.upper, -b.size, b.lower)
    if order is GreedyOrder.AREA:
        return lambda b: (-b.size * (b.upper - b.lower), -b.size, b.lower)
    return lambda b: (b.lower, -b.size)


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def greedy_layout(buffers: Sequence[Buffer], order: GreedyOrder | str = GreedyOrder.SIZE) -> dict:
    """Best-fit placement in ``order``: each buffer goes into the smallest gap (between buffers already
    placed that overlap it in time) that holds it, else on top of them."""
    order = GreedyOrder(order)
    placed: list[tuple[int, int, int, int]] = []   # (lower, upper, offset, end) of placed buffers
    offsets: dict = {}
    for b in sorted(buffers, key=_key(order)):
        if b.size == 0:
            offsets[b.id] = 0
            continue
        busy = sorted((o, e) for lo, up, o, e in placed if lo < b.upper and b.lower < up)
        best, best_waste, x = None, None, 0
        for o, e in busy:
            start = _align(x, b.alignment)
            if o - start >= b.size:
                waste = o - start - b.size
                if best_waste is None or waste < best_waste:
                    best, best_waste = start, waste
            x = max(x, e)
        if best is None:
            best = _align(x, b.alignment)
        offsets[b.id] = best
        placed.append((b.lower, b.upper, best, best + b.size))
    return offsets


def _best_greedy(buffers: Sequence[Buffer]) -> tuple[dict, int, str]:
    best = None
    for order in GreedyOrder:
        offs = greedy_layout(buffers, order)
        h = height(buffers, offs)
        if best is None or h < best[1]:
            best = (offs, h, order.value)
    assert best is not None
    return best


def _cpsat(buffers: Sequence[Buffer], bound: int, capacity: int | None, hint: dict, time_limit: float,
           progress) -> tuple[str, dict | None]:
    """CP-SAT over the non-empty buffers: (status name, offsets or None)."""
    from ortools.sat.python import cp_model
    live = [b for b in buffers if b.size]
    top = capacity if capacity is not None else bound
    m = cp_model.CpModel()
    hvar = m.NewIntVar(0, top, "height")
    xs, ys, ks = [], [], {}
    for b in live:
        k = m.NewIntVar(0, max(0, (top - b.size) // b.alignment), f"k{b.id}")
        ks[b.id] = k
        start = k * b.alignment if b.alignment > 1 else k
        xs.append(m.NewIntervalVar(b.lower, b.upper - b.lower, b.upper, f"t{b.id}"))
        ys.append(m.NewIntervalVar(start, b.size, start + b.size, f"a{b.id}"))
        m.Add(hvar >= start + b.size)
        if b.id in hint:
            m.AddHint(k, hint[b.id] // b.alignment)
    m.AddNoOverlap2D(xs, ys)
    if capacity is None:
        m.Minimize(hvar)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit)
    solver.parameters.num_workers = 2
    st = solver.Solve(m)
    name = solver.StatusName(st)
    if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        offs = {b.id: solver.Value(ks[b.id]) * b.alignment for b in live}
        offs.update({b.id: 0 for b in buffers if not b.size})
        return name, offs
    return name, None


def solve_layout(buffers: Sequence[Buffer], capacity: int | None = None, time_limit: float = 60.0,
                 progress: Callable[[str], None] | None = None, exact: bool = True) -> LayoutResult:
    """The lowest layout found within ``time_limit`` (see the module docstring); with ``capacity``, one
    that fits if any is found. The result is always a valid layout (checked)."""
    t0 = time.perf_counter()
    say = progress or (lambda m: None)
    ids = [b.id for b in buffers]
    if len(set(ids)) != len(ids):
        raise ValueError("buffer ids must be unique")
    lb = lower_bound(buffers)
    offsets, h, how = _best_greedy(buffers)
    say(f"layout: greedy {h:,} ({how}), lower bound {lb:,}")
    status = LayoutStatus.OPTIMAL if h == lb else LayoutStatus.FEASIBLE
    solver = f"greedy/{how}"
    if capacity is not None and lb > capacity:
        status = LayoutStatus.INFEASIBLE
    elif status is not LayoutStatus.OPTIMAL and (capacity is None or h > capacity) and exact:
        left = time_limit - (time.perf_counter() - t0)
        if left > 0.05:
            say(f"layout: CP-SAT no-overlap-2D for up to {left:.0f}s")
            name, offs = _cpsat(buffers, h, capacity, offsets, left, say)
            if offs is not None and not validate_layout(buffers, offs, capacity):
                h2 = height(buffers, offs)
                if h2 <= h:
                    offsets, h, solver = offs, h2, "cp-sat"
                    status = LayoutStatus.OPTIMAL if name == "OPTIMAL" or h == lb else LayoutStatus.FEASIBLE
            elif name == "INFEASIBLE":
                status = LayoutStatus.INFEASIBLE if capacity is not None else status
            say(f"layout: CP-SAT {name.lower()}, height {h:,}")
    if capacity is not None and status in (LayoutStatus.OPTIMAL, LayoutStatus.FEASIBLE) and h > capacity:
        status = LayoutStatus.UNKNOWN
    errors = validate_layout(buffers, offsets)
    assert not errors, errors[:3]
    return LayoutResult(status, offsets, h, lb, time.perf_counter() - t0, solver)
