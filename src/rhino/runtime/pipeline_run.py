"""``rhino run`` for plans with pipeline stages: ``plan.world`` local processes (gloo) or this rank of a
``torchrun`` job, each running its ``runtime.pipeline.PipelineStep``; every rank's loss and held state
shards compared with single-device training (PyTorch's accumulation loop for m > 1 micro-batches).

The result's ``pipeline`` entry records, per step and stage, the seconds spent running programs
(``busy``) and the rest of the step (``idle``: waiting for boundary values, the schedule's bubble), the
slowest rank of each stage; ``idle_fraction`` is ``sum idle / sum (busy + idle)`` over stages and steps.
"""
from __future__ import annotations

import os
import time

import torch

from ..capture import Captured
from ..capture.schedule import planned_rates, set_rates
from ..ir.graph import Graph, Role
from ..lower.spmd_ops import set_context
from ..sharding.plan import ShardingPlan
from .collectives import TORCH_COLLECTIVES, shard_tensor
from .compare import Tolerance, reference_run, tolerance_for
from .groups import build_stage_groups
from .launch import in_torchrun, launch, run_from_env
from .pipeline import PipelineStep, compare_stages
from .microbatch import checked_microbatch_graph
from .run import RunResult, bytes_by_role, mismatch_notes

__all__ = ["run_pipeline", "pipeline_rank_state"]


def pipeline_rank_state(step: PipelineStep, state: dict, device) -> dict[str, torch.Tensor]:
    """This rank's shards of the state its stage holds, from the global ``state``."""
    value = {i.name: i.value for i in step.rp.graph.inputs}
    return {n: shard_tensor(state[n].to(device), step.rp.value[value[n]], step.plan.mesh, step.local)
            for n in step.state_names}


def _rank_main(ctx, graph_json: str, plan_json: str, state: dict, batch: tuple, steps: int, timeout_s: float,
               micro_json: str | None, rates: list | None = None):
    graph = Graph.from_json(graph_json)
    plan = ShardingPlan.from_json(plan_json)
    groups = build_stage_groups(plan.mesh, plan.stages, timeout_s)
    step_fn = PipelineStep(graph, plan, ctx.rank, ctx.device,
                           micro_graph=Graph.from_json(micro_json) if micro_json else None)
    set_context(plan.mesh, step_fn.local, groups, TORCH_COLLECTIVES)
    local = pipeline_rank_state(step_fn, state, ctx.device)
    batch_local = step_fn.local_batch(batch)
    held = bytes_by_role(graph, local)
    losses = []
    for k in range(steps):
        set_rates(local, rates[k] if rates else None)
        losses.append(step_fn.run(local, batch_local))
    return {"losses": losses, "local": {n: t.detach().cpu() for n, t in local.items()}, "held": held,
            "stage_times": [(t.busy, t.idle) for t in step_fn.times], "sent_bytes": [t.sent_bytes for t in step_fn.times]}


def run_pipeline(cap: Captured, plan: ShardingPlan, nproc: int, steps: int = 2, timeout_s: float = 60.0,
                 tol: Tolerance | None = None) -> RunResult:
    """``runtime.run.run_plan`` for ``plan.stages > 1`` (module docstring)."""
    start = time.perf_counter()
    if plan.world != nproc:
        raise ValueError(f"the plan has {plan.stages} stages of mesh {plan.mesh}: {plan.world} devices, but --nproc "
                         f"is {nproc}; pass --nproc {plan.world} or another strategy")
    micro = checked_microbatch_graph(cap, plan.microbatches)
    step0 = PipelineStep(cap.graph, plan, 0, micro_graph=micro)   # checks the plan before processes start
    args = (cap.graph.to_json(), plan.to_json(), cap.initial_state(),
            tuple(b.detach() for b in cap.workload.batch), steps, timeout_s,
            micro.to_json() if micro is not None else None, planned_rates(cap, steps))
    if in_torchrun():
        results = {int(os.environ["RANK"]): run_from_env(_rank_main, *args, timeout_s=timeout_s)}
    else:
        results = dict(enumerate(launch(_rank_main, nproc, *args, timeout_s=timeout_s)))
    tol = tol or tolerance_for(cap, plan.world)
    ref = reference_run(cap, steps, plan.microbatches)
    cmp = compare_stages(step0.rp, step0.spec, results, ref, tol)
    ranks = sorted(results)
    comm, collectives = _step_communication(step0)
    result = RunResult(cmp.ok, plan.world, f"pp{plan.stages}x{plan.mesh}", steps, cmp.max_abs_diff, comm, collectives,
                       results[ranks[0]]["losses"], ref.losses, cmp.first_mismatch,
                       [results[r]["held"] for r in ranks])
    if not cmp.ok:   # each stage (and each rank of a stage) draws its own random masks
        result.first_mismatch += mismatch_notes(cap, plan.world, tol)
    result.pipeline = _stage_times(plan, results)
    result.seconds = time.perf_counter() - start
    return result


def _step_communication(step: PipelineStep) -> tuple[int, dict[str, int]]:
    """Stage 0 rank 0's collective bytes and counts per step (forward and backward programs once per
    micro-batch, the update once; point-to-point messages not included)."""
    m, total, kinds = step.microbatches, 0, {}
    for (key, first, v), prog in step.programs.items():
        if v != step.stage:
            continue       # stage 0 rank 0's first chunk
        runs = 1 if key == "U" else (1 if first else m - 1) if (key, False, v) in step.programs else m
        total += runs * prog.comm_bytes
        for kind, n in prog.collectives.items():
            kinds[kind] = kinds.get(kind, 0) + runs * n
    return total, kinds


def _stage_times(plan: ShardingPlan, results: dict[int, dict]) -> dict:
    """Busy and idle seconds per step and stage (the slowest rank of the stage by busy time)."""
    W = plan.mesh.world
    busy, idle = [], []
    steps = len(next(iter(results.values()))["stage_times"])
    for k in range(steps):
        b, i = [], []
        for s in range(plan.stages):
            times = [results[r]["stage_times"][k] for r in range(s * W, (s + 1) * W) if r in results]
            if times:
                bt, it = max(times)
                b.append(round(bt, 6))
                i.append(round(it, 6))
        busy.append(b)
        idle.append(i)
    total = sum(map(sum, busy)) + sum(map(sum, idle))
    # point-to-point bytes of the last step over the ranks reporting (all in a local run; ``comm_bytes_per_step``
    # counts collectives only)
    p2p = sum(r["sent_bytes"][-1] for r in results.values() if r.get("sent_bytes"))
    return {"stages": plan.stages, "microbatches": plan.microbatches, "schedule": plan.schedule,
            "busy_s": busy, "idle_s": idle, "idle_fraction": round(sum(map(sum, idle)) / total, 4) if total else 0.0,
            "p2p_bytes_per_step": p2p}
