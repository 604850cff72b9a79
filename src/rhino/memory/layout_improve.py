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

Focus (``ImproveOptions.focus``; a pass on 60,000 buffers costs seconds, so the plain search gets few):
the pressure at time ``t`` is the bytes live at ``t`` plus the highest floor among the buffers live at
``t``; a buffer is hot when the highest pressure over its lifetime plus ``focus_size * s_i`` is at
least ``focus * T`` (a buffer live where the arena is nearly full, or large against the slack there),
or when it ends above ``T`` in ``start``. Where hot buffers are at most ``focus_share`` of all, the
passes above run on the hot buffers alone (their own time index: a pass costs a fraction of a full
one), boosting every hot buffer that ends above ``T - focus_band * (h - T)`` (``h``: the pass's height;
the band 0 is the rule above: only those above ``T``); every time the best hot layout has not improved for ``focus_stall`` passes, reaches ``T``, or
the time left is about that of one completion, it is completed: the cold buffers go lowest fit in
decreasing ``pi`` around the hot ones (``given``), which is a valid layout of all buffers. Cold
buffers that end above ``T`` there become hot (boosted) and the hot search goes on with the priorities
it has. At every time where the pressure is at least ``focus * T`` all live buffers are hot, so the
hot search sees the whole problem where the arena is full; elsewhere the cold ones have slack.

Measured on ``benchmarks/layout_scale.py``'s ``random-1`` (60,000 buffers, one leaf; gaps over the
max-load bound): one lowest-fit pass by size 3.95%, by ``s * life ** alpha`` 3.33% / 3.24% / 2.68% /
4.53% at ``alpha`` 0.1 / 0.2 / 0.3 / 0.5; squeaky wheel from ``alpha`` 0.3, boost 1.5: 1.74% after
9 passes (58 s at load ~10, 2 shared cores); ``rhino layout --time-limit 60``: 2.04% (load 14.5).
``wide-1``: 5.51% (the size pass alone 5.52%). Focus (``solve_layout``, 50 s, in one process, load
~6, plain search / focus 0.9 one after the other): ``random-1`` 1.81% / 0.69%, ``random-2`` 1.93% / 1.31%
(0.95: 1.46%); the hot search alone on ``random-1``'s 1,604 hot buffers at 0.95 levels off at ~0.55% after
~500 passes (boost 1.2 / 2 / 3: 0.89 / 1.12 / 1.68%). Hot search alone at 0.9 (deterministic, best after
100 / 150 / 200 passes): ``random-1`` (5,481 hot) band 0: 1.458 / 1.124 / 0.743%, band 1: 0.797 / 0.591 /
0.564%, boost by the excess (1 + 0.5 (e - T) / (h - T)): 1.331 / 1.259 / 1.259%; ``random-2`` (4,954 hot)
band 0: 1.209% at 100-200, band 1: 1.179 / 1.179 / 0.835%. Tried and not kept (``docs/benchmarks.md``): ruin and
recreate of time x address boxes at the peak, and orders grouped by the highest load over a lifetime.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numba
import numpy as np

from .layout_eject import EjectOptions, eject_repair
from .layout_greedy import place_in_order, time_index
from .layout_skyline import SkylineOptions, skyline_search

__all__ = ["ImproveOptions", "hot_buffers", "plain_skyline", "search_kind", "squeaky_wheel", "step_pressure"]


