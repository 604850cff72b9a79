"""``rhino run``: execute a sharded plan on N processes and compare with single-device training."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..capture import Captured
from ..capture.schedule import planned_rates, set_rates
from ..ir.graph import Graph, Role
from ..ir.registry import draws_rng
from ..lower.spmd_ops import set_context
from ..sharding.plan import ResolvedPlan, ShardingPlan, resolve
from .collectives import TORCH_COLLECTIVES, shard_tensor
from .compare import TOLERANCES, Tolerance, compare_ranks, reference_run, state_dtype, tolerance_for
from .groups import build_groups
from .launch import in_torchrun, launch, run_from_env
from .microbatch import checked_microbatch_graph
from .rank_step import RankStep

__all__ = ["RunResult", "run_plan", "compare_results", "bytes_by_role", "random_ops_note", "mismatch_notes"]


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
    memory_plan: list[dict] = field(default_factory=list)     # per rank: {rank, arena_bytes, plan_bytes} (--memory-plan)
    pipeline: dict | None = None   # plans with stages: busy/idle seconds per step and stage (runtime.pipeline_run)

    def to_dict(self) -> dict:
        """The ``rhino run --json`` object."""
        return {"ok": self.ok, "max_abs_diff": self.max_abs_diff, "mesh": self.mesh, "nproc": self.nproc,
                "steps": self.steps, "comm_bytes_per_step": self.comm_bytes_per_step,
                "collectives_per_step": self.collectives_per_step, "losses": self.losses,
                "reference_losses": self.reference_losses, "first_mismatch": self.first_mismatch,
                "state_bytes_per_rank": self.local_state_bytes, "seconds": round(self.seconds, 2),
                **({"memory_plan": self.memory_plan} if self.memory_plan else {}),
                **({"pipeline": self.pipeline} if self.pipeline is not None else {})}


def _rank_main(ctx, graph_json: str, plan_json: str, state: dict, batch: tuple, steps: int, timeout_s: float,
               measure: bool = False, micro_json: str | None = None, overlap: bool = False,
               memory_plan: str | None = None, rank_plans: dict | None = None, rates: list | None = None):
    graph = Graph.from_json(graph_json)
    plan = ShardingPlan.from_json(plan_json)
    rp = resolve(graph, plan)
    mesh = plan.mesh
    groups = build_groups(mesh, timeout_s)
    set_context(mesh, ctx.rank, groups, TORCH_COLLECTIVES)
    if memory_plan:   # this rank's step in its planned arena (level ``memory_plan``)
        from .arena_step import ArenaRankStep
        step_fn = ArenaRankStep(graph, plan, ctx.rank, ctx.device, level=memory_plan,
                                planned=(rank_plans or {}).get(ctx.rank))
    else:
        step_fn = RankStep(graph, plan, ctx.rank, ctx.device, overlap=overlap,
                           micro_graph=Graph.from_json(micro_json) if micro_json else None)
    local = {inp.name: shard_tensor(state[inp.name].to(ctx.device), rp.value[inp.value], mesh, ctx.rank)
             for inp in graph.inputs if inp.role is not Role.BATCH}
    batch_local = step_fn.local_batch(batch)
    held = bytes_by_role(graph, local)
    losses, times, peak = [], [], 0
    for step in range(steps):
        set_rates(local, rates[step] if rates else None)
        if measure and step == 0:  # the first step runs node by node and counts live bytes
            loss, peak = step_fn.run_measured(local, batch_local)
        else:
            if measure:
                dist.barrier()
            t0 = time.perf_counter()
            loss = step_fn.run(local, batch_local)
            if measure:
                dist.barrier()
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    own = {name: t.detach().cpu() for name, t in local.items()}  # this rank's shards, compared one by one
    arena = {"arena_bytes": step_fn.arena_bytes, "plan_bytes": step_fn.plan_bytes} if memory_plan else {}
    return {"losses": losses, "local": own, "held": held, "times": times, "peak": peak, **arena}


def bytes_by_role(graph: Graph, local: dict) -> dict[str, int]:
    """Bytes of a rank's local state tensors by role (parameter, buffer, optimizer state)."""
    out: dict[str, int] = {}
    for inp in graph.inputs:
        if inp.name in local:
            out[inp.role.value] = out.get(inp.role.value, 0) + local[inp.name].numel() * local[inp.name].element_size()
    return out


