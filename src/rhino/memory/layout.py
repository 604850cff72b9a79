"""Memory layout for fixed lifetimes: an offset per buffer in one arena (pure Python + OR-Tools).

Problem: buffers ``i`` with half-open lifetimes ``[lower_i, upper_i)``, sizes ``s_i`` and alignments
``a_i``. Find offsets ``o_i`` (multiples of ``a_i``, ``o_i >= 0``) such that two buffers that are live
at the same time do not overlap in address: ``o_i + s_i <= o_j or o_j + s_j <= o_i``. Objective: the
height ``max_i o_i + s_i`` (minimised), or, with a capacity ``C``, any layout with height <= C.

Solvers (``solve_layout``):

1. Greedy best-fit in several orders (``GreedyOrder``): buffers are placed one by one, each at the
   lowest-waste gap among the buffers already placed that overlap it in time (XLA's and TFLite's
   greedy-by-size is ``SIZE``; ROAM's "long-lived first" baseline is ``LONG_LIVED_FIRST``).
   ``SIZE_START`` breaks ties between equal sizes by start: where every buffer has one size ``s`` (no
   floors, alignments dividing ``s``), every offset is a multiple of ``s``, and a buffer placed in start
   order overlaps only buffers live at its start (with it a clique of the interval graph: at most
   ``load / s - 1`` of them), so a free slot below the bound is left for it and the layout meets the
   bound (the greedy colouring of an interval graph by left ends; Golumbic, "Algorithmic Graph Theory
   and Perfect Graphs", 1980). On a 60,000-buffer trace of one size (``docs/benchmarks.md``) the squeaky wheel
   from ``SIZE`` ended 0.74% above the bound in 56 s, this order's lowest-fit pass at it in ~1 s. It is the
   leaves' second lowest-fit pass, their first where all sizes are equal (``_greedy_phase``: skyline vs ``SIZE``).
2. Exact, at a capacity: a portfolio of the MiniMalloc-style branch and bound (``layout_bnb``, in this thread) and
   CP-SAT (``layout_cpsat``, canonical then default search in time slices that double, in a second thread from
   half a second on); the first to find a layout or prove there is none stops the other. Without a capacity the
   height is minimised by asking it for capacities between the lower bound and the best height found (the bound
   first, then halving the gap); an unanswered capacity leaves the best layout so far (never nothing). On
   ``LayoutOptions.peak.min_buffers`` buffers or more, the first try gets ``1 - peak.share`` of its time and,
   unanswered, the peak split (``layout_peak``: the buffers live at the peak stacked in start order, the two sides
   laid out apart) the rest; its layout is kept where lower (``_fit_then_peak``; leaves of the split below too).

3. Large problems (more than ``LayoutOptions.split.above`` buffers): ``layout_split`` peels the buffers
   that span their window (exact) and cuts leaves larger than ``split.max_leaf`` at key points (only
   where the cut's bound stays within ``split.cut_tolerance`` of the lower bound); each leaf is laid
   out on the floors of the buffers stacked below it: greedy first, the portfolio above where greedy
   does not reach the height ``H`` (the bound or the capacity), in a share of the time by its size;
   a leaf above ``split.max_leaf`` (no exact search) gets the greedy passes, then, where a few buffers
   carry all but ``split.light_share`` of its load, those first (greedy, squeaky wheel, exact search) and
   the rest around them (``split.big_first``), then the squeaky-wheel search (``layout_improve``,
   ``split.improve``: lowest-fit passes on the hot buffers where few are hot, else skyline passes,
   ``layout_skyline``, after a shorter greedy phase; a first skyline pass joins the greedy ones and, where far
   lower, chooses the skyline search) for the rest of its share, first the core window where one applies
   (``layout_core``, ``split.core``: the buffers around a few full steps close together by the exact search, the
   rest around them), with ejection chains (``layout_eject``, ``split.eject``: the buffers above the target moved
   down by moving those in their way) on each completion of the hot search and on its best layouts in a thread
   beside it where there are two cores, else after it in ``split.eject.share`` of the share, then window repair
   (``layout_window``, ``split.window``: the top buffers' time windows laid out again around the others, where
   such windows are small) in ``split.window.share``; identical leaves (repeated layers or steps) share a layout.
   The branch and bound never sees more than ``split.max_leaf`` buffers there, which bounds its memory (its
   time-neighbour lists, undo logs and candidate pool grow with buffers x live buffers; buffers live over the whole
   step, such as parameters and optimizer state, neighbour every other one and are what the peel removes).
   Revisit (``split.revisit``): while time is left and the height is above ``H``'s start, the highest leaf gets a
   large leaf's search again from its layout, down to the next highest leaf's top, while that lowers it
   (``benchmarks/layout_scale.py``: ``bimodal-1``'s 3,742-buffer leaf kept its greedy 1.471% with 27 s of 60 unused,
   revisited 0.0005%; held-out ``realloc-2``: squeaky wheel 3.973%, with chains and window repair 2.827%, 0 now).

Time limit: greedy orders after the first stop at the deadline (the first one places the buffers it has not
reached on top when it passes), and the exact search runs in threads that are left at the deadline (their set-up
cannot be interrupted; they stop at their next check), so ``solve_layout`` returns about when its limit is up
(plus validating the result).

``lower_bound``: the most bytes live at one time, raised where alignments exceed sizes
(``layout_bound.aligned_bound``); a height equal to it is optimal.
``validate_layout`` is the independent checker every result goes through.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from operator import attrgetter
from typing import Callable, Hashable, Sequence

import numpy as np

from .layout_alloc import allocator_pass
from .layout_bound import aligned_bound, max_load
from .layout_check import buffer_arrays, layout_heights, validate_layout
from .layout_bnb import LayoutOptions, SearchStatus, capacity_in_range, preorder_indices, search_layout
from .layout_core import CoreSolver, core_window
from .layout_eject import Follower, cores, eject_repair
from .layout_greedy import greedy_order, lowest_firsts, lowest_fit_passes, place_in_order, slot_stack
from .layout_improve import search_kind, squeaky_wheel
from .layout_peak import peak_split
from .layout_skyline import SkylineRace, first_priorities
from .layout_split import decompose, heavy_buffers, splittable
from .layout_window import window_repair, windows_small

__all__ = ["Buffer", "GreedyOrder", "LayoutStatus", "LayoutResult", "LayoutOptions", "validate_layout",
           "lower_bound", "aligned_bound", "max_load", "height", "greedy_layout", "solve_layout"]

Progress = Callable[[str], None]
# above this CP-SAT only (with the split off; with it, leaves hold at most split.max_leaf buffers).
# Measured: GPT-2 XL (7,282 buffers) at its lower bound, 7,282 nodes, set-up 0.8 s + search 2.5 s (2
# cores, load 2.2); both grow about quadratically, so ~25 s at 20,000
_BNB_MAX_BUFFERS = 20000
# a large leaf's set-up before its first placement, per buffer: a 1,000,000-buffer leaf with no time left
# took 6.6 s to its greedy layout (the arrays, the skyline pass's, the pass's order), ``slot_stack`` 1.1 s
NO_PASS_SECONDS = 7e-6
# the allocator replay (``layout_alloc``) per buffer, at least: 1.0-2.2 s on the 1,000,000-buffer traces of
# ``docs/benchmarks.md`` session 24 (6-22% over the bound, where slots are 41-293%)
ALLOC_PASS_SECONDS = 1e-6
_ID = attrgetter("id")


@dataclass(frozen=True, slots=True)  # slots: 47 MB less RSS for 1,000,000 buffers read
class Buffer:
    id: Hashable
    lower: int
    upper: int      # exclusive
    size: int
    alignment: int = 1

    def __post_init__(self) -> None:
        if self.upper <= self.lower:
            raise ValueError(f"buffer {self.id}: upper ({self.upper}) must be greater than lower ({self.lower})")
        if self.size < 0:
            raise ValueError(f"buffer {self.id}: size must be >= 0, got {self.size}")
        if self.alignment < 1:
            raise ValueError(f"buffer {self.id}: alignment must be >= 1, got {self.alignment}")


class GreedyOrder(str, Enum):
    SIZE = "size"                          # largest first (XLA / TFLite greedy-by-size)
    LONG_LIVED_FIRST = "long_lived_first"  # longest lifetime first (ROAM's heuristic baseline)
    AREA = "area"                          # largest size x lifetime first
    START = "start"                        # by start time (an allocator's view, first-fit in time)
    # largest first, equal sizes by start: one size and no floors, any fit in start order is optimal (module docstring)
    SIZE_START = "size_start"


class LayoutStatus(str, Enum):
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    UNKNOWN = "unknown"


@dataclass
class LayoutResult:
    status: LayoutStatus
    offsets: dict
    height: int
    lower_bound: int
    seconds: float
    solver: str  # "greedy/<order>", "bnb", "cp-sat/canonical-<preorder>" or "cp-sat/default"
    notes: list[str] = field(default_factory=list)
    nodes: int = 0  # branch-and-bound nodes explored
    valid: bool = False  # validate_layout found no overlap, no negative offset (and, with a capacity, the
    #                      layout fits whenever the status says it does)


def height(buffers: Sequence[Buffer], offsets: dict) -> int:
    return int(layout_heights(buffers, offsets).max(initial=0))


def lower_bound(buffers: Sequence[Buffer]) -> int:
    """No layout is lower: the most bytes live at one time, or more where alignments exceed sizes
    (``aligned_bound``)."""
    return aligned_bound(*buffer_arrays(buffers))


def _key(order: GreedyOrder) -> Callable[[Buffer], tuple]:
    if order is GreedyOrder.SIZE:
        return lambda b: (-b.size, b.lower - b.upper, b.lower)
    if order is GreedyOrder.LONG_LIVED_FIRST:
        return lambda b: (b.lower - b.upper, -b.size, b.lower)
    if order is GreedyOrder.AREA:
        return lambda b: (-b.size * (b.upper - b.lower), -b.size, b.lower)
    if order is GreedyOrder.SIZE_START:
        return lambda b: (-b.size, b.lower, b.lower - b.upper)
    return lambda b: (b.lower, -b.size)


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def greedy_layout(buffers: Sequence[Buffer], order: GreedyOrder | str = GreedyOrder.SIZE,
                  floor: dict | None = None, deadline: float | None = None, finish: bool = False) -> dict | None:
    """Best-fit placement in ``order``: each buffer goes into the smallest gap (between buffers already
    placed that overlap it in time) that holds it, else on top of them; ties go to the lowest gap.
    Each placement is vectorised over the placed buffers (numpy), so n buffers cost n array passes.
    ``floor``: the lowest offset of some buffers (by id). When ``deadline`` (``time.monotonic``) passes
    first: None, or with ``finish`` the buffers left go above all placed so far, in slots by size class
    (``slot_stack``)."""
    order = GreedyOrder(order)
    floor = floor or {}
    n = len(buffers)
    lo, up = np.empty(n, np.int64), np.empty(n, np.int64)
    off, end = np.empty(n, np.int64), np.empty(n, np.int64)
    count = 0
    offsets: dict = {}
    ranked = sorted(buffers, key=_key(order))
    for k, b in enumerate(ranked):
        if b.size == 0:
            offsets[b.id] = 0
            continue
        if deadline is not None and count % 256 == 0 and time.monotonic() > deadline:
            if not finish:
                return None
            rest = [r for r in ranked[k:] if r.size]
            fields = (np.array([getattr(r, a) for r in rest], np.int64) for a in ("lower", "upper", "size",
                                                                                  "alignment"))
            fl = np.array([floor.get(r.id, 0) for r in rest], np.int64)
            at = slot_stack(*fields, fl, int(end[:count].max(initial=0)))
            offsets.update((r.id, int(o)) for r, o in zip(rest, at.tolist()))
            offsets.update((r.id, 0) for r in ranked[k:] if not r.size)
            return offsets
        f = _align(floor.get(b.id, 0), b.alignment)
        live = np.flatnonzero((lo[:count] < b.upper) & (up[:count] > b.lower))
        best = f
        if live.size:
            o, e = off[live], end[live]
            rank = np.lexsort((e, o))
            o, e = o[rank], e[rank]
            below = np.maximum.accumulate(np.concatenate(([0], e[:-1])))  # highest end under each gap
            start = np.maximum(-(-below // b.alignment) * b.alignment, f)
            waste = o - start - b.size
            fits = np.flatnonzero(waste >= 0)
            if fits.size:
                best = int(start[fits[np.argmin(waste[fits])]])
            else:
                best = max(_align(max(int(below[-1]), int(e[-1])), b.alignment), f)
        offsets[b.id] = best
        lo[count], up[count], off[count], end[count] = b.lower, b.upper, best, best + b.size
        count += 1
    return offsets


def _best_greedy(buffers: Sequence[Buffer], deadline: float | None = None, lowest_fit: bool = False) -> tuple:
    """The lowest greedy layout; orders after the first stop at ``deadline``; with ``lowest_fit``
    (``SplitOptions.lowest_fit``), the compiled lowest-fit passes (``lowest_fit_passes``) after the first."""
    best, more, t0 = None, None, time.monotonic()
    for order in GreedyOrder:
        offs = greedy_layout(buffers, order, deadline=None if best is None else deadline)
        if offs is None:
            break
        if best is None and lowest_fit:
            more = lowest_fit_passes(buffers, deadline, time.monotonic() - t0)
        h = height(buffers, offs)
        if best is None or h < best[1]:
            best = (offs, h, order.value)
    return more if more is not None and more[1] < best[1] else best


SOLVER_THREAD = "rhino-solver-"   # name prefix of the search threads left running at a deadline (see cli.main.entry)


def _fit(buffers: Sequence[Buffer], capacity: int, deadline: float, options: LayoutOptions,
         say: Progress, floor: list[int] | None = None) -> tuple[SearchStatus, dict | None, str, int]:
    """One capacity: branch and bound here and CP-SAT in a thread, the first answer wins (``floor``:
    a lowest offset per buffer)."""
    from .layout_cpsat import CpsatRun, CpStrategy
    lo, up = [b.lower for b in buffers], [b.upper for b in buffers]
    sz, al = [b.size for b in buffers], [b.alignment for b in buffers]
    stop = threading.Event()
    found: list[tuple[SearchStatus, list[int] | None, str]] = []
    runs: list[CpsatRun] = []
    t0 = time.monotonic()
    bnb = len(buffers) <= _BNB_MAX_BUFFERS and capacity_in_range(sz, al, capacity)

    def portfolio() -> None:
        if bnb and stop.wait(0.5):  # small instances are settled by the branch and bound alone
            return
        plan = [(CpStrategy.CANONICAL, p) for p in options.preorders[:2]] + [(CpStrategy.DEFAULT, None)]
        orders = {}
        for _, p in plan:
            if p is not None and not stop.is_set():
                orders[p] = preorder_indices(lo, up, sz, p)
        slice_s = 2.0
        while not stop.is_set():
            for strategy, p in plan:
                left = deadline - time.monotonic()
                if left < 0.5 or stop.is_set():  # building the model alone takes a while on big problems
                    return
                run = CpsatRun()
                runs.append(run)
                name = f"cp-sat/{strategy.value}" + (f"-{p.value}" if p is not None else "")
                st, offs = run.solve(lo, up, sz, al, capacity, strategy, orders.get(p), min(slice_s, left), floor)
                if st is not SearchStatus.LIMIT:
                    found.append((st, offs, name))
                    stop.set()
                    return
            slice_s *= 2

    def tick(nodes: int) -> None:
        say(f"layout: capacity {capacity:,}: {nodes:,} nodes, {time.monotonic() - t0:.0f}s")

    def exact() -> None:
        res = search_layout(lo, up, sz, al, capacity, options, deadline=deadline, stop=stop, progress=tick,
                            floor=floor)
        done.append(res)
        if res.status is not SearchStatus.LIMIT:
            found.insert(0, (res.status, res.offsets, "bnb"))
            stop.set()

    # both run in threads that this one leaves at the deadline (their set-up cannot be interrupted; they
    # stop at their next check of ``stop``), so that the time limit holds
    done: list = []
    worker = threading.Thread(target=portfolio, daemon=True, name=SOLVER_THREAD + "cp-sat") if options.cpsat else None
    searcher = threading.Thread(target=exact, daemon=True, name=SOLVER_THREAD + "bnb") if bnb else None
    for t in (worker, searcher):
        if t is not None:
            t.start()
    try:
        if searcher is None and worker is None:
            return SearchStatus.LIMIT, None, "", 0
        while not stop.is_set() and time.monotonic() < deadline and any(
                t is not None and t.is_alive() for t in (worker, searcher)):
            stop.wait(min(0.05, max(0.0, deadline - time.monotonic())))
    finally:
        stop.set()
        for run in runs:
            run.stop()
        for t in (worker, searcher):
            if t is not None:
                t.join(0.2)
    nodes = done[0].nodes if done else 0
    if not found:
        return SearchStatus.LIMIT, None, "", nodes
    st, offs, name = found[0]
    return st, (None if offs is None else {b.id: o for b, o in zip(buffers, offs)}), name, nodes


def solve_layout(buffers: Sequence[Buffer], capacity: int | None = None, time_limit: float = 60.0,
                 options: LayoutOptions = LayoutOptions(), progress: Progress | None = None,
                 exact: bool = True) -> LayoutResult:
    """The lowest layout found within ``time_limit`` (see the module docstring); with ``capacity``, one
    that fits if any is found (``INFEASIBLE`` when proven impossible, ``UNKNOWN`` when time ran out:
    then the layout is the best greedy one, above the capacity). ``exact=False``: greedy only."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + time_limit
    say = progress or (lambda m: None)
    ids = [b.id for b in buffers]
    if len(set(ids)) != len(ids):
        raise ValueError("buffer ids must be unique")
    split = options.split
    if exact and split.enabled and len(buffers) > split.above:
        res = _solve_split(buffers, capacity, deadline, options, say)
        if res is not None:
            res.seconds = time.perf_counter() - t0
            return res
    lb = lower_bound(buffers)
    offsets, h, how = _best_greedy(buffers, deadline, options.split.lowest_fit)
    say(f"layout: greedy {h:,} ({how}), lower bound {lb:,}")
    solver, nodes = f"greedy/{how}", 0
    if capacity is not None:
        if lb > capacity:
            status = LayoutStatus.INFEASIBLE
        elif h <= capacity:
            status = LayoutStatus.OPTIMAL if h == lb else LayoutStatus.FEASIBLE
        elif not exact:
            status = LayoutStatus.UNKNOWN
        else:
            st, offs, name, nodes, lower = _fit_then_peak(buffers, capacity, deadline, options, say)
            status = {SearchStatus.INFEASIBLE: LayoutStatus.INFEASIBLE, SearchStatus.LIMIT: LayoutStatus.UNKNOWN,
                      SearchStatus.FOUND: LayoutStatus.FEASIBLE}[st]
            if offs is not None and _accept(buffers, offs, capacity, name, say):
                offsets, h, solver = offs, height(buffers, offs), name
                status = LayoutStatus.OPTIMAL if h == lb else status
            elif st is SearchStatus.FOUND:
                status = LayoutStatus.UNKNOWN
            elif lower is not None and lower[1] < h:  # above the capacity, but below greedy
                offsets, h, solver = lower[0], lower[1], "peak-split"
    else:
        proven = lb  # no layout is lower than this
        if exact:
            offsets, h, name, proven, nodes = _minimize(buffers, None, offsets, h, lb, deadline, options, say)
            solver = name or solver
        status = LayoutStatus.OPTIMAL if h <= proven else LayoutStatus.FEASIBLE
    fits = status in (LayoutStatus.OPTIMAL, LayoutStatus.FEASIBLE)
    valid = not validate_layout(buffers, offsets, capacity if fits else None)
    say(f"layout: {status.value}, height {h:,} ({solver}){'' if valid else ', INVALID'}")
    return LayoutResult(status, offsets, h, lb, time.perf_counter() - t0, solver, nodes=nodes, valid=valid)