@dataclass(frozen=True)
class ImproveOptions:
    """Squeaky-wheel search (see the module docstring): ``alpha`` the lifetime exponent of the first
    priorities, ``boost`` the factor for a buffer above the target, ``max_passes`` a cap on passes
    (0: none); ``greedy_share``: of a leaf's time, the share that the greedy passes before the search may
    take (a pass past it stops; the first always finishes). ``focus`` (0: off), ``focus_size``,
    ``focus_share``, ``focus_stall``, ``focus_band``: the search on the hot buffers (module docstring). Values: chosen on
    ``random-1`` (0.9 / 6 after 0.9 / 0 and 0.95 / 6: large cold buffers ended above the target in the
    completions), ``focus_share`` so that ``wide-1`` and the training leaves (hot share 0.67 and more)
    keep the plain search, lowered from 0.5 to 0.4 with the skyline passes (session 14): ``wide-2`` (45.6%
    hot with its first pass) 1.436% focused, 0.955% with skyline passes (``solve_layout``, 52 s); the
    ``random`` traces are 12-18% hot. ``plain``: the passes of the plain search, ``"skyline"`` (``layout_skyline``,
    with ``skyline``'s settings; a pass 5-10 times faster, lower on the ``wide`` traces) or
    ``"lowest-fit"`` (the passes above). ``skyline_start`` (``layout._greedy_phase``): one skyline pass
    (``first_priorities``) joins a large leaf's greedy passes and is kept where lower; where its excess
    over the target is at most ``skyline_switch`` times the first greedy pass's, the plain (skyline)
    search runs whatever the focus says. Measured (``rhino layout --time-limit 60``): the public
    ``pangu_2.6B`` trace (18,692 buffers, 23% hot) 2.44% with the focus, 0.758% for the skyline pass,
    0.000% with the skyline search from it (8.8 s; excess ratio 0.23); ``wide-4`` (ratio 0.90) 1.116%
    focused, 1.496% switched, hence 0.5. ``skyline_start_share``: of the leaf's time, the most that pass
    may take (it is dropped if not done by then; it runs in a thread beside the first greedy pass, which
    it stops once it has a layout and that pass is past ``greedy_share``): ~0.1-0.4 s on 60,000 buffers of
    most shapes (1.6 s on ``dense-1``, whose lowest-fit pass takes 17 s), but its scan for a buffer that
    fits the lowest run grows quadratically where most lifetimes overlap (one pass on the whole of
    ``nested-1`` 13 s, a 60,000-buffer clique 20 s, ``lifo-1`` 3.8 s). It was 0.1 with the passes one
    after the other: at ``--time-limit 5`` on ``dense-1`` the skyline pass was dropped and the lowest-fit
    pass, cut at the deadline, stacked the rest (12.650% over the bound; 3.195% now; at 60 s unchanged
    on 12 traces, ``docs/benchmarks.md`` session 23). ``second_share``: the
    second lowest-fit pass (``GreedyOrder.SIZE_START``) may run past ``greedy_share`` for 1.5 times the
    first's time, up to this share of the leaf's time (``onesizeplus-1``: at the bound in 3.3 s against 26.8 s
    without; ``paged-1``'s passes take 15-19 s, beyond it, so it stays 0.370% where that pass alone is at
    the bound). ``focus_greedy_share``: ``greedy_share`` where the search will be the focused one (its hot passes
    do not start from the greedy layouts, which only set the height to beat). ``completion_eject``: with
    ``squeaky_wheel``'s ``eject``, a completion that ends above the target gets ejection chains (``layout_eject``)
    for at most this share of the search's time before it counts: the cold buffers that a completion puts on top
    of a low hot layout come down instead of raising it. Both measured in session 41 (``solve_layout``, 56 s,
    ``random-1..8``, ``-11``, ``-14``; ``docs/benchmarks.md``): ``random-11`` 2.599% -> 1.615% (a hot layout at
    1.858% completed to 3.461% by nine cold buffers of ~3.5 MB, 1.615% after the chains), ``random-4`` 1.153% ->
    0.957% (the greedy share), the others within 0.07% either way. With the chains, a completion (and a new hot
    search where cold buffers join the hot ones) pays sooner, so ``focus_stall`` went from 60 to 10 (chosen on
    ``random-1``, ``-2``, ``-4``, ``-7``, ``-11``, ``-14`` at 60 / 35 / 20 / 10 / 5: ``random-11`` 1.615 / 1.615 /
    1.236 / 0.998 / 1.289%, ``random-14`` 2.646 / 1.943 / 1.943 / 1.943 / 1.943%)."""
    enabled: bool = True
    greedy_share: float = 0.35
    alpha: float = 0.3
    boost: float = 1.5
    max_passes: int = 0
    focus: float = 0.9
    focus_size: float = 6.0
    focus_share: float = 0.4
    focus_stall: int = 10
    focus_band: float = 1.0
    plain: str = "skyline"
    focus_greedy_share: float = 0.1
    completion_eject: float = 0.05
    skyline: SkylineOptions = SkylineOptions()
    skyline_start: bool = True
    skyline_switch: float = 0.5
    skyline_start_share: float = 0.5
    second_share: float = 0.1
    # above this many buffers the skyline pass may take ``huge_skyline_share`` of the leaf's time: on a
    # 1,000,000-buffer leaf of ~1,250 live buffers it took 14 s and came 3.99% above the bound, where the
    # first lowest-fit pass took 44 s for 17-19%; the quadratic shapes above are 60,000 buffers
    huge: int = 200_000
    huge_skyline_share: float = 0.4

    def __post_init__(self) -> None:
        if self.plain not in ("skyline", "lowest-fit"):
            raise ValueError(f"ImproveOptions.plain is {self.plain!r}; use 'skyline' or 'lowest-fit'")