def run_plan(cap: Captured, plan: ShardingPlan, nproc: int, steps: int = 2, timeout_s: float = 60.0,
             measure: bool = False, tol: Tolerance | None = None, overlap: bool = False,
             memory_plan: str | None = None) -> RunResult:
    """Run ``steps`` steps of ``plan`` on ``nproc`` local processes (gloo) and compare every rank's loss
    and state shards with single-device training (``tol``: by default from the state's dtype, see
    ``runtime.compare.tolerance_for``); each rank runs its ``RankStep``. With ``plan.microbatches > 1`` the
    reference is PyTorch's gradient-accumulation loop (``runtime.compare.accumulation_steps``).
    ``overlap``: the ranks run the overlapped programs (``lower.overlap``) instead of the blocking ones.
    ``memory_plan``: a memory-planning level (O1, O2): each rank runs its planned order inside one arena
    (``runtime.arena_step.ArenaRankStep``; blocking collectives), each distinct rank program planned once
    here before the ranks start (``arena_step.plan_ranks``); ``RunResult.memory_plan`` gives each rank's
    arena bytes and plan height.

    ``measure``: the first step counts each rank's peak of live tensor bytes (``LiveBytesMeter``) and
    the later steps are timed between barriers (``RunResult.step_seconds``: slowest rank per step).

    Under ``torchrun`` this process is one rank of the job instead (NCCL with CUDA); each rank compares
    its own shards against single-device training and returns the result.
    """
    start = time.perf_counter()
    graph = cap.graph
    if plan.stages > 1:
        if memory_plan:
            from .pipeline import PIPELINE_MEMORY_PLAN
            raise ValueError(PIPELINE_MEMORY_PLAN)
        if measure or overlap:
            raise ValueError("measure and overlap are not supported with pipeline stages yet")
        from .pipeline_run import run_pipeline
        return run_pipeline(cap, plan, nproc, steps, timeout_s, tol)
    rp: ResolvedPlan = resolve(graph, plan)
    if plan.mesh.world != nproc:
        raise ValueError(f"the plan's mesh {plan.mesh} has {plan.mesh.world} devices but --nproc is {nproc}; "
                         f"pass --nproc {plan.mesh.world} or another strategy")
    if memory_plan:
        from .arena_step import check_memory_plan_supported, plan_ranks
        check_memory_plan_supported(plan)
    micro = checked_microbatch_graph(cap, plan.microbatches)
    comm = RankStep(graph, plan, 0, micro_graph=micro).step_communication()  # checks the plan before processes start
    state = cap.initial_state()
    batch = tuple(b.detach() for b in cap.workload.batch)
    # each distinct rank program planned once, here, before the ranks start (under torchrun each rank plans its own)
    rank_plans = plan_ranks(graph, plan, memory_plan) if memory_plan and not in_torchrun() else None
    args = (graph.to_json(), plan.to_json(), state, batch, steps, timeout_s, measure,
            micro.to_json() if micro is not None else None, overlap, memory_plan, rank_plans, planned_rates(cap, steps))
    if in_torchrun():
        results = {int(__import__("os").environ["RANK"]): run_from_env(_rank_main, *args, timeout_s=timeout_s)}
    else:
        results = dict(enumerate(launch(_rank_main, nproc, *args, timeout_s=timeout_s)))
    return compare_results(cap, rp, comm, results, steps, start, tol)


def program_communication(prog) -> tuple[int, dict[str, int]]:
    """(bytes sent, collectives by kind) of one lowered rank program, as ``compare_results`` takes them."""
    return prog.comm_bytes, dict(prog.collectives)


def compare_results(cap: Captured, rp: ResolvedPlan, comm: tuple[int, dict], results: dict[int, dict], steps: int,
                    start: float, tol: Tolerance | None = None) -> RunResult:
    """A ``RunResult`` from the ranks' results (rank -> {"losses", "local", ...}; under torchrun only this
    rank's): every given rank's losses and state shards against single-device training. ``comm``: rank 0's
    bytes and collectives per step (``RankStep.step_communication``)."""
    plan = rp.plan
    tol = tol or tolerance_for(cap, plan.mesh.world)
    ref = reference_run(cap, steps, plan.microbatches)
    ranks = sorted(results)
    first = results[ranks[0]]
    result = RunResult(True, plan.mesh.world, str(plan.mesh), steps, 0.0, comm[0], comm[1],
                       first["losses"], ref.losses,
                       local_state_bytes=[results[r]["held"] for r in ranks],
                       step_seconds=[max(ts) for ts in zip(*[results[r].get("times", []) for r in ranks])],
                       peak_live_bytes=[results[r].get("peak", 0) for r in ranks])
    cmp = compare_ranks(rp, results, ref, tol)
    result.ok, result.max_abs_diff, result.first_mismatch = cmp.ok, cmp.max_abs_diff, cmp.first_mismatch
    if not cmp.ok:
        result.first_mismatch += mismatch_notes(cap, plan.mesh.world, tol)
    result.memory_plan = [{"rank": r, "arena_bytes": results[r]["arena_bytes"], "plan_bytes": results[r]["plan_bytes"]}
                          for r in ranks if "arena_bytes" in results[r]]
    result.seconds = time.perf_counter() - start
    return result


def mismatch_notes(cap: Captured, world: int, tol: Tolerance) -> str:
    """What to append to a mismatch of a ``world``-rank run: ``random_ops_note``, and for a float32 run how to
    tell rounding noise from a wrong result (float32 sums run in another order on several ranks, and Adam
    turns a gradient below that noise into a step of ``lr`` either way; float64 checks at 1e-9)."""
    note = random_ops_note(cap, world)
    if tol == TOLERANCES[torch.float32] and state_dtype(cap) is torch.float64:
        note += ("; the float64 step computes a float32 region (a cast to float32 in the model), so it is "
                 "compared at float32's tolerance")
    elif tol == TOLERANCES[torch.float32]:
        note += ("; in float32, summation-order noise amplified by the optimizer can exceed this tolerance: "
                 "rerun with --dtype float64 to check at 1e-9")
    return note


def random_ops_note(cap: Captured, world: int) -> str:
    """What to append to a mismatch of a ``world``-rank run when the step draws random numbers (each rank,
    or each pipeline stage, draws its own masks, so the run need not equal single-device training); "" when
    it draws none or runs on one rank."""
    drawn = sorted({n.op for n in cap.graph.nodes if draws_rng(n.op)})
    if not drawn or world < 2:
        return ""
    return (f"; the step draws random numbers ({', '.join(drawn)}), which each rank draws for itself, so a "
            f"sharded or pipelined run need not equal single-device training: check exactness with those ops made "
            f"deterministic (dropout p=0, noise passed in the batch instead of drawn in the step)")