def _peak(buffers: Sequence[Buffer], floor: list[int] | None, cap: int, deadline: float, options: LayoutOptions,
          say: Progress) -> tuple[dict, int] | None:
    """The peak split's layout (``layout_peak``) toward ``cap`` until ``deadline``, with its height; None
    where it does not apply (``PeakOptions``), did not finish or fails the validator."""
    peak = options.peak
    if not peak.enabled or len(buffers) < peak.min_buffers:
        return None
    lo, up, sz, al = buffer_arrays(buffers)
    fl = np.zeros(len(buffers), np.int64) if floor is None else np.array(floor, np.int64)
    off, h, passes = peak_split(lo, up, sz, al, fl, cap, deadline, peak)
    if off is None or (off < fl)[sz > 0].any():  # empty buffers sit at 0 (``place_in_order``)
        return None
    say(f"layout: peak split {h:,} after {passes} passes")
    offs = _by_id(list(buffers), off)
    return (offs, h) if _accept(buffers, offs, h, "peak-split", say) else None


def _fit_then_peak(buffers: Sequence[Buffer], cap: int, deadline: float, options: LayoutOptions, say: Progress,
                   floor: list[int] | None = None,
                   peak: bool = True) -> tuple[SearchStatus, dict | None, str, int, tuple | None]:
    """``_fit`` at ``cap``; where the peak split applies (``peak`` and ``_peak``), the exact search gets
    ``1 - share`` of the time and, unanswered, the split the rest. Returns ``_fit``'s answer (the split's
    layout as found where it fits) and the split's layout with its height where it does not fit (else
    None)."""
    applies = peak and options.peak.enabled and len(buffers) >= options.peak.min_buffers
    first = time.monotonic() + (1 - options.peak.share) * (deadline - time.monotonic()) if applies else deadline
    st, offs, name, nodes = _fit(buffers, cap, first, options, say, floor)
    if st is not SearchStatus.LIMIT or not applies:
        return st, offs, name, nodes, None
    lower = _peak(buffers, floor, cap, deadline, options, say)
    if lower is not None and lower[1] <= cap:
        return SearchStatus.FOUND, lower[0], "peak-split", nodes, None
    return st, offs, name, nodes, lower


