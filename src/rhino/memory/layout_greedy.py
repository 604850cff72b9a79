"""Compiled best-fit greedy for large layouts (numba; no torch).

Same placement rule as ``layout.greedy_layout`` (each buffer in the order given goes into the smallest
gap, between the already placed buffers that overlap it in time, that holds it at or above its floor;
ties to the lowest gap; else on top of them), compiled, with a second rule ``lowest`` (first fit by
address: the lowest gap that holds it).

Time index (``TimeIndex``): all lifetimes are known in advance, so the buffers are bucketed by time once
(buckets half a mean lifetime wide) into one CSR array with each entry's start, end and first bucket
stored inline (contiguous scans, no linked lists); a placement scans its buckets, skips entries not yet
placed (offset -1) and counts a buffer met in several buckets only in the first bucket both share
(``set_offset`` moves a placed buffer in it, or removes it with offset -1).

Measured on ``benchmarks/layout_scale.py``'s ``random-1`` (60,000 buffers): best fit by size 13.0% above
the max-load bound, by lifetime 5.6% (what ``greedy_layout`` gives too); lowest fit by size 3.95%. One
lowest-fit pass by size, the earlier per-pass linked lists against this index in one process: 7.3-8.1 s
against 2.0-2.1 s of CPU (35.8-41.1 s against 10.1-10.4 s wall at load 10.9 on 2 shared cores), the
same layout (lowest fit pops the placed intervals off a heap by offset until a gap holds the buffer).
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

import numba
import numpy as np

from .layout_check import buffer_arrays

__all__ = ["TimeIndex", "time_index", "set_offset", "set_given", "gather_placed", "find_gap", "place_in_order",
           "past", "slot_stack", "greedy_order", "lowest_firsts", "lowest_fit_passes"]

_CHUNK = 4096  # buffers placed between two deadline checks


class TimeIndex(NamedTuple):
    """Buffers by time bucket: bucket ``b`` holds entries ``start[b]:start[b + 1]`` of ``member`` (buffer
    indices) with their starts ``mlo``, ends ``mup``, first buckets ``mb0``, offsets ``moff`` (-1: not
    placed) and address ends ``mend`` inline; buffer ``i``'s entries are ``epos[estart[i]:estart[i + 1]]``
    (``set_offset`` keeps them in step); ``b0``/``b1``: each buffer's first and last bucket;
    ``t0``/``width``: bucket ``b`` covers ``t0 + b*width`` on."""
    b0: np.ndarray
    b1: np.ndarray
    start: np.ndarray
    member: np.ndarray
    mlo: np.ndarray
    mup: np.ndarray
    mb0: np.ndarray
    moff: np.ndarray
    mend: np.ndarray
    estart: np.ndarray
    epos: np.ndarray
    t0: int
    width: int


@numba.njit(cache=True)
def past(deadline):
    """Whether ``time.monotonic()`` is past ``deadline``, from compiled code (the deadline checks of the
    ``layout_eject`` and ``layout_skyline`` kernels)."""
    with numba.objmode(now="float64"):
        now = time.monotonic()
    return now > deadline


@numba.njit(cache=True)
def _fill(b0, b1, sz, start, member, estart, epos):
    fill = start[:-1].copy()
    for i in range(b0.size):
        if sz[i] > 0:
            k = estart[i]
            for b in range(b0[i], b1[i] + 1):
                member[fill[b]] = i
                epos[k] = fill[b]
                k += 1
                fill[b] += 1


def time_index(lo: np.ndarray, up: np.ndarray, sz: np.ndarray) -> TimeIndex:
    """The time index of the non-empty buffers, none placed (see the module docstring). Buckets ``width``
    wide hold about sum(life) / width + n entries; at sum(life) / 2n that is ~3n, and a placement visits
    ~3 buckets' worth of live buffers when lifetimes are alike."""
    n = len(sz)
    t0 = int(lo.min()) if n else 0
    width = max(1, -(-int((up - lo).sum()) // (2 * max(n, 1))))
    if n:  # at most ~4n buckets, even for a subset whose lifetimes are short against its span
        width = max(width, -(-(int(up.max()) - t0) // (4 * n)))
    b0, b1 = (lo - t0) // width, (up - 1 - t0) // width
    nb = int(b1.max()) + 1 if n else 1
    d = np.zeros(nb + 1, np.int64)  # buffers live per bucket: +1 at the first bucket, -1 after the last
    np.add.at(d, b0[sz > 0], 1)
    np.add.at(d, b1[sz > 0] + 1, -1)
    start = np.zeros(nb + 1, np.int64)
    np.cumsum(np.cumsum(d[:nb]), out=start[1:])
    estart = np.zeros(n + 1, np.int64)
    np.cumsum(np.where(sz > 0, b1 - b0 + 1, 0), out=estart[1:])
    member, epos = np.empty(int(start[-1]), np.int64), np.empty(int(estart[-1]), np.int64)
    _fill(b0, b1, sz, start, member, estart, epos)
    moff = np.full(member.size, -1, np.int64)
    return TimeIndex(b0, b1, start, member, lo[member], up[member], b0[member], moff, moff.copy(), estart, epos,
                     t0, width)


@numba.njit(cache=True)
def set_offset(i, o, s, off, moff, mend, estart, epos):
    """Buffer ``i`` (``s`` bytes) at offset ``o`` (-1: not placed), in ``off`` and the index."""
    off[i] = o
    for k in range(estart[i], estart[i + 1]):
        moff[epos[k]] = o
        mend[epos[k]] = o + s


@numba.njit(cache=True)
def set_given(off, sz, moff, mend, estart, epos):
    """The index records exactly the buffers with an offset (>= 0) in ``off``."""
    moff[:] = -1
    for i in range(off.size):
        if off[i] >= 0 and sz[i] > 0:
            set_offset(i, off[i], sz[i], off, moff, mend, estart, epos)


@numba.njit(cache=True)
def gather_placed(i, lo, up, b0, b1, start, member, mlo, mup, mb0, moff, mend, so, se, sid):
    """Offsets, ends and ids (into ``so``/``se``/``sid``) of the placed buffers other than ``i`` (not
    placed itself) that overlap ``i`` in time; returns their count."""
    m = 0
    li, ui, bi = lo[i], up[i], b0[i]
    for b in range(bi, b1[i] + 1):
        for q in range(start[b], start[b + 1]):
            if moff[q] >= 0 and mlo[q] < ui and mup[q] > li and (mb0[q] == b or bi == b):
                so[m] = moff[q]
                se[m] = mend[q]
                sid[m] = member[q]
                m += 1
    return m


@numba.njit(cache=True)
def _sift(so, se, k, m):
    """Restore the min-heap on ``so`` (``se`` moves along) below position ``k`` of ``m``."""
    while True:
        c = 2 * k + 1
        if c >= m:
            return
        if c + 1 < m and so[c + 1] < so[c]:
            c += 1
        if so[k] <= so[c]:
            return
        so[k], so[c] = so[c], so[k]
        se[k], se[c] = se[c], se[k]
        k = c


@numba.njit(cache=True)
def _lowest_gap(so, se, m, s, a, f):
    """``find_gap`` with ``lowest``: the intervals come off a heap by offset until a gap holds the buffer
    (a partial sort: O(m + k log m) for the k intervals below that gap). Permutes ``so``/``se``."""
    for k in range(m // 2 - 1, -1, -1):
        _sift(so, se, k, m)
    below = 0
    while m:
        start = max(-(-below // a) * a, f)
        if so[0] - start - s >= 0:
            return start
        if se[0] > below:
            below = se[0]
        m -= 1
        so[0], se[0] = so[m], se[m]
        _sift(so, se, 0, m)
    return max(-(-below // a) * a, f)


@numba.njit(cache=True)
def find_gap(so, se, m, s, a, f, lowest):
    """The offset for a buffer of ``s`` bytes (alignment ``a``, floor ``f``) among the intervals
    ``[so, se)[:m]``: the smallest gap that holds it (ties: the lowest), or with ``lowest`` the lowest
    such gap; else on top of them all. Permutes ``so``/``se`` with ``lowest``."""
    f = -(-f // a) * a
    if m == 0:
        return f
    if lowest:
        return _lowest_gap(so, se, m, s, a, f)
    rank = np.argsort(so[:m])
    below = 0
    best = -1
    bestw = np.int64(-1)
    for q in rank:
        start = max(-(-below // a) * a, f)
        w = so[q] - start - s
        if w >= 0 and (bestw < 0 or w < bestw):
            bestw = w
            best = start
            if lowest:
                return best
        if se[q] > below:
            below = se[q]
    if best < 0:
        best = max(-(-below // a) * a, f)
    return best


@numba.njit(cache=True, nogil=True)  # nogil: ejection chains may run beside it (``layout_eject.Follower``)
def _place(lo, up, sz, al, floor, order, lowest, k0, k1, b0, b1, start, member, mlo, mup, mb0, moff, mend, estart,
           epos, off, so, se, sid):
    """Place ``order[k0:k1]`` (those with offset -1) in turn (see the module docstring)."""
    for k in range(k0, k1):
        i = order[k]
        if off[i] >= 0:
            continue
        if sz[i] == 0:
            off[i] = 0
            continue
        m = gather_placed(i, lo, up, b0, b1, start, member, mlo, mup, mb0, moff, mend, so, se, sid)
        set_offset(i, find_gap(so, se, m, sz[i], al[i], floor[i], lowest), sz[i], off, moff, mend, estart, epos)


def place_in_order(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray,
                   order: np.ndarray, deadline: float | None = None, finish: bool = False,
                   lowest: bool = False, given: np.ndarray | None = None,
                   index: TimeIndex | None = None,
                   stop: Callable[[float, int], bool] | None = None) -> np.ndarray | None:
    """Offsets (input order) of the buffers placed best-fit in ``order`` on their floors. When
    ``deadline`` (``time.monotonic``) passes first: None, or with ``finish`` the buffers left go above
    all placed so far, in slots by size class (``slot_stack``); when ``stop(done, top)`` says so (asked as
    often as the clock, with the share of ``order`` placed and the height of the buffers placed): None. ``lowest``: the lowest gap that holds a
    buffer, not the smallest. ``given``: offsets fixed in advance (-1: place it), there for every placement; ``order``
    may then list only the others (a buffer in neither keeps -1).
    ``index``: ``time_index(lo, up, sz)`` when the caller has it (its placements are reset here)."""
    n = len(sz)
    lo, up, sz, al, floor = (np.ascontiguousarray(x, np.int64) for x in (lo, up, sz, al, floor))
    order = np.ascontiguousarray(order, np.int64)
    if order.size and (order.min() < 0 or order.max() >= n):
        raise ValueError(f"order holds indices outside 0..{n - 1}")
    off = np.full(n, -1, np.int64) if given is None else np.array(given, np.int64)
    if n == 0:
        return off
    ix = time_index(lo, up, sz) if index is None else index
    set_given(off, sz, ix.moff, ix.mend, ix.estart, ix.epos)
    so, se, sid = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    top = 0
    for k0 in range(0, order.size, _CHUNK):
        if stop is not None and k0:
            done = order[max(0, k0 - _CHUNK):k0]
            top = max(top, int((off[done] + sz[done]).max(initial=0)))
            if stop(k0 / order.size, top):
                return None
        if deadline is not None and k0 and time.monotonic() > deadline:
            if not finish:
                return None
            top = int(np.where(off >= 0, off + sz, 0).max(initial=0))
            rest = order[k0:][off[order[k0:]] < 0]
            off[rest] = slot_stack(lo[rest], up[rest], sz[rest], al[rest], floor[rest], top)
            return off
        _place(lo, up, sz, al, floor, order, lowest, k0, min(order.size, k0 + _CHUNK), ix.b0, ix.b1, ix.start, ix.member,
               ix.mlo, ix.mup, ix.mb0, ix.moff, ix.mend, ix.estart, ix.epos, off, so, se, sid)
    return off


def slot_stack(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray,
               base: int) -> np.ndarray:
    """Offsets at or above ``base`` (and each floor) for buffers that a pass had no time left to place,
    in O(n log n): each buffer takes a slot of its class (its size rounded up to a power of two, and its
    alignment); within a class, slots are shared over time as in interval partitioning (a buffer takes a
    slot freed by its start, else a new one: as many slots as the class has buffers live at once); the
    classes' slot columns are stacked from ``base``. At most twice the bytes live per class, summed over
    the classes, where one stack of the buffers would hold all of their bytes."""
    n = len(sz)
    out = np.zeros(n, np.int64)
    if n == 0:
        return out
    base = max(int(base), int(floor.max()))
    cls = np.where(sz > 0, np.ceil(np.log2(np.maximum(sz, 1))).astype(np.int64), -1)
    width = np.where(sz > 0, -(-(np.int64(1) << np.maximum(cls, 0)) // al) * al, 0)
    # the classes in (size class, alignment) order, each its buffers in input order (one sort: 1,000,000
    # buffers 0.3 s, where a unique over both columns and a mask per class took 0.9 s)
    _, rank = np.unique(al, return_inverse=True)
    key = (cls + 1) * (int(rank.max()) + 1) + rank.reshape(-1)
    order = np.argsort(key, kind="stable")
    for ix in np.split(order, np.flatnonzero(np.diff(key[order])) + 1):
        c, a = int(cls[ix[0]]), int(al[ix[0]])
        if c < 0:
            continue  # empty buffers take no room (offset 0)
        slot = _partition(lo[ix], up[ix])
        base = -(-base // a) * a
        out[ix] = base + slot * width[ix[0]]
        base += int(width[ix[0]]) * (int(slot.max()) + 1)
    return out


@numba.njit(cache=True)
def _partition(lo, up):
    """Interval partitioning: a slot per buffer, the fewest slots (a slot free at a buffer's start is reused)."""
    n = lo.size
    order = np.argsort(lo, kind="mergesort")
    slot = np.empty(n, np.int64)
    free_t, free_s = np.empty(n, np.int64), np.empty(n, np.int64)  # min-heap of (free from, slot)
    m, slots = 0, 0
    for i in order:
        if m > 0 and free_t[0] <= lo[i]:
            s = free_s[0]
            m -= 1
            free_t[0], free_s[0] = free_t[m], free_s[m]
            _sift(free_t, free_s, 0, m)
        else:
            s = slots
            slots += 1
        slot[i] = s
        free_t[m], free_s[m] = up[i], s
        k = m
        m += 1
        while k > 0:
            p = (k - 1) // 2
            if free_t[k] < free_t[p]:
                free_t[k], free_t[p], free_s[k], free_s[p] = free_t[p], free_t[k], free_s[p], free_s[k]
                k = p
            else:
                break
    return slot


def greedy_order(name: str, lo: np.ndarray, up: np.ndarray, sz: np.ndarray) -> np.ndarray:
    """The indices of ``layout.GreedyOrder`` ``name``'s order (stable, as ``sorted`` by its key)."""
    if name == "size":
        return np.lexsort((lo, lo - up, -sz))
    if name == "long_lived_first":
        return np.lexsort((lo, -sz, lo - up))
    if name == "area":
        return np.lexsort((lo, -sz, -sz * (up - lo)))
    if name == "size_start":
        return np.lexsort((lo - up, lo, -sz))
    if name == "start":
        return np.lexsort((-sz, lo))
    raise ValueError(f"unknown greedy order {name!r}")


def lowest_firsts(sz: np.ndarray) -> list[str]:
    """The first two lowest-fit orders: size, then size with equal sizes by start; the other way round where
    every buffer has one size (``layout.GreedyOrder.SIZE_START``: optimal there)."""
    return ["size_start", "size"] if np.unique(sz[sz > 0]).size <= 1 else ["size", "size_start"]


#: a compiled lowest-fit pass takes up to this many times ``layout.greedy_layout``'s first (numpy best-fit)
#: pass on the same buffers; measured on 5,000 buffers: all live at once 0.99 s against 0.20 s (5x, the
#: heap pops every live buffer), a staircase (each live 1,000 steps) 0.30 against 0.28 s, power-of-two sizes
#: 0.07 against 0.14 s; a pass is not interrupted below 4,096 buffers (``_CHUNK``), so it starts only where
#: this many first passes' time is left
LOWEST_COST = 6.0


def lowest_fit_passes(buffers, deadline: float | None, first_s: float) -> tuple[dict, int, str] | None:
    """The lower of two lowest-fit passes (size first, equal sizes by lifetime, then by start; start first
    where every buffer has one size: ``layout.GreedyOrder.SIZE_START``) of ``layout.solve_layout``'s plain path
    (``SplitOptions.lowest_fit``), each started only while ``LOWEST_COST * first_s`` is left before
    ``deadline``: offsets by id, height and name; None where neither ran."""
    lo, up, sz, al = buffer_arrays(buffers)
    best = None
    for name in lowest_firsts(sz):
        if deadline is not None and time.monotonic() + LOWEST_COST * first_s > deadline:
            break
        off = place_in_order(lo, up, sz, al, np.zeros(len(sz), np.int64), greedy_order(name, lo, up, sz), deadline,
                             lowest=True)
        if off is None:
            break
        h = int((off + sz).max(initial=0))
        if best is None or h < best[1]:
            best = (dict(zip((b.id for b in buffers), off.tolist())), h, f"{name}/lowest")
    return best
