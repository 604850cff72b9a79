"""Operator ordering for the smallest peak of live bytes (ROAM's first stage).

Orders (all lists of op ids; ``simulate.check_order`` accepts every one of them):

- :func:`program_order` — the order the ops were given in (what eager PyTorch runs).
- :func:`least_peak_order` — ROAM's heuristic baseline, "least-peak-memory-first": repeatedly run the
  ready op that leaves the running peak lowest (``max(peak so far, live + its outputs)``), then the one
  that leaves the fewest live bytes after it, then the earliest in program order.
- :func:`rule_order` — a list scheduler that follows a base order except where ROAM's rules (the
  named options of :class:`OrderOptions`) say otherwise:

  * ``constants_late``: *floating* ops (no ancestor reads a graph input: optimizer constants,
    parameter casts) run right before the first op that needs them;
  * ``updates_early``: a weight update — a connected group of OPTIMIZER ops (or, as a second
    candidate that does not trust the roles, of the side branches off the spine of the graph, see
    ``IndexedProblem.spine``) — runs as soon as its inputs exist, as long as its steps stay at or
    below the threshold ``max(crossover, peak so far)``, where the crossover is the live bytes at the
    LOSS op in the base order; otherwise it waits until it fits or until the base order reaches it.

- Two more named rules make further candidates: ``loss_barrier`` (least-peak-first where the ops the
  loss does not depend on wait for the loss: backward pieces that read only forward values must not
  run in the forward pass) and ``sink_late`` (every candidate is post-processed by moving each op to
  just before its first successor whenever that cannot raise any step's live bytes: its inputs are
  read at or after that point anyway).
- :func:`order_ops` — the planner. Level ``O1`` keeps the best of the orders above (seconds). Level
  ``O2`` then repeatedly takes the step where the peak is reached and re-solves a window of
  consecutive positions around it exactly with CP-SAT (``order_ilp``; ops outside a window keep
  their places, so each window is an independent subproblem). With ``key_point_windows`` the
  windows snap to the segments between key points of the graph of non-floating, non-optimizer ops
  (ops that every other such op precedes or follows; ROAM splits the graph there): a segment up to
  ``segment_size`` ops is one window, solved to optimality; a longer one gets windows of
  ``segment_size`` consecutive ops around the peak step, which covers ROAM's forward/backward
  "rings" around the loss (a window straddling the loss holds the last forward and first backward
  ops). A window is accepted only when it lowers its own peak below the current peak; the loop stops
  at the lower bound (``IndexedProblem.lower_bound``), when no window around a peak step improves,
  or at the time limit. A slow window keeps the best solution found; nothing ever fails.
  This is ``division="flat"``. ``division="tree"`` replaces the windows around the peak with ROAM's
  recursive task tree (``order_tree``: key-point, loss and halving cuts down to exact leaves, children
  merged across their seams by an exact interleaving under the order constraints between them).
"""
from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from .order_graph import IndexedProblem
from .order_ilp import solve_window, window_booleans
from .order_tree import TreeSettings, TreeStats, improve_tree
from .problem import MemProblem, OpRole

__all__ = [
    "Division",
    "OptLevel",
    "OrderOptions",
    "OrderResult",
    "least_peak_order",
    "order_ops",
    "program_order",
    "rule_order",
]


class OptLevel(str, Enum):
    """``O1``: heuristics only (seconds). ``O2``: heuristics, then exact CP-SAT windows (default)."""

    O1 = "O1"
    O2 = "O2"


class Division(str, Enum):
    """How ``O2`` divides the order into exact subproblems: ``flat`` windows around the peak step
    (default), or ROAM's recursive ``tree`` (``order_tree``)."""

    FLAT = "flat"
    TREE = "tree"