def _minimize(buffers: Sequence[Buffer], floor: list[int] | None, offsets: dict, h: int, low: int, deadline: float,
              options: LayoutOptions, say: Progress) -> tuple[dict, int, str, int, int]:
    """Lower a layout of height ``h`` with the exact search (``_fit``) at capacities in ``[low, h)``: ``low``
    first, with half the time left, then halving the gap between the highest capacity left unanswered
    (or the lowest proven) and the best height (an unanswered capacity keeps the best layout so far).
    Returns (offsets, height, solver ("" if unchanged), the lowest height not proven impossible, nodes)."""
    proven = low  # the lowest height not proven impossible (with ``low`` a lower bound: none is lower)
    unknown = low - 1  # the highest capacity left unanswered
    solver, nodes, tries = "", 0, 0
    while proven < h and deadline - time.monotonic() > 0.05:
        cap = proven if unknown < proven else (max(proven, unknown + 1) + h - 1) // 2
        if cap >= h:
            break
        share = (deadline - time.monotonic()) * (0.5 if cap < h - 1 else 1.0)
        known = f", none below {proven:,}" if proven > low else ""  # ``low`` itself need not be a bound
        say(f"layout: best {h:,}{known}; trying {cap:,} for up to {share:.0f}s")
        # the first try: where it is unanswered, the peak split gets its share of it (``_fit_then_peak``)
        st, offs, name, n, lower = _fit_then_peak(buffers, cap, time.monotonic() + share, options, say, floor,
                                                  peak=tries == 0)
        tries += 1
        nodes += n
        if lower is not None and lower[1] < h:
            offsets, h, solver = lower[0], lower[1], "peak-split"
        if (st is SearchStatus.FOUND and offs is not None and _accept(buffers, offs, cap, name, say)
                and (floor is None or all(offs[b.id] >= f for b, f in zip(buffers, floor)))):
            offsets, h, solver = offs, height(buffers, offs), name
        elif st is SearchStatus.INFEASIBLE:
            proven = cap + 1
        elif cap == h - 1:  # unanswered with all the time left: nothing more to try
            break
        else:
            unknown = cap
    return offsets, h, solver, proven, nodes


