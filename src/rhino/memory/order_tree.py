"""Tree-based task division for the operator order (ROAM's division; ``OrderOptions(division="tree")``).

ROAM (Shu et al., arXiv 2310.19295) divides the graph recursively into sub-graphs that are solved
independently and merged under the order constraints between them. Here a task is a run of consecutive
positions ``[a, b)`` of the current order (ops outside a task keep their places, so the live bytes outside
it do not change and disjoint tasks are independent subproblems: ``order_ilp``'s window argument).

Decomposition (:func:`build_tree`), applied from the root ``[0, n)`` down:

1. a task of at most ``leaf_size`` ops whose CP-SAT model has at most ``leaf_booleans`` booleans is a
   *leaf*;
2. otherwise, if key points of the graph (``IndexedProblem.chain_points``: spine key points and the loss)
   sit strictly inside it, it is cut right after each of them (``"key points"``);
3. otherwise, if the LOSS op sits inside it, it is cut right after the loss into a forward side and a
   backward side (``"loss"``): the merge across this seam reorders the last forward and the first
   backward ops together, ROAM's innermost ring around the loss;
4. otherwise it is cut in the middle (``"halves"``).

Solving, bottom-up (children before their parent): a leaf is reordered exactly by CP-SAT
(``order_ilp.solve_window``, at most ``window_time_limit`` seconds). A parent then *merges* each pair of
neighbouring children across their seam: the last ``merge_span`` ops of the left child (sequence ``A``)
and the first ``merge_span`` ops of the right one (``B``) are interleaved, each child keeping its own
solved order. The merge's order constraints are the edges between them: an op of ``B`` may run before
an op of ``A`` only if it does not depend on it (and conversely). Among these interleavings the one
with the smallest peak is exact, by dynamic programming (:func:`merge_seam`). With ``branch_merge`` a
parent also merges two sub-graphs that are not runs of positions: its spine ops
(``IndexedProblem.spine``: forward, loss and backward chain) and its side-branch ops (weight updates,
floating ops), each in its current order, over the ``2 * merge_span`` positions around its highest step
(:func:`merge_parts`, the same program):

- state ``(i, j)``: the first ``i`` ops of ``A`` and the first ``j`` of ``B`` have run; the bytes live
  between steps, ``L(i, j)``, depend on the state only (a tensor is live once its producer ran, until
  its last reader ran, or to the end when it is kept or read after the window);
- moves: run ``A[i]`` (allowed when every predecessor of ``A[i]`` in ``B`` is among ``B[:j]``) or
  ``B[j]`` (likewise), costing ``base[i + j] + L(i, j) + out(op)`` bytes during that step;
- ``best(i, j) = min`` over the moves into ``(i, j)`` of ``max(best(previous), cost of the move)``;
  ``best(|A|, |B|)`` is the smallest peak of the seam. Concatenation (``A`` then ``B``) is one of the
  interleavings, so a merge never raises the window's peak.

A change is kept only when it lowers the peak of its window (nothing rises anywhere else), so every
order stays topological and its peak never exceeds the starting order's. Passes over the tree repeat
(the tree is rebuilt on the new order) until the lower bound is reached, a pass changes nothing
("local optimum") or the time limit ("time limit"). With ``peak_only`` (a named pruning rule) a leaf
or seam is solved only when it holds a step at the current peak: others cannot lower the peak.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from .order_graph import IndexedProblem
from .order_ilp import Window, solve_window, window_booleans

__all__ = ["Task", "TaskKind", "TreeSettings", "TreeStats", "build_tree", "improve_tree", "merge_parts", "merge_seam"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TreeSettings:
    """Knobs of the tree division (``OrderOptions`` fills them in)."""

    leaf_size: int = 100  # most ops per exact leaf (ROAM's sub-graph size)
    leaf_booleans: int = 4000  # most run/started booleans per leaf model
    window_time_limit: float = 2.0  # seconds per leaf solve
    workers: int = 2  # CP-SAT workers
    merge_span: int = 150  # ops of each child on either side of a seam that a merge interleaves
    peak_only: bool = True  # solve only leaves and seams holding a step at the current peak
    branch_merge: bool = True  # also interleave each task's spine and side-branch ops around the peak


@dataclass
class TreeStats:
    """What the tree search did."""

    leaves: int = 0  # leaf solves run
    merges: int = 0  # seam merges run
    improved: int = 0  # solves that lowered their window's peak
    passes: int = 0
    stopped: str = ""


class TaskKind(str, Enum):
    """A leaf, or the rule that cut a task into its children (the module docstring's rules 2-4)."""

    LEAF = "leaf"
    KEY_POINTS = "key points"
    LOSS = "loss"
    HALVES = "halves"


@dataclass
class Task:
    """Positions ``[a, b)`` of the order and how the task is divided."""

    a: int
    b: int
    kind: TaskKind
    children: list[Task] = field(default_factory=list)


def build_tree(g: IndexedProblem, order: Sequence[int], settings: TreeSettings) -> Task:
    """The task tree of ``order`` (see the module docstring for the division rules)."""
    pos = g.positions(order)
    cuts = sorted(pos[k] + 1 for k in g.chain_points())
    loss_cut = pos[g.loss] + 1 if g.loss >= 0 else -1
    return _divide(g, order, 0, g.n, cuts, loss_cut, settings)


def _is_leaf(g: IndexedProblem, order: Sequence[int], a: int, b: int, s: TreeSettings) -> bool:
    if b - a > s.leaf_size:
        return False
    if b - a <= 8:
        return True
    return window_booleans(g, order, a, b) <= s.leaf_booleans


def _divide(g: IndexedProblem, order: Sequence[int], a: int, b: int, cuts: list[int], loss_cut: int,
            s: TreeSettings) -> Task:
    if _is_leaf(g, order, a, b, s):
        return Task(a, b, TaskKind.LEAF)
    inside = [c for c in cuts if a < c < b]
    if inside:
        kind, bounds = TaskKind.KEY_POINTS, [a, *inside, b]
    elif a < loss_cut < b:
        kind, bounds = TaskKind.LOSS, [a, loss_cut, b]
    else:
        kind, bounds = TaskKind.HALVES, [a, (a + b) // 2, b]
    return Task(a, b, kind, [_divide(g, order, lo, hi, cuts, loss_cut, s) for lo, hi in zip(bounds, bounds[1:])])


def merge_seam(g: IndexedProblem, order: Sequence[int], live: Sequence[int], a: int, c: int, b: int,
               deadline: float = float("inf")) -> tuple[list[int], list[int]] | None:
    """The interleaving of ``A = order[a:c]`` and ``B = order[c:b]`` (each in its own order) with the
    smallest peak, subject to the edges between them (the module docstring's dynamic program).

    ``live`` is ``g.profile(order)``. Returns the window's new ops and live bytes, or None when the
    deadline passed first.
    """
    return merge_parts(g, order, live, a, b, [t >= c for t in range(a, b)], deadline)


def merge_parts(g: IndexedProblem, order: Sequence[int], live: Sequence[int], a: int, b: int,
                in_b: Sequence[bool], deadline: float = float("inf")) -> tuple[list[int], list[int]] | None:
    """Like :func:`merge_seam` for any split of the window ``[a, b)`` into two parts: ``A``, the ops at
    positions ``a + u`` with ``in_b[u]`` false, and ``B``, the others, each kept in its current order."""
    w = Window(g, order, live, a, b)
    k = b - a
    part_a = [u for u in range(k) if not in_b[u]]
    part_b = [u for u in range(k) if in_b[u]]
    idx = [0] * k
    for i, u in enumerate(part_a):
        idx[u] = i
    for j, u in enumerate(part_b):
        idx[u] = j
    m, nb = len(part_a), len(part_b)
    out_w, gain, frees, start = _seam_bytes(w, in_b, idx, part_a, part_b)
    need = [0] * k  # ops of the other part that must have run first (a prefix length)
    for u in range(k):
        for p in w.preds[u]:
            if in_b[p] != in_b[u]:
                need[u] = max(need[u], idx[p] + 1)
    par = _interleave(w, part_a, part_b, out_w, gain, frees, need, start, deadline)
    if par is None:
        return None
    peak, par = par
    seq: list[int] = []
    i, j = m, nb
    while i or j:
        if par[i][j] == 1:
            i -= 1
            seq.append(part_a[i])
        else:
            j -= 1
            seq.append(part_b[j])
    seq.reverse()
    new_live = w.live_of(seq)
    assert max(new_live) == peak, "the merge's dynamic program disagrees with the window's live bytes"
    return [w.ops[u] for u in seq], new_live


def _seam_bytes(w: Window, in_b: Sequence[bool], idx: Sequence[int], part_a: list[int], part_b: list[int]):
    """Per window slot: bytes its outputs hold during its step, bytes still live after it, and the
    tensors it frees as ``(size, last reader's index in the other part)``; plus the bytes live at the
    window's start."""
    k = w.k
    out_w = [0] * k
    gain = [0] * k
    frees: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    start = 0
    for size, slot, readers, to_end in w.tensors:
        if slot is not None:
            out_w[slot] += size
            if readers or to_end:
                gain[slot] += size
        else:
            start += size
        if to_end or not readers:
            continue
        ia = max((idx[r] for r in readers if not in_b[r]), default=-1)  # last reader in A (its A index)
        ib = max((idx[r] for r in readers if in_b[r]), default=-1)
        if ia >= 0:
            frees[part_a[ia]].append((size, ib))
        if ib >= 0:
            frees[part_b[ib]].append((size, ia))
    return out_w, gain, frees, start


def _interleave(w: Window, part_a: list[int], part_b: list[int], out_w: list[int], gain: list[int],
                frees: list[list[tuple[int, int]]], need: list[int], start: int, deadline: float):
    """The dynamic program over states ``(i, j)``: the smallest peak and the move into each state
    (1: ran ``A[i-1]``, 2: ran ``B[j-1]``); None when the deadline passes."""
    m, nb = len(part_a), len(part_b)
    inf = float("inf")
    best = [[inf] * (nb + 1) for _ in range(m + 1)]
    par = [[0] * (nb + 1) for _ in range(m + 1)]
    between = [[0] * (nb + 1) for _ in range(m + 1)]
    best[0][0] = 0
    between[0][0] = start
    for i in range(m + 1):
        if time.perf_counter() > deadline:
            return None
        row, brow, prow = best[i], between[i], par[i]
        nxt = best[i + 1] if i < m else None
        ua = part_a[i] if i < m else -1
        for j in range(nb + 1):
            if j > 0:
                u = part_b[j - 1]  # B[j-1] run from state (i, j-1)
                lb = brow[j - 1]
                brow[j] = lb + gain[u] - sum(sz for sz, other in frees[u] if other < i)
                if need[u] <= i and row[j - 1] < inf:
                    cost = max(row[j - 1], w.base[i + j - 1] + lb + out_w[u])
                    if cost < row[j]:
                        row[j], prow[j] = cost, 2
            elif i > 0:
                u = part_a[i - 1]  # A[i-1] run from state (i-1, 0)
                brow[0] = between[i - 1][0] + gain[u] - sum(sz for sz, other in frees[u] if other < 0)
            if nxt is not None and need[ua] <= j and row[j] < inf:
                cost = max(row[j], w.base[i + j] + brow[j] + out_w[ua])  # A[i] from state (i, j)
                if cost < nxt[j]:
                    nxt[j], par[i + 1][j] = cost, 1
    return best[m][nb], par


class _Search:
    """One run of the tree search over a mutable order and its profile."""

    def __init__(self, g: IndexedProblem, order: list[int], lb: int, deadline: float, s: TreeSettings,
                 progress: Progress | None, stats: TreeStats) -> None:
        self.g, self.order, self.lb, self.deadline, self.s = g, order, lb, deadline, s
        self.live = g.profile(order)
        self.peak = max(self.live)
        self.progress, self.stats = progress, stats
        self.failed: set[tuple[int, ...]] = set()
        self.spine = g.spine()
        self.changed = False
        self.last_report = time.perf_counter()

    def done(self) -> bool:
        return self.peak <= self.lb or time.perf_counter() >= self.deadline

    def worth(self, a: int, b: int) -> bool:
        return not self.s.peak_only or max(self.live[a:b]) >= self.peak

    def accept(self, a: int, b: int, ops: list[int], live: list[int]) -> None:
        self.order[a:b] = ops
        self.live[a:b] = live
        self.peak = max(self.live)
        self.changed = True
        self.stats.improved += 1

    def leaf(self, t: Task) -> None:
        a, b = t.a, t.b
        sig = (a, b, hash(tuple(self.order[a:b])))
        if b - a < 2 or sig in self.failed or not self.worth(a, b):
            return
        old = max(self.live[a:b])
        limit = min(self.s.window_time_limit, max(0.05, self.deadline - time.perf_counter()))
        res = solve_window(self.g, self.order, self.live, a, b, limit, bound=old - 1, workers=self.s.workers)
        self.stats.leaves += 1
        if res.order is not None and res.live is not None and max(res.live) < old:
            self.accept(a, b, res.order, res.live)
        else:
            self.failed.add(sig)

    def seam(self, a: int, c: int, b: int) -> None:
        lo, hi = max(a, c - self.s.merge_span), min(b, c + self.s.merge_span)
        sig = (lo, c, hi, hash(tuple(self.order[lo:hi])))
        if sig in self.failed or not self.worth(lo, hi):
            return
        old = max(self.live[lo:hi])
        res = merge_seam(self.g, self.order, self.live, lo, c, hi, self.deadline)
        self.stats.merges += 1
        if res is not None and max(res[1]) < old:
            self.accept(lo, hi, *res)
        elif res is not None:
            self.failed.add(sig)

    def solve(self, t: Task) -> None:
        if self.done():
            return
        if t.kind is TaskKind.LEAF:
            self.leaf(t)
            return
        for child in t.children:
            self.solve(child)
        for left, right in zip(t.children, t.children[1:]):
            if self.done():
                return
            self.seam(t.a, left.b, t.b)
        if self.s.branch_merge and not self.done():
            self.branches(t)
        self.report(t)

    def branches(self, t: Task) -> None:
        """Interleave the task's spine ops and its side-branch ops (each in its current order) over the
        ``2 * merge_span`` positions around its highest step."""
        top = max(range(t.a, t.b), key=self.live.__getitem__)
        lo, hi = max(t.a, top - self.s.merge_span), min(t.b, top + self.s.merge_span)
        sig = (-1, lo, hi, hash(tuple(self.order[lo:hi])))
        if sig in self.failed or not self.worth(lo, hi):
            return
        side = [not self.spine[op] for op in self.order[lo:hi]]
        if all(side) or not any(side):
            return
        old = max(self.live[lo:hi])
        res = merge_parts(self.g, self.order, self.live, lo, hi, side, self.deadline)
        self.stats.merges += 1
        if res is not None and max(res[1]) < old:
            self.accept(lo, hi, *res)
        elif res is not None:
            self.failed.add(sig)

    def report(self, t: Task) -> None:
        if self.progress and time.perf_counter() - self.last_report > 1.0:
            self.last_report = time.perf_counter()
            st = self.stats
            self.progress(f"order: tree task [{t.a}, {t.b}) ({t.kind.value}) merged, peak {self.peak:,} B (lower bound "
                          f"{self.lb:,} B), {st.leaves} leaves, {st.merges} merges, {st.improved} improved")


def improve_tree(g: IndexedProblem, order: list[int], lb: int, deadline: float, settings: TreeSettings,
                 progress: Progress | None = None, stats: TreeStats | None = None) -> tuple[list[int], TreeStats]:
    """Lower the peak of ``order`` (op indices, topological) by the tree division until ``deadline``
    (``time.perf_counter()`` seconds); the result is topological and its peak at most ``order``'s."""
    st = stats or TreeStats()
    run = _Search(g, list(order), lb, deadline, settings, progress, st)
    while True:
        if run.peak <= lb:
            st.stopped = "lower bound"
            break
        if time.perf_counter() >= deadline:
            st.stopped = "time limit"
            break
        run.changed = False
        st.passes += 1
        run.solve(build_tree(g, run.order, settings))
        if not run.changed:
            st.stopped = "time limit" if time.perf_counter() >= deadline and run.peak > lb else "local optimum"
            break
    return run.order, st
