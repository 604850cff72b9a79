"""Exact layout at a capacity: branch and bound over canonical solutions (after MiniMalloc, Moffitt,
ASPLOS 2023, "MiniMalloc: A Lightweight Memory Allocator for Hardware-Accelerated Machine Learning").

Formulation
  Data: buffers ``i`` with half-open lifetimes ``[l_i, u_i)``, sizes ``z_i > 0``, alignments ``a_i``;
  a capacity ``C``. (Zero-byte buffers take no address; they get offset 0 and are not searched.)
  Variables: an offset ``o_i``, an integer multiple of ``a_i``.
  Constraints: ``fits``: ``0 <= o_i`` and ``o_i + z_i <= C``; ``no_overlap``: for every pair live at
  a common time, ``o_i + z_i <= o_j`` or ``o_j + z_j <= o_i``.
  Objective: none (feasibility); ``layout.solve_layout`` minimises the height by searching over ``C``.

Sections: sweeping the lifetimes, a section is the set of buffers live just before some buffer ends
(the maximal cliques of the interval graph). Two buffers overlap in time iff they share a section, and
a buffer covers a contiguous range of sections ``[slo_i, shi_i)``, precomputed once. Per section the
search keeps ``top`` (the highest end of a placed buffer in it) and ``total`` (the bytes not yet
placed); per buffer ``mo`` (its minimum offset: the highest end of a placed time-neighbour, aligned).

Search: a depth-first search that places one buffer per level, always at its ``mo``. Any layout can be
pushed down ("gravity") until every buffer rests on a time-neighbour or on 0 and buffers are placed in
order of (offset, preorder index); these canonical solutions are what the search enumerates, so it is
complete: it finds a layout under ``C`` if one exists and otherwise proves there is none.

Rules (``LayoutOptions``; each sound, each can be turned off, all on by default):
  canonical_only     place buffers in non-decreasing (offset, preorder index): a buffer whose ``mo``
                     is below the last placement's is only placed after its ``mo`` rises.
  dominance          skip a buffer whose ``mo`` is >= ``min(mo_j + z_j)`` over unplaced ``j``: that
                     ``j`` would fit entirely below it, so a canonical solution places ``j`` first.
  section_inference  per section: floor + unplaced bytes <= C.
  unallocated_floor  a section's floor is at least the lowest ``mo`` of its unplaced buffers (not
                     only its ``top``): gaps below them are wasted.
  monotonic_floor    (needs canonical_only) every later placement is at or above the current offset,
                     so floor >= current offset; also filters candidates: ``mo <= C - max total``.
  hatless            after a buffer with no unplaced time-neighbour fails, stop trying siblings: its
                     ``mo`` never changes, so every later sibling would leave it unplaceable.
  enclosing_first    (new here) at the root of an independent part, a buffer whose unplaced
                     time-neighbours all live within its lifetime and have ``mo`` >= its own is placed
                     at its ``mo`` without branching: any layout can shift the buffers between that
                     ``mo`` and the buffer up by its size and drop it down (sizes aligned allowing).
  identical_order    identical buffers (same lifetime, size, alignment) are placed in preorder.
  decomposition      when no unplaced buffer crosses a section boundary, the sides are solved as
                     independent sub-problems.
  nogood_cache       a failed node is remembered by (unplaced buffers, their ``mo``, section range,
                     ranking) with its (last offset, last rank); a later node with that state and a
                     last placement not below it fails at once (its completions are a subset). A
                     fixed-size table of two 64-bit hashes per key; a full slot window forgets one.
  dynamic_preorder   each part split off by ``decomposition`` re-ranks its buffers by the preorder
                     with ``T`` taken from the current section totals (MiniMalloc's SubSolve does);
                     the tie-break of ``canonical_only`` is then that rank.
  preorders          the static orders that break ties (``Preorder``); several are run round robin
                     with doubling node limits (restarts against heavy tails). Independent parts of
                     the problem (no buffer crosses a time) run their own round robin.

The search itself is compiled (``layout_bnb_core``, numba): an explicit stack over flat arrays, run in
node-limited chunks so that this module checks the deadline and the stop event between them.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

import numpy as np

from . import layout_bnb_core as core
from .layout_peak import PeakOptions
from .layout_split import SplitOptions

__all__ = ["Preorder", "LayoutOptions", "SearchStatus", "SearchResult", "capacity_in_range", "search_layout",
           "preorder_indices"]

_CACHE_SLOTS = 1 << 19  # nogood cache entries per preorder (16 MB); a full window forgets one
# nodes between deadline checks: the compiled search holds the GIL, so one call must be short for the
# thread that waits on the deadline (``layout._fit``). 50,000 nodes took tens of milliseconds on small
# problems but ~5 s on a 1,412-buffer window of ``wide-3`` (``solve_layout`` 23.9 s for a 20 s limit;
# docs/benchmarks.md, session 18), and nodes took ~1 ms each on ``wide-4``'s, so the first call is short
# and the next ones follow the measured node rate to ~_CHUNK_SECONDS a call
_CHUNK = 256  # the first call's nodes
_CHUNK_SECONDS = 0.05
_CHUNK_RANGE = (16, 1_000_000)


class Preorder(str, Enum):
    """Static tie-break orders (MiniMalloc's heuristics): letters sort descending by W = lifetime
    length, A = size x length, T = the most bytes live in any of the buffer's sections, Z = size."""
    WAT = "WAT"
    TAW = "TAW"
    TWA = "TWA"
    AWT = "AWT"


@dataclass(frozen=True)
class LayoutOptions:
    """Pruning rules of the exact search (see the module docstring) and the solvers ``solve_layout``
    runs. Defaults are the fastest sound setting; tests turn each rule off."""
    canonical_only: bool = True
    dominance: bool = True
    section_inference: bool = True
    unallocated_floor: bool = True
    monotonic_floor: bool = True
    hatless: bool = True
    enclosing_first: bool = True
    identical_order: bool = True
    decomposition: bool = True
    nogood_cache: bool = True
    dynamic_preorder: bool = True
    preorders: tuple[Preorder, ...] = (Preorder.WAT, Preorder.TAW, Preorder.TWA)
    cpsat: bool = True  # solve_layout: also run the CP-SAT portfolio (layout_cpsat.py) alongside
    split: SplitOptions = SplitOptions()  # solve_layout on large problems: leaves (layout_split.py)
    peak: PeakOptions = PeakOptions()  # after an unanswered exact try: the peak split (layout_peak.py)


class SearchStatus(str, Enum):
    FOUND = "found"
    INFEASIBLE = "infeasible"
    LIMIT = "limit"  # node limit, deadline or stop request


@dataclass
class SearchResult:
    status: SearchStatus
    offsets: list[int] | None  # in input order, when found
    nodes: int


class _Problem:
    """Lifetimes, sections and time-neighbours of the non-empty buffers (input labels)."""

    def __init__(self, lower, upper, size, alignment, floor=None):
        self.floor = np.zeros(len(size), np.int64) if floor is None else np.asarray(floor, dtype=np.int64)
        self.lower = np.asarray(lower, dtype=np.int64)
        self.upper = np.asarray(upper, dtype=np.int64)
        self.size = np.asarray(size, dtype=np.int64)
        self.align = np.asarray(alignment, dtype=np.int64)
        n = self.n = len(self.size)
        # sweep: ends before starts at equal times (half-open); a section closes at the first end after
        # a start (the event before it is a start), holding every buffer live then
        times = np.concatenate([self.upper, self.lower])
        kinds = np.concatenate([np.zeros(n, np.int64), np.ones(n, np.int64)])
        ids = np.concatenate([np.arange(n), np.arange(n)])
        ev = np.lexsort((ids, kinds, times))
        is_start = kinds[ev] == 1
        closed = np.cumsum(~is_start & np.concatenate(([False], is_start[:-1])))  # sections closed so far
        self.slo, self.shi = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.slo[ids[ev][is_start]] = closed[is_start]
        self.shi[ids[ev][~is_start]] = closed[~is_start]
        self.S = S = int(closed[-1]) if n else 0
        # members of each section (CSR, by buffer within a section): buffer b is in [slo_b, shi_b)
        rows = np.repeat(np.arange(n), self.shi - self.slo)
        secs = self.slo[rows] + _ragged(np.zeros(n, np.int64), self.shi - self.slo)
        by_sec = np.argsort(secs, kind="stable")  # rows ascending within a section
        self.mem_ptr = np.searchsorted(secs[by_sec], np.arange(S + 1), side="left")
        self.mem_idx = rows[by_sec]
        self.section_total = np.zeros(S, np.int64)
        np.add.at(self.section_total, secs, self.size[rows])
        # time-neighbours (CSR, sorted): the members of b's first section and the buffers whose first
        # section lies inside b's range
        self.by_slo = np.argsort(self.slo, kind="stable")
        slo_ptr = np.searchsorted(self.slo[self.by_slo], np.arange(S + 1), side="left")
        n1 = self.mem_ptr[self.slo + 1] - self.mem_ptr[self.slo]
        n2 = slo_ptr[self.shi] - slo_ptr[np.minimum(self.slo + 1, S)]
        row = np.concatenate([np.repeat(np.arange(n), n1), np.repeat(np.arange(n), n2)])
        col = np.concatenate([self.mem_idx[_ragged(self.mem_ptr[self.slo], n1)],
                              self.by_slo[_ragged(slo_ptr[np.minimum(self.slo + 1, S)], n2)]])
        keep = row != col
        self.nb_row, self.nb_col = row[keep], col[keep]

    def components(self) -> list[np.ndarray]:
        """Independent parts: groups of buffers with no buffer crossing between them in time."""
        if self.n == 0:
            return []
        order = self.by_slo
        reach = np.maximum.accumulate(self.shi[order])
        return np.split(order, np.flatnonzero(self.slo[order][1:] >= reach[:-1]) + 1)

    def preorder(self, p: Preorder) -> np.ndarray:
        width = self.upper - self.lower
        keys = {"W": width, "A": self.size * width, "Z": self.size,
                "T": np.maximum.reduceat(np.append(self.section_total, 0),
                                         np.ravel([self.slo, self.shi], order="F"))[::2] if self.n else width}
        # lexsort: last key is primary; descending via negation; input index breaks ties
        return np.lexsort([np.arange(self.n)] + [-keys[c] for c in reversed(p.value)])


class _Tree:
    """One preorder's compiled search (``layout_bnb_core``): buffers are relabelled so that label ==
    preorder index (the canonical tie-break); the state persists across calls, so a node-limited
    call can be resumed, and the nogood cache across restarts."""

    def __init__(self, prob: _Problem, preorder: Preorder, capacity: int, opts: LayoutOptions):
        self.cap = int(capacity)
        self.flags = _flags(opts)
        order = self.order = prob.preorder(preorder)
        self.floor = np.ascontiguousarray(prob.floor[order])
        n = self.n = prob.n
        self.inv = inv = np.empty(n, np.int64)
        inv[order] = np.arange(n)
        i64 = lambda x: np.ascontiguousarray(x, dtype=np.int64)  # noqa: E731
        Z, AL = prob.size[order], prob.align[order]
        SLO, SHI = i64(prob.slo[order]), i64(prob.shi[order])
        lower, upper = prob.lower[order], prob.upper[order]
        ov_ptr, ov_k, ov_o = _relabel(inv[prob.nb_row], inv[prob.nb_col], n)
        # enclosing_first: neighbours not within a buffer's lifetime ("out" of it), and the reverse
        # lists (the buffers k is "out" of), and whether k's size keeps its neighbours' alignment
        out_left = i64(np.bincount(ov_k, (lower[ov_o] < lower[ov_k]) | (upper[ov_o] > upper[ov_k]), n))
        is_io = (lower[ov_k] < lower[ov_o]) | (upper[ov_k] > upper[ov_o])
        io_ptr = np.zeros(n + 1, np.int64)
        io_ptr[1:] = np.cumsum(np.bincount(ov_k[is_io], minlength=n))
        shift_ok = i64(np.bincount(ov_k, Z[ov_k] % AL[ov_o] != 0, n) == 0)
        twin = np.full(n, n, np.int64)
        seen: dict[tuple, int] = {}
        for k, key in enumerate(zip(lower.tolist(), upper.tolist(), Z.tolist(), AL.tolist())):
            if key in seen:
                twin[k] = seen[key]
            seen[key] = k
        S = prob.S
        mem_sec = np.repeat(np.arange(S), np.diff(prob.mem_ptr))
        mem_ptr, _, mem_idx = _relabel(mem_sec, inv[prob.mem_idx], S)
        by_slo = i64(np.argsort(SLO, kind="stable"))
        slo_ptr = i64(np.searchsorted(SLO[by_slo], np.arange(S + 1), side="left"))
        width = upper - lower
        codes = {"W": core.KEY_W, "A": core.KEY_A, "T": core.KEY_T, "Z": core.KEY_Z}
        self.P = (i64(Z), i64(AL), SLO, SHI, ov_ptr, _nonempty(ov_o), io_ptr, _nonempty(ov_o[is_io]), shift_ok,
                  twin, i64(mem_ptr), _nonempty(mem_idx),
                  by_slo, slo_ptr, i64(width), i64(Z * width), i64(Z), i64([codes[c] for c in preorder.value]))
        diff = np.zeros(S + 1, np.int64)  # cuts[s]: buffers across boundary s (in [SLO, SHI - 1))
        np.add.at(diff, SLO, 1)
        np.add.at(diff, np.maximum(SHI - 1, SLO), -1)
        cuts = np.cumsum(diff)[:max(S - 1, 0)]
        self.init = (out_left, prob.section_total.copy(), cuts)
        self.M = (self.floor.copy(), np.ones(n + 1, np.int64), out_left.copy(), np.zeros(S, np.int64),
                  prob.section_total.copy(), cuts.copy(), np.zeros(n, np.int64), np.arange(n, dtype=np.int64),
                  np.full(S, n, np.int64))
        self.M[1][n] = 0  # sentinel: "no twin" is never unplaced
        trail, frames = 3 * n + S + 8, 2 * n + 8
        self.T = (*(np.zeros(trail, np.int64) for _ in range(4)),
                  np.zeros(len(self.P[5]) + 1, np.int64), np.zeros(len(self.P[5]) + 1, np.int64),
                  np.zeros(int((SHI - SLO).sum()) + 1, np.int64),
                  *(np.zeros(frames, np.int64) for _ in range(13)),
                  np.zeros(S + 2 * n + 8, np.int64), np.zeros(S + 2 * n + 8, np.int64))
        self.G = tuple(np.zeros(8 * n + 64, np.int64) for _ in range(3))
        size = _CACHE_SLOTS if opts.nogood_cache else 4
        self.C = (np.zeros(size, np.uint64), np.zeros(size, np.uint64), np.zeros(size, np.int64),
                  np.zeros(size, np.int64))
        self.st = np.zeros(core.ST_SIZE, np.int64)

    @property
    def nodes(self) -> int:
        return int(self.st[core.ST_NODES])

    @property
    def sol(self) -> np.ndarray:
        return self.M[6]

    def start(self, a: int, b: int) -> None:
        """A fresh search of the part of sections ``[a, b)`` (the node count and cache carry on)."""
        mo, un, out_left, top, total, cuts, _, rank, _ = self.M
        mo[:] = self.floor
        un[:self.n] = 1
        top[:] = 0
        out_left[:], total[:], cuts[:] = self.init
        rank[:] = np.arange(self.n)
        nodes = self.st[core.ST_NODES]
        self.st[:] = 0
        self.st[core.ST_NODES] = nodes
        self.st[[core.ST_PART_A, core.ST_PART_B, core.ST_PART_SUB, core.ST_PART_LINK]] = a, b, 1, -1

    def resume(self, limit: int) -> int:
        """Run until ``limit`` nodes in all (then LIMIT) or the end of the part."""
        while True:
            code = core.run(self.P, self.M, self.T, self.G, self.C, self.st, self.cap, limit, self.flags)
            if code != core.GROW:
                return code
            self.G = tuple(np.concatenate([g, np.zeros_like(g)]) for g in self.G)


def _ragged(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + l) for s, l in zip(starts, lengths)])``."""
    total = int(lengths.sum())
    first = np.cumsum(lengths) - lengths
    return np.repeat(starts - first, lengths) + np.arange(total)


def _relabel(rows: np.ndarray, cols: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR of the pairs ``(rows, cols)`` with each row's columns sorted: ``(ptr, row, col)``."""
    m = max(int(cols.max(initial=0)) + 1, 1)
    key = np.sort(rows.astype(np.int64) * m + cols)
    ptr = np.zeros(n + 1, np.int64)
    ptr[1:] = np.cumsum(np.bincount(rows, minlength=n))
    return ptr, key // m, key % m