def _solve_split(buffers: Sequence[Buffer], capacity: int | None, deadline: float, options: LayoutOptions,
                 say: Progress) -> LayoutResult | None:
    """``solve_layout`` by leaves (``layout_split``), each on the floors of the buffers stacked below
    it, at the height ``H`` (the lower bound, or the capacity): best-fit greedy first, the exact search
    (``_fit``) where greedy does not fit; a leaf that fits neither keeps its best greedy layout and
    raises ``H`` (later leaves get that slack). Where the sizes do not allow an exact peel
    (``splittable``: alignments that do not divide every size), the leaves are the independent
    components alone. None when the bound is above the capacity (the plain path reports that)."""
    t0 = time.monotonic()
    lo, up, sz, al = buffer_arrays(buffers)
    lb = aligned_bound(lo, up, sz, al)
    # for the leaves' last steps, the offsets by id, the height and the validation: four times what the
    # arrays and the bound took (a loaded machine slows both alike; 1,000,000 buffers: 0.38-0.54 s for
    # those, 0.71-0.88 s for the last steps)
    reserve = 4 * (time.monotonic() - t0)
    if capacity is not None and lb > capacity:
        return None
    opts = options.split
    target = lb if capacity is None else capacity
    dec = decompose(lo, up, sz, opts.max_leaf, opts.cuts, opts.cut_band, opts.cut_samples,
                    max_bound=int(target * (1 + opts.cut_tolerance)) if capacity is None else capacity,
                    peel=splittable(sz, al), fine=len(buffers) > opts.fine_cuts_above,
                    deadline=time.monotonic() + opts.cut_share * (deadline - reserve - time.monotonic()))
    say(f"layout: {len(buffers):,} buffers split into {len(dec.leaves):,} leaves ({dec.stacked:,} stacked, "
        f"{dec.cuts} cuts, largest {max((len(leaf.index) for leaf in dec.leaves), default=0):,}); "
        f"lower bound {lb:,}")
    # identical leaves (the same buffers and floors shifted in time: repeated layers or steps) share a
    # layout; the time left is shared among distinct leaves by their sizes
    leaves = sorted(dec.leaves, key=lambda leaf: -len(leaf.index))
    keys = [np.stack([lo[x] - lo[x].min(), up[x] - lo[x].min(), sz[x], al[x], dec.floor[x]]).tobytes()
            for x in (leaf.index for leaf in leaves)]
    left_n = sum(dict(zip(keys, (len(leaf.index) for leaf in leaves))).values())
    H, solvers, done = target, {}, {}
    for leaf, key in zip(leaves, keys):
        x = leaf.index
        if key not in done:
            share = max(0.0, deadline - reserve - time.monotonic()) * len(x) / max(left_n, 1)
            left_n -= len(x)
            if share <= (NO_PASS_SECONDS * len(x) if len(x) > opts.max_leaf else 0.0):  # no time for a pass
                done[key] = _short_leaf(lo[x], up[x], sz[x], al[x], dec.floor[x], share, opts.allocator)
            else:
                bufs = [buffers[i] for i in x]
                offs, name = _leaf(bufs, dec.floor[x].tolist(), H, time.monotonic() + share, options, say)
                done[key] = (_starts(bufs, offs).tolist(), name)
        H = max(H, int((np.array(done[key][0], np.int64) + sz[x]).max(initial=0)))
    if opts.revisit and opts.improve.enabled and H > target:
        _revisit(dict(zip(keys, (leaf.index for leaf in leaves))), done, buffers, dec.floor, target,
                 deadline - reserve, options, say)
    pos = dec.offsets.astype(np.int64)  # the stacked buffers', then each leaf's
    for leaf, key in zip(leaves, keys):
        pos[leaf.index], name = done[key]
        solvers[name] = solvers.get(name, 0) + 1
    offsets = dict(zip(map(_ID, buffers), pos.tolist()))
    h = int((pos + sz).max(initial=0))
    fits = capacity is None or h <= capacity
    status = LayoutStatus.OPTIMAL if h == lb else LayoutStatus.FEASIBLE if fits else LayoutStatus.UNKNOWN
    valid = not validate_layout(buffers, offsets, capacity if fits else None)
    top = max(solvers, key=solvers.get) if solvers else "none"
    solver = f"split/{len(dec.leaves)} leaves, {dec.cuts} cuts/{top}"
    say(f"layout: {status.value}, height {h:,} ({solver}){'' if valid else ', INVALID'}")
    return LayoutResult(status, offsets, h, lb, 0.0, solver, valid=valid)