@dataclass
class OrderOptions:
    """Named rules and knobs of the ordering (house rule 3: each has a safe default; the module
    docstring says what each rule does; a rule that is off only removes candidates, so the result
    stays valid and never below the other candidates).

    ``cross_loss_bottom`` is a layout rule (used by ``plan.plan_memory``): activations live across
    the loss are stacked at the bottom of the arena, the latest freed lowest. ``o1_layout_seconds`` is one
    too: at O1, when no greedy layout reaches the order's live peak, the exact layout search
    (``layout.solve_layout``) runs for at most that many seconds (and half the time left); it stops at once
    where it proves the peak, as on small rank programs (0 turns it off: greedy layouts only).
    """

    constants_late: bool = True
    updates_early: bool = True
    sink_late: bool = True
    loss_barrier: bool = True
    cross_loss_bottom: bool = True
    o1_layout_seconds: float = 1.0
    key_point_windows: bool = True
    segment_size: int = 100  # most ops per exact window (ROAM's ring size)
    window_booleans: int = 4000  # about this many run/started booleans per window (fewer ops if needed)
    window_time_limit: float = 2.0  # seconds per window solve
    workers: int = 2  # CP-SAT workers
    division: Division | str = Division.FLAT  # O2's task division (see ``Division``)
    merge_span: int = 150  # tree division: ops of each child a seam merge interleaves
    tree_peak_only: bool = True  # tree division: solve only leaves and seams holding a peak step
    tree_branch_merge: bool = True  # tree division: also interleave spine and side-branch ops (order_tree)

    def __post_init__(self) -> None:
        try:
            self.division = Division(self.division)
        except ValueError:
            raise ValueError(f"unknown order division {self.division!r}; use one of "
                             f"{[d.value for d in Division]}") from None


@dataclass
class OrderResult:
    """An order (op ids) and how it was found."""

    order: list[int]
    peak: int  # max live bytes over the steps of ``order``
    lower_bound: int  # no order of this problem has a smaller peak
    source: str  # the candidate the result came from, "+windows" ("+tree") when the flat (tree) division improved it
    candidates: dict[str, int] = field(default_factory=dict)  # heuristic name -> its peak
    seconds: float = 0.0
    windows: int = 0  # window solves run
    improved: int = 0  # window solves that lowered the peak of their window
    stopped: str = ""  # why O2 stopped: "lower bound", "local optimum", "time limit", "" (O1)


Progress = Callable[[str], None]

NO_DEADLINE = float("inf")
CHECK_EVERY = 64  # list-scheduler steps between clock reads (a read costs about as much as one step)


class _OutOfTime(Exception):
    """A heuristic passed its deadline; ``order_ops`` keeps the candidates finished before it."""


def _check(deadline: float, step: int) -> None:
    if step % CHECK_EVERY == 0 and time.perf_counter() >= deadline:
        raise _OutOfTime


# -- live-bytes bookkeeping shared by the list schedulers -------------------------------------------
class _Tracker:
    """Live bytes while an order is built op by op (the lifetime rule of ``problem.py``)."""

    def __init__(self, g: IndexedProblem) -> None:
        self.g = g
        self.rem = [len(c) for c in g.cons]
        self.done = [False] * g.n
        self.freed = [0] * g.n  # bytes op i frees after its step if it ran now
        for j in range(g.m):
            if len(g.cons[j]) == 1 and not g.keep[j]:
                self.freed[g.cons[j][0]] += g.size[j]
        self.unused_out = [sum(g.size[j] for j in outs if not g.cons[j] and not g.keep[j]) for outs in g.op_out]
        self.unused_in = sum(g.size[j] for j in range(g.m) if g.is_input[j] and not g.cons[j] and not g.keep[j])
        self.live = g.input_bytes
        self.peak = 0
        self.steps = 0
        self.order: list[int] = []

    def during(self, i: int) -> int:
        return self.live + self.g.out_bytes[i]

    def after(self, i: int) -> int:
        return self.live + self.g.out_bytes[i] - self.freed[i] - self.unused_out[i]

    def run(self, i: int) -> None:
        g = self.g
        self.peak = max(self.peak, self.during(i))
        self.live = self.after(i)
        if self.steps == 0:
            self.live -= self.unused_in
        self.steps += 1
        self.done[i] = True
        self.order.append(i)
        for j in g.op_in[i]:
            self.rem[j] -= 1
            if self.rem[j] == 1 and not g.keep[j]:
                for c in g.cons[j]:
                    if not self.done[c]:
                        self.freed[c] += g.size[j]
                        break


