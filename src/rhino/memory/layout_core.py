"""Core window: lay out the buffers around a leaf's full steps with the exact search, the others greedily around
them (numpy over ``layout_greedy``; no torch).

Formulation. A leaf (lifetimes ``[l_i, u_i)``, sizes ``s_i``, alignments, floors ``f_i``) and a target ``T``.
The pressure at step ``t`` is the bytes live at ``t`` plus the highest floor among the buffers live there, ``P``
its maximum; a step is hot when its pressure is at least ``(1 - hot) * P``. The window ``[a, b)`` runs from
``margin`` steps before the first hot step to ``margin`` steps after the last; the buffers live in it are the
core, their lifetimes clipped to it (two buffers that overlap overlap inside the window too, or lie on
opposite sides of it: the clipped problem's layouts are valid for the real lifetimes). The core is laid out by
``solve`` (the caller's exact search, towards ``T``, on the floors); its offsets are then fixed and every other
buffer is placed lowest fit around them (``place_in_order``'s ``given``) by the squeaky wheel
(``layout_improve``'s first priorities ``s_i * life_i ** alpha``, times ``boost`` for a buffer that ends above
``max(T, core height)``), until it ends there or its time is up. Margins ``margins x`` the median lifetime are
tried in turn, each with an equal part of the time left (a core above ``max_core`` buffers is not tried), until
one reaches ``T`` or its core alone ends above ``T`` (a wider window holds more); the lowest valid layout is kept.

Applies only where a single window holds every hot step with at most ``max_core`` buffers: a few full steps
close together, where the arena is full only briefly (``benchmarks/layout_scale.py``'s ``realloc`` shape: arrays
reallocated at twice their size, a peak at a reallocation). There the squeaky wheel leaves holes at the peak
(``realloc-2``: one of 2.1% of the bound) that an exact layout of the few hundred buffers around it does not,
and outside the window the load is low enough (``realloc-2``: at most 92% of the bound) for a greedy fill.
Where the full steps spread over the whole leaf (the ``random`` shape) no window applies and nothing is spent.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .layout_greedy import place_in_order, time_index
from .layout_improve import step_pressure

__all__ = ["CoreOptions", "core_window", "hot_window"]

# ``solve(lo, up, sz, al, floor, target, deadline)``: offsets (input order) of a layout of the clipped core, or
# None when none was found in time
CoreSolver = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, float], np.ndarray | None]


@dataclass(frozen=True)
class CoreOptions:
    """Core window (module docstring): ``hot`` the pressure band of the hot steps (a fraction of the highest);
    ``margins`` the windows tried, in median lifetimes on each side of the hot steps; ``max_core`` the most
    buffers in a core (the exact search's range); ``share`` of a large leaf's search time, the most it takes;
    ``solve_share`` of each try's time, the core's part (the rest: the fill); ``alpha``/``boost`` the fill's
    squeaky wheel. Values: measured on ``realloc-2`` and ``realloc-6`` (whole traces, hot 0.04: their hot steps
    span 71 and 38 steps; margins 0.1 / 0.25 of the median lifetime left holes where the window's edge met the
    fill (4-10% over the bound), 0.5 / 0.75 laid them out at 0.662% / 0.000%); ``max_core``: ``realloc-6``'s
    highest leaf (floors from the split widen its hot steps to 806) has a first core of 925 buffers (0.262%)."""
    enabled: bool = True
    hot: float = 0.04
    margins: tuple[float, ...] = (0.5, 0.75, 1.0)
    max_core: int = 1200
    share: float = 0.35
    solve_share: float = 0.6
    alpha: float = 0.3
    boost: float = 1.5

    def __post_init__(self) -> None:
        if not 0 < self.hot < 1:
            raise ValueError(f"CoreOptions.hot must be in (0, 1), got {self.hot}")


def hot_window(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, floor: np.ndarray, hot: float) -> tuple[int, int]:
    """The first hot step and one past the last (module docstring)."""
    times, pressure = step_pressure(*(np.ascontiguousarray(x, np.int64) for x in (lo, up, sz, floor)))
    steps = np.flatnonzero(pressure >= (1.0 - hot) * pressure.max())
    return int(times[steps[0]]), int(times[steps[-1] + 1])


def core_window(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray, target: int,
                deadline: float, options: CoreOptions, solve: CoreSolver,
                say: Callable[[str], None] = lambda m: None) -> tuple[np.ndarray | None, int]:
    """The lowest valid layout of the tries (module docstring), with its height; (None, 0) where no window
    applies or no try finished."""
    n = len(sz)
    if n == 0 or not options.enabled:
        return None, 0
    first, last = hot_window(lo, up, sz, floor, options.hot)
    life = max(1, int(np.median(up - lo)))
    tries = []
    for m in options.margins:
        a, b = first - int(m * life), last + int(m * life)
        core = np.flatnonzero((lo < b) & (up > a))
        if len(core) > options.max_core:
            break
        if len(core) < n and (not tries or len(core) > len(tries[-1][2])):
            tries.append((a, b, core))
    if not tries:
        return None, 0
    best, best_h = None, 0
    ix = time_index(lo, up, sz)
    for k, (a, b, core) in enumerate(tries):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        end = time.monotonic() + left / (len(tries) - k)
        offs = solve(np.maximum(lo[core], a), np.minimum(up[core], b), sz[core], al[core], floor[core], target,
                     time.monotonic() + options.solve_share * (end - time.monotonic()))
        if offs is None:
            continue
        given = np.full(n, -1, np.int64)
        given[core] = offs
        core_h = int((offs + sz[core]).max(initial=0))
        off, h = _fill(lo, up, sz, al, floor, given, max(target, core_h), end, options, ix)
        say(f"layout: core window of {len(core):,} buffers ({b - a:,} steps): {h:,}" if off is not None else
            f"layout: core window of {len(core):,} buffers ({b - a:,} steps): no fill in time")
        if off is not None and (best is None or h < best_h):
            best, best_h = off, h
        if (best is not None and best_h <= target) or core_h > target:  # a wider core holds more: no easier
            break
    return best, best_h


def _fill(lo, up, sz, al, floor, given: np.ndarray, goal: int, deadline: float, options: CoreOptions,
          ix) -> tuple[np.ndarray | None, int]:
    """The squeaky-wheel fill around the fixed core (``given``): its lowest pass, or None if none finished."""
    rest = np.flatnonzero(given < 0)
    pri = sz.astype(np.float64) * np.maximum(up - lo, 1).astype(np.float64) ** options.alpha
    best, best_h = None, 0
    while time.monotonic() < deadline:
        order = rest[np.argsort(-pri[rest], kind="stable")]
        off = place_in_order(lo, up, sz, al, floor, order, lowest=True, given=given, index=ix, deadline=deadline)
        if off is None:
            break
        end = off + sz
        h = int(end.max(initial=0))
        if best is None or h < best_h:
            best, best_h = off, h
        if h <= goal:
            break
        pri[end > goal] *= options.boost
    return best, best_h