def _short_leaf(lo: np.ndarray, up: np.ndarray, sz: np.ndarray, al: np.ndarray, fl: np.ndarray, share: float,
                allocator: bool) -> tuple[list, str]:
    """A leaf without the time of a pass's set-up: the allocator replay where it fits in ``share``
    (``ALLOC_PASS_SECONDS`` per buffer), else per-size-class slots (``slot_stack``)."""
    if allocator and share > ALLOC_PASS_SECONDS * len(sz):
        off = allocator_pass(lo, up, sz, al, fl, time.monotonic() + share)
        if off is not None:
            return off.tolist(), "allocator"
    return slot_stack(lo, up, sz, al, fl, 0).tolist(), "slots"


def _revisit(index: dict, done: dict, buffers: Sequence[Buffer], floor: np.ndarray, target: int, deadline: float,
             options: LayoutOptions, say: Progress) -> None:
    """Time left after every leaf had its share (``SplitOptions.revisit``): a large leaf's search (``_improve``; the
    core window once per leaf) on the leaf whose top is highest, from its layout, down to the next highest leaf's
    top (or ``target``); repeated while it lowers that leaf and time is left. ``index``: distinct leaf key -> its
    buffers (indices into ``buffers``); ``done``: key -> (offsets, solver), updated (identical leaves share it)."""
    sz = np.fromiter((b.size for b in buffers), np.int64, len(buffers))
    tops = {key: int((np.array(done[key][0], np.int64) + sz[ix]).max(initial=0)) for key, ix in index.items()}
    cored = set()
    while time.monotonic() < deadline:
        key = max(tops, key=tops.get)
        if tops[key] <= target:
            return
        rest = max((t for k, t in tops.items() if k != key), default=0)
        bufs = [buffers[i] for i in index[key]]
        offs, h, how = _improve(bufs, floor[index[key]].tolist(), max(target, rest), deadline, options, say,
                                dict(zip(map(_ID, bufs), done[key][0])), tops[key], done[key][1], False,
                                core=key not in cored)
        cored.add(key)
        say(f"layout: leaf of {len(bufs):,} buffers revisited: {tops[key]:,} -> {h:,}")
        if h >= tops[key]:
            return
        done[key], tops[key] = (_starts(bufs, offs).tolist(), how), h