def _least_peak(g: IndexedProblem, prio: Sequence[int], before_loss: Sequence[bool] | None = None,
                deadline: float = NO_DEADLINE) -> list[int]:
    """Least-peak-first list scheduling; with ``before_loss``, ops outside it wait for the LOSS op.
    Raises ``_OutOfTime`` past ``deadline``."""
    tr = _Tracker(g)
    indeg = [len(p) for p in g.preds]
    ready: list[int] = []
    held: list[int] = []
    for i in range(g.n):
        if indeg[i] == 0:
            (ready if before_loss is None or before_loss[i] else held).append(i)
    while ready or held:
        _check(deadline, tr.steps)
        if not ready:
            ready, held = held, []
            before_loss = None
        best_k, best_key = 0, None
        peak, live = tr.peak, tr.live
        for k, i in enumerate(ready):
            during = live + g.out_bytes[i]
            key = (during if during > peak else peak, during - tr.freed[i] - tr.unused_out[i], prio[i])
            if best_key is None or key < best_key:
                best_k, best_key = k, key
        i = ready[best_k]
        ready[best_k] = ready[-1]
        ready.pop()
        tr.run(i)
        if i == g.loss and before_loss is not None:
            ready.extend(held)
            held = []
            before_loss = None
        for s in g.succs[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                (ready if before_loss is None or before_loss[s] else held).append(s)
    assert len(tr.order) == g.n, "the dependency graph has a cycle"
    return tr.order


def _update_groups(g: IndexedProblem, member: Sequence[bool]) -> list[int]:
    """Group id per op (-1 outside): connected components of the member ops (one weight update each)."""
    parent = list(range(g.n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i in range(g.n):
        if member[i]:
            for p in g.preds[i]:
                if member[p]:
                    parent[find(p)] = find(i)
    return [find(i) if member[i] else -1 for i in range(g.n)]


def _rules(g: IndexedProblem, base: Sequence[int], constants_late: bool, updates_early: bool,
           by_role: bool = True, deadline: float = NO_DEADLINE) -> list[int]:
    """ROAM's rules (``constants_late``, ``updates_early``) as a list schedule that follows ``base``
    elsewhere; ``by_role``: an update is a group of OPTIMIZER ops, else of the ops off the spine.
    Raises ``_OutOfTime`` past ``deadline``."""
    return _RuleScheduler(g, base, constants_late, updates_early, by_role).run(deadline)


class _RuleScheduler:
    """The list scheduler of ``_rules``. Ready non-floating ops run by base position; a weight update
    whose outside inputs all exist is *pending* and runs whole as soon as its rise over the live bytes
    keeps it at or below ``max(crossover, peak so far)``; floating ops run right before their first reader."""

    def __init__(self, g: IndexedProblem, base: Sequence[int], constants_late: bool, updates_early: bool,
                 by_role: bool) -> None:
        n = g.n
        self.g = g
        self.prio = g.positions(base)
        self.floating = g.floating() if constants_late else [False] * n
        self.group = _update_groups(g, self._update_members(updates_early, by_role))
        self.members: dict[int, list[int]] = {}
        for i in sorted(range(n), key=self.prio.__getitem__):
            if self.group[i] >= 0:
                self.members.setdefault(self.group[i], []).append(i)
        self.crossover = g.profile(base)[self.prio[g.loss]] if updates_early and g.loss >= 0 else 0
        self.tr = _Tracker(g)
        floating, group = self.floating, self.group
        # floating predecessors run on demand (right before their first reader), so they do not gate readiness
        self.indeg = [sum(not floating[p] for p in g.preds[i]) for i in range(n)]
        self.ext = {gid: sum(1 for i in ops for p in g.preds[i] if not floating[p] and group[p] != gid)
                    for gid, ops in self.members.items()}  # unfinished outside predecessors of each update
        self.heap: list[tuple[int, int]] = []  # ready non-floating ops by base position
        self.pending: list[tuple[int, int, int]] = []  # (rise, base position, group) of updates whose inputs exist

    def _update_members(self, updates_early: bool, by_role: bool) -> list[bool]:
        g, floating = self.g, self.floating
        if by_role:
            return [updates_early and g.role[i] is OpRole.OPTIMIZER and not floating[i] for i in range(g.n)]
        spine = g.spine()
        return [updates_early and not spine[i] and not floating[i] for i in range(g.n)]

    def pending_floating(self, i: int, also: set[int] | None = None) -> list[int]:
        """Floating ancestors of ``i`` not yet run, in a topological order (earliest base position first)."""
        g, prio, floating, done = self.g, self.prio, self.floating, self.tr.done
        out: list[int] = []
        seen: set[int] = set() if also is None else also

        def visit(u: int) -> None:
            for p in sorted(g.preds[u], key=prio.__getitem__):
                if floating[p] and not done[p] and p not in seen:
                    seen.add(p)
                    visit(p)
                    out.append(p)

        visit(i)
        return out

    def group_sequence(self, gid: int) -> list[int]:
        """The update's remaining ops (with their floating inputs), in a topological order."""
        g, prio = self.g, self.prio
        left = [i for i in self.members[gid] if not self.tr.done[i]]
        inside = set(left)
        deg = {i: sum(1 for p in g.preds[i] if p in inside) for i in left}
        ready = [(prio[i], i) for i in left if deg[i] == 0]
        heapq.heapify(ready)
        seq: list[int] = []
        seen: set[int] = set()
        while ready:
            i = heapq.heappop(ready)[1]
            seq.extend(self.pending_floating(i, seen))
            seq.append(i)
            for s_ in g.succs[i]:
                if s_ in inside:
                    deg[s_] -= 1
                    if deg[s_] == 0:
                        heapq.heappush(ready, (prio[s_], s_))
        return seq

    def rise(self, seq: list[int]) -> int:
        """How far above the current live bytes running ``seq`` now would go."""
        g, tr = self.g, self.tr
        rem: dict[int, int] = {}
        cur = top = 0
        for i in seq:
            cur += g.out_bytes[i]
            top = max(top, cur)
            for j in g.op_in[i]:
                r = rem.get(j, tr.rem[j]) - 1
                rem[j] = r
                if r == 0 and not g.keep[j]:
                    cur -= g.size[j]
            cur -= tr.unused_out[i]
        return top

    def queue_update(self, gid: int) -> None:
        """Group ``gid``'s outside inputs all exist: it waits in ``pending`` for room under the threshold."""
        heapq.heappush(self.pending, (self.rise(self.group_sequence(gid)), self.prio[self.members[gid][0]], gid))

    def release(self, i: int) -> None:
        if self.floating[i]:
            return
        for s_ in self.g.succs[i]:
            self.indeg[s_] -= 1
            if self.indeg[s_] == 0 and not self.floating[s_]:
                heapq.heappush(self.heap, (self.prio[s_], s_))
            gid = self.group[s_]
            if gid >= 0 and self.group[i] != gid:
                self.ext[gid] -= 1
                if self.ext[gid] == 0:
                    self.queue_update(gid)

    def emit(self, i: int) -> None:
        if self.tr.done[i]:
            return
        for f in self.pending_floating(i):
            self.tr.run(f)
            self.release(f)
        self.tr.run(i)
        self.release(i)

    def run_fitting_update(self) -> bool:
        """Run the earliest (in base order) pending update that fits under the threshold now; False when
        none fits."""
        pending, tr = self.pending, self.tr
        limit = max(self.crossover, tr.peak)
        best = None
        for k, (r, p, gid) in enumerate(pending):
            if tr.live + r <= limit and (best is None or p < pending[best][1]):
                best = k
        if best is None:
            return False
        r, p, gid = pending[best]
        pending[best] = pending[-1]
        pending.pop()
        heapq.heapify(pending)
        seq = self.group_sequence(gid)
        if tr.live + self.rise(seq) <= limit:
            for i in seq:
                self.emit(i)
        elif seq:
            heapq.heappush(pending, (self.rise(seq), p, gid))
        return True

    def run(self, deadline: float = NO_DEADLINE) -> list[int]:
        g, heap, tr = self.g, self.heap, self.tr
        for i in range(g.n):
            if self.indeg[i] == 0 and not self.floating[i]:
                heapq.heappush(heap, (self.prio[i], i))
        for gid, e in self.ext.items():
            if e == 0:
                self.queue_update(gid)
        loops = 0
        while True:
            loops += 1
            _check(deadline, loops)
            if self.pending and self.run_fitting_update():
                continue
            while heap and tr.done[heap[0][1]]:
                heapq.heappop(heap)
            if not heap:
                break
            self.emit(heapq.heappop(heap)[1])
        for i in sorted(range(g.n), key=self.prio.__getitem__):  # floating ops nothing else needs
            self.emit(i)
        assert len(tr.order) == g.n and g.is_topological(tr.order)
        return tr.order


def _sink_late(g: IndexedProblem, order: list[int], max_passes: int = 20, deadline: float = NO_DEADLINE) -> list[int]:
    """Move ops later, right before their first successor, where that cannot raise any step's bytes.

    Op ``u`` moves from its step to just before its earliest successor ``c`` when every tensor it
    reads is kept or also read at or after ``c`` (so no input lives longer) and the outputs nobody
    reads are no bigger than ``c``'s outputs (so the new step stays below ``c``'s old step). Its
    outputs then live shorter and nothing else changes: no step gets more live bytes. Moves of one
    pass are applied together (they only go later, so the conditions still hold); passes repeat
    until nothing moves, or until ``deadline`` (the last finished pass is returned).
    """
    n = g.n
    unused = [sum(g.size[j] for j in outs if not g.cons[j] and not g.keep[j]) for outs in g.op_out]
    for _ in range(max_passes):
        if time.perf_counter() >= deadline:
            break
        pos = g.positions(order)
        # per tensor: the last reader's step and who it is, and the step of the reader before it
        last = [-1] * g.m
        who = [-1] * g.m
        second = [-1] * g.m
        for j in range(g.m):
            for x in g.cons[j]:
                px = pos[x]
                if px > last[j]:
                    second[j], last[j], who[j] = last[j], px, x
                elif px > second[j]:
                    second[j] = px
        key = [float(p) for p in pos]
        moved = 0
        for u in range(n):
            succ = g.succs[u]
            if not succ:
                continue
            c = succ[0]
            f = pos[c]
            for x in succ:
                if pos[x] < f:
                    c, f = x, pos[x]
            if f == pos[u] + 1 or unused[u] > g.out_bytes[c]:
                continue
            ok = True
            for j in g.op_in[u]:
                if not g.keep[j] and (second[j] if who[j] == u else last[j]) < f:
                    ok = False
                    break
            if ok:
                key[u] = f - 0.5 + pos[u] / (2.0 * n + 2.0)  # before c, in the old relative order
                moved += 1
        if not moved:
            break
        order = sorted(order, key=key.__getitem__)
    return order


def program_order(problem: MemProblem) -> list[int]:
    """The ops' ids in the order given."""
    return problem.op_ids()


def least_peak_order(problem: MemProblem) -> list[int]:
    """ROAM's least-peak-memory-first heuristic (see the module docstring)."""
    g = IndexedProblem(problem)
    return g.to_ids(_least_peak(g, list(range(g.n))))


def rule_order(problem: MemProblem, base: Sequence[int] | None = None,
               options: OrderOptions | None = None) -> list[int]:
    """``base`` (default: program order) with ROAM's ordering rules applied (see the module docstring)."""
    g = IndexedProblem(problem)
    opts = options or OrderOptions()
    b = list(range(g.n)) if base is None else g.from_ids(base)
    return g.to_ids(_rules(g, b, opts.constants_late, opts.updates_early))


class _Found(dict):
    """Heuristic name -> order, with each order's peak measured as it is stored (``peaks``)."""

    def __init__(self, g: IndexedProblem) -> None:
        super().__init__()
        self.g = g
        self.peaks: dict[str, int] = {}

    def __setitem__(self, name: str, order: list[int]) -> None:
        assert self.g.is_topological(order), "a heuristic broke a dependency"
        self.peaks[name] = self.g.peak(order)
        super().__setitem__(name, order)


def _candidates(g: IndexedProblem, opts: OrderOptions, progress: Progress | None = None,
                deadline: float = NO_DEADLINE) -> _Found:
    """The heuristic orders: program order, least-peak-first, and the rules applied to both; past
    ``deadline`` only those finished before it (program order at least)."""
    out = _Found(g)
    out["program"] = list(range(g.n))
    try:
        _heuristics(g, opts, progress, deadline, out)
    except _OutOfTime:
        if progress:
            progress(f"order: time limit during the heuristics; {len(out)} of them finished")
    return out


def _heuristics(g: IndexedProblem, opts: OrderOptions, progress: Progress | None, deadline: float,
                out: dict[str, list[int]]) -> None:
    """Adds the heuristic orders to ``out`` one by one (raises ``_OutOfTime`` past ``deadline``)."""
    t = time.perf_counter()

    def note(name: str) -> None:
        nonlocal t
        if progress and time.perf_counter() - t > 1.0:
            t = time.perf_counter()
            progress(f"order: heuristic {name} done")

    def rules(base: list[int], by_role: bool) -> list[int]:
        return _rules(g, base, opts.constants_late, opts.updates_early, by_role, deadline)

    prog = out["program"]
    greedy = out["least_peak"] = _least_peak(g, prog, deadline=deadline)
    note("least_peak")
    need: list[bool] | None = None
    if opts.loss_barrier and g.loss >= 0:
        need = g.ancestors(g.loss)
        need[g.loss] = True
        out["least_peak|loss"] = _least_peak(g, prog, need, deadline)
        note("least_peak|loss")
    if opts.constants_late or opts.updates_early:
        for by_role in (True, False) if opts.updates_early else (True,):
            tag = "" if by_role else "/side"
            out[f"rules{tag}(program)"] = rules(prog, by_role)
            note(f"rules{tag}(program)")
            out[f"rules{tag}(least_peak)"] = rules(greedy, by_role)
            note(f"rules{tag}(least_peak)")
            out[f"least_peak(rules{tag})"] = _least_peak(g, g.positions(out[f"rules{tag}(program)"]), deadline=deadline)
            note(f"least_peak(rules{tag})")
            if need is not None:
                out[f"rules{tag}(least_peak|loss)"] = rules(out["least_peak|loss"], by_role)
                out[f"least_peak|loss(rules{tag})"] = _least_peak(g, g.positions(out[f"rules{tag}(program)"]), need,
                                                                  deadline)
                note(f"least_peak|loss(rules{tag})")
    if opts.sink_late:
        for name in list(out):
            if name != "program" and name != "least_peak":
                out[name] = _sink_late(g, out[name], deadline=deadline)
                note(f"sink_late({name})")
        _check(deadline, 0)
        out["sink_late(program)"] = _sink_late(g, prog, deadline=deadline)
        out["sink_late(least_peak)"] = _sink_late(g, greedy, deadline=deadline)
        if "least_peak|loss" in out:
            out["least_peak|loss"] = _sink_late(g, out["least_peak|loss"], deadline=deadline)


def _windows_around(g: IndexedProblem, order: Sequence[int], s: int, size: int, budget: int,
                    segment: tuple[int, int] | None) -> list[tuple[int, int]]:
    """Windows ``[a, b)`` containing step ``s``, at most ``size`` ops and about ``budget`` booleans:
    the key-point segment around ``s`` when it fits, then windows centred on ``s`` and leaning left
    and right, shrunk until they fit the budget."""
    n = g.n
    out: list[tuple[int, int]] = []
    if segment is not None:
        lo, hi = segment
        if hi - lo <= size and window_booleans(g, order, lo, hi) <= budget:
            out.append((lo, hi))
    for frac in (0.5, 0.8, 0.2):
        w = min(size, n)
        while w >= 2:
            a = max(0, min(s - int(w * frac), n - w))
            b = a + w
            if window_booleans(g, order, a, b) <= budget or w <= 8:
                if (a, b) not in out:
                    out.append((a, b))
                break
            w = w * 3 // 4
    return out


def _improve(g: IndexedProblem, order: list[int], opts: OrderOptions, lb: int, deadline: float,
             progress: Progress | None, stats: OrderResult) -> list[int]:
    live = g.profile(order)
    chain = g.chain_points()
    fixed = dict(zip(chain, g.must_live(chain)))  # bytes live at these ops' steps in every order
    kps = chain if opts.key_point_windows else []
    failed: set[tuple[int, int, int]] = set()
    last_report = time.perf_counter()
    budget = opts.window_booleans
    while True:
        peak = max(live)
        if peak <= lb:
            stats.stopped = "lower bound"
            break
        now = time.perf_counter()
        if now >= deadline:
            stats.stopped = "time limit"
            break
        pos = g.positions(order)
        kp_pos = sorted(pos[k] for k in kps)
        pick = None
        for s in (s for s, v in enumerate(live) if v == peak):
            seg = None
            if kp_pos:
                r = bisect.bisect_right(kp_pos, s)
                seg = (kp_pos[r - 1] if r > 0 else 0, kp_pos[r] + 1 if r < len(kp_pos) else g.n)
            for a, b in _windows_around(g, order, s, opts.segment_size, budget, seg):
                sig = (a, b, hash(tuple(order[a:b])))
                if sig in failed:
                    continue
                if max((fixed.get(o, 0) for o in order[a:b]), default=0) >= peak:
                    failed.add(sig)  # a step of this window cannot go below the peak in any order
                    continue
                pick = (a, b, sig)
                break
            if pick:
                break
        if pick is None:
            stats.stopped = "local optimum"
            break
        a, b, sig = pick
        wlb = max((fixed.get(o, 0) for o in order[a:b]), default=0)
        limit = min(opts.window_time_limit, max(0.05, deadline - now))
        res = solve_window(g, order, live, a, b, limit, bound=peak - 1, lower=wlb, workers=opts.workers)
        stats.windows += 1
        if res.order is not None and res.peak is not None and res.peak < peak:
            order[a:b] = res.order
            assert res.live is not None
            live[a:b] = res.live
            stats.improved += 1
        else:
            failed.add(sig)
        if res.status == "unknown":
            budget = max(500, budget * 2 // 3)  # too big to settle in time: smaller windows
        elif res.seconds < limit / 4:
            budget = min(opts.window_booleans, budget * 5 // 4)
        if progress and (time.perf_counter() - last_report > 1.0 or res.seconds > 1.0):
            last_report = time.perf_counter()
            progress(f"order: window [{a}, {b}) {res.status} in {res.seconds:.1f}s, peak {max(live):,} B "
                     f"(lower bound {lb:,} B), {stats.windows} windows")
    return order


def _divide(g: IndexedProblem, order: list[int], opts: OrderOptions, lb: int, deadline: float,
            progress: Progress | None, stats: OrderResult) -> list[int]:
    """O2's exact improvement of ``order`` by the chosen division; ``stats`` gets the counts."""
    if opts.division is Division.FLAT:
        return _improve(g, order, opts, lb, deadline, progress, stats)
    settings = TreeSettings(opts.segment_size, opts.window_booleans, opts.window_time_limit, opts.workers,
                            opts.merge_span, opts.tree_peak_only, opts.tree_branch_merge)
    order, ts = improve_tree(g, order, lb, deadline, settings, progress, TreeStats())
    stats.windows, stats.improved, stats.stopped = ts.leaves + ts.merges, ts.improved, ts.stopped
    return order


def order_ops(problem: MemProblem, level: OptLevel | str = OptLevel.O2, options: OrderOptions | None = None,
              time_limit: float = 60.0, progress: Progress | None = None, search_share: float = 1.0) -> OrderResult:
    """The best order found for ``problem`` at ``level`` within ``time_limit`` seconds: the heuristics may
    use all of it, O2's exact search ``search_share`` of what they leave."""
    t0 = time.perf_counter()
    level = OptLevel(level)
    opts = options or OrderOptions()
    g = IndexedProblem(problem)
    lb = g.lower_bound()
    if g.n == 0:
        return OrderResult([], 0, 0, "program", {"program": 0}, 0.0)
    deadline = t0 + time_limit
    cands = _candidates(g, opts, progress, deadline)
    peaks = cands.peaks
    name = min(peaks, key=lambda k: (peaks[k], list(cands).index(k)))
    if progress:
        progress("order: heuristics " + ", ".join(f"{k} {v:,} B" for k, v in peaks.items()))
    res = OrderResult(list(cands[name]), peaks[name], lb, name, peaks)
    if level is OptLevel.O2 and peaks[name] > lb:
        now = time.perf_counter()
        order = _divide(g, list(cands[name]), opts, lb, now + search_share * max(0.0, deadline - now), progress, res)
        peak = g.peak(order)
        assert peak <= res.peak and g.is_topological(order)
        if peak < res.peak:
            tag = "+tree" if opts.division is Division.TREE else "+windows"
            res.order, res.peak, res.source = order, peak, name + tag
    elif level is OptLevel.O2:
        res.stopped = "lower bound"
    res.order = g.to_ids(res.order)
    res.seconds = time.perf_counter() - t0
    return res
