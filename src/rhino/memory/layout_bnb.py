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
  nogood_cache       a failed node is remembered by (unplaced buffers, their ``mo``, section range)
                     with its (last offset, last index); a later node with that state and a
                     last placement not below it fails at once (its completions are a subset).
  preorders          the static orders that break ties (``Preorder``); several are run round robin
                     with doubling node limits (restarts against heavy tails). Independent parts of
                     the problem (no buffer crosses a time) run their own round robin.
"""
from __future__ import annotations

import hashlib
import sys
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

import numpy as np

__all__ = ["Preorder", "LayoutOptions", "SearchStatus", "SearchResult", "search_layout", "preorder_indices"]

_BIG = np.int64(1) << 62
_CACHE_LIMIT = 1_000_000  # entries; the cache is cleared past this (about 100 MB)


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
    preorders: tuple[Preorder, ...] = (Preorder.WAT, Preorder.TAW, Preorder.TWA)
    cpsat: bool = True  # solve_layout: also run the CP-SAT portfolio (layout_cpsat.py) alongside


class SearchStatus(str, Enum):
    FOUND = "found"
    INFEASIBLE = "infeasible"
    LIMIT = "limit"  # node limit, deadline or stop request


@dataclass
class SearchResult:
    status: SearchStatus
    offsets: list[int] | None  # in input order, when found
    nodes: int


class _Stop(Exception):
    pass


class _Problem:
    """Lifetimes, sections and time-neighbours of the non-empty buffers (input labels)."""

    def __init__(self, lower, upper, size, alignment):
        self.lower = np.asarray(lower, dtype=np.int64)
        self.upper = np.asarray(upper, dtype=np.int64)
        self.size = np.asarray(size, dtype=np.int64)
        self.align = np.asarray(alignment, dtype=np.int64)
        n = self.n = len(self.size)
        # sweep: ends before starts at equal times (half-open); a section closes at the first end after
        # a start, holding every buffer live then
        times = np.concatenate([self.upper, self.lower])
        kinds = np.concatenate([np.zeros(n, np.int64), np.ones(n, np.int64)])
        ids = np.concatenate([np.arange(n), np.arange(n)])
        live: dict[int, None] = {}
        sections: list[list[int]] = []
        start, self.slo, self.shi = [0] * n, [0] * n, [0] * n
        opened = False
        for i in np.lexsort((ids, kinds, times)).tolist():
            b = int(ids[i])
            if kinds[i]:
                live[b] = None
                start[b] = len(sections)
                opened = True
            else:
                if opened:
                    sections.append(list(live))
                    opened = False
                del live[b]
                self.slo[b], self.shi[b] = start[b], len(sections)
        self.sections = sections
        self.section_total = np.array([int(self.size[m].sum()) for m in sections], dtype=np.int64)
        order = np.argsort(self.lower, kind="stable")
        lo_sorted = self.lower[order]
        self.neighbours: list[np.ndarray] = []
        for b in range(n):
            pre = order[:np.searchsorted(lo_sorted, self.upper[b], side="left")]
            nb = pre[self.upper[pre] > self.lower[b]]
            self.neighbours.append(np.sort(nb[nb != b]))

    def components(self) -> list[np.ndarray]:
        """Independent parts: groups of buffers with no buffer crossing between them in time."""
        order = sorted(range(self.n), key=lambda b: self.slo[b])
        comps, cur, hi = [], [], -1
        for b in order:
            if cur and self.slo[b] >= hi:
                comps.append(np.array(cur))
                cur = []
            cur.append(b)
            hi = max(hi, self.shi[b])
        if cur:
            comps.append(np.array(cur))
        return comps

    def preorder(self, p: Preorder) -> np.ndarray:
        width = self.upper - self.lower
        keys = {"W": width, "A": self.size * width, "Z": self.size,
                "T": np.array([int(self.section_total[self.slo[b]:self.shi[b]].max()) for b in range(self.n)])}
        # lexsort: last key is primary; descending via negation; input index breaks ties
        return np.lexsort([np.arange(self.n)] + [-keys[c] for c in reversed(p.value)])


class _Tree:
    """Search state for one preorder: buffers are relabelled so that label == preorder index (the
    canonical tie-break). Arrays have one extra sentinel slot ``n`` that is never unplaced."""

    def __init__(self, prob: _Problem, preorder: Preorder, capacity: int, opts: LayoutOptions):
        self.opts, self.cap = opts, int(capacity)
        order = prob.preorder(preorder)
        self.order = order
        n = self.n = prob.n
        self.inv = inv = np.empty(n, np.int64)
        inv[order] = np.arange(n)
        self.z = prob.size[order].tolist()
        self.Z = np.append(prob.size[order], 0)
        self.AL = np.append(prob.align[order], 1)
        self.aligned = bool((self.AL > 1).any())
        self.slo = [prob.slo[b] for b in order]
        self.shi = [prob.shi[b] for b in order]
        self.SLO = np.append(np.array(self.slo, np.int64), 0)
        self.SHI = np.append(np.array(self.shi, np.int64), 0)
        lower, upper = prob.lower[order], prob.upper[order]
        self.OV = [np.sort(inv[prob.neighbours[b]]) for b in order]
        # neighbours not within the buffer's lifetime (enclosing_first), and whether its size keeps
        # every neighbour's alignment when they shift up by it
        out = [ov[(lower[ov] < lower[k]) | (upper[ov] > upper[k])] for k, ov in enumerate(self.OV)]
        self.out_left = np.append(np.array([len(o) for o in out], np.int64), 1)  # unplaced ones
        self.in_out = [ov[(lower[k] < lower[ov]) | (upper[k] > upper[ov])] for k, ov in enumerate(self.OV)]
        self.in_out = [x if x.size else None for x in self.in_out]
        self.shift_ok = np.array([not self.aligned or bool((self.z[k] % self.AL[ov] == 0).all())
                                  for k, ov in enumerate(self.OV)] + [False])
        twin = np.full(n + 1, n, np.int64)
        seen: dict[tuple, int] = {}
        for k in range(n):
            key = (int(lower[k]), int(upper[k]), self.z[k], int(self.AL[k]))
            if key in seen:
                twin[k] = seen[key]
            seen[key] = k
        self.twin = twin
        self.has_twins = bool((twin < n).any())
        self.stride = n + 1
        S = len(prob.sections)
        members = [np.sort(inv[np.array(m, np.int64)]) for m in prob.sections]
        self.mem = np.concatenate(members) if members else np.zeros(0, np.int64)
        self.mstart = np.zeros(S + 1, np.int64)
        self.mstart[1:] = np.cumsum([len(m) for m in members])
        self.mo = np.zeros(n + 1, np.int64)
        self.un = np.ones(n + 1, bool)
        self.un[n] = False
        self.top = np.zeros(S, np.int64)
        self.total = prob.section_total.copy()
        self.cuts = np.zeros(max(S - 1, 0), np.int64)
        for k in range(n):
            self.cuts[self.slo[k]:self.shi[k] - 1] += 1
        self.sol = np.zeros(n, np.int64)
        self.cache: dict[bytes, tuple[int, int]] = {}
        self.nodes = 0
        self.limit = 0
        self.tick: Callable[[int], None] = lambda nodes: None

    # -- the search -------------------------------------------------------------------------------
    def run(self, comp: np.ndarray, limit: float) -> bool:
        """Search one independent part (input labels ``comp``); raises ``_Stop`` at the limit."""
        self.limit = self.nodes + limit
        labels = self.inv[comp]
        part = np.zeros(self.n + 1, bool)
        part[labels] = True
        a = int(self.SLO[labels].min())
        b = int(self.SHI[labels].max())
        return self._subsolve(part, a, b)

    def _subsolve(self, part: np.ndarray, a: int, b: int) -> bool:
        if self.opts.enclosing_first:
            k = self._enclosing(part)
            if k >= 0:
                self.nodes += 1
                return self._place(part, a, b, k, int(self.mo[k]), True)
        return self._search(part, a, b, 0, -1)

    def _enclosing(self, part: np.ndarray) -> int:
        un, mo = self.un, self.mo
        for k in np.flatnonzero(part & un & (self.out_left == 0) & self.shift_ok).tolist():
            ov = self.OV[k]
            if (mo[ov[un[ov]]] >= mo[k]).all():
                return k
        return -1

    def _search(self, part: np.ndarray, a: int, b: int, last_o: int, last_k: int) -> bool:
        self.nodes += 1
        if self.nodes > self.limit:
            raise _Stop
        if not self.nodes & 63:
            self.tick(self.nodes)
        opts, mo, un = self.opts, self.mo, self.un
        idx = np.flatnonzero(part & un)
        if not idx.size:
            return True
        m = mo[idx]
        key = None
        if opts.nogood_cache:
            key = hashlib.blake2b(idx.tobytes() + m.tobytes() + b"%d,%d" % (a, b), digest_size=16).digest()
            hit = self.cache.get(key)
            if hit is not None and (last_o, last_k) >= hit:
                return False
        # candidates in (offset, preorder index) order: one integer key per buffer
        order_key = m * self.stride + idx
        keep = m < (m + self.Z[idx]).min() if opts.dominance else np.ones(idx.size, bool)
        if opts.canonical_only:
            keep &= order_key > last_o * self.stride + last_k
            if opts.monotonic_floor and opts.section_inference:
                keep &= m <= self.cap - self.total[a:b].max()
        if opts.identical_order and self.has_twins:
            keep &= ~un[self.twin[idx]]
        order_key = np.sort(order_key[keep])
        cand = order_key % self.stride
        cm = order_key // self.stride
        for k, o in zip(cand.tolist(), cm.tolist()):
            if self._place(part, a, b, k, o, False):
                return True
            if opts.hatless and not un[self.OV[k]].any():
                break
        if key is not None:
            old = self.cache.get(key)
            if old is None or (last_o, last_k) < old:
                if len(self.cache) >= _CACHE_LIMIT:
                    self.cache.clear()
                self.cache[key] = (last_o, last_k)
        return False

    def _place(self, part: np.ndarray, a: int, b: int, k: int, o: int, sub: bool) -> bool:
        """Place ``k`` at ``o``, check the bounds, go on; the state is restored on return."""
        z = self.z[k]
        h = o + z
        if h > self.cap:
            return False
        mo, un = self.mo, self.un
        ov = self.OV[k]
        sel = ov[un[ov] & (mo[ov] < h)]
        old = mo[sel]
        mo[sel] = -(-h // self.AL[sel]) * self.AL[sel] if self.aligned else h
        un[k] = False
        self.sol[k] = o
        inside = self.in_out[k] if self.opts.enclosing_first else None
        if inside is not None:
            self.out_left[inside] -= 1
        sa, sb = self.slo[k], self.shi[k]
        top_old = self.top[sa:sb].copy()
        self.top[sa:sb] = h
        self.total[sa:sb] -= z
        try:
            return self._check(sa, sb, sel) and self._descend(part, a, b, k, o, sub)
        finally:
            self.top[sa:sb] = top_old
            self.total[sa:sb] += z
            un[k] = True
            mo[sel] = old
            if inside is not None:
                self.out_left[inside] += 1

    def _check(self, x: int, y: int, sel: np.ndarray) -> bool:
        """Section bounds on the sections whose floor or total changed (the others passed before).
        The monotonic floor needs no check here: the candidate filter ``mo <= C - max total`` is it."""
        opts = self.opts
        if sel.size:
            x = min(x, int(self.SLO[sel].min()))
            y = max(y, int(self.SHI[sel].max()))
        floor = self.top[x:y]
        if opts.unallocated_floor:
            seg = self.mem[self.mstart[x]:self.mstart[y]]
            umin = np.minimum.reduceat(np.where(self.un[seg], self.mo[seg], _BIG), self.mstart[x:y] - self.mstart[x])
            floor = np.maximum(floor, np.where(umin < _BIG, umin, 0))
        if opts.section_inference:
            floor = floor + self.total[x:y]
        return int(floor.max()) <= self.cap

    def _descend(self, part: np.ndarray, a: int, b: int, k: int, o: int, sub: bool) -> bool:
        sa, sb = self.slo[k], self.shi[k]
        if not self.opts.decomposition or sb - sa < 2:
            return self._subsolve(part, a, b) if sub else self._search(part, a, b, o, k)
        crossing = self.cuts[sa:sb - 1]  # buffers crossing each boundary, now without k
        crossing -= 1
        try:
            cut = np.flatnonzero(crossing == 0)
            if cut.size:
                return self._split(part, a, b, (cut + sa + 1).tolist())
            return self._subsolve(part, a, b) if sub else self._search(part, a, b, o, k)
        finally:
            crossing += 1

    def _split(self, part: np.ndarray, a: int, b: int, cuts: list[int]) -> bool:
        rest = part & self.un
        pts = [a, *cuts, b]
        for x, y in zip(pts, pts[1:]):
            sub = rest & (self.SHI > x) & (self.SLO < y)
            if sub.any() and not self._subsolve(sub, x, y):
                return False
        return True


def search_layout(lower: Sequence[int], upper: Sequence[int], size: Sequence[int], alignment: Sequence[int],
                  capacity: int, options: LayoutOptions = LayoutOptions(), deadline: float = float("inf"),
                  node_limit: int | None = None, stop: threading.Event | None = None,
                  progress: Callable[[int], None] | None = None) -> SearchResult:
    """Offsets under ``capacity`` (FOUND), a proof that none exist (INFEASIBLE), or LIMIT when the node
    limit, ``deadline`` (``time.monotonic()``) or ``stop`` came first. With several preorders and no
    node limit, each independent part runs them round robin with node limits doubling from twice its
    size; otherwise the first preorder runs one complete search (what the option tests count).
    ``progress(nodes)`` is called about every two seconds."""
    if not options.preorders:
        raise ValueError("LayoutOptions.preorders must name at least one Preorder")
    sizes = np.asarray(size, dtype=np.int64)
    aligns = np.asarray(alignment, dtype=np.int64)
    offsets = np.zeros(len(sizes), np.int64)
    nz = np.flatnonzero(sizes > 0)
    # canonical offsets are sums of sizes rounded up to alignments: work in units of their gcd
    unit = int(np.gcd.reduce(np.concatenate([sizes[nz], aligns[nz]]))) if nz.size else 1
    capacity = int(capacity) // unit
    if capacity * (len(nz) + 1) >= 2 ** 62:
        raise ValueError(f"capacity {capacity * unit} is too large for the exact search")
    prob = _Problem(np.asarray(lower)[nz], np.asarray(upper)[nz], sizes[nz] // unit, aligns[nz] // unit)
    trees: dict[Preorder, _Tree] = {}
    next_report = [time.monotonic() + 2.0]

    def nodes() -> int:
        return sum(t.nodes for t in trees.values())

    def halted() -> bool:
        return time.monotonic() > deadline or (stop is not None and stop.is_set())

    def tick(_: int) -> None:
        if halted():
            raise _Stop
        if progress is not None and time.monotonic() >= next_report[0]:
            next_report[0] = time.monotonic() + 2.0
            progress(nodes())

    def tree(p: Preorder) -> _Tree:
        if p not in trees:
            trees[p] = _Tree(prob, p, capacity, options)
            trees[p].tick = tick
        return trees[p]

    single = node_limit is not None or len(options.preorders) == 1
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 6 * prob.n + 1000))
    try:
        for comp in prob.components():
            limit = 2 * len(comp)
            solved = None
            while solved is None:
                limit *= 2
                for p in options.preorders[:1] if single else options.preorders:
                    t = tree(p)
                    try:
                        ok = t.run(comp, node_limit - nodes() if node_limit is not None else
                                   float("inf") if single else limit)
                    except _Stop:
                        if single or halted():
                            return SearchResult(SearchStatus.LIMIT, None, nodes())
                        continue
                    if not ok:
                        return SearchResult(SearchStatus.INFEASIBLE, None, nodes())
                    solved = t
                    break
            offsets[nz[comp]] = solved.sol[solved.inv[comp]] * unit
    finally:
        sys.setrecursionlimit(old_limit)
    return SearchResult(SearchStatus.FOUND, offsets.tolist(), nodes())


def preorder_indices(lower: Sequence[int], upper: Sequence[int], size: Sequence[int], preorder: Preorder) -> list[int]:
    """Input indices of the non-empty buffers in ``preorder`` (the CP-SAT canonical strategy's ties)."""
    sizes = np.asarray(size, dtype=np.int64)
    nz = np.flatnonzero(sizes > 0)
    prob = _Problem(np.asarray(lower)[nz], np.asarray(upper)[nz], sizes[nz], np.ones(nz.size, np.int64))
    return nz[prob.preorder(preorder)].tolist()