def _leaf(bufs: list[Buffer], floor: list[int], cap: int, deadline: float, options: LayoutOptions,
          say: Progress) -> tuple[dict, str]:
    """One leaf at or under ``cap`` if greedy or the exact search (above ``max_leaf``: ``big_first``, ``_improve``)
    finds it in time, else its lowest greedy layout (greedy orders past the first stop at the deadline)."""
    large = len(bufs) > options.split.max_leaf
    search = large and options.split.improve.enabled
    best, best_h, how, skyline = _greedy_phase(bufs, floor, cap, deadline, options, search)
    # out of time (a first pass that took it all): keep what there is; a search's set-up alone takes about
    # what a pass's does (1,000,000 buffers: ~5 s, none of it a pass)
    late = deadline - time.monotonic() < NO_PASS_SECONDS * len(bufs)
    if large and best_h > cap and options.split.big_first and not late:
        offs = _big_first(bufs, floor, cap, time.monotonic() + 0.5 * (deadline - time.monotonic()), options, say)
        h = height(bufs, offs) if offs is not None else best_h
        if h < best_h:
            best, best_h, how = offs, h, "big-first"
    if search and best_h > cap and not late:
        best, best_h, how = _improve(bufs, floor, cap, deadline, options, say, best, best_h, how, skyline)
    if best_h <= cap:
        return best, how
    say(f"layout: leaf of {len(bufs):,} buffers: greedy {best_h:,} ({how}) above {cap:,}; "
        f"{max(0.0, deadline - time.monotonic()):.0f}s left for it")
    if len(bufs) <= options.split.max_leaf and deadline - time.monotonic() > 0.1:
        st, offs, name, _, lower = _fit_then_peak(bufs, cap, deadline, options, say, floor)
        if (st is SearchStatus.FOUND and offs is not None and all(offs[b.id] >= f for b, f in zip(bufs, floor))
                and _accept(bufs, offs, cap, name, say)):
            return offs, name
        if lower is not None and lower[1] < best_h:
            best, how = lower[0], "peak-split"
    assert best is not None  # the first greedy pass always finishes
    return best, how


def _improve(bufs: list[Buffer], floor: list[int], cap: int, deadline: float, options: LayoutOptions, say: Progress,
             best: dict, best_h: int, how: str, plain: bool, core: bool = True) -> tuple[dict, int, str]:
    """A leaf's search from its lowest layout ``best`` (height ``best_h``, by ``how``) towards ``cap``: the core window
    (if ``core``), the squeaky wheel (``plain``: plain whatever the focus says), ejection chains beside it (two cores)
    or after it, window repair where windows are small (``windows_small``). Returns (layout by id, height, how)."""
    lo, up, sz, al = buffer_arrays(bufs)
    fl = np.array(floor, np.int64)
    now, co = time.monotonic(), options.split.core  # a few full steps close together: those buffers exactly first
    offs, h = core_window(lo, up, sz, al, fl, cap, now + co.share * (deadline - now), co, _core_solver(options, say),
                          say) if core else (None, 0)
    if offs is not None and h < best_h:
        best, best_h, how = _by_id(bufs, offs), h, "core-window"
    if best_h <= cap:
        return best, best_h, how
    start = _starts(bufs, best)
    eject, window = options.split.eject, options.split.window
    # the window repair's share at the end; ejection chains: in a thread beside the search where there
    # are two cores, else after it
    repair = window.enabled and windows_small(lo, up, sz, window)
    search_end = deadline - (window.share * (deadline - time.monotonic()) if repair else 0.0)
    follower = (Follower(lo, up, sz, al, fl, cap, search_end, eject).start()
                if eject.enabled and eject.beside and cores() >= 2 else None)
    sw_deadline = search_end - (eject.share * (search_end - time.monotonic())
                                if eject.enabled and follower is None else 0.0)
    if follower is not None:
        follower.offer(start, best_h)
    offs, h, passes = squeaky_wheel(lo, up, sz, al, fl, cap, sw_deadline, options.split.improve, start,
                                    on_best=None if follower is None else follower.offer, plain=plain,
                                    eject=eject if eject.enabled else None)
    say(f"layout: leaf of {len(bufs):,} buffers: squeaky wheel {h:,} after {passes} passes (greedy {best_h:,})")
    if h < best_h:
        best, best_h, how = _by_id(bufs, offs), h, "squeaky-wheel"
    if follower is not None:
        offs, h = follower.finish(wait=best_h > cap)
        say(f"layout: leaf of {len(bufs):,} buffers: ejection chains beside it {h:,}")
        if offs is not None and h < best_h:
            best, best_h, how = _by_id(bufs, offs), h, "squeaky-wheel+eject"
    elif eject.enabled and best_h > cap:
        start = _starts(bufs, best)
        offs, h, moved = eject_repair(lo, up, sz, al, fl, start, cap, search_end, eject)
        say(f"layout: leaf of {len(bufs):,} buffers: ejection chains {best_h:,} -> {h:,} ({moved} moved)")
        if h < best_h:
            best, best_h, how = _by_id(bufs, offs), h, how + "+eject"
    if repair and best_h > cap:
        start = _starts(bufs, best)
        offs, h, fixed = window_repair(lo, up, sz, al, fl, start, cap, deadline, window)
        say(f"layout: leaf of {len(bufs):,} buffers: window repair {best_h:,} -> {h:,} ({fixed} windows fixed)")
        if h < best_h:
            best, best_h, how = _by_id(bufs, offs), h, how + "+window"
    return best, best_h, how


