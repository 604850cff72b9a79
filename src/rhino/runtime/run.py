"""``rhino run``: execute a sharded plan on N processes and compare with single-device training."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..capture import Captured
from ..capture.optim import state_name
from ..check import eager_steps
from ..ir.graph import Graph, Role
from ..lower.spmd import lower_rank
from ..lower.spmd_ops import set_context
from ..sharding.plan import ResolvedPlan, ShardingPlan, resolve
from .collectives import gather_tensor, shard_tensor
from .groups import build_groups
from .launch import in_torchrun, launch, run_from_env
from .measure import LiveBytesMeter

__all__ = ["RunResult", "run_plan", "RTOL", "ATOL"]

# Distributed results may sum in another order than one device: rtol 1e-4, atol 1e-5 (issue contract).
RTOL, ATOL = 1e-4, 1e-5


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
               every_rank: bool = False, measure: bool = False):
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
    held = _bytes_by_role(graph, local)
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
    final = {}
    keep = every_rank or ctx.rank == 0
    for inp in graph.inputs:
        if inp.role is not Role.BATCH:
            full = gather_tensor(local[inp.name], rp.value[inp.value], mesh, ctx.rank, groups)
            if keep:
                final[inp.name] = full.cpu()
    return {"losses": losses, "final": final if keep else None, "held": held, "times": times, "peak": peak,
            "peak_node": peak_node}


def _bytes_by_role(graph: Graph, local: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for inp in graph.inputs:
        if inp.name in local:
            out[inp.role.value] = out.get(inp.role.value, 0) + local[inp.name].numel() * local[inp.name].element_size()
    return out


def run_plan(cap: Captured, plan: ShardingPlan, nproc: int, steps: int = 2, timeout_s: float = 60.0,
             measure: bool = False) -> RunResult:
    """Run ``steps`` steps of ``plan`` on ``nproc`` local processes (gloo) and compare with one device.

    ``measure``: the first step counts each rank's peak of live tensor bytes (``LiveBytesMeter``) and
    the later steps are timed between barriers (``RunResult.step_seconds``: slowest rank per step).

    Under ``torchrun`` this process is one rank of the job instead (NCCL with CUDA); every rank returns
    the result, compared on each against single-device training.
    """
    start = time.perf_counter()
    graph = cap.graph
    rp: ResolvedPlan = resolve(graph, plan)
    if plan.mesh.world != nproc:
        raise ValueError(f"the plan's mesh {plan.mesh} has {plan.mesh.world} devices but --nproc is {nproc}; "
                         f"pass --nproc {plan.mesh.world} or another strategy")
    prog0 = lower_rank(rp, 0)
    state = cap.initial_state()
    batch = tuple(b.detach() for b in cap.workload.batch)
    if in_torchrun():
        mine = run_from_env(_rank_main, graph.to_json(), plan.to_json(), state, batch, steps, timeout_s, True,
                            measure, timeout_s=timeout_s)
        results = [mine]
    else:
        results = launch(_rank_main, nproc, graph.to_json(), plan.to_json(), state, batch, steps, timeout_s,
                         False, measure, timeout_s=timeout_s)
    return _compare(cap, plan, prog0, results, steps, nproc, start)


def _compare(cap: Captured, plan: ShardingPlan, prog0, results: list, steps: int, nproc: int,
             start: float) -> RunResult:
    w = cap.workload
    model, optimizer = copy.deepcopy((w.model, w.optimizer))
    reference = eager_steps(model, optimizer, w.loss_fn, w.batch, steps)
    result = RunResult(True, nproc, str(plan.mesh), steps, 0.0, prog0.comm_bytes, prog0.collectives,
                       results[0]["losses"], [float(x) for x in reference],
                       local_state_bytes=[r["held"] for r in results],
                       step_seconds=[max(ts) for ts in zip(*[r.get("times", []) for r in results])],
                       peak_live_bytes=[r.get("peak", 0) for r in results])
    pairs = [(f"loss[step {i + 1}]", torch.tensor(a, dtype=torch.float64), b.double())
             for i, (a, b) in enumerate(zip(result.losses, reference))]
    final = results[0]["final"]
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    pairs += [(n, final[n], params[n].detach()) for n in cap.param_names + cap.frozen_names]
    pairs += [(n, final[n], buffers[n]) for n in cap.buffer_names]
    for u in cap.updates:
        tstate = optimizer.state.get(params[u.name], {})
        for key in u.torch_keys:
            if tstate.get(key) is not None:
                pairs.append((state_name(u.name, key), final[state_name(u.name, key)], tstate[key]))
    for name, a, b in pairs:
        a64, b64 = a.double().reshape(b.shape), b.double()
        diff = float((a64 - b64).abs().max()) if a64.numel() else 0.0
        result.max_abs_diff = max(result.max_abs_diff, diff)
        if result.ok and not torch.allclose(a64, b64, rtol=RTOL, atol=ATOL):
            result.ok = False
            result.first_mismatch = f"{name} differs from single-device training (max abs diff {diff:.3g})"
    result.seconds = time.perf_counter() - start
    return result