def squeaky_wheel(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray, target: int,
                  deadline: float, options: ImproveOptions = ImproveOptions(),
                  start: np.ndarray | None = None,
                  on_best: Callable[[np.ndarray, int], None] | None = None,
                  plain: bool = False, eject: EjectOptions | None = None) -> tuple[np.ndarray | None, int, int]:
    """The lowest layout (offsets in input order) of the squeaky-wheel passes until ``deadline``
    (``time.monotonic``) or a height at most ``target``; ``start``: a layout to beat (kept when no pass
    is lower); ``on_best(offsets, height)`` is called with every lower layout found; ``plain``: the plain
    search whatever the focus would say (``layout._greedy_phase``: a skyline pass far below the greedy
    ones); ``eject``: the ejection chains of the focused search's completions (``completion_eject``; None: none).
    Returns the offsets (None when no pass finished and no ``start``), their height and the
    number of passes finished (with ``focus``: hot passes and completions)."""
    lo, up, sz, al, floor = (np.ascontiguousarray(x, np.int64) for x in (lo, up, sz, al, floor))
    best = None if start is None else np.asarray(start, np.int64)
    best_h = int((best + sz).max(initial=0)) if best is not None else 0
    if len(sz) == 0 or (best is not None and best_h <= target):
        return best, best_h, 0
    # in log space: a boost adds log(boost) (repeated boosts would overflow a product after ~1,750 passes)
    with np.errstate(divide="ignore"):
        pri = np.log(sz.astype(np.float64)) + options.alpha * np.log((up - lo).astype(np.float64))
    step = float(np.log(options.boost))
    if not plain:
        hot = _hot_to_focus(lo, up, sz, floor, target, options, best)
        if hot is not None:
            return _focused(lo, up, sz, al, floor, target, deadline, options, best, best_h, pri, hot, on_best, eject)
    if options.plain == "skyline":
        return skyline_search(lo, up, sz, al, floor, target, deadline, options.skyline, best, on_best,
                              options.max_passes)
    ix = time_index(lo, up, sz)
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
        end, best, best_h = _keep(off, sz, best, best_h, on_best)
        if best_h <= target:
            break
        pri[end > target] += step
        prev_order, prev_off = order, off
    return best, best_h, passes


def hot_buffers(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, floor: np.ndarray, target: int,
                options: ImproveOptions = ImproveOptions()) -> np.ndarray:
    """The hot buffers of the focus (module docstring) without a first layout: those whose highest
    pressure over their lifetime plus ``focus_size`` times their size reaches ``focus * target``."""
    pressure = lifetime_pressure(*(np.ascontiguousarray(x, np.int64) for x in (lo, up, sz, floor)))
    return (pressure + options.focus_size * sz >= options.focus * target) & (sz > 0)


