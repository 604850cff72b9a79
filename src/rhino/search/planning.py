"""Planning a workload for a cluster: search, compare with the expert presets, build the report.

The library function behind ``rhino plan`` and ``rhino.plan`` / ``Trainer(cluster=...)`` (pure: no torch).
"""
from __future__ import annotations

from ..cost.estimate import estimate
from ..sharding.plan import resolve
from ..sharding.presets import StrategySpec, parse_strategy, preset_plan

__all__ = ["plan_workload"]


def _preset_plan(graph, strategy: str):
    spec = parse_strategy(strategy)
    plan = preset_plan(graph, StrategySpec(dp=spec.dp, tp=spec.tp, zero=spec.zero, sp=spec.sp,
                                           microbatches=spec.microbatches, recompute=spec.recompute))
    return plan, spec.recompute


def plan_workload(graph, cluster, *, level: str = "O2", time_limit: float = 60.0, presets: bool = True,
                  workload: str = "", progress=None, keep_presets: bool = True, fit_memory: str = "program"):
    """Search, compare with the presets, and build the report: (plan, report). ``fit_memory``: the search's
    fit check (``SearchOptions.fit_memory``: "program" or "planned")."""
    from ..search import SearchOptions, search
    from ..search.experts import best_preset, score_presets
    from ..search.rank_memory import planned_fit
    from ..search.report import build_report
    say = progress or (lambda event, info: None)
    options = SearchOptions(level=level, time_limit=time_limit, fit_memory=fit_memory)
    result = search(graph, cluster, options, progress=say)
    scores = score_presets(graph, cluster, say) if presets else []
    best = best_preset(scores)
    plan, est, source, recompute = result.plan, result.estimate, "search", result.best.recompute
    if keep_presets and best is not None and best.fits and best.step_seconds < est.step_seconds:
        plan, recompute = _preset_plan(graph, best.strategy)
        est = best.estimate
        source = f"preset {best.strategy} (faster than the searched plan, {result.estimate.step_seconds * 1e3:.3f} ms)"
        plan.meta.update({"level": result.level.value, "recompute": recompute, "cluster": str(cluster),
                          "predicted_step_seconds": est.step_seconds,
                          "predicted_peak_bytes": est.memory_bytes["peak"]})
    plan.meta["source"] = source
    plan.recompute = recompute  # what the runtime executes (the plan file's "recompute")
    rp = resolve(graph, plan)
    if source == "search" and est.pp == 1:     # a pipelined plan keeps the estimate of its stage cut
        est = planned_fit(rp, estimate(graph, cluster, rp, recompute=recompute), options)
    cands = [{"mesh": dict(zip(c.mesh.names, c.mesh.sizes)), "recompute": c.recompute,
              "pp": c.estimate.pp if c.estimate else 1,
              "microbatches": c.estimate.microbatches if c.estimate else 1,
              "step_seconds": c.step_seconds, "fits": c.fits,
              "peak_bytes": c.estimate.memory_bytes["peak"] if c.estimate else None,
              "model_step_seconds": c.model_seconds, "seconds": round(c.seconds, 3), "status": c.status_text,
              "problem": c.problem} for c in result.candidates]
    report = build_report(graph, cluster, rp, est, workload=workload, level=result.level.value,
                          search_seconds=result.search_seconds, presets=scores, best=best, source=source,
                          recompute=recompute, candidates=cands)
    return plan, report
