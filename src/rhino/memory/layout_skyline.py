"""Skyline passes for large layouts: canonical layouts built bottom up (numba; no torch).

Formulation. In a canonical layout (MiniMalloc, Moffitt, ASPLOS 2023) every buffer rests on its floor or
on the top of a buffer placed before it, and buffers are placed in non-decreasing offset order. A skyline
pass builds one greedily. The skyline is, per time step, the highest end of the buffers placed so far;
everything above it is free. Time is compressed to the distinct lifetime bounds. Repeatedly the lowest
segment ``[a, b)`` of the skyline (a maximal run of steps at one height ``y``; the leftmost on ties) is
taken, and among the unplaced buffers whose lifetimes lie inside ``[a, b)``:

- the one of highest priority that sits at ``y`` (its floor and alignment allow ``y``) goes there; else
- the one whose lowest position (``y`` raised to its floor, aligned) is lowest goes there, if that is
  below both neighbouring segments (the space under it stays empty); else
- the segment is raised to its lower neighbour and merges with it (that space stays empty).

A buffer goes where the skyline is flat over its whole lifetime, so it never overlaps one placed before:
a pass is valid by construction, with no overlap test.

Search (``skyline_search``): the squeaky wheel (Joslin & Clements, JAIR 10, 1999) over the priorities,
as ``layout_improve``'s plain search: ``pi_i = log s_i + alpha * log life_i`` at first (long-lived
buffers first, on which the shorter ones stack); after a pass of height ``h`` every buffer ending above
``T - band * (h - T)`` gets ``pi_i += log boost``; the lowest layout is kept.

Why (``benchmarks/layout_scale.py``, session 14): on the ``wide`` traces (uniform sizes, exponential
lifetimes) most buffers are hot, so the focused lowest-fit search does not apply and the plain one
stalls (``wide-1`` 4.241% over the max-load bound in 60 s). A skyline pass on 60,000 buffers takes
~0.2 s against 1-2 s for a lowest-fit pass, so the squeaky wheel gets 5-10 times the passes. Alone, in
30-40 s of one core: ``wide-1`` 2.6-3.0%, ``wide-2`` 1.12%, ``wide-3`` 4.63%. In ``rhino layout
--time-limit 60``, with ejection chains beside it: ``wide-1/2/3`` 2.184 / 0.955 / 3.804% (4.241 /
1.436 / 4.912% before); held out, ``wide-6/7`` 2.553 / 1.780% (3.994 / 2.686%). On the ``random``
traces the focused lowest-fit search stays better (``random-7``: 3.3% here against 1.1%).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import numba
import numpy as np

from .layout_greedy import past

__all__ = ["SkylineOptions", "SkylineRace", "first_priorities", "skyline_pass", "skyline_search"]

_INF = 1 << 62
_CHECK = 4096  # placements between two deadline checks


@dataclass(frozen=True)
class SkylineOptions:
    """The squeaky wheel over skyline passes (module docstring): ``alpha`` the lifetime exponent of the
    first priorities, ``boost`` the factor for a buffer ending in the band above ``T - band * (h - T)``.
    Values: measured on ``wide-1`` and ``wide-3`` (30 s each, one core; module docstring). ``greedy_share``:
    of a leaf's time, the share the greedy passes may take before this search (``layout._leaf``; the
    first pass always finishes): ``wide-1/2/3`` 2.205 / 1.436 / 3.903% at the lowest-fit search's 0.35,
    2.184 / 0.955 / 3.804% at 0.02 (``solve_layout``, 52 s)."""
    greedy_share: float = 0.02
    alpha: float = 2.0
    boost: float = 2.0
    band: float = 1.0


@numba.njit(cache=True, nogil=True)
def _push(hy, ha, m, y, a):
    """Push segment start ``a`` at height ``y`` on the heap ``hy``/``ha`` of size ``m``; the new size."""
    hy[m], ha[m] = y, a
    k = m
    while k > 0:
        p = (k - 1) // 2
        if hy[k] < hy[p] or (hy[k] == hy[p] and ha[k] < ha[p]):
            hy[k], hy[p], ha[k], ha[p] = hy[p], hy[k], ha[p], ha[k]
            k = p
        else:
            break
    return m + 1


@numba.njit(cache=True, nogil=True)
def _pop(hy, ha, m):
    """Remove the heap's root (the caller read it); the new size."""
    m -= 1
    hy[0], ha[0] = hy[m], ha[m]
    k = 0
    while True:
        c = 2 * k + 1
        if c >= m:
            break
        if c + 1 < m and (hy[c + 1] < hy[c] or (hy[c + 1] == hy[c] and ha[c + 1] < ha[c])):
            c += 1
        if hy[c] < hy[k] or (hy[c] == hy[k] and ha[c] < ha[k]):
            hy[k], hy[c], ha[k], ha[c] = hy[c], hy[k], ha[c], ha[k]
            k = c
        else:
            break
    return m


