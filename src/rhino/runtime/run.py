"""``rhino run``: execute a sharded plan on N processes and compare with single-device training."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..capture import Captured
from ..ir.graph import Graph, Role
from ..lower.spmd import lower_rank
from ..lower.spmd_ops import set_context
from ..sharding.plan import ResolvedPlan, ShardingPlan, resolve
from .collectives import shard_tensor
from .compare import Tolerance, compare_ranks, reference_run, tolerance_for
from .groups import build_groups
from .launch import in_torchrun, launch, run_from_env
from .measure import LiveBytesMeter

__all__ = ["RunResult", "run_plan", "compare_results", "bytes_by_role"]


@dataclass
class RunResult:
    ok: bool
    nproc: int
    mesh: str
    steps: int
    max_abs_diff: float
    comm_bytes_per_step: int
    collectives_per_step: dict[str, int]
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    first_mismatch: str | None = None
    local_state_bytes: list[dict[str, int]] = field(default_factory=list)
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)   # per step, slowest rank (measure=True)
    peak_live_bytes: list[int] = field(default_factory=list)  # per rank, first step (measure=True)


def _rank_main(ctx, graph_json: str, plan_json: str, state: dict, batch: tuple, steps: int, timeout_s: float,
               measure: bool = False):
    graph = Graph.from_json(graph_json)
    plan = ShardingPlan.from_json(plan_json)
    rp = resolve(graph, plan)
    mesh = plan.mesh
    groups = build_groups(mesh, timeout_s)
    set_context(mesh, ctx.rank, groups)
    prog = lower_rank(rp, ctx.rank, ctx.device)
    local = {}
    batch_local = []
    for inp in graph.inputs:
        if inp.role is Role.BATCH:
            idx = int(inp.name.split("/")[1])
            batch_local.append(shard_tensor(batch[idx].to(ctx.device), rp.value[inp.value], mesh, ctx.rank))
        else:
            local[inp.name] = shard_tensor(state[inp.name].to(ctx.device), rp.value[inp.value], mesh, ctx.rank)
    held = bytes_by_role(graph, local)
    names = [i.name for i in graph.inputs if i.role is not Role.BATCH]
    losses, times, peak, peak_node = [], [], 0, ""
    with torch.no_grad():
        for step in range(steps):
            args = [local[n] for n in names] + batch_local
            if measure and step == 0:  # the first step runs node by node and counts live bytes
                meter = LiveBytesMeter(prog.module, [local[n] for n in names])
                del args
                outs = meter.run(*([local[n] for n in names] + batch_local))
                peak, peak_node = meter.peak, meter.peak_node
            else:
                if measure:
                    dist.barrier()
                t0 = time.perf_counter()
                outs = prog.module(*args)
                del args
                if measure:
                    dist.barrier()
                times.append(time.perf_counter() - t0)
            losses.append(float(outs[0]))
            for name, value in zip(prog.output_names[1:], outs[1:]):
                local[name] = value
    own = {name: local[name].detach().cpu() for name in names}  # this rank's shards, compared one by one
    return {"losses": losses, "local": own, "held": held, "times": times, "peak": peak, "peak_node": peak_node}


def check_executable(plan: ShardingPlan) -> None:
    """ValueError for plan fields the runtime does not execute yet."""
    if plan.microbatches > 1 or plan.recompute != "none":
        raise ValueError(f"microbatches={plan.microbatches}, recompute={plan.recompute} are not executed by the "
                         f"runtime yet; use microbatches=1 and recompute=none")


def bytes_by_role(graph: Graph, local: dict) -> dict[str, int]:
    """Bytes of a rank's local state tensors by role (parameter, buffer, optimizer state)."""
    out: dict[str, int] = {}
    for inp in graph.inputs:
        if inp.name in local:
            out[inp.role.value] = out.get(inp.role.value, 0) + local[inp.name].numel() * local[inp.name].element_size()
    return out


def run_plan(cap: Captured, plan: ShardingPlan, nproc: int, steps: int = 2, timeout_s: float = 60.0,
             measure: bool = False, tol: Tolerance | None = None) -> RunResult:
    """Run ``steps`` steps of ``plan`` on ``nproc`` local processes (gloo) and compare every rank's loss
    and state shards with single-device training (``tol``: by default from the state's dtype, see
    ``runtime.compare.tolerance_for``).

    ``measure``: the first step counts each rank's peak of live tensor bytes (``LiveBytesMeter``) and
    the later steps are timed between barriers (``RunResult.step_seconds``: slowest rank per step).

    Under ``torchrun`` this process is one rank of the job instead (NCCL with CUDA); each rank compares
    its own shards against single-device training and returns the result.
    """
    start = time.perf_counter()
    check_executable(plan)
    graph = cap.graph
    rp: ResolvedPlan = resolve(graph, plan)
    if plan.mesh.world != nproc:
        raise ValueError(f"the plan's mesh {plan.mesh} has {plan.mesh.world} devices but --nproc is {nproc}; "
                         f"pass --nproc {plan.mesh.world} or another strategy")
    prog0 = lower_rank(rp, 0)
    state = cap.initial_state()
    batch = tuple(b.detach() for b in cap.workload.batch)
    if in_torchrun():
        mine = run_from_env(_rank_main, graph.to_json(), plan.to_json(), state, batch, steps, timeout_s,
                            measure, timeout_s=timeout_s)
        results = {int(__import__("os").environ["RANK"]): mine}
    else:
        results = dict(enumerate(launch(_rank_main, nproc, graph.to_json(), plan.to_json(), state, batch, steps,
                                        timeout_s, measure, timeout_s=timeout_s)))
    return compare_results(cap, rp, prog0, results, steps, start, tol)


def compare_results(cap: Captured, rp: ResolvedPlan, prog0, results: dict[int, dict], steps: int, start: float,
                    tol: Tolerance | None = None) -> RunResult:
    """A ``RunResult`` from the ranks' results (rank -> {"losses", "local", ...}; under torchrun only this
    rank's): every given rank's losses and state shards against single-device training."""
    plan = rp.plan
    tol = tol or tolerance_for(cap, plan.mesh.world)
    ref = reference_run(cap, steps)
    ranks = sorted(results)
    first = results[ranks[0]]
    result = RunResult(True, plan.mesh.world, str(plan.mesh), steps, 0.0, prog0.comm_bytes, prog0.collectives,
                       first["losses"], ref.losses,
                       local_state_bytes=[results[r]["held"] for r in ranks],
                       step_seconds=[max(ts) for ts in zip(*[results[r].get("times", []) for r in ranks])],
                       peak_live_bytes=[results[r].get("peak", 0) for r in ranks])
    cmp = compare_ranks(rp, results, ref, tol)
    result.ok, result.max_abs_diff, result.first_mismatch = cmp.ok, cmp.max_abs_diff, cmp.first_mismatch
    result.seconds = time.perf_counter() - start
    return result
