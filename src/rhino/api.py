"""Rhino's Python API: what the command line calls, for scripts and notebooks.

    import rhino
    cap = rhino.capture_step("examples/gpt.py")                       # or (model, optimizer, loss_fn, batch)
    est = rhino.estimate(cap, "8xA100-80G", strategy="dp=2,tp=4")
    plan, report = rhino.plan(cap, "8xA100-80G", level="O1")
    mem = rhino.memory_plan(cap, level="O1")                           # one device: operator order + arena layout
    rep = rhino.memory_report(cap, level="O1", execute=True)          # the same, aligned, checked and executed
    ranks = rhino.memory_report(cap, level="O1", strategy="dp=2,tp=2")  # every rank of a parallel plan
    result = rhino.train("examples/gpt.py", nproc=2, strategy="dp=2", steps=20)   # local processes
    trainer = rhino.Trainer("examples/gpt.py", strategy="dp=2")   # one rank, e.g. inside torchrun
    loss = trainer.step()

(``capture_step`` and ``memory_plan`` are not called ``capture`` and ``memory``: those names are Rhino's
subpackages.) Workloads are ``FILE[:FUNC]`` specs (see the README's workload section), ``rhino.Workload`` objects or
``(model, optimizer, loss_fn, batch)`` tuples.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from .capture import Captured, Workload, load_workload
from .capture import capture as _capture_workload
from .cost.cluster import parse_cluster
from .cost.estimate import Estimate
from .runtime.trainer import Trainer, TrainResult, train
from .sharding.plan import ShardingPlan

__all__ = ["capture_step", "estimate", "plan", "plan_and_run", "memory_plan", "memory_report", "rank_memory_report",
           "Trainer",
           "TrainResult", "train", "ShardingPlan"]


def capture_step(workload, dtype: torch.dtype | None = None) -> Captured:
    """The training step of ``workload`` as one IR graph (forward, backward and optimizer update)."""
    from .capture import default_dtype
    with default_dtype(dtype):
        if isinstance(workload, (str, Path)):
            workload = load_workload(str(workload))
        elif isinstance(workload, (tuple, list)):
            model, opt, loss_fn, batch = workload
            workload = Workload(model, opt, loss_fn, tuple(batch) if isinstance(batch, (tuple, list)) else (batch,),
                                "<in memory>", "workload")
        elif not isinstance(workload, Workload):
            raise ValueError("workload must be a FILE[:FUNC] spec, a (model, optimizer, loss_fn, batch) tuple or "
                             "a rhino Workload")
        return _capture_workload(workload)


def _graph(cap_or_graph):
    return cap_or_graph.graph if isinstance(cap_or_graph, Captured) else cap_or_graph


def estimate(cap: Captured, cluster: str, *, strategy: str | None = None, plan: ShardingPlan | None = None,
             schedule: str = "1f1b", overlap: bool = True, allow_tf32: bool = False, profile=None) -> Estimate:
    """Predicted step time and per-device memory of a strategy string (default: data parallelism over the whole
    cluster) or a plan on ``cluster``. ``schedule``: the pipeline schedule (1f1b, gpipe); ``overlap``: gradient
    reduction overlaps the backward pass; ``allow_tf32``: fp32 matmuls on TF32 tensor cores; ``profile``: a
    ``rhino profile`` file (or a loaded ``MachineProfile``) whose measured numbers replace the datasheet's."""
    from .cost.estimate import estimate as _estimate, estimate_strategy
    from .cost.machine_profile import load_profile
    from .cost.step import StepOptions
    c, prof = parse_cluster(cluster), None
    if profile is not None:
        c, prof = (load_profile(profile) if isinstance(profile, (str, Path)) else profile).apply(c)
    options = StepOptions(overlap_gradient_reduction=overlap, allow_tf32=allow_tf32, profile=prof)
    if plan is not None:
        # the plan's own stages (with their cut), micro-batches and recomputation
        return _estimate(_graph(cap), c, plan, schedule=schedule, options=options)
    return estimate_strategy(_graph(cap), c, strategy or f"dp={c.world}", options=options, schedule=schedule)


