"""Peak split: a layout heuristic for mid-sized problems the exact search leaves open (numpy +
``layout_greedy``; no torch).

Formulation. Let ``t*`` be a time where the most bytes are live (the max-load bound ``L``). The buffers
live at ``t*`` pairwise overlap (a clique); every other buffer ends by ``t*`` (left) or starts after it
(right), and no left buffer overlaps a right one in time. So once the clique's offsets are fixed, the
left and right buffers are two independent layout problems around it. The clique is stacked in start
order, earliest at the bottom (lowest fit in that order: each one lands on those before it, or above
its floor); for the left side that stack is a floor: a left buffer overlaps exactly the clique buffers
that start before it ends, a prefix of the stack. Each side is then laid out by the lowest-fit
squeaky wheel (``layout_improve``'s rule: priorities ``log s_i + alpha log life_i``, ``+ log boost``
for a buffer that ends above the target), the side with the highest best top first, ``batch`` passes
at a time, until both are at or below the target or the deadline. The result is the clique plus each
side's best pass.

Why (``docs/benchmarks.md``, session 18): on windows of ``benchmarks/layout_scale.py``'s ``wide-3``
around its peak (1,412 / 2,129 / 2,925 buffers, lifetimes cut to the window), ``solve_layout``'s
portfolio (branch and bound and CP-SAT, 20 s) ended 1.695 / 3.474 / 4.731% above the bound and this
split 0.825 / 1.024 / 0.976% (20 s). It does not win everywhere: on ``random-7``'s peak window (1,022
buffers, long lifetimes) the branch and bound reached 0.093%, the split 4.185%. So
``layout.solve_layout`` splits the time of its first exact try at a capacity: the exact search gets
``1 - share`` of it and, where it comes back unanswered, the peak split the rest; the lower layout is kept
and the exact search goes on below it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .layout_greedy import place_in_order, time_index
from .layout_improve import ImproveOptions

__all__ = ["PeakOptions", "peak_split"]


@dataclass(frozen=True)
class PeakOptions:
    """When ``layout.solve_layout`` runs the peak split (module docstring): ``enabled``; ``min_buffers``:
    smaller problems are left to the exact search alone (MiniMalloc's instances, up to ~500 buffers,
    are settled by the branch and bound; ``docs/benchmarks.md``); ``share``: of the time of the first
    exact try at a capacity, the part the split gets after the exact search's part came back unanswered
    (the exact search then goes on; on ``wide-3``'s windows of 1,412 / 2,129 / 2,925 buffers, 20 s, 0.3
    gave 0.956 / 1.177 / 1.517% over the bound and 0.5 gave 0.956 / 1.039 / 1.242%); ``batch``: passes on
    one side before the sides are compared again (not tuned; a pass on those windows takes ~10 ms). The
    squeaky wheel's ``alpha``, ``boost`` and ``max_passes`` (per side) are ``ImproveOptions``'."""
    enabled: bool = True
    min_buffers: int = 600
    share: float = 0.5
    batch: int = 4
    improve: ImproveOptions = ImproveOptions()

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"PeakOptions.share is {self.share}; use a fraction in [0, 1]")
        if self.batch < 1:
            raise ValueError(f"PeakOptions.batch is {self.batch}; use at least 1")


def peak_time(lo: np.ndarray, up: np.ndarray, sz: np.ndarray) -> int:
    """The first time at which the most bytes are live."""
    times = np.unique(np.concatenate([lo, up]))
    d = np.zeros(len(times), np.int64)
    np.add.at(d, np.searchsorted(times, lo), sz)
    np.add.at(d, np.searchsorted(times, up), -sz)
    return int(times[int(np.argmax(np.cumsum(d)))])


class _Side:
    """One side's squeaky wheel: its buffers, priorities and best pass so far."""

    def __init__(self, idx: np.ndarray, pri: np.ndarray):
        self.idx, self.pri = idx, pri
        self.best: np.ndarray | None = None
        self.top = 0
        self.passes = 0


def peak_split(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray, target: int,
               deadline: float, options: PeakOptions = PeakOptions()) -> tuple[np.ndarray | None, int, int]:
    """Offsets (input order) by the peak split toward ``target`` until ``deadline`` (``time.monotonic``),
    their height and the passes run; None when the deadline came before every part had one pass."""
    lo, up, sz, al, floor = (np.ascontiguousarray(x, np.int64) for x in (lo, up, sz, al, floor))
    n = len(sz)
    if n == 0:
        return np.zeros(0, np.int64), 0, 0
    if time.monotonic() > deadline:  # (a pass of a staircase's 2,500-buffer side: 0.27 s; see below)
        return None, 0, 0
    t = peak_time(lo, up, sz)
    clique = np.flatnonzero((lo <= t) & (up > t))
    index = time_index(lo, up, sz)
    off = place_in_order(lo, up, sz, al, floor, clique[np.argsort(lo[clique], kind="stable")], deadline,
                         lowest=True, index=index)
    if off is None:
        return None, 0, 0
    imp = options.improve
    with np.errstate(divide="ignore"):  # empty buffers: -inf, placed last (at their floor, 0 bytes)
        pri = np.log(sz.astype(np.float64)) + imp.alpha * np.log((up - lo).astype(np.float64))
    sides = [_Side(s, pri[s].copy()) for s in (np.flatnonzero(up <= t), np.flatnonzero(lo > t)) if s.size]
    step = float(np.log(imp.boost))
    while True:
        todo = [s for s in sides if (s.best is None or s.top > target)
                and (imp.max_passes <= 0 or s.passes < imp.max_passes)]
        if not todo:
            break
        side = max(todo, key=lambda s: (s.best is None, s.top))  # a side without a pass first
        for _ in range(options.batch if imp.max_passes <= 0 else min(options.batch, imp.max_passes - side.passes)):
            # ``place_in_order`` looks at the clock only between chunks of 4,096 buffers, so a side below that
            # is one unchecked pass: the deadline is asked before each (a 5,000-buffer staircase, each buffer
            # live 1,000 steps: a batch of four 0.27 s passes after the deadline; wall 3.3-3.7 s at
            # ``--time-limit 2``)
            if time.monotonic() > deadline:
                break
            cand = place_in_order(lo, up, sz, al, floor, side.idx[np.argsort(-side.pri, kind="stable")], deadline,
                                  lowest=True, given=off, index=index)
            if cand is None:
                break
            side.passes += 1
            tops = cand[side.idx] + sz[side.idx]
            top = int(tops.max())
            if side.best is None or top < side.top:
                side.best, side.top = cand[side.idx], top
            if top <= target:
                break
            side.pri[tops > target] += step
        if time.monotonic() > deadline:
            break
    if any(s.best is None for s in sides):
        return None, 0, sum(s.passes for s in sides)
    for s in sides:
        off[s.idx] = s.best
    return off, int((off + sz).max(initial=0)), sum(s.passes for s in sides)
