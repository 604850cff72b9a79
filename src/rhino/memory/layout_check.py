"""Fast overlap check of a layout (numba; no torch): whether any two buffers overlap in time and address.

Sweep over time (ends before starts at equal times: lifetimes are half-open). While no overlap has been
found, the live buffers are disjoint in address, so a new buffer overlaps one of them exactly when it
overlaps the live buffer starting at or below its offset nearest to it, or the one starting above it
nearest to it. The live buffers are kept by the rank of their offset in a Fenwick tree (counts), whose
descent finds those two neighbours: O(n log n) for n buffers, however many are live at once (the
pairwise check in ``layout.validate_layout`` is O(n x live), 6 s for 60,000 buffers all live at once).
``layout.validate_layout`` lists the overlapping pairs with its pairwise check only when this one finds
one.
"""
from __future__ import annotations

import numba
import numpy as np

__all__ = ["any_overlap"]


def any_overlap(lo: np.ndarray, up: np.ndarray, start: np.ndarray, end: np.ndarray) -> bool:
    """True when two of the buffers (lifetimes ``[lo, up)``, addresses ``[start, end)``, every size > 0)
    overlap in both time and address."""
    n = len(lo)
    if n < 2:
        return False
    times = np.concatenate([up, lo]).astype(np.int64)
    kinds = np.concatenate([np.zeros(n, np.int64), np.ones(n, np.int64)])  # 0: an end, 1: a start
    order = np.lexsort((kinds, times))
    addrs, rank = np.unique(np.asarray(start, np.int64), return_inverse=True)
    return _sweep(order, rank.astype(np.int64), np.asarray(start, np.int64), np.asarray(end, np.int64), addrs.size)


@numba.njit(cache=True, nogil=True)
def _add(tree, r, v):
    i = r + 1
    while i < tree.size:
        tree[i] += v
        i += i & -i


@numba.njit(cache=True, nogil=True)
def _count(tree, r):
    """Live buffers at ranks 0..r-1."""
    s, i = 0, r
    while i > 0:
        s += tree[i]
        i -= i & -i
    return s


@numba.njit(cache=True, nogil=True)
def _kth(tree, k, top):
    """The rank of the k-th live buffer (k >= 1) in offset order."""
    pos, step = 0, top
    while step > 0:
        if pos + step < tree.size and tree[pos + step] < k:
            pos += step
            k -= tree[pos]
        step >>= 1
    return pos


@numba.njit(cache=True, nogil=True)
def _sweep(order, rank, start, end, m):
    n = rank.size
    tree = np.zeros(m + 1, np.int64)
    who = np.full(m, -1, np.int64)  # the live buffer at each offset rank
    top = 1
    while top * 2 <= m:
        top *= 2
    live = 0
    for e in order:
        i = e - n if e >= n else e
        r = rank[i]
        if e < n:  # its end
            _add(tree, r, -1)
            who[r] = -1
            live -= 1
            continue
        if who[r] >= 0:  # another live buffer at the same offset
            return True
        below = _count(tree, r)
        if below > 0 and end[who[_kth(tree, below, top)]] > start[i]:
            return True
        if below < live and start[who[_kth(tree, below + 1, top)]] < end[i]:
            return True
        _add(tree, r, 1)
        who[r] = i
        live += 1
    return False