def _nonempty(idx: np.ndarray) -> np.ndarray:
    """A CSR index array for the compiled code (never empty)."""
    return np.ascontiguousarray(idx, np.int64) if idx.size else np.zeros(1, np.int64)


def _flags(opts: LayoutOptions) -> int:
    bits = {"canonical_only": core.CANONICAL, "dominance": core.DOMINANCE,
            "section_inference": core.SECTION_INFERENCE, "unallocated_floor": core.UNALLOCATED_FLOOR,
            "monotonic_floor": core.MONOTONIC_FLOOR, "hatless": core.HATLESS,
            "enclosing_first": core.ENCLOSING_FIRST, "identical_order": core.IDENTICAL_ORDER,
            "decomposition": core.DECOMPOSITION, "nogood_cache": core.NOGOOD_CACHE,
            "dynamic_preorder": core.DYNAMIC_PREORDER}
    return sum(bit for name, bit in bits.items() if getattr(opts, name))


def _next_chunk(chunk: int, nodes: int, took: float) -> int:
    """The next call's nodes: ~``_CHUNK_SECONDS`` at the last call's node rate, growing at most 4x a call."""
    if nodes <= 0 or took <= 0:
        return chunk
    return int(min(max(nodes * _CHUNK_SECONDS / took, _CHUNK_RANGE[0]), 4 * chunk, _CHUNK_RANGE[1]))