def plan(cap: Captured, cluster: str, *, level: str = "O1", time_limit: float = 60.0, presets: bool = True,
         workload: str = "", progress=None, fit_memory: str = "program"):
    """Search the fastest plan that fits ``cluster``: ``(ShardingPlan, report)`` (``report.text()``).
    ``workload`` names it in the report; ``progress(event, info)`` gets the search's events; ``fit_memory``:
    "program" (the cost model's peak) or "planned" (also each rank program's memory plan, ``SearchOptions``)."""
    from .search.planning import plan_workload
    return plan_workload(_graph(cap), parse_cluster(cluster), level=level, time_limit=time_limit, presets=presets,
                         workload=workload, progress=progress, fit_memory=fit_memory)


def plan_and_run(cap: Captured, cluster: str = "cpu:4", *, level: str = "O2", time_limit: float = 10.0,
                 steps: int = 2, workload: str = "", status=None) -> dict:
    """Search a plan for a local CPU cluster (``cpu:N``), run it on N local processes for ``steps`` steps and
    compare every rank with one device (``runtime.run.run_plan``). Returns {"ok", "cluster", "mesh", "nproc",
    "max_abs_diff", "first_mismatch", "step_seconds" (predicted), "best_preset", "preset_seconds",
    "search_seconds", "source"}; ``status`` gets one line before each stage."""
    from .runtime.run import run_plan
    from .search.planning import plan_workload
    say = status or (lambda message: None)
    c = parse_cluster(cluster)
    if c.device.name != "cpu" or c.nodes != 1:
        raise ValueError(f"the plan runs on local processes: give a cluster like cpu:4, not {c}")
    say(f"planning for {c} ...")
    plan, report = plan_workload(_graph(cap), c, level=level, time_limit=time_limit, workload=workload)
    say(f"running the plan on {c.world} processes ...")
    r = run_plan(cap, plan, c.world, steps)
    d = report.to_dict()
    bp = d["best_preset"] or {}
    return {"ok": r.ok, "cluster": str(c), "mesh": r.mesh, "nproc": r.nproc, "max_abs_diff": r.max_abs_diff,
            "first_mismatch": r.first_mismatch, "step_seconds": d["step_seconds"],
            "best_preset": bp.get("strategy"), "preset_seconds": bp.get("step_seconds", float("nan")),
            "search_seconds": d["search_seconds"], "source": d["source"]}


def memory_plan(cap: Captured, *, level: str = "O1", time_limit: float = 60.0):
    """One device's memory plan (ROAM): an operator order and an arena offset per tensor; ``.height`` is the
    arena's peak bytes, ``.valid`` the layout validator's verdict."""
    from .memory.from_graph import problem_from_graph
    from .memory.plan import plan_memory
    problem, _ = problem_from_graph(_graph(cap))
    problem.validate()
    return plan_memory(problem, level=level, time_limit=time_limit)


def memory_report(cap: Captured, *, level: str = "O2", time_limit: float = 60.0, execute: bool = False,
                  name: str = "", progress=None, status=None, strategy: str | None = None,
                  plan: ShardingPlan | None = None, cluster: str | None = None, method: str = "rhino"):
    """What ``rhino memory`` reports: one device's memory plan (``memory_plan``) with offsets aligned for the
    arena executor, checked independently (order and layout), and with ``execute`` one step run in the
    planned arena and compared with plain PyTorch (``lower.arena.compare_arena_step``). Returns a
    ``memory.step_report.StepMemoryReport`` (``.ok``, ``.to_dict()``). ``progress`` gets the solver's
    messages, ``status`` one line before each stage.

    With ``strategy`` (a strategy string), ``plan`` (a ``ShardingPlan``) or ``cluster`` (a plan is searched
    for it at O1), every rank of that parallel plan is planned instead (``rank_memory_report``). ``method="model"``
    plans the single device with the MODeL baseline (``memory.plan.plan_memory``)."""
    if method != "rhino" and (strategy is not None or plan is not None or cluster is not None):
        raise ValueError(f"method {method!r} plans one device; drop it with a strategy, a plan or a cluster")
    if strategy is not None or plan is not None or cluster is not None:
        return rank_memory_report(cap, strategy=strategy, plan=plan, cluster=cluster, level=level,
                                  time_limit=time_limit, execute=execute, name=name, progress=progress,
                                  status=status)
    from .check import ATOL, RTOL
    from .memory.from_graph import problem_from_graph
    from .memory.step_report import plan_step_memory
    say = status or (lambda message: None)
    if execute and cap.workload.on_meta:
        raise ValueError("the workload builds its model on the meta device, which holds no data; plan without "
                         "execute, or build the workload on a real device to execute it")
    problem, mapping = problem_from_graph(cap.graph, name=name)
    problem.validate()
    say(f"planning {len(problem.ops)} ops, {len(problem.tensors)} tensors at {level} "
        f"(time limit {time_limit:g} s) ...")
    report = plan_step_memory(problem, mapping, workload=name, level=level, time_limit=time_limit,
                              progress=progress, method=method)
    if execute:
        from .lower.arena import compare_arena_step
        say("executing one step in the arena and in plain PyTorch ...")
        report.execute = compare_arena_step(cap.graph, problem, mapping, report.plan, cap.initial_state,
                                            cap.workload.batch, RTOL, ATOL)
    return report


