"""Allocator pass: the layout an online first-fit allocator gives, for a leaf's greedy phase (numba; no torch).

Formulation. The buffers' starts and ends are replayed in time order (ends before starts at equal times:
lifetimes are half-open; equal starts largest first); each start takes the lowest free hole below the
top that holds it at or above its floor (aligned), else goes on the top; each end frees its range and
merges it with the holes beside it (or lowers the top). Holes are a sorted array: O(n x holes).

Why: the compiled greedy passes (``layout_greedy``) gather every placed buffer live beside the one placed:
O(n x live). On a staircase of 200,000 buffers (each starting one step after the previous, live 1,000
steps, sizes uniform up to 1 MiB) ``rhino layout --time-limit 60`` ended 6.415% above the max-load bound
(the lowest-fit pass by size: 27.0% in 17 s; by start, the last pass, never reached, 0.315% in 7.2 s);
this pass gives 0.315% in 0.06 s (``rhino layout --time-limit 10``: 8.308% -> 0.257%). A forward and
backward trace of 200,000 buffers (LIFO activations with crossings): 18.307% -> 0.107% at 10 s (the first
lowest-fit pass did not finish; this one takes 2.3 s). ``wide-1``, ``random-1``, ``lifo-1`` at 10 s: unchanged.
"""
from __future__ import annotations

import time

import numba
import numpy as np

__all__ = ["allocator_pass"]

_CHUNK = 4096  # events between two deadline checks (a placement scans up to every hole)


@numba.njit(cache=True)
def _replay(order, lo, up, sz, al, floor, off, state, hs, he, k0, k1):
    """Events ``order[k0:k1]`` (``i`` a start of buffer ``i``, ``~i`` its end); ``state`` = [top, holes, height]."""
    top, m, height = state[0], state[1], state[2]
    for k in range(k0, k1):
        e = order[k]
        if e >= 0:
            i = e
            a, f = al[i], -(-floor[i] // al[i]) * al[i]
            placed = -1
            for q in range(m):
                st = max(-(-hs[q] // a) * a, f)
                if st + sz[i] <= he[q]:
                    placed = st
                    s0, e0 = hs[q], he[q]
                    left, right = st > s0, st + sz[i] < e0
                    if left and right:  # one hole becomes two: shift the rest up
                        for r in range(m, q + 1, -1):
                            hs[r], he[r] = hs[r - 1], he[r - 1]
                        he[q], hs[q + 1], he[q + 1] = st, st + sz[i], e0
                        m += 1
                    elif left:
                        he[q] = st
                    elif right:
                        hs[q] = st + sz[i]
                    else:
                        for r in range(q, m - 1):
                            hs[r], he[r] = hs[r + 1], he[r + 1]
                        m -= 1
                    break
            if placed < 0:
                placed = max(-(-top // a) * a, f)
                if placed > top:
                    hs[m], he[m] = top, placed
                    m += 1
                top = placed + sz[i]
                height = max(height, top)
            off[i] = placed
        else:
            i = ~e
            s, t = off[i], off[i] + sz[i]
            # the hole index where [s, t) goes (holes never overlap a live buffer)
            q = 0
            while q < m and hs[q] < s:
                q += 1
            if q > 0 and he[q - 1] == s:
                q -= 1
                s = hs[q]
                for r in range(q, m - 1):
                    hs[r], he[r] = hs[r + 1], he[r + 1]
                m -= 1
            if q < m and hs[q] == t:
                t = he[q]
                for r in range(q, m - 1):
                    hs[r], he[r] = hs[r + 1], he[r + 1]
                m -= 1
            if t >= top:
                top = s
                while m > 0 and he[m - 1] == top:  # the hole below the top joins the free space above
                    m -= 1
                    top = hs[m]
            else:
                for r in range(m, q, -1):
                    hs[r], he[r] = hs[r - 1], he[r - 1]
                hs[q], he[q] = s, t
                m += 1
    state[0], state[1], state[2] = top, m, height


def allocator_pass(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray,
                   deadline: float | None = None) -> np.ndarray | None:
    """Offsets (input order) of the allocator replay (module docstring); None when ``deadline``
    (``time.monotonic``) passes first. Empty buffers sit at 0 (as in ``layout_greedy.place_in_order``)."""
    lo, up, sz, al, floor = (np.ascontiguousarray(x, np.int64) for x in (lo, up, sz, al, floor))
    n = sz.size
    off = np.zeros(n, np.int64)
    live = np.flatnonzero(sz > 0)
    if live.size == 0:
        return off
    times = np.concatenate([up[live], lo[live]])
    kind = np.concatenate([np.zeros(live.size, np.int64), np.ones(live.size, np.int64)])  # ends first
    big = np.concatenate([np.zeros(live.size, np.int64), -sz[live]])
    events = np.concatenate([~live, live])[np.lexsort((big, kind, times))]
    state = np.zeros(3, np.int64)
    hs, he = np.empty(2 * n + 1, np.int64), np.empty(2 * n + 1, np.int64)
    for k0 in range(0, events.size, _CHUNK):
        if deadline is not None and k0 and time.monotonic() > deadline:
            return None
        _replay(events, lo, up, sz, al, floor, off, state, hs, he, k0, min(events.size, k0 + _CHUNK))
    return off