def _unit(sizes: np.ndarray, aligns: np.ndarray, nz: np.ndarray) -> int:
    """Canonical offsets are sums of sizes rounded up to alignments: the search works in units of their gcd."""
    return int(np.gcd.reduce(np.concatenate([sizes[nz], aligns[nz]]))) if nz.size else 1


def capacity_in_range(size, alignment, capacity: int) -> bool:
    """Whether ``search_layout`` can take this capacity: its sums of offsets stay below 2**62 in int64."""
    sizes, aligns = np.asarray(size, dtype=np.int64), np.asarray(alignment, dtype=np.int64)
    nz = np.flatnonzero(sizes > 0)
    return int(capacity) // _unit(sizes, aligns, nz) * (len(nz) + 1) < 2 ** 62


def search_layout(lower: Sequence[int], upper: Sequence[int], size: Sequence[int], alignment: Sequence[int],
                  capacity: int, options: LayoutOptions = LayoutOptions(), deadline: float = float("inf"),
                  node_limit: int | None = None, stop: threading.Event | None = None,
                  progress: Callable[[int], None] | None = None,
                  floor: Sequence[int] | None = None) -> SearchResult:
    """Offsets under ``capacity`` (FOUND), a proof that none exist (INFEASIBLE), or LIMIT when the node
    limit, ``deadline`` (``time.monotonic()``) or ``stop`` came first. With several preorders and no
    node limit, each independent part runs them round robin with node limits doubling from twice its
    size; otherwise the first preorder runs one complete search (what the option tests count).
    The compiled search runs in chunks of nodes (about ``_CHUNK_SECONDS`` each at the measured node
    rate), between which the deadline and ``stop`` are checked; ``progress(nodes)`` is called about
    every two seconds. ``floor``: a lowest offset per buffer (0 if None); the canonical solutions then
    rest on a neighbour or on their floor."""
    if not options.preorders:
        raise ValueError("LayoutOptions.preorders must name at least one Preorder")
    sizes = np.asarray(size, dtype=np.int64)
    aligns = np.asarray(alignment, dtype=np.int64)
    offsets = np.zeros(len(sizes), np.int64)
    nz = np.flatnonzero(sizes > 0)
    unit = _unit(sizes, aligns, nz)
    if not capacity_in_range(size, alignment, capacity):
        raise ValueError(f"capacity {capacity} is too large for the exact search")
    capacity = int(capacity) // unit
    al_u = aligns[nz] // unit
    fl = np.zeros(nz.size, np.int64) if floor is None else np.asarray(floor, dtype=np.int64)[nz]
    fl = -(-fl // (unit * al_u)) * al_u  # in units, rounded up to each alignment
    prob = _Problem(np.asarray(lower)[nz], np.asarray(upper)[nz], sizes[nz] // unit, al_u, fl)
    trees: dict[Preorder, _Tree] = {}
    next_report = time.monotonic() + 2.0

    def nodes() -> int:
        return sum(t.nodes for t in trees.values())

    def halted() -> bool:
        return time.monotonic() > deadline or (stop is not None and stop.is_set())

    chunk = _CHUNK

    def run(t: _Tree, budget: float) -> int:
        nonlocal next_report, chunk
        end = t.nodes + budget
        while True:
            t0, n0 = time.monotonic(), t.nodes
            code = t.resume(int(min(end, t.nodes + chunk)))
            chunk = _next_chunk(chunk, t.nodes - n0, time.monotonic() - t0)
            if code != core.LIMIT or t.nodes >= end or halted():
                return code
            if progress is not None and time.monotonic() >= next_report:
                next_report = time.monotonic() + 2.0
                progress(nodes())

    single = node_limit is not None or len(options.preorders) == 1
    for comp in prob.components():
        a, b = int(prob.slo[comp].min()), int(prob.shi[comp].max())
        limit = 2 * len(comp)
        solved = None
        while solved is None:
            limit *= 2
            for p in options.preorders[:1] if single else options.preorders:
                if p not in trees:
                    if halted():  # the set-up of a tree takes a while on large problems
                        return SearchResult(SearchStatus.LIMIT, None, nodes())
                    trees[p] = _Tree(prob, p, capacity, options)
                t = trees[p]
                t.start(a, b)
                code = run(t, node_limit - nodes() if node_limit is not None else
                           float("inf") if single else limit)
                if code == core.LIMIT:
                    if single or halted():
                        return SearchResult(SearchStatus.LIMIT, None, nodes())
                    continue
                if code == core.INFEASIBLE:
                    return SearchResult(SearchStatus.INFEASIBLE, None, nodes())
                solved = t
                break
        offsets[nz[comp]] = solved.sol[solved.inv[comp]] * unit
    return SearchResult(SearchStatus.FOUND, offsets.tolist(), nodes())


def preorder_indices(lower: Sequence[int], upper: Sequence[int], size: Sequence[int], preorder: Preorder) -> list[int]:
    """Input indices of the non-empty buffers in ``preorder`` (the CP-SAT canonical strategy's ties)."""
    sizes = np.asarray(size, dtype=np.int64)
    nz = np.flatnonzero(sizes > 0)
    prob = _Problem(np.asarray(lower)[nz], np.asarray(upper)[nz], sizes[nz], np.ones(nz.size, np.int64))
    return nz[prob.preorder(preorder)].tolist()