def rank_memory_report(cap: Captured, *, strategy: str | None = None, plan: ShardingPlan | None = None,
                       cluster: str | None = None, level: str = "O2", time_limit: float = 60.0, execute: bool = False,
                       name: str = "", progress=None, status=None):
    """Memory plans for every rank of a parallel plan (exactly one of ``strategy``, ``plan`` or ``cluster``):
    each rank's program (``lower.rank_graph``, communication buffers included) as a memory problem, each
    distinct problem planned once (``memory.step_report.plan_rank_memory``); without ``execute`` only the probe
    ranks' programs are built where they agree (``lower.rank_graph.probed_rank_problems``; the report's
    ``built``). ``time_limit`` bounds building
    the rank programs and planning them, all together (not the search for ``cluster``, nor ``execute``). ``execute``
    runs every rank in its planned arena in lockstep in this process and compares every rank's loss and
    state with the plain rank programs (``lower.arena_ranks.compare_arena_ranks``). Returns a
    ``memory.step_report.RankMemoryReport`` (``.ok``, ``.to_dict()``)."""
    from .check import ATOL, RTOL
    from .lower.rank_graph import probed_rank_problems, rank_memories
    from .memory.step_report import plan_rank_memory
    from .runtime.arena_step import rank_resolved_plan
    from .sharding.presets import parse_strategy, preset_plan
    say = status or (lambda message: None)
    if sum(x is not None for x in (strategy, plan, cluster)) != 1:
        raise ValueError("give exactly one of strategy, plan or cluster")
    if execute and cap.workload.on_meta:
        raise ValueError("the workload builds its model on the meta device, which holds no data; plan without "
                         "execute, or build the workload on a real device to execute it")
    if cluster is not None:
        say(f"searching a plan for {cluster} ...")
        from .search.planning import plan_workload
        plan, _ = plan_workload(_graph(cap), parse_cluster(cluster), level="O1", workload=name)
    elif plan is None:
        plan = preset_plan(cap.graph, parse_strategy(strategy))
    t0 = time.perf_counter()
    rp = rank_resolved_plan(cap.graph, plan)
    if execute:  # every rank runs: every rank's program
        say(f"building the {plan.mesh.world} rank programs of mesh {plan.mesh} ...")
        mems = rank_memories(rp)
        built, rows = [m.rank for m in mems], [(m.rank, m.problem, m.mapping) for m in mems]
    else:
        built, rows = probed_rank_problems(rp, say)
        if len(built) < plan.mesh.world:
            say(f"ranks {', '.join(map(str, built))} have one program; the other {plan.mesh.world - len(built)} ranks "
                f"of mesh {plan.mesh} share it (even shards: the same ops and shapes on every rank)")
    left = max(0.0, time_limit - (time.perf_counter() - t0))
    say(f"planning each distinct rank program at {level} ({left:.1f} s left of the {time_limit:g} s limit) ...")
    report = plan_rank_memory(rows, workload=name, mesh=str(plan.mesh),
                              strategy=plan.strategy_string or "plan file", level=level, time_limit=left,
                              progress=progress)
    report.built = built
    if execute:
        from .lower.arena_ranks import compare_arena_ranks
        say("executing one step of every rank in its arena and in the plain rank programs (lockstep) ...")
        report.execute = compare_arena_ranks(rp, mems, report, cap.initial_state(),
                                             tuple(b.detach() for b in cap.workload.batch), RTOL, ATOL)
    return report