def _core_solver(options: LayoutOptions, say: Progress) -> CoreSolver:
    """``layout_core``'s search of a core: a tenth of its time greedy, then ``_minimize`` from the target up."""
    def solve(lo, up, sz, al, fl, target, deadline):
        sub = [Buffer(k, int(a), int(b), int(z), int(g)) for k, (a, b, z, g) in enumerate(zip(lo, up, sz, al))]
        now = time.monotonic()
        offs, h, _ = _leaf_greedy(sub, fl.tolist(), target, now + 0.1 * (deadline - now), options.split.lowest_fit)
        return _starts(sub, _minimize(sub, fl.tolist(), offs, h, target, deadline, options, say)[0])
    return solve


def _greedy_phase(bufs: list[Buffer], floor: list[int], cap: int, deadline: float, options: LayoutOptions,
                  search: bool) -> tuple[dict, int, str, bool]:
    """A leaf's greedy passes and whether its search will be the skyline one. Without the search: the passes until
    ``deadline``. With it: one skyline pass (``ImproveOptions.skyline_start``, in a thread, ``SkylineRace``;
    dropped if not done in ``skyline_start_share`` of the time, ``huge_skyline_share`` above ``huge`` buffers)
    beside the first greedy pass (without a skyline layout it may take the whole time: the one layout; with one,
    it is dropped at ``cap`` or once past ``greedy_share``); the lower is kept (and the allocator pass,
    ``SplitOptions.allocator``, where lower); then the other greedy passes until ``greedy_share`` of the time, or
    ``skyline.greedy_share`` where the search will be the skyline one (the second, ``SIZE_START``, may run for 1.5
    times the first's time, within ``second_share``): where the skyline pass's excess over ``cap`` is at most
    ``skyline_switch`` times the first greedy one's, or ``search_kind`` says so (asked with the lowest pass as
    its start, as ``squeaky_wheel`` will be; skyline passes are fast, so the greedy ones get less time), or
    ``focus_greedy_share`` where it says the search will be focused."""
    lowest = options.split.lowest_fit
    if not search:
        return (*_leaf_greedy(bufs, floor, cap, deadline, lowest), False)
    now = time.monotonic()
    improve = options.split.improve
    lo, up, sz, al = buffer_arrays(bufs)
    fl = np.array(floor, np.int64)
    race = (SkylineRace(lo, up, sz, al, fl, first_priorities(lo, up, sz, improve.skyline),
                        now + (improve.huge_skyline_share if len(bufs) > improve.huge else improve.skyline_start_share)
                        * (deadline - now)) if improve.skyline_start else None)
    share_end = now + improve.greedy_share * (deadline - now)

    def stop(done: float, top: int) -> bool:
        # the skyline pass has a layout at ``cap`` or below this pass's top so far, or one and this pass is past
        # its share and, on a huge leaf (few search passes there), at its pace so far (``done`` of its buffers
        # placed) would not end by the deadline (``random-7``, 60,000 buffers, at --time-limit 5: 5.258% kept
        # to its end, 4.172% for the skyline search from its share on)
        h, t = race.height, time.monotonic()
        return h is not None and (h <= cap or top >= h or (t > share_end and (
            len(bufs) <= improve.huge or t_first + (t - t_first) / max(done, 1e-9) > deadline)))

    pre = allocator_pass(lo, up, sz, al, fl, share_end) if options.split.allocator else None
    t_first = time.monotonic()
    # without a skyline layout, the first pass is the one layout: it may take all the time; with one, its
    # share, or on a huge leaf as long as it would end by the deadline and stays below the skyline pass
    # (1,000,000 buffers, ``docs/benchmarks.md`` session 24: ~1,250 live, a lowest-fit pass 119 s for 17-19%
    # over the bound, a skyline pass 3.6 s for 3.99%; ``random``'s shape, 48 s for 1.48%, the skyline pass 4.05%)
    first = _leaf_greedy(bufs, floor, cap, deadline, lowest, count=1, stop=None if race is None else stop)
    sky = None if race is None else race.result(stop=first is not None and first[1] <= cap)
    sky_h = None if sky is None else race.height
    pre_h = None if pre is None else int((pre + sz).max(initial=0))
    if pre is not None and (first is None or pre_h < first[1]):  # the allocator's
        first = (_by_id(bufs, pre), pre_h, "allocator")
    if first is None or (sky_h is not None and sky_h <= cap):  # dropped: the skyline pass starts a skyline search
        return _by_id(bufs, sky), sky_h, "skyline", sky_h > cap
    best, best_h, how = first
    if best_h <= cap:
        return best, best_h, how, False
    if time.monotonic() >= deadline:  # the first pass took it all (each step below reads every buffer again)
        return (best, best_h, how, False) if sky_h is None or sky_h >= best_h else (_by_id(bufs, sky), sky_h,
                                                                                     "skyline", False)
    t_more = time.monotonic()
    second = min(t_more + 1.5 * (t_more - t_first), now + improve.second_share * (deadline - now))
    skyline = False
    if sky_h is not None and sky_h < best_h:
        skyline = sky_h - cap <= improve.skyline_switch * (best_h - cap)
        best, best_h, how = _by_id(bufs, sky), sky_h, "skyline"
    start = _starts(bufs, best)
    kind = "skyline" if skyline else search_kind(lo, up, sz, fl, cap, improve, start)
    skyline = kind == "skyline"
    shares = {"skyline": improve.skyline.greedy_share, "focus": improve.focus_greedy_share}
    share = shares.get(kind, improve.greedy_share)
    end = now + share * (deadline - now)
    skip = 1
    # (a pass whose time is over is not started: its set-up alone takes ~1.5 s on 1,000,000 buffers)
    if lowest and max(end, second) > time.monotonic():  # the second lowest-fit pass (``SIZE_START`` but on
        # one-size leaves) gets about the first's time
        more = _leaf_greedy(bufs, floor, cap, max(end, second), lowest, skip=1, count=1)
        if more is not None and more[1] < best_h:
            best, best_h, how = more
    skip = 2 if lowest else 1
    more = _leaf_greedy(bufs, floor, cap, end, lowest, skip=skip) if best_h > cap and end > time.monotonic() else None
    return (*(more if more is not None and more[1] < best_h else (best, best_h, how)), skyline)


