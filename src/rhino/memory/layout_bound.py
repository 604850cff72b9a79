"""Lower bounds of a layout's height from the buffers' arrays (numpy; no torch): the bytes live at one time,
and what alignments larger than sizes add to them."""
from __future__ import annotations

import numpy as np

__all__ = ["max_load", "aligned_bound"]


def max_load(lo: np.ndarray, up: np.ndarray, sz: np.ndarray) -> int:
    """The most bytes live at one time (half-open lifetimes): no layout is lower."""
    if not len(sz):
        return 0
    t = np.concatenate([up, lo])
    d = np.concatenate([-sz, sz]).astype(np.int64)
    # frees before allocations at equal times (a stable sort of the frees first: 1,000,000 buffers 0.35 s,
    # against 0.5 s for a lexsort)
    live = np.cumsum(d[np.argsort(t, kind="stable")])
    return max(0, int(live.max()))


def aligned_bound(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray) -> int:
    """``max_load``, raised by alignments: for each alignment ``A`` > 1 in use, the non-empty buffers whose
    alignment is a multiple of ``A`` start at distinct multiples of ``A`` where they are live together, so
    each but the topmost spans ``ceil(s / A) * A`` bytes up to the next one's start. Hence the height is at
    least ``sum ceil(s_i / A) * A - max_i (ceil(s_i / A) * A - s_i)`` over those live at any one time (the
    slack's maximum taken over the whole class, which only lowers it). A 2 MiB alignment on 64-byte buffers:
    56 live at once need 115,343,424 B where 2,761,416 B are live (``docs/benchmarks.md``, session 21).
    One sort of the times for all of them (``max_load``'s order)."""
    if not len(sz):
        return 0
    order = np.argsort(np.concatenate([up, lo]), kind="stable")

    def peak(w: np.ndarray) -> int:  # the most of ``w`` live at once
        return max(0, int(np.cumsum(np.concatenate([-w, w]).astype(np.int64)[order]).max()))

    best = peak(sz)
    for a in np.unique(al).tolist():
        m = (al % a == 0) & (sz > 0)
        if a <= 1 or not m.any():
            continue
        span = np.where(m, -(-sz // a) * a, 0)
        best = max(best, peak(span) - int((span - sz)[m].max()))
    return best
