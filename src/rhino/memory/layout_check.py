"""The independent check of a layout (numba; no torch): ``validate_layout`` lists what is wrong, after the fast
overlap check ``any_overlap`` (whether any two buffers overlap in time and address).

Sweep over time (ends before starts at equal times: lifetimes are half-open). While no overlap has been
found, the live buffers are disjoint in address, so a new buffer overlaps one of them exactly when it
overlaps the live buffer starting at or below its offset nearest to it, or the one starting above it
nearest to it. The live buffers are kept by the rank of their offset in a Fenwick tree (counts), whose
descent finds those two neighbours: O(n log n) for n buffers, however many are live at once (the
pairwise check in ``validate_layout`` is O(n x live), 6 s for 60,000 buffers all live at once).
``validate_layout`` lists the overlapping pairs with its pairwise check only when this one finds one.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Sequence

import numba
import numpy as np

__all__ = ["any_overlap", "buffer_arrays", "layout_heights", "validate_layout"]

_CHUNK = 256  # validate_layout: buffers checked against the live ones at once
_ID = attrgetter("id")
_FIELDS = [attrgetter(f) for f in ("lower", "upper", "size", "alignment")]


def buffer_arrays(buffers: Sequence) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ``lower``, ``upper``, ``size`` and ``alignment`` of each buffer (``layout.Buffer``) as int64 arrays
    (1,000,000 buffers: 0.1 s; list comprehensions took 0.5 s)."""
    return tuple(np.fromiter(map(f, buffers), np.int64, len(buffers)) for f in _FIELDS)


def layout_heights(buffers: Sequence, offsets: dict) -> np.ndarray:
    """Where each buffer ends: its offset plus its size."""
    return np.fromiter(map(offsets.__getitem__, map(_ID, buffers)), np.int64, len(buffers)) + \
        np.fromiter(map(_FIELDS[2], buffers), np.int64, len(buffers))


def validate_layout(buffers: Sequence, offsets: dict, capacity: int | None = None) -> list[str]:
    """Every violation: a missing, negative or misaligned offset, a buffer above the capacity, and
    every pair of buffers overlapping in both time and address. Empty when the layout is valid."""
    errors = []
    off = list(map(offsets.get, map(_ID, buffers)))
    missing = None in off
    has = np.fromiter((x is not None for x in off), bool, len(off)) if missing else np.ones(len(off), bool)
    o = np.fromiter((-1 if x is None else x for x in off) if missing else off, np.int64, len(off))
    lo, up, sz, al = buffer_arrays(buffers)
    bad = ~has | (o < 0) | (o % al != 0) | ((o + sz > capacity) if capacity is not None else False)
    for i in np.flatnonzero(bad).tolist():  # (the checks vectorised above: 2.1 -> 1.6 s on 1,000,000 buffers)
        b, x = buffers[i], off[i]
        if x is None:
            errors.append(f"buffer {b.id} has no offset")
            continue
        if x < 0:
            errors.append(f"buffer {b.id} has a negative offset {x}")
        if x % b.alignment:
            errors.append(f"buffer {b.id} offset {x} is not a multiple of its alignment {b.alignment}")
        if capacity is not None and x + b.size > capacity:
            errors.append(f"buffer {b.id} ends at {x + b.size}, above the capacity {capacity}")
    keep = np.flatnonzero(has & (sz > 0))
    keep = keep[np.argsort(lo[keep], kind="stable")]
    lo, up = lo[keep], up[keep]
    start = o[keep]
    end = start + sz[keep]
    if not any_overlap(lo, up, start, end):  # O(n log n); the pairwise pass below names the pairs
        return errors
    ok = [buffers[i] for i in keep.tolist()]
    live = np.zeros(0, np.int64)  # earlier buffers still live at the chunk's first start
    for c0 in range(0, len(ok), _CHUNK):
        c1 = min(c0 + _CHUNK, len(ok))
        live = live[up[live] > lo[c0]]
        js = np.concatenate([live, np.arange(c0, c1)])
        i = np.arange(c0, c1)[:, None]  # each buffer against the earlier ones live at its start
        hit = (js[None, :] < i) & (up[js][None, :] > lo[i]) & (start[js][None, :] < end[i]) & \
            (start[i] < end[js][None, :])
        for r, q in zip(*np.nonzero(hit)):
            a, b, j, k = ok[js[q]], ok[c0 + r], js[q], c0 + r
            errors.append(f"buffers {a.id} [{a.lower},{a.upper}) @ {start[j]}+{a.size} and {b.id} "
                          f"[{b.lower},{b.upper}) @ {start[k]}+{b.size} overlap in time and address")
        live = js[up[js] > lo[c1 - 1]]
    return errors


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