def _hot_to_focus(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, floor: np.ndarray, target: int,
                  options: ImproveOptions, start: np.ndarray | None) -> np.ndarray | None:
    """The hot buffers where the focus applies (``focus`` on, at most ``focus_share`` of the buffers hot, those
    above the target in ``start`` included), else None."""
    if options.focus <= 0:
        return None
    hot = hot_buffers(lo, up, sz, floor, target, options)
    if start is not None:
        hot |= np.asarray(start) + sz > target
    return hot if hot.sum() <= options.focus_share * len(sz) else None


def search_kind(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, floor: np.ndarray, target: int,
                options: ImproveOptions = ImproveOptions(), start: np.ndarray | None = None) -> str:
    """The search ``squeaky_wheel`` (without ``plain``) will run on these buffers from ``start``: ``"focus"``
    (the focus applies), else ``options.plain`` (``"skyline"`` or ``"lowest-fit"``)."""
    lo, up, sz, floor = (np.ascontiguousarray(x, np.int64) for x in (lo, up, sz, floor))
    return "focus" if _hot_to_focus(lo, up, sz, floor, target, options, start) is not None else options.plain


def plain_skyline(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, floor: np.ndarray, target: int,
                  options: ImproveOptions = ImproveOptions(), start: np.ndarray | None = None) -> bool:
    """Whether ``squeaky_wheel`` on these buffers (from ``start``) will be the skyline search: ``plain``
    is ``"skyline"`` and the focus does not apply (more than ``focus_share`` hot)."""
    return search_kind(lo, up, sz, floor, target, options, start) == "skyline"


