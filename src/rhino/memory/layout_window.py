"""Window repair: lower the top of a valid layout by laying out again the buffers of one time window at a time
around all the others, fixed (pure numpy over ``layout_greedy``; no torch).

Formulation. A valid layout (offsets ``o_i``, floors ``f_i``, alignments ``a_i``) of height ``h`` above a
target ``T``. While ``h > T`` and time is left, with the goal ``G = max(T, h - step * T)``: the buffer
ending highest above ``G`` names a window: its lifetime widened by ``m`` steps on each side, then widened
again until it holds the whole lifetime of every buffer ending above ``G`` that it meets. The buffers whose lifetimes lie inside the window
("movable") are laid out again; every other buffer keeps its offset (``place_in_order``'s ``given``: an
obstacle wherever it is). Each pass places the movable buffers lowest fit (at or above their floors,
aligned) in decreasing priority; priorities start at the sizes and, after a pass, every movable buffer
ending above ``G`` gains ``s_i (1 + boost (e_i - G) / G)`` (a squeaky wheel inside the window). The
lowest pass replaces the movable buffers' offsets when its top is below theirs before, so the height
never rises. A window that does not reach ``G`` in ``passes`` passes is tried again with ``m`` doubled,
up to ``widen`` tries (``m`` starts at ``width`` times the median lifetime); a buffer whose windows all
fail, or whose window would move more than ``max_movable`` buffers, is left and the next one is taken.

Why (``benchmarks/layout_scale.py``'s ``hugebytes-1``, session 16): after the squeaky wheel and the
ejection chains its top is 1.495% above the bound, in four runs of time, three of them where at most
93% of the bound is live. Moving only the buffers above a line cannot fix it (the room above the line is
too small), but laying out a whole window again can. From that layout, in 8.4 s: 1.126% with the goal
``T`` itself (windows grow to hold every buffer above the bound), 1.003 / 0.816 / 0.672% with ``step``
0.002 / 0.005 / 0.01.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .layout_greedy import place_in_order

__all__ = ["WindowOptions", "window_repair", "windows_small"]


@dataclass(frozen=True)
class WindowOptions:
    """Window repair (module docstring). ``share``: of a large leaf's time, the part kept for it after the
    squeaky wheel and the ejection chains; ``width``, ``widen``, ``passes``, ``boost``, ``max_movable``:
    the window and its search; ``step``: how far below the height each goal is, as a fraction of the
    target. Values: ``hugebytes-1`` (width 2 is ~3,000 steps; step: module docstring)."""
    enabled: bool = True
    share: float = 0.15
    width: float = 2.0
    widen: int = 3
    passes: int = 300
    boost: float = 50.0
    max_movable: int = 4000
    step: float = 0.01

    def __post_init__(self) -> None:
        if not self.step > 0:
            raise ValueError(f"WindowOptions.step must be positive (a fraction of the target), got {self.step}")


def window_repair(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray,
                  offsets: np.ndarray, target: int, deadline: float,
                  options: WindowOptions = WindowOptions()) -> tuple[np.ndarray, int, int]:
    """A layout no higher than ``offsets`` (see the module docstring): (offsets, height, windows that
    reached their goal)."""
    off = np.array(offsets, np.int64)
    end = off + sz
    n = len(sz)
    if n == 0:
        return off, 0, 0
    margin = _margin(lo, up, options)
    left = np.ones(n, bool)  # buffers not yet given up on
    fixed = 0
    while time.monotonic() < deadline:
        h = int(end.max())
        goal = max(target, h - int(options.step * target))
        above = (end > goal) & left
        if h <= target or not above.any():
            break
        i = int(np.argmax(np.where(above, end, -1)))
        done = False
        for k in range(options.widen):
            tried = _window(i, margin << k, lo, up, sz, al, floor, off, end, goal, deadline, options)
            if tried is None:
                break
            if tried:
                done = True
                break
        if done:
            fixed += 1
        else:
            left[i] = False
    return off, int(end.max(initial=0)), fixed


def windows_small(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, options: WindowOptions = WindowOptions(),
                  samples: int = 64) -> bool:
    """Whether the repair can work here: the median, over the ``samples`` buffers of largest ``size x
    lifetime`` (those that end on top), of the buffers lying inside a first window around one (before any
    widening) is at most half of ``max_movable``. Long lifetimes among many (``random``: 11,780 in a
    window) or a dense plateau make the windows too large, and the time is better left to the search."""
    n = len(lo)
    if n == 0:
        return False
    margin = _margin(lo, up, options)
    pick = np.argsort(-(sz.astype(np.float64) * (up - lo)), kind="stable")[:samples]
    counts = [int(((lo >= lo[i] - margin) & (up <= up[i] + margin)).sum()) for i in pick.tolist()]
    return float(np.median(counts)) <= options.max_movable / 2


def _margin(lo: np.ndarray, up: np.ndarray, options: WindowOptions) -> int:
    """A first window's margin on each side: ``width`` median lifetimes (at least one step)."""
    return max(1, int(options.width * float(np.median(up - lo))))


def _window(i: int, margin: int, lo, up, sz, al, floor, off, end, target: int, deadline: float,
            options: WindowOptions) -> bool | None:
    """One window around buffer ``i`` (``off`` and ``end`` updated in place when it is lower): whether its
    movable buffers now end at most at ``target``; None when it would move more than ``max_movable``."""
    a, b = int(lo[i]) - margin, int(up[i]) + margin
    while True:  # widen until the window holds every buffer above the target that it meets
        over = np.flatnonzero((lo < b) & (up > a) & (end > target))
        na, nb = min(a, int(lo[over].min()) - margin), max(b, int(up[over].max()) + margin)
        if (na, nb) == (a, b):
            break
        a, b = na, nb
    sub = np.flatnonzero((lo < b) & (up > a))
    mov = (lo[sub] >= a) & (up[sub] <= b)
    if mov.sum() > options.max_movable:
        return None
    l, u, z, al_s, fl = lo[sub], up[sub], sz[sub], al[sub], floor[sub]
    given = np.where(mov, -1, off[sub])
    before = int(end[sub[mov]].max())
    pri = z.astype(np.float64)
    best, best_h = None, before
    for _ in range(options.passes):
        if time.monotonic() > deadline:
            break
        order = np.argsort(-pri, kind="stable")
        o = place_in_order(l, u, z, al_s, fl, order[mov[order]], lowest=True, given=given)
        e = o + z
        h = int(e[mov].max())
        if h < best_h:
            best, best_h = o, h
        if h <= target:
            break
        hot = mov & (e > target)
        pri[hot] += z[hot] * (1.0 + options.boost * (e[hot] - target) / max(target, 1))
    if best is not None:
        off[sub[mov]] = best[mov]
        end[sub[mov]] = best[mov] + z[mov]
    return best_h <= target
