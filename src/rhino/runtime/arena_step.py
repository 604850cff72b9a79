"""``ArenaRankStep``: one rank's training step run in its planned order inside one preallocated arena
(``rhino run --memory-plan``, ``rhino train --memory-plan``, ``Trainer(memory_plan=True)``).

The rank's program is the blocking one ``RankStep`` runs without overlap, as an IR graph
(``lower.rank_graph``); its memory problem is planned here (``memory.step_report.plan_step_memory``: order,
aligned offsets, independent checks) and executed by ``lower.arena.ArenaProgram``, whose communication nodes
call ``spmd_ops.redistribute`` on the process context (blocking: no overlap in arena mode). ``rhino run``
plans each distinct rank program once before the ranks start (``plan_ranks``); under torchrun each rank plans
its own problem; the collective-order constraint of ``rank_graph.rank_problem`` keeps every rank's
collectives in program order whatever order the planner picks, so the ranks always meet.

Recomputation (``plan.recompute``) is supported (the rewritten step is what is lowered, as in ``RankStep``);
gradient accumulation (``microbatches > 1``) and pipeline stages (``stages > 1``) are not (one clear error).
"""
from __future__ import annotations

import dataclasses

import torch

from ..ir.graph import Graph
from ..lower.arena import ArenaProgram
from ..lower.rank_graph import RankMemory, rank_memories
from ..memory.step_report import StepMemoryReport, check_plan, plan_rank_memory, plan_step_memory
from ..sharding.plan import ResolvedPlan, ShardingPlan, resolve
from .rank_step import with_recompute

__all__ = ["ArenaRankStep", "rank_resolved_plan", "check_memory_plan_supported", "plan_ranks", "MICROBATCH_MEMORY_PLAN"]


def check_memory_plan_supported(plan: ShardingPlan) -> None:
    """ValueError when the plan has something a memory plan per rank cannot run yet."""
    if plan.stages > 1:   # planned as one program, a pipelined plan's rank would hold every stage's ops
        raise ValueError(f"memory plans per rank cover one program per step, but the plan has {plan.stages} "
                         f"pipeline stages (each stage runs separate forward and backward programs per "
                         f"micro-batch); drop the pp key from the strategy or use a plan without stages")
    if plan.microbatches > 1:
        raise ValueError(MICROBATCH_MEMORY_PLAN.format(plan.microbatches))


#: the refusal of a memory plan per rank for a plan with micro-batches (also before ``rhino train`` starts ranks)
MICROBATCH_MEMORY_PLAN = ("memory plans per rank cover one micro-batch per step, but the plan has microbatches={}; "
                          "drop microbatches from the strategy or plan")


def rank_resolved_plan(graph: Graph, plan: ShardingPlan) -> ResolvedPlan:
    """The resolved plan of the step the ranks run (recomputation applied, as ``RankStep`` does)."""
    check_memory_plan_supported(plan)
    resolve(graph, plan)   # the plan is for this workload
    g, p = with_recompute(graph, plan)
    return resolve(g, dataclasses.replace(p, fingerprint=""))


def plan_ranks(graph: Graph, plan: ShardingPlan, level: str = "O1",
               time_limit: float = 60.0) -> dict[int, StepMemoryReport]:
    """Every rank's memory plan, each distinct program planned once (``memory.step_report.plan_rank_memory``):
    what ``rhino run --memory-plan`` hands its ranks before they start, so that ranks with equal programs run
    equal arenas (planned in each rank, a time-limited search can end at different heights)."""
    from ..lower.rank_graph import probed_rank_problems
    _, problems = probed_rank_problems(rank_resolved_plan(graph, plan))
    report = plan_rank_memory(problems, level=level, time_limit=time_limit)
    return {r: report.of_rank(r) for r, _, _ in problems}


class ArenaRankStep:
    """One rank's step in its planned arena; ``run(local_state, local_batch)`` as ``RankStep.run``."""

    def __init__(self, graph: Graph, plan: ShardingPlan, rank: int, device: torch.device | str = "cpu", *,
                 level: str = "O1", time_limit: float = 60.0, planned: StepMemoryReport | None = None) -> None:
        """``planned``: this rank's plan made beforehand (``plan_ranks``: once per distinct program, so equal
        programs get equal arenas), checked here against this rank's own problem; else planned here."""
        self.plan, self.rank, self.device, self.microbatches = plan, rank, torch.device(device), 1
        self.rp = rank_resolved_plan(graph, plan)
        self.memory: RankMemory = rank_memories(self.rp, [rank])[0]
        m = self.memory
        if planned is None:
            planned = plan_step_memory(m.problem, m.mapping, workload=f"rank {rank}", level=level,
                                       time_limit=time_limit)
        elif planned.valid:   # the independent check, on the problem this rank runs
            planned.invalid_reason = check_plan(m.problem, planned.plan)
        self.report: StepMemoryReport = planned
        if not self.report.valid:
            raise AssertionError(f"rank {rank}'s memory plan is invalid: {self.report.invalid_reason}")
        p = self.report.plan
        self.arena = ArenaProgram(m.graph, m.problem, m.mapping, p.order, p.offsets, p.height, self.device)

    @property
    def plan_bytes(self) -> int:
        return int(self.report.plan.height)

    @property
    def arena_bytes(self) -> int:
        """Bytes of the arena buffer of the last step (0 before the first)."""
        return int(self.arena.stats.arena_bytes)

    def local_batch(self, batch: tuple) -> tuple:
        from .data import rank_batch
        return rank_batch(tuple(batch), self.rp, self.rank, 1, self.device)

    def run(self, local_state: dict, local_batch: tuple) -> float:
        """One training step; ``local_state``'s tensors are updated or replaced. Returns the loss."""
        with torch.no_grad():
            return float(self.arena.step(local_state, tuple(local_batch)))

    def run_measured(self, local_state: dict, local_batch: tuple) -> tuple[float, int]:
        """``run``; the peak live bytes reported are the arena's plus the state's (the arena holds every
        intermediate of the step at once)."""
        loss = self.run(local_state, local_batch)
        held = sum(t.numel() * t.element_size() for t in local_state.values())
        return loss, self.arena_bytes + held