def _by_id(bufs: list[Buffer], offs: np.ndarray) -> dict:
    """Offsets in ``bufs`` order as a dict by buffer id."""
    return dict(zip(map(_ID, bufs), offs.tolist()))


def _starts(bufs: list[Buffer], offsets: dict) -> np.ndarray:
    """The offsets of ``bufs`` (a dict by buffer id) in their order."""
    return np.fromiter(map(offsets.__getitem__, map(_ID, bufs)), np.int64, len(bufs))


def _big_first(bufs: list[Buffer], floor: list[int], cap: int, deadline: float, options: LayoutOptions,
               say: Progress) -> dict | None:
    """A leaf whose load a few buffers carry (``SplitOptions.big_first``): the fewest buffers, largest
    ``size x lifetime`` first, without which at most ``light_share * cap`` bytes are live at any time
    (``heavy_buffers``; at most ``max_leaf`` of them), laid out alone: the greedy passes (a tenth of the
    time), the squeaky wheel (``split.improve``; until half the time), then the exact search at ``cap``
    and down from their best height (``_minimize``, until ``deadline``); then the others lowest fit by
    size around them (``given``). None when the leaf is not of that shape."""
    lo, up, sz, al = buffer_arrays(bufs)
    heavy = heavy_buffers(lo, up, sz, int(options.split.light_share * cap), options.split.max_leaf)
    if heavy is None:
        return None
    sub = [bufs[i] for i in heavy.tolist()]
    sub_floor = [floor[i] for i in heavy.tolist()]
    now = time.monotonic()
    first = _leaf_greedy(sub, sub_floor, cap, now + 0.1 * (deadline - now), options.split.lowest_fit)
    assert first is not None  # the first greedy pass always finishes
    offs, h, how = first
    if h > cap and options.split.improve.enabled:
        start = _starts(sub, offs)
        sw, sw_h, _ = squeaky_wheel(lo[heavy], up[heavy], sz[heavy], al[heavy], np.array(sub_floor, np.int64), cap,
                                    now + 0.5 * (deadline - now), options.split.improve, start)
        if sw_h < h:
            offs, h, how = _by_id(sub, sw), sw_h, "squeaky-wheel"
    offs, h, name, _, _ = _minimize(sub, sub_floor, offs, h, cap, deadline, options, say)
    given = np.full(len(bufs), -1, np.int64)
    given[heavy] = [offs[b.id] for b in sub]
    off = place_in_order(lo, up, sz, al, np.array(floor, np.int64), greedy_order(GreedyOrder.SIZE.value, lo, up, sz),
                         lowest=True, given=given)
    say(f"layout: leaf of {len(bufs):,} buffers: {len(sub):,} heavy ones at {h:,} ({name or how}), the rest "
        f"around them: {int((off + sz).max(initial=0)):,}")
    return _by_id(bufs, off)


def _leaf_greedy(bufs: list[Buffer], floor: list[int], cap: int, deadline: float,
                 lowest_fit: bool, skip: int = 0, count: int | None = None,
                 finish: bool = True, stop: Callable[[float, int], bool] | None = None) -> tuple[dict, int, str] | None:
    """The lowest of the compiled greedy passes (``layout_greedy``): every order best fit (as
    ``greedy_layout``) and, with ``lowest_fit``, lowest fit (size first: the best pass on random traces;
    then size with equal sizes by start; that first where every buffer has one size, where it is optimal);
    stops at ``cap`` or the deadline (the first pass always finishes, unless not ``finish``). ``skip``:
    passes already run (then none is forced to finish: None when none did); ``count``: at most this
    many passes; ``stop``: ``place_in_order``'s (a pass it stops is dropped)."""
    lo, up, sz, al = buffer_arrays(bufs)
    fl = np.array(floor, np.int64)
    passes = [(o, False) for o in GreedyOrder]
    if lowest_fit:
        # size first (``_greedy_phase``'s reference pass); where every buffer has one size, size by start
        firsts = [GreedyOrder(name) for name in lowest_firsts(sz)]
        passes = [(o, True) for o in firsts] + passes + [(o, True) for o in GreedyOrder if o not in firsts]
    best, best_h, how = None, 0, ""
    for order, low in passes[skip:None if count is None else skip + count]:
        offs = place_in_order(lo, up, sz, al, fl, greedy_order(order.value, lo, up, sz), deadline,
                              finish=finish and best is None and not skip, lowest=low, stop=stop)
        if offs is None:
            break
        h = int((offs + sz).max(initial=0))
        if best is None or h < best_h:
            best, best_h, how = offs, h, f"greedy/{order.value}" + ("/lowest" if low else "")
        if best_h <= cap:
            break
    if best is None:
        assert skip or not finish or stop is not None  # else the first pass always finishes
        return None
    return _by_id(bufs, best), best_h, how


def _accept(buffers: Sequence[Buffer], offsets: dict, capacity: int, solver: str, say) -> bool:
    """A solver's layout counts only if the validator passes it."""
    errors = validate_layout(buffers, offsets, capacity)
    if errors:
        say(f"layout: {solver} returned an invalid layout at capacity {capacity:,}, discarded: {errors[:2]}")
    return not errors
