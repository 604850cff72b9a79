"""Ejection chains: lower the top of a valid layout by moving buffers out of the way (numba; no torch).

Formulation. A valid layout of height ``h`` (offsets ``o_i``, floors ``f_i``, alignments ``a_i``) and a
target ``T``. Repeatedly, with ``cap = max(T, h - step)``: every buffer ending above ``cap`` (largest
``s_i * life_i`` first) is taken out and placed with its end at most ``cap``:

- directly: the lowest offset (at or above its floor, aligned) that no buffer live at the same time
  covers, if one ends at most ``cap``; else
- by ejection: at a candidate offset ``x`` (its floor, or the end of a buffer live at the same time,
  aligned and at or above its floor, ``x + s <= cap``) that at most ``max_blockers`` buffers live at the
  same time cover, candidates ranked by the sum of those blockers' ``size x lifetime``: the blockers are
  taken out, the buffer goes to ``x``, and each blocker (largest first) is placed again the same way, at
  most ``depth`` levels deep, trying at most ``tries`` candidates per buffer and ``budget`` placements
  per top buffer. A chain that fails is undone exactly (a log of the moves).

When every buffer above ``cap`` has moved, the height is at most ``cap`` and the next round starts. A
buffer it cannot move makes the search deeper (``depth`` + 1 up to ``max_depth``), then wider (``tries`` x 2
up to ``max_tries``, back at ``depth``), from the layout reached; it stops there, at ``T``, or at the
deadline. Every move keeps the layout valid and no buffer ends above the height it started from, so the
result is never higher.

Where they run (``layout._leaf``, on a leaf too large for the exact search): with two cores or more in a
thread beside the squeaky wheel (``Follower``: the compiled kernels of both release the GIL), from each
lower layout the squeaky wheel finds; with one core, after it, in ``EjectOptions.share`` of the leaf's time.

Why (``benchmarks/layout_scale.py``, session 12): the squeaky wheel's best layouts of the random traces
that miss 1% have a handful of buffers on top at times where the arena is not full (``random-4``: 27
buffers above 1.01x the bound, at 1.38-1.77%, not at its peak) that no lowest-fit order brought down;
ejection moves the buffers in their way, which a greedy pass never does once they are placed.
Measured (one process, from the CLI's session-11 layouts): ``random-4`` 1.768% -> 1.199% at depth 4 and
8 tries (1.8 s of CPU, then stuck), 0.998% at depth 6 (12.9 s), 0.977% with the escalation in 20 s;
``wide-1`` 5.066% -> 4.150% (depth 4), 3.815% (32 tries, 11 s), 3.909% (escalation, 20 s); ``random-7``
1.525% unchanged (its top buffers span its peak, where the arena is full).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numba
import numpy as np

from .layout_greedy import gather_placed, past, set_given, set_offset, time_index

__all__ = ["EjectOptions", "eject_repair", "Follower", "cores"]

_ENTER, _NEXT, _OK, _FAIL = 0, 1, 2, 3


@dataclass(frozen=True)
class EjectOptions:
    """Ejection chains (module docstring). ``beside``: with two cores or more they run in a thread beside
    the squeaky wheel (``Follower``) for the whole of a large leaf's time; else ``share``: of its time,
    the part kept for them after the squeaky wheel; ``step``: how far below the height each round aims,
    as a fraction of the target; ``depth``/``tries`` to start with, ``max_depth``/``max_tries`` for the escalation. Values:
    measured on ``random-4`` (depth 2 / 3 / 4 / 6: 1.262 / 1.244 / 1.199 / 0.998%; ``budget`` 200,000:
    no change)."""
    enabled: bool = True
    beside: bool = True
    share: float = 0.1
    depth: int = 4
    max_depth: int = 8
    max_blockers: int = 2000
    tries: int = 8
    max_tries: int = 64
    budget: int = 50_000
    step: float = 2e-4


@numba.njit(cache=True)
def _up(x, a):
    return -(-x // a) * a


@numba.njit(cache=True)
def _by_offset(so, se, sid, m):
    """Sort ``[so, se)[:m]`` and their ids by offset, in place."""
    rk = np.argsort(so[:m])
    so[:m] = so[:m][rk]
    se[:m] = se[:m][rk]
    sid[:m] = sid[:m][rk]


@numba.njit(cache=True)
def _lowest_below(so, se, m, s, cap, a, f):
    """The lowest aligned offset at or above ``f`` where ``s`` bytes overlap none of ``[so, se)[:m]``
    (sorted by offset) and end at most ``cap``; -1 if there is none. ``layout_greedy.find_gap`` without
    the cap, which stops at the first interval past it, and without permuting the intervals."""
    below = f
    for q in range(m):
        x = _up(below, a)
        if x + s > cap:
            return -1
        if so[q] >= x + s:
            return x
        if se[q] > below:
            below = se[q]
    x = _up(below, a)
    return x if x + s <= cap else -1


@numba.njit(cache=True)
def _candidates(b, so, se, sid, m, sz, al, floor, area, cap, max_blockers, out):
    """Candidate offsets for ``b`` (module docstring) into ``out``, best first; returns their count.
    ``so``/``se``/``sid``: sorted by offset."""
    s, a, f = sz[b], al[b], floor[b]
    longest = 0
    for q in range(m):
        longest = max(longest, se[q] - so[q])
    xs = np.empty(m + 1, np.int64)
    xs[0] = _up(f, a)
    for q in range(m):
        xs[q + 1] = _up(max(se[q], f), a)
    xs = np.unique(xs)
    score = np.empty(xs.size, np.float64)
    keep = np.empty(xs.size, np.int64)
    n = 0
    for c in range(xs.size):
        x = xs[c]
        if x + s > cap:
            break
        k, total = 0, 0.0
        q = np.searchsorted(so[:m], x + s) - 1
        low = x - longest
        while q >= 0 and so[q] > low:
            if se[q] > x:
                k += 1
                if k > max_blockers:
                    break
                total += area[sid[q]]
            q -= 1
        if k <= max_blockers:
            keep[n] = x
            score[n] = total
            n += 1
    order = np.argsort(score[:n], kind="mergesort")
    for c in range(n):
        out[c] = keep[order[c]]
    return n


@numba.njit(cache=True)
def _blockers(x, s, so, se, sid, m, out):
    """Ids of the buffers among ``[so, se)[:m]`` (any order) overlapping ``[x, x + s)``."""
    k = 0
    for q in range(m):
        if so[q] < x + s and se[q] > x:
            out[k] = sid[q]
            k += 1
    return k


@numba.njit(cache=True)
def _undo(mark, nlog, logb, logo, sz, off, moff, mend, estart, epos):
    for q in range(nlog - 1, mark - 1, -1):
        set_offset(logb[q], logo[q], sz[logb[q]], off, moff, mend, estart, epos)
    return mark


@numba.njit(cache=True)
def _apply(b, x, blockers, sz, off, moff, mend, estart, epos, logb, logo, nlog):
    """Take ``blockers`` out (sorted largest first, in place) and put ``b`` at ``x``, logging each move;
    returns the new log length."""
    blockers[:] = blockers[np.argsort(-sz[blockers], kind="mergesort")]
    for c in blockers:
        logb[nlog], logo[nlog] = c, off[c]
        nlog += 1
        set_offset(c, -1, sz[c], off, moff, mend, estart, epos)
    logb[nlog], logo[nlog] = b, -1
    set_offset(b, x, sz[b], off, moff, mend, estart, epos)
    return nlog + 1


@numba.njit(cache=True, nogil=True)
def _move(top, cap, depth, max_blockers, tries, budget, limit, lo, up, sz, al, floor, area, off, b0, b1, start,
          member, mlo, mup, mb0, moff, mend, estart, epos):
    """Place ``top`` (placed, ending above ``cap``) with its end at most ``cap`` by an ejection chain (an
    explicit depth-first search, module docstring); on failure everything is as before. Returns whether
    it moved. ``limit[0]``: the deadline (``time.monotonic``; another thread may bring it forward)."""
    n = sz.size
    so, se, sid = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    cand = np.empty((depth + 1, n + 1), np.int64)
    ncand, nxt = np.zeros(depth + 1, np.int64), np.zeros(depth + 1, np.int64)
    blk = np.empty((depth + 1, max_blockers), np.int64)
    nblk, j, mark = np.zeros(depth + 1, np.int64), np.zeros(depth + 1, np.int64), np.zeros(depth + 1, np.int64)
    buf = np.empty(depth + 2, np.int64)
    cap_log = 8 * n + 16
    logb, logo = np.empty(cap_log, np.int64), np.empty(cap_log, np.int64)
    logb[0], logo[0] = top, off[top]
    set_offset(top, -1, sz[top], off, moff, mend, estart, epos)
    nlog, level, nodes, state = 1, 0, 0, _ENTER
    buf[0] = top
    while True:
        if state == _ENTER:
            b = buf[level]
            nodes += 1
            if nodes > budget or nlog + max_blockers + 2 > cap_log or (nodes % 64 == 0 and past(limit[0])):
                _undo(0, nlog, logb, logo, sz, off, moff, mend, estart, epos)
                return False
            m = gather_placed(b, lo, up, b0, b1, start, member, mlo, mup, mb0, moff, mend, so, se, sid)
            _by_offset(so, se, sid, m)
            x = _lowest_below(so, se, m, sz[b], cap, al[b], floor[b])
            if x >= 0:
                logb[nlog], logo[nlog] = b, -1
                nlog += 1
                set_offset(b, x, sz[b], off, moff, mend, estart, epos)
                state = _OK
            elif level == depth:
                state = _FAIL
            else:
                ncand[level] = _candidates(b, so, se, sid, m, sz, al, floor, area, cap, max_blockers, cand[level])
                nxt[level] = 0
                state = _NEXT
        elif state == _NEXT:
            b = buf[level]
            if nxt[level] >= min(ncand[level], tries):
                state = _FAIL
                continue
            x = cand[level, nxt[level]]
            nxt[level] += 1
            m = gather_placed(b, lo, up, b0, b1, start, member, mlo, mup, mb0, moff, mend, so, se, sid)
            k = _blockers(x, sz[b], so, se, sid, m, blk[level])
            nblk[level], j[level], mark[level] = k, 0, nlog
            nlog = _apply(b, x, blk[level, :k], sz, off, moff, mend, estart, epos, logb, logo, nlog)
            if k == 0:
                state = _OK
            else:
                buf[level + 1] = blk[level, 0]
                level += 1
                state = _ENTER
        elif state == _OK:
            if level == 0:
                return True
            level -= 1
            j[level] += 1
            if j[level] < nblk[level]:
                buf[level + 1] = blk[level, j[level]]
                level += 1
                state = _ENTER
        else:  # _FAIL
            if level == 0:
                _undo(0, nlog, logb, logo, sz, off, moff, mend, estart, epos)
                return False
            level -= 1
            nlog = _undo(mark[level], nlog, logb, logo, sz, off, moff, mend, estart, epos)
            state = _NEXT


def eject_repair(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray,
                 offsets: np.ndarray, target: int, deadline: float, options: EjectOptions = EjectOptions(),
                 stop: Callable[[int], bool] | None = None,
                 limit: np.ndarray | None = None) -> tuple[np.ndarray, int, int]:
    """A layout at most as high as ``offsets`` (a valid layout, input order), lowered by ejection chains
    until ``target``, the end of the escalation, ``deadline`` (``time.monotonic``) or ``stop(height)``
    (asked between buffers), or ``limit[0]`` (a one-element float array: a deadline another thread may
    bring forward). Returns the offsets, their height and the number of buffers moved below a round's
    cap."""
    limit = np.array([deadline], np.float64) if limit is None else limit
    lo, up, sz, al, floor = (np.ascontiguousarray(x, np.int64) for x in (lo, up, sz, al, floor))
    off = np.array(offsets, np.int64)
    if sz.size == 0:
        return off, 0, 0
    ix = time_index(lo, up, sz)
    set_given(off, sz, ix.moff, ix.mend, ix.estart, ix.epos)
    area = sz * (up - lo).astype(np.float64)
    step = max(1, int(target * options.step))
    moved, depth, tries = 0, options.depth, options.tries
    while time.monotonic() < min(deadline, limit[0]):
        end = off + sz
        h = int(end.max())
        if h <= target:
            break
        cap = max(target, h - step)
        tops = np.flatnonzero(end > cap)
        for b in tops[np.argsort(-area[tops], kind="stable")].tolist():
            if stop is not None and stop(h):
                return off, int((off + sz).max()), moved
            if off[b] + sz[b] <= cap:
                continue
            if not _move(b, cap, depth, options.max_blockers, tries, options.budget, limit, lo, up, sz, al,
                         floor, area, off, ix.b0, ix.b1, ix.start, ix.member, ix.mlo, ix.mup, ix.mb0, ix.moff,
                         ix.mend, ix.estart, ix.epos):
                if depth < options.max_depth:  # stuck: search deeper, then wider, from this layout
                    depth += 1
                elif tries < options.max_tries:
                    depth, tries = options.depth, 2 * tries
                else:
                    return off, int((off + sz).max()), moved
                break
            moved += 1
    return off, int((off + sz).max()), moved


def cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Follower:
    """Ejection chains in a thread beside the squeaky wheel (with two cores or more; ``_move`` and the
    greedy pass run without the GIL): ``offer`` (the squeaky wheel's ``on_best``) hands it each lower
    layout; it works from the lowest layout known, its own or the squeaky wheel's, and starts again from
    the squeaky wheel's when that becomes lower than the one it is lowering; when its escalation ends it
    waits for a lower one. ``finish`` stops it, or with ``wait`` (the search ended before the deadline
    without reaching the target) lets it end by itself (at the latest at ``deadline``), and returns its
    lowest layout and height (None, 0 when it made none)."""

    def __init__(self, lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray,
                 target: int, deadline: float, options: EjectOptions = EjectOptions()) -> None:
        self._args = (lo, up, sz, al, floor)
        self._target, self._deadline, self._options = target, deadline, options
        self._lock = threading.Lock()
        self._latest: tuple[np.ndarray, int] | None = None
        self._own: tuple[np.ndarray, int] | None = None
        self._done = threading.Event()
        self._closed = threading.Event()  # no more offers
        self._limit = np.array([deadline], np.float64)  # brought forward by ``finish`` and ``offer``
        self._working = 1 << 62  # height of the layout being repaired
        self._thread = threading.Thread(target=self._run, name="rhino-eject", daemon=True)

    def start(self) -> "Follower":
        self._thread.start()
        return self

    def offer(self, offsets: np.ndarray, height: int) -> None:
        with self._lock:
            if self._latest is None or height < self._latest[1]:
                self._latest = (np.array(offsets, np.int64), int(height))
            if height < self._working:  # lower than the layout being repaired: start again from it
                self._limit[0] = 0.0

    def _latest_height(self) -> int | None:
        with self._lock:
            return None if self._latest is None else self._latest[1]

    def _run(self) -> None:
        waiting_below = None  # after the escalation ended: wait for a squeaky layout below this height
        while not self._done.is_set() and time.monotonic() < self._deadline:
            with self._lock:
                latest = self._latest
            if latest is None or (waiting_below is not None and latest[1] >= waiting_below):
                if self._closed.is_set():  # no lower layout will come
                    break
                self._done.wait(0.05)
                continue
            start = self._own if self._own is not None and self._own[1] <= latest[1] else latest
            with self._lock:
                self._working, self._limit[0] = start[1], self._deadline
            off, h, _ = eject_repair(*self._args, start[0], self._target, self._deadline, self._options,
                                     stop=self._stop, limit=self._limit)
            if self._own is None or h < self._own[1]:
                self._own = (off, h)
            lh = self._latest_height()
            waiting_below = None if lh is not None and lh < h else h
        with self._lock:
            self._working = 1 << 62

    def _stop(self, height: int) -> bool:
        with self._lock:
            self._working = height
            lh = None if self._latest is None else self._latest[1]
        return self._done.is_set() or (lh is not None and lh < height)

    def finish(self, wait: bool = False) -> tuple[np.ndarray | None, int]:
        if wait:  # the search stopped early: let the chains go on until they end or the deadline
            self._closed.set()
        else:
            self._done.set()
            self._limit[0] = 0.0
        self._thread.join(max(0.0, self._deadline - time.monotonic()) + 1.0)
        return (None, 0) if self._own is None else self._own
