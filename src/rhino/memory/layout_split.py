"""Decomposition of a large layout problem into independent leaves (numpy and numba; no torch).

Peel (exact while no cut was made). Let a window be a set of buffers with time span ``[A, B)`` (the
lowest start, the highest end). A buffer live over all of ``[A, B)`` ("spanning") overlaps every other buffer of the
window in time, so in any layout every other buffer lies wholly below or wholly above it; moving the
spanning buffers to the bottom of the window and shifting the buffers below them up by their sizes
keeps the layout valid (when every size is a multiple of every alignment) and its height. So the
spanning buffers are stacked at the window's base, and the rest splits into its independent
components (groups with no buffer crossing between them in time), each a window on top of that
stack (each buffer of the window gets that stack's top as its floor). Repeated, this gives leaves: no
leaf has a spanning buffer or splits further, and the problem's optimal height is the most over
leaves of the leaf's optimal height on its floor.

Key-point cut (heuristic, option ``cuts``): a leaf of more than ``max_leaf`` buffers is cut at a time
``t`` among the starts between the ``cut_band`` quantiles of its buffers (ROAM's key points divide
the graph where little memory is live; here the time is chosen by the bound below). The buffers live
across ``t`` are stacked (longest-lived to the right lowest, as saved activations nest), and every
other buffer of the leaf gets a floor: the highest end of the stacked buffers it overlaps in time
(a staircase, not the whole stack: a buffer after ``t`` rests only on those still live when it
starts). Both sides then split apart. The cut's bound is the most, over times ``u``, of the highest
stacked end a buffer live at ``u`` must rest on plus the other bytes live at ``u``; a cut is made only
when it is at most ``max_bound``. With floors, leaves are no longer independent of the stack, so a
decomposition with cuts is not exact (``Decomposition.exact``); the caller reports the height against
the problem's own lower bound.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numba
import numpy as np

from .layout_core import CoreOptions
from .layout_eject import EjectOptions
from .layout_improve import ImproveOptions
from .layout_window import WindowOptions

__all__ = ["SplitOptions", "Leaf", "Decomposition", "decompose", "splittable", "heavy_buffers"]


@dataclass(frozen=True)
class SplitOptions:
    """When and how ``layout.solve_layout`` decomposes: above ``above`` buffers (``enabled``) it peels
    and splits into leaves, each solved on its own; a leaf above ``max_leaf`` buffers is cut at a key
    point (``cuts``) when the cut's bound is within ``cut_tolerance`` (a fraction) of the problem's
    lower bound (with a capacity: within the capacity). ``above``: the branch and bound alone handles
    MiniMalloc's instances (up to ~500 buffers) and GPT-2 XL's 7,282 buffers within seconds
    (``_BNB_MAX_BUFFERS``'s measurement); ``max_leaf``: its set-up and search grow about quadratically."""
    enabled: bool = True
    above: int = 5000
    max_leaf: int = 6000
    cuts: bool = True
    cut_tolerance: float = 0.0
    cut_band: float = 0.25   # a cut leaves at least this fraction of the leaf's starts on each side
    cut_samples: int = 24    # cut times evaluated per leaf
    # above this many buffers in all, cut times are those of fewest bytes across, each with three stack
    # orders (``_cut_time``'s ``fine``): a 1,000,000-buffer trace 224,880% -> 1.282% over its bound (60 s;
    # as one leaf its first pass ran out of time). Not below: such cuts lost on 60,000 buffers, where the
    # one leaf's search does better (random-7 1.114 -> 2.954%, hugebytes-1 0.672 -> 2.388%, pangu_2.6B
    # 0.000 -> 0.758%; train-1, Y_1, lognorm-1, bimodal-1 at the bound either way; 90,000 buffers of the
    # long shape: 1.035% as one leaf, 2.064% cut)
    fine_cuts_above: int = 100_000
    # cuts stop (the windows left become leaves) past this share of the time left after the reserve:
    # the fine cuts of a 1,000,000-buffer trace took 7.3 s, so at --time-limit 15 the run ended at 26 s
    cut_share: float = 0.5
    # leaves' greedy also tries lowest fit (``layout_greedy``; random-1: 5.6% -> 4.0%), and so does the unsplit
    # problem's (``layout._best_greedy``; 5,000 buffers of power-of-two sizes aligned to their size: 3.396% ->
    # 0.554% over the bound at --time-limit 2, 0.920% -> 0.554% at 10)
    lowest_fit: bool = True
    # leaves' greedy phase also replays an online first-fit allocator (``layout_alloc``; 200,000-buffer
    # staircase, --time-limit 10: 8.308% -> 0.257%; a 200,000-buffer two-phase trace: 18.307% -> 0.107%;
    # wide-1, random-1, lifo-1 at 10 s unchanged)
    allocator: bool = True
    improve: ImproveOptions = ImproveOptions()  # leaves above max_leaf: squeaky wheel after the first pass
    big_first: bool = True  # leaves above max_leaf whose load a few buffers carry: those exactly first
    light_share: float = 0.005  # big_first: the others hold at most this fraction of the target live at once
    revisit: bool = True  # time left after every leaf: a large leaf's search again on the highest leaf (bimodal-1)
    eject: EjectOptions = EjectOptions()  # leaves above max_leaf: ejection chains after the squeaky wheel
    window: WindowOptions = WindowOptions()  # leaves above max_leaf: window repair after both (layout_window)
    core: CoreOptions = CoreOptions()  # large leaves and the revisit: the full steps' window exactly (layout_core)


@dataclass
class Leaf:
    index: np.ndarray  # input indices of its buffers (their floors: ``Decomposition.floor``)
    cut: bool          # some stacked buffer below it came from a key-point cut (not exact)


@dataclass
class Decomposition:
    offsets: np.ndarray      # stacked buffers' offsets (in input order; -1 for buffers of a leaf)
    floor: np.ndarray        # each leaf buffer's lowest offset (the stacked buffers below it)
    leaves: list[Leaf]
    stacked: int             # buffers stacked by peels and cuts
    cuts: int                # key-point cuts made

    @property
    def exact(self) -> bool:
        """No cut was made: the optimum is the max over leaves of the leaf's optimum on its floor."""
        return self.cuts == 0


def splittable(size: np.ndarray, alignment: np.ndarray) -> bool:
    """Peeling shifts buffers by the sizes of others: exact only when every size is a multiple of
    every alignment (then every base is aligned for every buffer too)."""
    lcm = int(np.lcm.reduce(alignment.astype(np.int64))) if alignment.size else 1
    return bool((size % lcm == 0).all())


@numba.njit(cache=True)
def _push_runs(arr, lo, up, s, e, base, ws, top):
    """Push the components of ``arr[s:e]`` (sorted by start; groups with no buffer crossing between them
    in time: its contiguous runs) onto the window stack ``ws`` as ``(start, end, base)``."""
    r, reach = s, up[arr[s]]
    for p in range(s + 1, e):
        if lo[arr[p]] >= reach:
            ws[top, 0], ws[top, 1], ws[top, 2] = r, p, base
            top += 1
            r, reach = p, up[arr[p]]
        else:
            reach = max(reach, up[arr[p]])
    ws[top, 0], ws[top, 1], ws[top, 2] = r, e, base
    return top + 1


@numba.njit(cache=True)
def _peel_windows(arr, lo, up, sz, floor, offsets, base0, peel, big):
    """The peels of ``arr``'s components (``arr``: buffer indices sorted by start, longest first among
    equal starts; each component on ``base0``): the spanning buffers of a window are its longest prefix
    whose every end is the largest from it on (each spans the rest, so the rest stays one component);
    they are stacked latest end lowest on the window's base (``offsets``), and the rest's components are
    windows on that stack's top. A window with no spanning buffer is a leaf (its buffers' ``floor``
    raised to its base), or, above ``big`` buffers, left to the caller (a cut). Returns the leaves
    ``[start, end)`` in ``arr``, the windows left ``[start, end, base]`` and the buffers stacked. In
    compiled code: on deeply nested lifetimes (a random stack of 60,000 buffers: 45,000 windows) the
    numpy version took 4.4 s."""
    n = arr.size
    ws = np.empty((n + 1, 3), np.int64)
    leaves, left = np.empty((n, 2), np.int64), np.empty((n, 3), np.int64)
    suf = np.empty(n, np.int64)
    nl = nleft = stacked = 0
    top = _push_runs(arr, lo, up, 0, n, base0, ws, 0) if n else 0
    while top > 0:
        top -= 1
        s, e, base = ws[top, 0], ws[top, 1], ws[top, 2]
        k = 0
        if peel:
            m = up[arr[e - 1]]
            for p in range(e - 1, s - 1, -1):
                m = max(m, up[arr[p]])
                suf[p] = m
            while s + k < e and up[arr[s + k]] >= suf[s + k]:
                k += 1
        if k == 0:
            if peel and e - s > big:
                left[nleft, 0], left[nleft, 1], left[nleft, 2] = s, e, base
                nleft += 1
            else:
                for p in range(s, e):
                    floor[arr[p]] = max(floor[arr[p]], base)
                leaves[nl, 0], leaves[nl, 1] = s, e
                nl += 1
            continue
        sub = arr[s:s + k]
        t = h = base
        for q in np.argsort(-up[sub], kind="mergesort"):  # latest end lowest, then by start (stable)
            i = sub[q]
            offsets[i] = max(t, floor[i])
            t = offsets[i] + sz[i]
            h = max(h, t)
        stacked += k
        if s + k < e:
            top = _push_runs(arr, lo, up, s + k, e, h, ws, top)
    return leaves[:nl], left[:nleft], stacked


def _profile(l: np.ndarray, u: np.ndarray, z: np.ndarray, times: int) -> np.ndarray:
    """Bytes live at each compressed time."""
    d = np.zeros(times + 1, np.int64)
    np.add.at(d, l, z)
    np.add.at(d, u, -z)
    return np.cumsum(d)[:times]


def _cut_time(idx: np.ndarray, lo: np.ndarray, up: np.ndarray, sz: np.ndarray, floor: np.ndarray, band: float,
              samples: int, fine: bool) -> tuple[int, int, int]:
    """The cut with the lowest bound among ``samples`` start times between the ``band`` quantiles of the
    starts, evenly spaced (ties: the most central), stacked latest end lowest: (time, bound, stack
    order: an index into ``_ORDERS``). ``fine``: the candidates are the start times across which the
    fewest bytes live instead, each tried with every stack order. Bound of a cut at ``t``: the buffers
    across it stacked, the larger over times ``u`` of the highest stacked end that a buffer live at
    ``u`` must rest on plus the other bytes live at ``u`` (a lower bound on the sides' height, given
    the stack). Why ``fine`` (``SplitOptions.fine_cuts_above``): the stack, and the room its staircase
    wastes beside the cut, grow with the bytes across; evenly spaced candidates with one order missed
    every cut of a 1,000,000-buffer trace whose load dips to under half its peak."""
    starts = np.sort(lo[idx])
    cand = np.unique(starts[int(len(starts) * band):int(len(starts) * (1 - band)) + 1])
    cand = cand[cand > starts[0]]  # a cut needs a buffer on each side
    if cand.size == 0:
        cand = np.unique(starts[starts > starts[0]])
    times = np.unique(np.concatenate([lo[idx], up[idx]]))
    nt = times.size
    l, u, z = np.searchsorted(times, lo[idx]), np.searchsorted(times, up[idx]), sz[idx]
    if cand.size > samples and not fine:
        cand = cand[np.linspace(0, cand.size - 1, samples).astype(np.int64)]
    elif cand.size > samples:
        # bytes live across each candidate: started before it minus ended at or before it
        began, ended = np.zeros(nt + 1, np.int64), np.zeros(nt + 1, np.int64)
        np.add.at(began, l + 1, z)
        np.add.at(ended, u, z)
        ct = np.searchsorted(times, cand)
        across = np.cumsum(began)[ct] - np.cumsum(ended)[ct]
        cand = np.sort(cand[np.lexsort((np.abs(cand - starts[len(starts) // 2]), across))[:samples]])
    # outside the span of the buffers across a cut nothing is stacked: the bound there is the load
    load = _profile(l, u, z, nt)
    before = np.maximum.accumulate(load)
    after = np.maximum.accumulate(load[::-1])[::-1]
    best, best_t, best_o = None, int(cand[0]), 0
    mid = starts[len(starts) // 2]
    for t in cand.tolist():
        tc = int(np.searchsorted(times, t))
        x = np.flatnonzero((l < tc) & (u > tc))
        a, b = int(l[x].min()), int(u[x].max())
        lx, ux = l[x] - a, u[x] - a
        # the other bytes live in the span: the load less the buffers across
        rest = load[a:b] - _profile(lx, ux, z[x], b - a)
        out = max(int(before[a - 1]) if a else 0, int(after[b]) if b < nt else 0)
        for o in range(len(_ORDERS) if fine else 1):
            perm = _ORDERS[o](l[x], u[x])
            end = np.empty(len(x), np.int64)  # in the order of ``x``
            end[perm] = _stack(idx[x[perm]], sz, floor[idx[x[perm]]])
            stair = np.zeros(b - a + 1, np.int64)
            np.maximum.at(stair, lx, end)  # left of t: the stacked buffers started by u
            left = np.maximum.accumulate(stair[:b - a])
            stair[:] = 0
            np.maximum.at(stair, ux, end)  # right of t: those still live after u
            right = np.maximum.accumulate(stair[::-1])[::-1][1:]
            c = tc - a
            key = (max(out, int((left[:c] + rest[:c]).max(initial=0)), int((right[c:] + rest[c:]).max(initial=0))),
                   abs(t - mid))
            if best is None or key < best:
                best, best_t, best_o = key, t, o
    return best_t, best[0], best_o


# stack orders of a cut (lowest first): the latest end (exact on the right), the earliest start (exact on
# the left), the longest lifetime
_ORDERS = (lambda l, u: np.lexsort((l, -u)), lambda l, u: np.lexsort((-u, l)), lambda l, u: np.lexsort((l, l - u)))


def _stack(x: np.ndarray, sz: np.ndarray, floors: np.ndarray) -> np.ndarray:
    """Ends of the buffers ``x`` stacked in that order, each on its floor (``floors``, in that order) or
    the one before: ``end_i = max_{j <= i} (floor_j + z_j + ... + z_i)``."""
    zc = np.cumsum(sz[x])
    return zc + np.maximum.accumulate(floors - (zc - sz[x]))


def _raise_floors(rest: np.ndarray, x: np.ndarray, end: np.ndarray, lo, up, floor) -> None:
    """Each buffer of ``rest`` rests above the stacked ``x`` that it overlaps in time. ``rest`` lies
    wholly before or wholly after every start of ``x`` (a cut) or inside all of ``x`` (a peel): the
    ``x`` a buffer overlaps are those starting before its end and ending after its start."""
    by_lo = np.argsort(lo[x], kind="stable")
    pm_lo = np.maximum.accumulate(end[by_lo])
    n_lo = np.searchsorted(lo[x][by_lo], up[rest], "left")  # x starting before the buffer ends
    by_up = np.argsort(-up[x], kind="stable")
    pm_up = np.maximum.accumulate(end[by_up])
    n_up = np.searchsorted(-up[x][by_up], -lo[rest], "left")  # x ending after the buffer starts
    a = np.where(n_lo > 0, pm_lo[np.maximum(n_lo - 1, 0)], 0)
    b = np.where(n_up > 0, pm_up[np.maximum(n_up - 1, 0)], 0)
    floor[rest] = np.maximum(floor[rest], np.minimum(a, b))


def decompose(lower, upper, size, max_leaf: int = 6000, cuts: bool = True, cut_band: float = 0.25,
              cut_samples: int = 24, max_bound: int | None = None, peel: bool = True,
              fine: bool = False, deadline: float | None = None) -> Decomposition:
    """Peel and (with ``cuts``) cut the buffers into leaves (see the module docstring); a cut is made
    only if its bound (``_cut_time``, by its ``fine`` rule with ``fine``) is at most ``max_bound``
    (None: any), and none after ``deadline`` (``time.monotonic()``). Zero-byte buffers get offset 0 and
    no leaf. ``peel`` only where ``splittable`` holds; without it the leaves are the components (groups
    with no buffer crossing between them in time: independent whatever the alignments, each from offset 0)."""
    lo, up = np.asarray(lower, np.int64), np.asarray(upper, np.int64)
    sz = np.asarray(size, np.int64)
    offsets = np.full(len(sz), -1, np.int64)
    offsets[sz == 0] = 0
    floor = np.zeros(len(sz), np.int64)
    leaves: list[Leaf] = []
    n_stacked = n_cuts = 0
    live = np.flatnonzero(sz > 0)
    live = live[np.lexsort((-up[live], lo[live]))]  # windows stay sorted by start, longest first
    # buffers whose components are to be peeled (sorted by start), below a cut?, the base they rest on
    todo = [(live, False, 0)] if live.size else []
    while todo:
        arr, cut, base = todo.pop()
        spans, left, k = _peel_windows(arr, lo, up, sz, floor, offsets, base, peel, max_leaf if cuts else arr.size)
        n_stacked += k
        leaves.extend(Leaf(_by_start(arr[s:e], lo), cut) for s, e in spans.tolist())
        for s, e, b in left.tolist():  # a window above max_leaf with no spanning buffer: a cut, if one fits
            idx = arr[s:e]
            floor[idx] = np.maximum(floor[idx], b)
            t, bound = None, None
            if deadline is None or time.monotonic() < deadline:
                t, bound, order = _cut_time(idx, lo, up, sz, floor, cut_band, cut_samples, fine)
            if t is None or (max_bound is not None and bound > max_bound):
                leaves.append(Leaf(_by_start(idx, lo), cut))
                continue
            span = (lo[idx] < t) & (up[idx] > t)
            x, rest = idx[span], idx[~span]
            x = x[_ORDERS[order](lo[x], up[x])]
            end = _stack(x, sz, floor[x])
            offsets[x] = end - sz[x]
            n_stacked += len(x)
            n_cuts += 1
            _raise_floors(rest, x, end, lo, up, floor)
            todo.append((rest, True, 0))  # (a cut always has buffers on both sides)
    floor[offsets >= 0] = 0
    return Decomposition(offsets, floor, leaves, n_stacked, n_cuts)


def _by_start(idx: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """A leaf's buffers by start, then index."""
    return idx[np.lexsort((idx, lo[idx]))]


def heavy_buffers(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, light_bytes: int, most: int) -> np.ndarray | None:
    """The fewest buffers, taken largest ``size x lifetime`` first, without which at most ``light_bytes`` are
    live at any time (sorted indices); None when that takes none or more than ``most``. Removing buffers
    never raises the load, so the count is found by bisection over prefixes of that order."""
    n = len(sz)
    order = np.lexsort((np.arange(n), -(sz.astype(np.float64) * (up - lo))))
    times = np.unique(np.concatenate([lo, up]))
    l, u = np.searchsorted(times, lo), np.searchsorted(times, up)

    def light_peak(k: int) -> int:
        rest = order[k:]
        return int(_profile(l[rest], u[rest], sz[rest], times.size).max(initial=0))

    if light_peak(0) <= light_bytes or light_peak(min(most, n)) > light_bytes:
        return None
    a, b = 1, min(most, n)
    while a < b:
        k = (a + b) // 2
        a, b = (a, k) if light_peak(k) <= light_bytes else (k + 1, b)
    return np.sort(order[:a])
