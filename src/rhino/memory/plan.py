"""``plan_memory``: an operator order and an arena offset for every tensor (ROAM's two stages).

1. Order (``order.order_ops``): heuristics and ROAM's rules (until the time left after the baselines,
   less the reserve for the by-size layout and the checks), then (level ``O2``) exact CP-SAT windows
   with ``ORDER_SHARE`` of what the heuristics leave; ``options.division`` picks flat windows around the peak (default)
   or ROAM's task tree (``order_tree``).
2. Layout of that order's buffers (``problem.buffers``): the greedy layouts of ``layout.py`` by size
   and long-lived first, ROAM's cross-loss rule (option ``cross_loss_bottom``: the tensors live across
   the loss are pre-placed at the bottom of the arena, the latest freed lowest, and the rest placed
   first fit above and around them), and at ``O2`` ``layout.solve_layout`` (every greedy order, then
   its exact CP-SAT search with the time left); the lowest height wins. Nothing more is tried once a
   layout reaches the order's peak of live bytes (its lower bound).
3. Baselines, computed on the same problem: PyTorch's program order (its live-bytes peak, and the
   caching-allocator simulation of ``allocator.py``), best-fit (program order + ``GreedyOrder.SIZE``
   layout, as XLA/TFLite) and ROAM's heuristic baseline (least-peak-first order +
   ``GreedyOrder.LONG_LIVED_FIRST`` layout). If a baseline's arena is lower than Rhino's own, the plan
   takes the baseline's order and layout (``source`` says which), so Rhino is never worse.
   The baselines watch the clock: the program order's live peak and best-fit (the plan of last resort)
   always run; the allocator simulation and the heuristic baseline only when their estimated time
   (``BASELINE_COST``) fits before the deadline less what must still run; a skipped one is None in the
   plan and named in ``skipped_baselines``. When even ``order_ops``' fixed part (the order lower bound)
   does not fit, the order is the program order and ``order_lower_bound`` the op-local bound
   (``op_local_bound``; ``stats["order_bound"]`` says which).

Every plan is checked (``simulate.check_order`` and ``layout.validate_layout``); ``valid`` records it.
``order_lower_bound`` is ``IndexedProblem.lower_bound``: bytes every order must hold at some step,
computed from the graph alone (not from the plan), so a plan whose ``height`` equals it is optimal.
``method="model"`` plans with the MODeL baseline (``model_ilp``) instead of steps 1-3.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .allocator import AllocatorStats, simulate_allocator
from .layout import Buffer, GreedyOrder, greedy_layout, solve_layout, validate_layout
from .order_graph import IndexedProblem
from .order import OptLevel, OrderOptions, OrderResult, least_peak_order, order_ops, program_order
from .problem import MemProblem, OpRole, TensorKind, buffers, lifetimes
from .simulate import check_order, replay

__all__ = ["MemoryPlan", "plan_memory", "stacked_layout", "op_local_bound"]

Progress = Callable[[str], None]


@dataclass
class MemoryPlan:
    """An order, an offset per tensor, and the baselines it was measured against (bytes, seconds)."""

    order: list[int]  # op ids
    offsets: dict[int, int]  # tensor id -> byte offset in the arena (zero-size tensors at 0)
    height: int  # arena bytes: max over tensors of offset + size
    lower_bound: int  # max live bytes over the steps of ``order``: no layout of this order is lower
    pytorch_live_peak: int  # program order, max live bytes (``simulate.replay``)
    pytorch_peak: int | None  # program order through the caching-allocator simulation, peak reserved (None: skipped)
    bestfit_peak: int  # program order + best-fit (greedy by size) layout, arena height
    heuristic_peak: int | None  # least-peak-first order + long-lived-first layout (ROAM's heuristic baseline)
    solve_seconds: float
    valid: bool  # check_order and validate_layout both pass
    level: str
    source: str = "rhino"  # "rhino", or the baseline whose plan was better: "heuristic", "bestfit"
    order_source: str = ""  # which ordering candidate won (``OrderResult.source``)
    layout_source: str = ""  # which layout won: a GreedyOrder name, "cross_loss_bottom", "exact"
    order_lower_bound: int = 0  # no order of the problem has fewer live bytes at its peak step
    pytorch_peak_allocated: int | None = 0  # allocator simulation, peak allocated (block sizes)
    stats: dict[str, float] = field(default_factory=dict)
    skipped_baselines: tuple[str, ...] = ()  # baselines left out for the time limit ("pytorch", "heuristic")


def _height(bufs: Sequence[Buffer], offsets: dict[int, int]) -> int:
    return max((offsets[b.id] + b.size for b in bufs), default=0)


def _cross_loss(problem: MemProblem, order: Sequence[int]) -> list[int]:
    """Tensors live before and after the LOSS op's step, latest freed first (ties: earliest made)."""
    loss = [op.id for op in problem.ops if op.role is OpRole.LOSS]
    if not loss:
        return []
    step = order.index(loss[-1])
    life = lifetimes(problem, order)
    cross = [t for t, (lo, hi) in life.items() if lo < step and hi > step + 1 and problem.tensors[t].size > 0]
    return sorted(cross, key=lambda t: (-life[t][1], life[t][0], t))