@numba.njit(cache=True, nogil=True)
def _find(nxt, p):
    """The first position at or after ``p`` whose buffer is unplaced (path-compressed skip list)."""
    r = p
    while nxt[r] != r:
        r = nxt[r]
    while nxt[p] != r:
        q = nxt[p]
        nxt[p] = r
        p = q
    return r


@numba.njit(cache=True, nogil=True)
def _pick(a, b, y, ceiling, li, ui, sz, al, floor, pri, order, first, nxt):
    """The buffer to place on segment ``[a, b)`` at height ``y`` (module docstring) and its offset, or
    (-1, 0) when the segment must be raised (``ceiling``: its lower neighbour's height)."""
    best, best_p, low, low_x = -1, -1.0, -1, _INF
    n = order.size
    p = _find(nxt, first[a])
    while p < n:
        i = order[p]
        if li[i] >= b:
            break
        if ui[i] <= b:
            x = max(y, floor[i])
            x = -(-x // al[i]) * al[i]
            if x == y:
                if best < 0 or pri[i] > best_p:
                    best, best_p = i, pri[i]
            elif best < 0 and (x < low_x or (x == low_x and pri[i] > pri[low])):
                low, low_x = i, x
        p = _find(nxt, p + 1)
    if best >= 0:
        return best, y
    if low >= 0 and low_x < ceiling:
        return low, low_x
    return -1, 0


@numba.njit(cache=True, nogil=True)
def _level(s, e, h, seg_end, seg_h, alive, sofe, K):
    """Make ``[s, e)`` one segment at height ``h``, merged with neighbours at that height; its start."""
    if e < K and seg_h[e] == h:
        alive[e] = False
        e = seg_end[e]
    if s > 0 and seg_h[sofe[s]] == h:
        alive[s] = False
        s = sofe[s]
    seg_end[s], seg_h[s], alive[s], sofe[e] = e, h, True, s
    return s


@numba.njit(cache=True, nogil=True)
def _pass(li, ui, sz, al, floor, pri, K, deadline):
    """One skyline pass (module docstring) over compressed time ``[0, K)``: offsets in input order, or
    None when ``deadline[0]`` (``time.monotonic``; an array, so another thread may move it) passes first."""
    n = li.size
    order = np.argsort(li, kind="mergesort")
    posof = np.empty(n, np.int64)
    posof[order] = np.arange(n)
    first = np.searchsorted(li[order], np.arange(K + 1))  # first position starting at or after t
    nxt = np.arange(n + 1)
    off = np.full(n, -1, np.int64)
    seg_end, seg_h = np.full(K + 1, -1, np.int64), np.zeros(K + 1, np.int64)
    alive, sofe = np.zeros(K + 1, np.bool_), np.full(K + 1, -1, np.int64)
    cap = 8 * n + 64
    hy, ha = np.empty(cap, np.int64), np.empty(cap, np.int64)
    left = 0
    for i in range(n):  # empty buffers take no room
        if sz[i] == 0:
            off[i] = 0
            nxt[posof[i]] = posof[i] + 1
        else:
            left += 1
    seg_end[0], alive[0], sofe[K] = K, True, 0
    m = _push(hy, ha, 0, 0, 0)
    steps = 0
    while left > 0:
        y, a = hy[0], ha[0]
        m = _pop(hy, ha, m)
        if not alive[a] or seg_h[a] != y:
            continue  # stale entry
        steps += 1
        if steps % _CHECK == 0 and past(deadline[0]):
            return None
        b = seg_end[a]
        ceiling = min(seg_h[sofe[a]] if a > 0 else _INF, seg_h[b] if b < K else _INF)
        i, x = _pick(a, b, y, ceiling, li, ui, sz, al, floor, pri, order, first, nxt)
        if i >= 0:
            off[i] = x
            nxt[posof[i]] = posof[i] + 1
            left -= 1
            l, u = li[i], ui[i]
            alive[a] = False
            if l > a:
                seg_end[a], seg_h[a], alive[a], sofe[l] = l, y, True, a
                m = _push(hy, ha, m, y, a)
            if u < b:
                seg_end[u], seg_h[u], alive[u], sofe[b] = b, y, True, u
                m = _push(hy, ha, m, y, u)
            s = _level(l, u, x + sz[i], seg_end, seg_h, alive, sofe, K)
        else:
            s = _level(a, b, ceiling, seg_end, seg_h, alive, sofe, K)
        m = _push(hy, ha, m, seg_h[s], s)
        if m > cap - 4:  # compact: one entry per live segment
            m, s = 0, 0
            while s < K:
                m = _push(hy, ha, m, seg_h[s], s)
                s = seg_end[s]
    return off


def skyline_pass(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray,
                 priority: np.ndarray, deadline: float | np.ndarray = float("inf")) -> np.ndarray | None:
    """Offsets (input order) of one skyline pass with ``priority`` (higher first among the buffers that
    fit a segment), or None when ``deadline`` (``time.monotonic``) passes first; as a one-element float64
    array, another thread may move it while the pass runs (to 0: stop it)."""
    lo, up, sz, al, floor = (np.ascontiguousarray(x, np.int64) for x in (lo, up, sz, al, floor))
    if sz.size == 0:
        return np.zeros(0, np.int64)
    pts = np.unique(np.concatenate([lo, up]))
    li, ui = np.searchsorted(pts, lo), np.searchsorted(pts, up)
    when = deadline if isinstance(deadline, np.ndarray) else np.array([deadline], np.float64)
    return _pass(li, ui, sz, al, floor, np.ascontiguousarray(priority, np.float64), len(pts) - 1, when)


class SkylineRace:
    """One skyline pass in a thread beside the caller's work (the compiled pass releases the GIL), until
    ``deadline`` (``time.monotonic``) at the latest: ``layout._greedy_phase`` runs its first greedy pass
    meanwhile."""

    def __init__(self, lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray,
                 priority: np.ndarray, deadline: float) -> None:
        self._when = np.array([deadline], np.float64)
        self.offsets: np.ndarray | None = None
        self.height: int | None = None
        self._thread = threading.Thread(target=self._run, args=(lo, up, sz, al, floor, priority), daemon=True)
        self._thread.start()

    def _run(self, lo, up, sz, al, floor, priority) -> None:
        off = skyline_pass(lo, up, sz, al, floor, priority, self._when)
        if off is not None:
            self.height = int((off + sz).max(initial=0))
        self.offsets = off  # last: ``height`` is set when this is

    def result(self, stop: bool = False) -> np.ndarray | None:
        """The pass's offsets (None when its deadline came first), after it ends; ``stop``: at once."""
        if stop:
            self._when[0] = 0.0
        self._thread.join()
        return self.offsets


def first_priorities(lo: np.ndarray, up: np.ndarray, sz: np.ndarray,
                     options: SkylineOptions = SkylineOptions()) -> np.ndarray:
    """The search's first priorities, ``log s_i + alpha * log life_i`` (module docstring)."""
    with np.errstate(divide="ignore"):
        return np.log(sz.astype(np.float64)) + options.alpha * np.log((up - lo).astype(np.float64))


def skyline_search(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray, target: int,
                   deadline: float, options: SkylineOptions = SkylineOptions(), start: np.ndarray | None = None,
                   on_best: Callable[[np.ndarray, int], None] | None = None,
                   max_passes: int = 0) -> tuple[np.ndarray | None, int, int]:
    """The squeaky wheel over skyline passes until ``deadline`` (``time.monotonic``), ``max_passes`` (0:
    no cap) or a height at most ``target`` (module docstring); ``start``: a layout to beat; ``on_best(offsets, height)`` hears of
    every lower layout. Returns the lowest offsets (None when no pass finished and no ``start``), their
    height and the number of passes finished (the interface of ``layout_improve.squeaky_wheel``)."""
    lo, up, sz, al, floor = (np.ascontiguousarray(x, np.int64) for x in (lo, up, sz, al, floor))
    best = None if start is None else np.asarray(start, np.int64)
    best_h = int((best + sz).max(initial=0)) if best is not None else 0
    if sz.size == 0 or (best is not None and best_h <= target):
        return best, best_h, 0
    pri = first_priorities(lo, up, sz, options)
    step = float(np.log(options.boost))
    pts = np.unique(np.concatenate([lo, up]))
    li, ui = np.searchsorted(pts, lo), np.searchsorted(pts, up)
    passes = 0
    while time.monotonic() < deadline and (max_passes <= 0 or passes < max_passes):
        off = _pass(li, ui, sz, al, floor, pri, len(pts) - 1, np.array([deadline], np.float64))
        if off is None:
            break
        passes += 1
        end = off + sz
        h = int(end.max())
        if best is None or h < best_h:
            best, best_h = off, h
            if on_best is not None:
                on_best(off, h)
        if best_h <= target:
            break
        pri[end > target - options.band * (h - target)] += step
    return best, best_h, passes
