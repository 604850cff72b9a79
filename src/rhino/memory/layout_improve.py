"""Improvement search for large layouts: squeaky-wheel greedy passes (numpy + ``layout_greedy``; no torch).

Formulation (squeaky-wheel optimisation, Joslin & Clements, JAIR 10, 1999). Each buffer ``i`` has a
priority ``pi_i``, at first ``s_i * life_i ** alpha`` (size, damped by lifetime: long-lived small
buffers come before short-lived ones of the same size). A pass places the buffers in decreasing
``pi`` (stable), each into the lowest gap at or above its floor that holds it among those placed
(``layout_greedy``, ``lowest``). After a pass with ends ``e_i`` and target ``T`` (the lower bound or the
capacity), every buffer with ``e_i > T`` (one that sits above the target: the "squeaky" ones) gets
``pi_i *= boost``, so the next pass places it earlier. The lowest layout of all passes is kept; the
search stops at the target or the deadline (a pass cut by the deadline is dropped). A pass whose order
starts like the previous one's keeps those buffers' offsets and places only the rest (``given``).

Measured on ``benchmarks/layout_scale.py``'s ``random-1`` (60,000 buffers, one leaf; gaps over the
max-load bound): one lowest-fit pass by size 3.95%, by ``s * life ** alpha`` 3.33% / 3.24% / 2.68% /
4.53% at ``alpha`` 0.1 / 0.2 / 0.3 / 0.5; squeaky wheel from ``alpha`` 0.3, boost 1.5: 1.74% after
9 passes (58 s at load ~10, 2 shared cores); ``rhino layout --time-limit 60``: 2.04% (load 14.5).
``wide-1``: 5.51% (the size pass alone 5.52%). Tried and not kept (``docs/benchmarks.md``): ruin and
recreate of time x address boxes at the peak, and orders grouped by the highest load over a lifetime.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .layout_greedy import place_in_order, time_index

__all__ = ["ImproveOptions", "squeaky_wheel"]


@dataclass(frozen=True)
class ImproveOptions:
    """Squeaky-wheel search (see the module docstring): ``alpha`` the lifetime exponent of the first
    priorities, ``boost`` the factor for a buffer above the target, ``max_passes`` a cap on passes
    (0: none); ``greedy_share``: of a leaf's time, the share that the greedy passes before the search may
    take (a pass past it stops; the first always finishes)."""
    enabled: bool = True
    greedy_share: float = 0.35
    alpha: float = 0.3
    boost: float = 1.5
    max_passes: int = 0


def squeaky_wheel(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray, target: int,
                  deadline: float, options: ImproveOptions = ImproveOptions(),
                  start: np.ndarray | None = None) -> tuple[np.ndarray | None, int, int]:
    """The lowest layout (offsets in input order) of the squeaky-wheel passes until ``deadline``
    (``time.monotonic``) or a height at most ``target``; ``start``: a layout to beat (kept when no pass
    is lower). Returns the offsets (None when no pass finished and no ``start``), their height and the
    number of passes finished."""
    lo, up, sz, al, floor = (np.ascontiguousarray(x, np.int64) for x in (lo, up, sz, al, floor))
    best = None if start is None else np.asarray(start, np.int64)
    best_h = int((best + sz).max(initial=0)) if best is not None else 0
    if len(sz) == 0 or (best is not None and best_h <= target):
        return best, best_h, 0
    ix = time_index(lo, up, sz)
    pri = sz * (up - lo).astype(np.float64) ** options.alpha
    prev_order = prev_off = None
    passes = 0
    while time.monotonic() < deadline and (options.max_passes <= 0 or passes < options.max_passes):
        order = np.argsort(-pri, kind="stable")
        given = None
        if prev_order is not None:  # the unchanged head of the order keeps its offsets
            diff = np.flatnonzero(order != prev_order)
            k = int(diff[0]) if diff.size else len(order)
            given = np.full(len(order), -1, np.int64)
            given[order[:k]] = prev_off[order[:k]]
        off = place_in_order(lo, up, sz, al, floor, order, deadline, lowest=True, given=given, index=ix)
        if off is None:
            break
        passes += 1
        end = off + sz
        h = int(end.max(initial=0))
        if best is None or h < best_h:
            best, best_h = off, h
        if best_h <= target:
            break
        pri[end > target] *= options.boost
        prev_order, prev_off = order, off
    return best, best_h, passes