def stacked_layout(bufs: Sequence[Buffer], bottom: Sequence[int], rest_key: Callable[[Buffer], object] | None = None
                   ) -> dict[int, int]:
    """ROAM's cross-loss rule: buffers ``bottom`` stacked from offset 0 in the given order, the others
    placed one by one (``rest_key`` order; default: biggest first) at the lowest offset where they
    overlap no placed buffer that is live at the same time."""
    by_id = {b.id: b for b in bufs}
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, lo, hi) sorted by offset
    offsets: dict[int, int] = {}

    def align(x: int, a: int) -> int:
        return -(-x // a) * a if a > 1 else x

    top = 0
    for t in bottom:
        b = by_id[t]
        off = align(top, b.alignment)
        offsets[t] = off
        top = off + b.size
        bisect.insort(placed, (off, off + b.size, b.lower, b.upper))
    key = rest_key or (lambda b: (-b.size, b.lower, b.id))
    for b in sorted((b for b in bufs if b.id not in offsets), key=key):
        x = 0
        for off, end, lo, hi in placed:
            if lo >= b.upper or b.lower >= hi:
                continue
            if off >= align(x, b.alignment) + b.size:
                break
            x = max(x, end)
        x = align(x, b.alignment)
        offsets[b.id] = x
        bisect.insort(placed, (x, x + b.size, b.lower, b.upper))
    return offsets


# the cross-loss layout (``stacked_layout``) over a long-lived-first greedy layout of the same order: 4.3 s /
# 3.3 s measured on GPT-2 XL b1 (program order, 11,870 ops)
STACKED_VS_LLF = 1.3
#: Estimated seconds of the optional baselines and of ``order_ops``' fixed part, in units of one replay of the
#: program order (measured on GPT-2 XL b1, 11,870 ops: replay 0.08 s, allocator 0.26 s, least-peak-first order
#: 0.57 s, IndexedProblem + order lower bound 0.64 s) and, for the long-lived-first layout, of one by-size greedy
#: layout (0.67 s / 0.77 s).
BASELINE_COST = {"allocator": 4.0, "least_peak": 8.0, "order_bound": 9.0, "llf_vs_size": 1.0}
ORDER_SHARE = 0.5  # O2: the exact order search's share of the time the heuristics leave (the layout gets the rest)
METHODS = ("rhino", "model")  # plan_memory's planners: ROAM-style (ours), MODeL's joint program (baseline)


def plan_memory(problem: MemProblem, level: OptLevel | str = OptLevel.O2, time_limit: float = 60.0,
                progress: Progress | None = None, options: OrderOptions | None = None,
                method: str = "rhino") -> MemoryPlan:
    """Plan ``problem``: an order and a layout whose arena is as low as the level and time allow.

    ``time_limit`` (seconds) bounds the whole call (plus about a second of slack): the baselines, one
    by-size layout and the final checks always run (3-5 s on GPT-2 XL's 11,870 ops); the order's heuristics
    get the time left after them and stop at their deadline (the program order is always a candidate); at
    O2 its exact windows get ``ORDER_SHARE`` of what the heuristics leave; the layout gets the rest (its
    other greedy orders only when their estimated time fits, then ``solve_layout``). ``progress`` gets one-line
    messages, at least every couple of seconds during the searches. ``method="model"`` plans with the
    MODeL baseline instead (``model_ilp.solve_model``: order and addresses in one CP-SAT program, its
    plan as found, never replaced by a better baseline); it raises ``ValueError`` when that finds no plan
    within ``time_limit``.
    """
    t0 = time.perf_counter()
    level = OptLevel(level)
    opts = options or OrderOptions()
    if method not in METHODS:
        raise ValueError(f"unknown planning method {method!r}; choose one of {', '.join(METHODS)}")
    problem.validate()

    def say(msg: str) -> None:
        if progress:
            progress(msg)

    deadline = t0 + time_limit
    base = _Baselines.of(problem, deadline)
    say(f"baselines: PyTorch {base.pytorch_live:,} B live, {_b(base.alloc and base.alloc.peak_reserved)} reserved; "
        f"best-fit {base.bestfit.height:,} B; heuristic {_b(base.heuristic and base.heuristic.height)}")
    if method == "model":
        return _model_plan(problem, base, level, t0, time_limit, say)

    # 1. order: the time left after the baselines, less the by-size layout and the plan's checks (the other
    # greedy layouts run only if they still fit: the heuristic orders gain more); at O2 the exact windows get
    # ORDER_SHARE of what the heuristics leave, the layout the rest
    left = deadline - time.perf_counter() - base.reserve
    if deadline - time.perf_counter() - base.check_seconds >= base.order_bound_seconds:
        # (with no time left for the heuristics the order is the program order, whose layout is best-fit's)
        res: OrderResult = order_ops(problem, level, opts, time_limit=max(0.0, left), progress=progress,
                                     search_share=ORDER_SHARE)
    else:   # no time for the order lower bound: the program order, the op-local bound
        res = OrderResult(list(base.bestfit.order), base.pytorch_live, op_local_bound(problem), "program",
                          {"program": base.pytorch_live})
    say(f"order: peak {res.peak:,} B ({res.source}, {res.seconds:.1f}s); layout ...")

    # 2. layout: the time left, less the checks' reserve
    t_layout = time.perf_counter()
    ours = _layout(problem, res, level, opts, deadline - base.check_seconds, time_limit, say, progress, base)
    t_layout = time.perf_counter() - t_layout

    # 3. never worse than the baselines
    cands = [c for c in (ours, base.heuristic, base.bestfit) if c is not None]
    best = min(cands, key=lambda c: c.height)  # ties: Rhino's, then the order here
    return _checked_plan(problem, best, res, base, level, t0, t_layout, say)


def _b(n: int | None) -> str:
    return "(skipped)" if n is None else f"{n:,} B"


def _model_plan(problem: MemProblem, base: _Baselines, level: OptLevel, t0: float, time_limit: float,
                say: Progress) -> MemoryPlan:
    """The MODeL baseline's plan, through the same checks as Rhino's (``_checked_plan``)."""
    from .model_ilp import solve_model
    left = max(0.0, time_limit - (time.perf_counter() - t0))
    r = solve_model(problem, time_limit=left)
    say(f"MODeL: {r.status}, arena {r.height if r.height is not None else '-'} B, bound {r.bound:,} B, "
        f"{r.seconds:.1f}s")
    if r.order is None or r.offsets is None:
        raise ValueError(f"MODeL found no plan for {problem.name or 'the problem'} within {time_limit:g} s "
                         f"({r.status}: {r.reason}); raise the time limit or plan with method='rhino'")
    bufs = buffers(problem, r.order)
    offsets = {b.id: r.offsets[b.id] for b in bufs}
    cand = _Candidate("model", r.order, bufs, offsets, _height(bufs, offsets), f"model/{r.status}")
    res = OrderResult(r.order, replay(problem, r.order).peak, IndexedProblem(problem).lower_bound(), "model")
    plan = _checked_plan(problem, cand, res, base, level, t0, 0.0, say)
    plan.stats.update({"model_bound": r.bound, "model_size": r.size})
    return plan


@dataclass
class _Candidate:
    """An order with its buffers and a layout of them; ``source``: "rhino" or the baseline's name; ``how``:
    which layout won."""

    source: str
    order: list[int]
    bufs: list[Buffer]
    offsets: dict[int, int]
    height: int
    how: str


@dataclass
class _Baselines:
    """PyTorch's program order (its live peak and the caching-allocator simulation), best-fit (program order,
    greedy by size) and ROAM's heuristic baseline (least-peak-first order, long-lived-first layout)."""

    pytorch_live: int
    alloc: AllocatorStats | None      # None: skipped for the time limit
    bestfit: _Candidate
    heuristic: _Candidate | None      # None: skipped for the time limit
    seconds: float
    check_seconds: float = 0.0  # estimate of the plan's final checks (replays of an order, a validation)
    size_seconds: float = 0.0  # one greedy layout by size (the layout always made)
    llf_seconds: float = 0.0  # one long-lived-first greedy layout
    reserve: float = 0.0  # what runs whatever the time: the by-size layout of the order and the checks
    order_bound_seconds: float = 0.0  # estimate of ``order_ops``' fixed part (IndexedProblem, lower bound)


    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(name for name, c in (("pytorch", self.alloc), ("heuristic", self.heuristic)) if c is None)

    @staticmethod
    def of(problem: MemProblem, deadline: float = float("inf")) -> _Baselines:
        """The baselines; the allocator simulation and the heuristic run only when their estimated time
        (``BASELINE_COST``) fits before ``deadline`` less what still runs after them (the order bound, the
        order's by-size layout, the checks)."""
        t0 = time.perf_counter()
        prog = program_order(problem)
        pt_live = replay(problem, prog).peak
        t_replay = time.perf_counter() - t0
        t_greedy = time.perf_counter()
        prog_bufs = buffers(problem, prog)
        bf_offsets = greedy_layout(prog_bufs, order=GreedyOrder.SIZE)
        t_greedy = time.perf_counter() - t_greedy
        bestfit = _Candidate("bestfit", prog, prog_bufs, bf_offsets, _height(prog_bufs, bf_offsets), "bestfit")
        checks = 3 * t_replay  # check_order, replay and validate_layout each cost about one replay (GPT-2 XL b1)
        after = t_greedy + checks + BASELINE_COST["order_bound"] * t_replay

        def in_time(seconds: float) -> bool:
            return time.perf_counter() + seconds + after <= deadline
        alloc = simulate_allocator(problem, prog) if in_time(BASELINE_COST["allocator"] * t_replay) else None
        t_llf = BASELINE_COST["llf_vs_size"] * t_greedy
        heuristic = None
        if in_time(BASELINE_COST["least_peak"] * t_replay + t_llf):
            heu_order = least_peak_order(problem)
            heu_bufs = buffers(problem, heu_order)
            t_llf = time.perf_counter()
            heu_offsets = greedy_layout(heu_bufs, order=GreedyOrder.LONG_LIVED_FIRST)
            t_llf = time.perf_counter() - t_llf
            heuristic = _Candidate("heuristic", heu_order, heu_bufs, heu_offsets, _height(heu_bufs, heu_offsets),
                                   "heuristic")
        return _Baselines(pt_live, alloc, bestfit, heuristic, time.perf_counter() - t0, checks, t_greedy, t_llf,
                          t_greedy + checks, BASELINE_COST["order_bound"] * t_replay)


def op_local_bound(problem: MemProblem) -> int:
    """Bytes every order holds at some step, from each op alone: while an op runs its inputs and outputs are
    live, and so are the inputs kept to the end of the step (the first term of ``IndexedProblem.lower_bound``,
    without the graph walks)."""
    size = {t: x.size for t, x in problem.tensors.items()}
    always = {t for t, x in problem.tensors.items() if x.kind is TensorKind.INPUT and x.also_output}
    always_bytes = sum(size[t] for t in always)
    per_op = (sum(size[t] for t in set(op.inputs) | set(op.outputs) if t not in always) for op in problem.ops)
    return always_bytes + max(per_op, default=0)


def _layout(problem: MemProblem, res: OrderResult, level: OptLevel, opts: OrderOptions, deadline: float, time_limit: float,
            say: Progress, progress: Progress | None, base: _Baselines) -> _Candidate:
    """The lowest layout of ``res.order``'s buffers: the greedy orders, the cross-loss rule when they miss
    the order's peak, then ``solve_layout`` (O2: the time left; O1: ``opts.o1_layout_seconds`` at most). The by-size layout always runs; the
    others only when their estimated time (``base``'s, on orders of the same problem) fits before ``deadline``."""
    order, order_peak = res.order, res.peak
    if list(order) == base.bestfit.order:    # the program order: its by-size layout is best-fit's
        bufs, offs, t_greedy = base.bestfit.bufs, base.bestfit.offsets, base.size_seconds
    else:
        t_greedy = time.perf_counter()
        bufs = buffers(problem, order)
        offs = greedy_layout(bufs, order=GreedyOrder.SIZE)
        t_greedy = time.perf_counter() - t_greedy  # one greedy layout of this order
    cands: list[tuple[dict[int, int], int, str]] = [(offs, _height(bufs, offs), GreedyOrder.SIZE.name)]
    if time.perf_counter() + base.llf_seconds < deadline:
        offs = greedy_layout(bufs, order=GreedyOrder.LONG_LIVED_FIRST)
        cands.append((offs, _height(bufs, offs), GreedyOrder.LONG_LIVED_FIRST.name))
    if (opts.cross_loss_bottom and min(c[1] for c in cands) > order_peak
            and time.perf_counter() + base.llf_seconds * STACKED_VS_LLF < deadline):
        bottom = _cross_loss(problem, order)
        if bottom:
            offs = stacked_layout(bufs, bottom)
            cands.append((offs, _height(bufs, offs), "cross_loss_bottom"))
    offsets, height, how = min(cands, key=lambda c: c[1])
    left = max(0.0, deadline - time.perf_counter())
    if level is OptLevel.O1 and height > order_peak and opts.o1_layout_seconds > 0 and left > 5 * t_greedy:
        # the exact search, short: it proves the order's peak at once where that is easy (small programs)
        lr = solve_layout(bufs, time_limit=min(opts.o1_layout_seconds, left / 2), progress=progress)
        if lr.offsets and not validate_layout(bufs, lr.offsets) and _height(bufs, lr.offsets) < height:
            offsets, height, how = dict(lr.offsets), _height(bufs, lr.offsets), f"{lr.solver} ({lr.status.value})"
    elif level is OptLevel.O2 and height > order_peak and left < 5 * t_greedy + 0.1:
        say(f"layout: greedy {height:,} B ({how}), lower bound {order_peak:,} B; no time left for the exact "
            f"search (its greedy start alone takes about {4 * t_greedy:.0f}s)")
    elif level is OptLevel.O2 and height > order_peak:
        say(f"layout: greedy {height:,} B ({how}), lower bound {order_peak:,} B; other greedy orders and "
            f"exact search for {left:.0f}s")
        # the plan's own checks (order, layout, replay) and stopping the solvers come after: keep 5%
        lr = solve_layout(bufs, time_limit=max(0.0, left - 0.05 * time_limit), progress=progress)
        if lr.offsets and not validate_layout(bufs, lr.offsets):
            h = _height(bufs, lr.offsets)
            if h < height:
                offsets, height, how = dict(lr.offsets), h, f"{lr.solver} ({lr.status.value})"
    return _Candidate("rhino", order, bufs, offsets, height, how)


def _checked_plan(problem: MemProblem, best: _Candidate, res: OrderResult, base: _Baselines, level: OptLevel, t0: float,
                  t_layout: float, say: Progress) -> MemoryPlan:
    """The plan of candidate ``best``, checked: its order (raises if broken), its layout and its live peak."""
    full = {t: 0 for t in problem.tensors}
    full.update(best.offsets)
    check_order(problem, best.order)  # raises on a broken order
    errors = validate_layout(best.bufs, best.offsets)
    live_peak = replay(problem, best.order).peak
    valid = not errors and live_peak <= best.height
    if not valid:
        say(f"plan: INVALID layout ({errors[:2] or f'arena {best.height:,} B below the live peak {live_peak:,} B'})")
    secs = time.perf_counter() - t0
    say(f"plan: arena {best.height:,} B (order peak {live_peak:,} B) vs PyTorch "
        f"{_b(base.alloc and base.alloc.peak_reserved)}, in {secs:.1f}s")
    return MemoryPlan(
        order=list(best.order), offsets=full, height=best.height, lower_bound=live_peak,
        pytorch_live_peak=base.pytorch_live, pytorch_peak=base.alloc and base.alloc.peak_reserved,
        bestfit_peak=base.bestfit.height, heuristic_peak=base.heuristic and base.heuristic.height,
        solve_seconds=secs, valid=valid,
        level=level.value, source=best.source,
        order_source=res.source if best.source == "rhino" else best.source, layout_source=best.how,
        order_lower_bound=res.lower_bound, pytorch_peak_allocated=base.alloc and base.alloc.peak_allocated,
        skipped_baselines=base.skipped,
        stats={"baseline_seconds": base.seconds, "order_seconds": res.seconds, "layout_seconds": t_layout,
               "windows": res.windows, "windows_improved": res.improved,
               "order_bound": "op-local" if res.source == "program" and not res.seconds else "order graph"})