def _keep(off: np.ndarray, sz: np.ndarray, best: np.ndarray | None, best_h: int,
          on_best: Callable[[np.ndarray, int], None] | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """A finished pass's ends, and the lowest layout so far with its height (``off`` when lower than
    ``best``, or when there is no ``best``; then ``on_best`` hears of it)."""
    end = off + sz
    h = int(end.max(initial=0))
    if best is None or h < best_h:
        if on_best is not None:
            on_best(off, h)
        return end, off, h
    return end, best, best_h


def _focused(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, floor: np.ndarray, target: int,
             deadline: float, options: ImproveOptions, best: np.ndarray | None, best_h: int, pri: np.ndarray,
             hot: np.ndarray, on_best: Callable[[np.ndarray, int], None] | None = None,
             eject: EjectOptions | None = None) -> tuple[np.ndarray | None, int, int]:
    """``squeaky_wheel`` on the hot buffers ``hot`` alone, each best hot layout completed by placing the
    cold ones around it (see the module docstring), a completion above ``target`` lowered by ejection chains
    (``eject``, ``completion_eject``). ``pri`` is updated in place."""
    n = len(sz)
    chains_s = options.completion_eject * max(0.0, deadline - time.monotonic())
    step = float(np.log(options.boost))  # priorities are logarithms (``squeaky_wheel``)
    passes = 0
    comp_s = None  # wall seconds of the last completion (a full pass with the hot buffers given)
    idx = None
    while time.monotonic() < deadline and (options.max_passes <= 0 or passes < options.max_passes):
        if idx is None:  # a new hot set: its own time index and search
            idx = np.flatnonzero(hot)
            sub = (lo[idx], up[idx], sz[idx], al[idx], floor[idx])
            ix = time_index(*sub[:3])
            sub_off, sub_h, fresh, stall, per_pass = None, 0, False, 0, None
        # keep time for one completion (the last one's seconds, at first a hot pass scaled to all
        # buffers); complete from 3x that before the deadline, which leaves time for cold buffers that
        # end above the target to join and be completed once more
        est = comp_s if comp_s is not None else (per_pass * n / len(idx) if per_pass else 0.0)
        pass_deadline = deadline - 1.5 * est
        last = options.max_passes > 0 and passes >= options.max_passes - 1  # the last pass completes
        if not (fresh and (sub_h <= target or stall >= options.focus_stall or last
                           or time.monotonic() > deadline - 3 * est)):
            if time.monotonic() > pass_deadline:
                break
            t = time.monotonic()
            off = place_in_order(*sub, np.argsort(-pri[idx], kind="stable"), pass_deadline, lowest=True, index=ix)
            if off is None:
                if fresh:
                    continue  # complete what was found
                break
            per_pass = time.monotonic() - t
            passes += 1
            end = off + sub[2]
            h = int(end.max(initial=0))
            if sub_off is None or h < sub_h:
                sub_off, sub_h, fresh, stall = off, h, True, 0
            else:
                stall += 1
            pri[idx[end > target - options.focus_band * max(h - target, 0)]] += step
            continue
        t = time.monotonic()
        given = np.full(n, -1, np.int64)
        given[idx] = sub_off
        off = place_in_order(lo, up, sz, al, floor, np.argsort(-pri, kind="stable"), deadline, lowest=True,
                             given=given)
        fresh, stall = False, 0
        if off is None:
            break
        comp_s = time.monotonic() - t
        passes += 1
        if eject is not None and chains_s > 0 and int((off + sz).max()) > target:
            off = eject_repair(lo, up, sz, al, floor, off, target, min(deadline, time.monotonic() + chains_s), eject)[0]
        end, best, best_h = _keep(off, sz, best, best_h, on_best)
        if best_h <= target:
            break
        over = (end > target) & ~hot
        if over.any():  # cold buffers that ended above the target join the hot ones, boosted
            pri[over] += step
            hot |= over
            idx = None
    return best, best_h, passes


@numba.njit(cache=True)
def _top_floor(a, b, fl, m):
    """Per time segment ``k < m``: the highest floor of the buffers covering it (buffer ``i`` covers
    segments ``a[i]:b[i]``), painted in decreasing floor with a next-unpainted pointer per segment."""
    out = np.zeros(m, np.int64)
    nxt = np.arange(m + 1)
    for i in np.argsort(-fl):
        if fl[i] <= 0:
            break
        k = a[i]
        while True:  # the first unpainted segment from a[i] on (path halving)
            while nxt[k] != k:
                nxt[k] = nxt[nxt[k]]
                k = nxt[k]
            if k >= b[i]:
                break
            out[k] = fl[i]
            nxt[k] = k + 1
    return out


def step_pressure(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, floor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pressure (``lifetime_pressure``) per segment ``[times[k], times[k + 1])`` between consecutive starts
    and ends: (times, pressure), ``len(pressure) == len(times) - 1``."""
    times = np.sort(np.concatenate([lo, up]))  # distinct by hand: np.unique is ~14x slower on 2,000,000 int64
    times = times[np.concatenate((times[:1] == times[:1], times[1:] != times[:-1]))]
    a, b = np.searchsorted(times, lo), np.searchsorted(times, up)
    m = len(times) - 1
    d = np.zeros(m + 1, np.int64)
    np.add.at(d, a, sz)
    np.add.at(d, b, -sz)
    table = np.cumsum(d)[:m]
    if (floor > 0).any():
        table = table + _top_floor(a, b, np.ascontiguousarray(floor, np.int64), m)
    return times, table


def lifetime_pressure(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, floor: np.ndarray) -> np.ndarray:
    """Per buffer, the highest pressure over its lifetime, where the pressure at time ``t`` is the bytes
    live at ``t`` plus the highest floor among the buffers live at ``t`` (with no floors: the max load
    over its lifetime). Times are compressed to the starts and ends; a sparse table answers the range
    maxima."""
    n = len(sz)
    if n == 0:
        return np.zeros(0, np.int64)
    times, table = step_pressure(lo, up, sz, floor)
    a, b = np.searchsorted(times, lo), np.searchsorted(times, up)
    level = np.frexp((b - a).astype(np.float64))[1] - 1  # floor(log2(segments covered)), exact
    out = np.zeros(n, np.int64)
    for q in range(int(level.max()) + 1):  # table[k] = max of segments k .. k + 2**q - 1
        sel = np.flatnonzero(level == q)
        out[sel] = np.maximum(table[a[sel]], table[b[sel] - (1 << q)])
        table = np.maximum(table[:-(1 << q)], table[1 << q:])
    return out
