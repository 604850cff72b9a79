"""One training step's memory plan with its independent checks: what ``rhino memory`` prints.

``plan_step_memory(problem, mapping)`` plans the problem of a captured step (``from_graph.problem_from_graph``)
with ``plan.plan_memory``, makes the offsets usable by the arena executor (each a multiple of
``mapping.align``, re-placed if not, never higher: ``align_plan``) and checks the result independently: the
order with ``simulate.check_order`` and the layout with ``layout.validate_layout`` (``check_plan``). Running
the step in the arena and comparing with plain PyTorch needs torch: ``lower.arena.compare_arena_step`` fills
``StepMemoryReport.execute``.

``plan_rank_memory`` does the same for every rank of a parallel plan (the problems of
``lower.rank_graph``): each *distinct* problem (``problem_key``: same ops, edges and tensor sizes) is planned
once and its plan serves every rank with that problem; ``RankMemoryReport`` lists them per rank. Its time
limit is for all of them: each distinct problem gets an even share of what is left when its turn comes.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .from_graph import GraphMemory, aligned_offsets
from .layout import validate_layout
from .order import OptLevel
from .plan import MemoryPlan, plan_memory
from .problem import MemProblem, buffers
from .simulate import check_order

__all__ = ["StepMemoryReport", "plan_step_memory", "align_plan", "check_plan", "BASELINES", "RankMemoryReport",
           "plan_rank_memory", "problem_key"]

# (name in the report, MemoryPlan attribute): the baselines Rhino's arena is compared with
BASELINES = (("pytorch_live", "pytorch_live_peak"), ("pytorch", "pytorch_peak"), ("bestfit", "bestfit_peak"),
             ("heuristic", "heuristic_peak"))


@dataclass
class StepMemoryReport:
    """A step's memory plan, whether its offsets were re-aligned, the independent check's verdict
    (``invalid_reason`` is None when the order and the layout pass) and, once executed, the comparison of
    the arena run with plain PyTorch (``execute``, see ``lower.arena.compare_arena_step``)."""

    workload: str
    level: str
    problem: MemProblem
    mapping: GraphMemory
    plan: MemoryPlan
    realigned: bool
    invalid_reason: str | None
    execute: dict | None = None

    @property
    def valid(self) -> bool:
        return bool(self.plan.valid and self.invalid_reason is None)

    @property
    def ok(self) -> bool:
        """Valid, and when executed, equal to PyTorch in an arena of exactly the planned height."""
        ex = self.execute
        return self.valid and (ex is None or bool(ex["equal"] and ex["arena_equals_plan"]))

    def to_dict(self) -> dict:
        """The ``rhino memory --json`` object (without ``report``, the PNG paths)."""
        plan, mapping = self.plan, self.mapping
        d = {
            "ok": self.ok,
            "workload": self.workload,
            "ops": len(self.problem.ops),
            "tensors": len(self.problem.tensors),
            "level": self.level,
            "pytorch_live_peak_bytes": int(plan.pytorch_live_peak),
            "pytorch_peak_bytes": _int(plan.pytorch_peak),
            "bestfit_peak_bytes": int(plan.bestfit_peak),
            "heuristic_peak_bytes": _int(plan.heuristic_peak),
            "skipped_baselines": list(plan.skipped_baselines),
            "rhino_peak_bytes": int(plan.height),
            "lower_bound_bytes": int(plan.lower_bound),
            "order_lower_bound_bytes": int(plan.order_lower_bound),
            "optimal": proven_optimal(plan),
            "solve_seconds": round(float(plan.solve_seconds), 3),
            "valid": self.valid,
            "source": getattr(plan, "source", ""),
            "state_bytes": mapping.state_bytes,
            "param_bytes": mapping.param_bytes,
            "inplace_state_updates": len(mapping.inplace),
            "realigned": self.realigned,
            "reduction": {k: reduction(plan.height, getattr(plan, attr)) for k, attr in BASELINES},
        }
        if self.invalid_reason is not None:
            d["invalid_reason"] = self.invalid_reason
        if self.execute is not None:
            d["execute"] = self.execute
        return d


def proven_optimal(plan: MemoryPlan) -> bool:
    """True only when the arena equals a bound computed from the problem alone: the order lower bound (bytes
    every order holds at some step), or, for a MODeL plan, the bound CP-SAT proved for the joint program."""
    bounds = [plan.order_lower_bound, int(plan.stats.get("model_bound", 0))]
    return plan.valid and plan.height <= max(bounds)


def reduction(ours: int, base: int | None) -> float | None:
    """The fraction of ``base`` bytes that ``ours`` saves (0 for an empty baseline, None for a skipped one), to
    4 places."""
    if base is None:
        return None
    return round(1.0 - ours / base, 4) if base > 0 else 0.0


def _int(n: int | None) -> int | None:
    return None if n is None else int(n)


def plan_step_memory(problem: MemProblem, mapping: GraphMemory, *, workload: str = "",
                     level: OptLevel | str = OptLevel.O2, time_limit: float = 60.0,
                     progress: Callable[[str], None] | None = None, method: str = "rhino") -> StepMemoryReport:
    """Plan ``problem`` (``plan.plan_memory``; ``method``: "rhino" or the "model" baseline), align its offsets
    for the executor and check it."""
    plan = plan_memory(problem, level=level, time_limit=time_limit, progress=progress, method=method)
    realigned = align_plan(problem, plan, mapping.align)
    return StepMemoryReport(workload, OptLevel(level).value, problem, mapping, plan, realigned,
                            check_plan(problem, plan))


def align_plan(problem: MemProblem, plan: MemoryPlan, align: int) -> bool:
    """Offsets the executor can use: each a multiple of ``align`` (re-placed if not; never higher). True when
    the offsets were re-placed; a re-placement that would raise the arena marks the plan invalid."""
    if all(plan.offsets.get(t, 0) % align == 0 for t, x in problem.tensors.items() if x.size):
        return False
    plan.offsets, height = aligned_offsets(problem, plan.order, plan.offsets, align)
    plan.valid = plan.valid and height <= plan.height  # aligning never raises the arena; the check reports it
    plan.height = max(height, plan.height)
    return True


def check_plan(problem: MemProblem, plan: MemoryPlan) -> str | None:
    """Independent check of the plan: the order (``check_order``) and the layout (``validate_layout``);
    None when both pass, else the first problem found."""
    try:
        check_order(problem, plan.order)
    except ValueError as exc:
        return f"order: {exc}"
    errors = validate_layout(buffers(problem, plan.order), plan.offsets, capacity=plan.height)
    return f"layout: {errors[0]}" if errors else None


def problem_key(problem: MemProblem) -> tuple:
    """Equal for two problems with the same ops, edges and tensors: one plan serves both."""
    ops = tuple((o.id, o.inputs, o.outputs, o.role, o.after) for o in problem.ops)
    tensors = tuple(sorted((t.id, t.size, t.kind, t.also_output) for t in problem.tensors.values()))
    return ops, tensors


#: the per-rank fields of ``RankMemoryReport.to_dict`` (``StepMemoryReport.to_dict`` keys)
RANK_FIELDS = ("ops", "tensors", "pytorch_live_peak_bytes", "pytorch_peak_bytes", "bestfit_peak_bytes",
               "heuristic_peak_bytes", "rhino_peak_bytes", "lower_bound_bytes", "solve_seconds", "valid",
               "source", "state_bytes", "param_bytes", "realigned", "reduction", "skipped_baselines")


#: plan_rank_memory: the least time limit a problem's plan gets (``plan_memory`` wants a positive one)
MIN_SHARE = 0.01


@dataclass
class RankMemoryReport:
    """Every rank's memory plan of a parallel plan: ``reports[k]`` plans the ranks ``groups[k]`` (equal
    problems); ``execute``: the lockstep run of every rank in its arena against the plain rank programs."""

    workload: str
    level: str
    mesh: str
    strategy: str
    groups: list[list[int]]
    reports: list[StepMemoryReport]
    execute: dict | None = None
    built: list[int] | None = None  # the ranks whose programs were built (``lower.rank_graph.probed_rank_problems``)

    def of_rank(self, rank: int) -> StepMemoryReport:
        return next(rep for ranks, rep in zip(self.groups, self.reports) if rank in ranks)

    @property
    def valid(self) -> bool:
        return all(rep.valid for rep in self.reports)

    @property
    def ok(self) -> bool:
        ex = self.execute
        return self.valid and (ex is None or bool(ex["equal"] and ex["arena_equals_plan"]))

    def to_dict(self) -> dict:
        """The ``rhino memory --strategy/--plan --json`` object: ``ranks: [{rank, program, ...}]``."""
        ranks = []
        for k, (group, rep) in enumerate(zip(self.groups, self.reports)):
            d = rep.to_dict()
            row = {f: d[f] for f in RANK_FIELDS}
            row["order_lower_bound_bytes"] = int(rep.plan.order_lower_bound)
            if rep.invalid_reason is not None:
                row["invalid_reason"] = rep.invalid_reason
            ranks += [{"rank": r, "program": k, **row} for r in group]
        out = {"ok": self.ok, "workload": self.workload, "level": self.level, "mesh": self.mesh,
               "strategy": self.strategy, "distinct_programs": len(self.groups),
               "ranks": sorted(ranks, key=lambda x: x["rank"])}
        if self.built is not None:
            out["built_ranks"] = self.built
        if self.execute is not None:
            out["execute"] = self.execute
        return out


def plan_rank_memory(problems: list[tuple[int, MemProblem, GraphMemory]], *, workload: str = "", mesh: str = "",
                     strategy: str = "", level: OptLevel | str = OptLevel.O2, time_limit: float = 60.0,
                     progress: Callable[[str], None] | None = None) -> RankMemoryReport:
    """Plan each distinct problem of ``problems`` ((rank, problem, mapping) per rank) once, aligned and checked
    as ``plan_step_memory`` does. ``time_limit`` (seconds) is for all of them: the k-th of n distinct problems
    gets 1 / (n - k) of the time left when its turn comes (``plan_memory`` finishes within its share plus
    about a second)."""
    deadline = time.perf_counter() + time_limit
    keys = [problem_key(problem) for _, problem, _ in problems]
    distinct = len(set(keys))
    by_key: dict[tuple, int] = {}
    groups: list[list[int]] = []
    reports: list[StepMemoryReport] = []
    for (rank, problem, mapping), key in zip(problems, keys):
        if key in by_key:
            groups[by_key[key]].append(rank)
            continue
        by_key[key] = len(groups)
        groups.append([rank])
        share = max(0.0, deadline - time.perf_counter()) / (distinct - len(reports))
        reports.append(plan_step_memory(problem, mapping, workload=f"{workload} rank {rank}", level=level,
                                        time_limit=max(share, MIN_SHARE), progress=progress))
    return RankMemoryReport(workload, OptLevel(level).value, mesh, strategy, groups, reports)
