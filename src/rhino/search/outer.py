"""Outer search: logical mesh shapes and recomputation around the per-mesh solvers; the best plan kept.

1. **Meshes** (``candidate_meshes``): the device count as one axis, and as two axes ``outer x inner``
   whose inner groups respect node boundaries (the inner size divides the devices per node, or is a
   whole number of nodes). Axes are named ``all``, or ``outer`` and ``inner``; ranks are row-major,
   so the inner axis is the one inside a node. On large graphs O1 solves every mesh but prices only
   the ``o1_priced_meshes`` its model ranks best.
2. **Per mesh** (``search_mesh``): build the problem (``problem.Builder``: cones of the graph are
   shared by all meshes), solve it (O1: ``segments.solve_o1``; O2: that, then the axis-wise descent
   and the joint ILP, ``levels``), assemble the plan, and score it with ``cost.estimate.estimate`` (the
   same numbers ``rhino estimate`` prints). When the estimate's memory peak is over capacity, the peak
   node becomes a memory row (with what the model did not see there, e.g. redistribution copies, as a
   constant) and the problem is solved again (``memory_rounds`` times at most).
3. **Recomputation**: ``recompute="auto"`` tries ``full`` recomputation only when no mesh fits without
   it; "always" tries both for every mesh.
4. **O1 refinement, best first** (small graphs, rule ``o1_refine_best_first``): steps 1-3 solve and
   price every candidate without descent; then, while O1's budget (``O1_TIME_BUDGET``) lasts, the
   fitting candidate that prices fastest now gets one round of O1's axis-wise descent
   (``levels.refine_o1``) from where its last round ended, again and again; a candidate leaves after
   ``levels.O1_ROUNDS`` rounds or a round that changes nothing. Each round's plan is priced exactly
   and kept when it is better (fits, then step time). A round at a time rather than all at once: the
   mesh that prices best before the descent is often not the best after it. With the rule off, each
   mesh descends as it is solved, on an even share of the budget.
5. Rule ``dp_follow``: each priced mesh's data-parallel split followed through the graph
   (``segments.followed_data_parallel``) replaces the mesh's plan when it prices faster.
6. The fastest plan that fits wins. Expert presets (``experts.preset_grid``) are scored separately
   for comparison (``rhino plan`` returns a preset instead when one is faster, and says so). When
   nothing fits, ``NoPlanFits`` names the best candidate's memory split and the smallest cluster or
   batch that would fit.

Pipeline parallelism (a later issue) is one more outer dimension: for ``pp`` stages the stage mesh is
``world / pp`` devices (``cost.estimate.stage_cluster``), the stage assignment is its own ILP over the
forward cones (an integer stage per cone, ``stage(u) <= stage(v)`` on every value, balanced compute,
cut bytes minimised; backward and optimizer cones follow their forward cones, as ``segments`` already
attaches them), and each stage's subgraph is the same per-mesh problem (``search_mesh`` on the stage's
nodes with the boundary values as inputs and outputs); ``cost.estimate``'s ``pp``/``microbatches``
price the result. Nothing in the per-mesh problem changes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..cost.cluster import Cluster
from ..cost.estimate import Estimate, estimate
from ..cost.memory import estimate_memory
from ..ir.graph import Graph
from ..sharding.mesh import Mesh
from ..sharding.plan import ShardingPlan
from .coarsen import Cones, build_cones
from .ilp import memory_over, row_bytes
from .levels import O1_DESCENT_NODES, O1_ROUNDS, refine_o1, solve_problem
from .segments import critical_classes
from .options import Level, SearchOptions
from .problem import Builder
from .space import Space

__all__ = ["Candidate", "SearchResult", "NoPlanFits", "candidate_meshes", "search", "search_mesh"]

Progress = Callable[[str, dict], None]


class NoPlanFits(ValueError):
    """No plan fits device memory; the message says what to change."""

    def __init__(self, message: str, best: "Candidate | None" = None) -> None:
        super().__init__(message)
        self.best = best


@dataclass
class Candidate:
    mesh: Mesh
    recompute: str
    plan: ShardingPlan | None
    estimate: Estimate | None
    seconds: float
    model_seconds: float = 0.0           # the ILP model's step time
    status: str = ""
    problem: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    model_peak: float = 0.0              # the ILP model's memory peak (its rows, conservative)
    model_peak_cap: float = 0.0          # the capacity the model planned for
    pricer: Callable | None = field(default=None, repr=False)
    finish: Callable | None = field(default=None, repr=False)   # price it (and refit memory)
    refine: Callable | None = field(default=None, repr=False)   # O1's descent, given a deadline (step 4)
    alternative: tuple | None = field(default=None, repr=False)  # (plan, Estimate): data parallel, followed

    def price(self) -> Estimate:
        """The cost model's estimate of the plan (computed once)."""
        if self.estimate is None or self.estimate_plan is not self.plan:
            self.keep(self.plan, self.pricer(self.plan))
        return self.estimate

    def keep(self, plan: ShardingPlan, est: Estimate) -> None:
        """Make ``plan``, priced ``est``, this candidate's plan."""
        self.plan, self.estimate, self.estimate_plan = plan, est, plan
        plan.meta.update({"predicted_step_seconds": est.step_seconds,
                          "predicted_peak_bytes": est.memory_bytes["peak"]})

    estimate_plan: object = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return self.estimate is not None and self.estimate.fits

    @property
    def step_seconds(self) -> float:
        return self.estimate.step_seconds if self.estimate is not None else float("inf")


@dataclass
class SearchResult:
    plan: ShardingPlan
    estimate: Estimate
    level: Level
    search_seconds: float
    candidates: list[Candidate]
    best: Candidate
    cones: Cones
    source: str = "search"                # "search" | "preset <strategy>"
    presets: list = field(default_factory=list)   # [(strategy, Estimate | error text)]


def candidate_meshes(cluster: Cluster, options: SearchOptions = SearchOptions()) -> list[Mesh]:
    """Mesh shapes for ``cluster`` (module docstring), one-axis first."""
    world, dpn = cluster.world, cluster.devices_per_node
    out = [Mesh(("all",), (world,))]
    if options.max_mesh_axes >= 2:
        for inner in range(2, world):
            if world % inner:
                continue
            if not (dpn % inner == 0 or inner % dpn == 0):
                continue
            out.append(Mesh(("outer", "inner"), (world // inner, inner)))
    return out


def _peak_index(graph: Graph, rp) -> int:
    mem = estimate_memory(graph, rp)
    names = {n.name: i for i, n in enumerate(graph.nodes)}
    return names.get(mem.peak_node, len(graph.nodes) - 1)


def search_mesh(graph: Graph, cluster: Cluster, mesh: Mesh, options: SearchOptions, *, cones: Cones,
                base: Space, fingerprint: str, recompute: str = "none", budget: float = 10.0,
                progress: Progress | None = None, shared: dict | None = None, price: bool = True) -> Candidate:
    """Search one mesh (module docstring, step 2). ``price=False``: build and solve only; the returned
    candidate's ``finish()`` prices it (and refits memory) later."""
    t0 = time.perf_counter()
    deadline = t0 + budget
    say = progress or (lambda event, info: None)
    space = Space(graph, mesh, options, like=base)
    b = Builder(graph, mesh, cluster, options, cones=cones, space=space, fingerprint=fingerprint,
                recompute=recompute, shared=shared)
    say("build", {"mesh": str(mesh), "recompute": recompute})
    p = b.build()
    say("solve", {"mesh": str(mesh), **p.size()})
    critical = critical_classes(graph, cones, b.boundary)
    sol = solve_problem(p, options, deadline=deadline, critical=critical)
    meta = {"level": options.level.value, "recompute": recompute, "cluster": str(cluster)}
    plan = b.assemble(sol.choice, f"search {options.level.value} mesh {mesh}")
    plan.meta.update(meta)
    cand = Candidate(mesh, recompute, plan, None, 0.0, sol.objective, sol.status, p.size(), sol.steps,
                     model_peak=p.capacity + memory_over(p, sol.choice), model_peak_cap=p.capacity,
                     pricer=lambda pl: estimate(graph, cluster, b.resolved(pl), recompute=recompute))
    cand.seconds = time.perf_counter() - t0

    def finish() -> None:
        nonlocal sol, plan
        t1 = time.perf_counter()
        est = cand.price()
        if sol.o1_choice and sol.o1_choice != sol.choice and memory_over(p, sol.o1_choice) <= 0:
            # O2 starts from O1's plan; where the model and the exact price disagree, keep the better one
            first = b.assemble(sol.o1_choice, f"search {options.level.value} mesh {mesh}")
            first.meta.update(meta)
            alt = cand.pricer(first)
            if _better(alt, est):
                cand.keep(first, alt)
                est = alt
                cand.status = "O1 (kept: priced faster than the O2 refinement)"
                sol.choice = sol.o1_choice
        if sol.followed and sol.followed != sol.choice and memory_over(p, sol.followed) <= 0:
            # rule dp_follow: the data-parallel split followed through the graph, priced now and kept at
            # the end if it prices faster than what the solver and the refinement found (``search``)
            dp = b.assemble(sol.followed, f"search {options.level.value} mesh {mesh}")
            dp.meta.update(meta)
            cand.alternative = (dp, cand.pricer(dp))
        rounds = 0
        while not est.fits and rounds < options.memory_rounds and sol.choice:
            rounds += 1
            i = _peak_index(graph, b.resolved(cand.plan))
            row = b.memory_row(i)
            modelled = row_bytes(row, sol.choice)
            row.const += max(0, est.memory_bytes["peak"] - modelled)
            p.memory.append(row)
            say("refit", {"mesh": str(mesh), "round": rounds, "node": graph.nodes[i].name})
            sol = solve_problem(p, options, deadline=max(deadline, time.perf_counter() + 1.0), start=sol.choice,
                                critical=critical)
            if memory_over(p, sol.choice) > 0:
                break               # the model cannot make it fit either: no point pricing again
            plan = b.assemble(sol.choice, f"search {options.level.value} mesh {mesh}")
            plan.meta.update(meta)
            cand.plan, cand.model_seconds, cand.status, cand.steps = plan, sol.objective, sol.status, sol.steps
            est = cand.price()
        cand.seconds += time.perf_counter() - t1
        say("scored", {"mesh": str(mesh), "step_seconds": est.step_seconds, "fits": est.fits,
                       "peak": est.memory_bytes["peak"]})

    walk: list[list[int]] = []          # where the last descent round ended

    def refine(until: float) -> bool:
        """Step 4: one round of O1's descent from where the last ended (first: the plan as it stands),
        kept when it prices better. True when the round changed the choice (another may help)."""
        t1 = time.perf_counter()
        say("refine", {"mesh": str(mesh), "recompute": recompute})
        start = walk[-1] if walk else sol.choice
        d = refine_o1(p, start, options, deadline=until, rounds=1)
        cand.steps = cand.steps + d.steps
        moved = d.choice != start
        if moved:
            walk.append(d.choice)
            new = b.assemble(d.choice, f"search {options.level.value} mesh {mesh}")
            new.meta.update(meta)
            alt = cand.pricer(new)
            if cand.estimate is None or _better(alt, cand.estimate):
                cand.keep(new, alt)
                if not cand.status.endswith(" + descent"):
                    cand.status += " + descent"
                cand.model_seconds = d.objective
                cand.model_peak = p.capacity + memory_over(p, d.choice)
                sol.choice = d.choice
        cand.seconds += time.perf_counter() - t1
        est = cand.estimate
        say("scored", {"mesh": str(mesh), "step_seconds": est.step_seconds, "fits": est.fits,
                       "peak": est.memory_bytes["peak"]})
        return moved

    cand.finish = finish
    if options.level is Level.O1 and options.o1_refine_best_first and p.nodes <= O1_DESCENT_NODES:
        cand.refine = refine
    if cand.model_peak > MODEL_MEMORY_SLACK * p.capacity:
        # the model's rows alone are over capacity (and they err only on the safe side by a little):
        # leave the exact pricing for later, in case no mesh fits and this is the best there is
        say("scored", {"mesh": str(mesh), "step_seconds": sol.objective, "fits": False, "peak": cand.model_peak})
    elif price:
        finish()
    return cand


def search(graph: Graph, cluster: Cluster, options: SearchOptions = SearchOptions(), *,
           progress: Progress | None = None) -> SearchResult:
    """The best plan for ``graph`` on ``cluster`` (module docstring). Raises ``NoPlanFits``."""
    t0 = time.perf_counter()
    say = progress or (lambda event, info: None)
    meshes = candidate_meshes(cluster, options)
    fingerprint = graph.fingerprint()
    base = Space(graph, meshes[0], options)
    say("cones", {"nodes": len(graph.nodes)})
    cones = build_cones(graph, base, options)
    say("meshes", {"meshes": [str(m) for m in meshes], "cones": len(cones.cones), "classes": len(cones.classes)})
    modes = ["none"] + (["full"] if options.recompute == "always" else [])
    cands: list[Candidate] = []
    shared: dict = {}
    for mode in modes:
        cands += _run(graph, cluster, meshes, options, cones, base, fingerprint, mode, t0, say, shared)
    if options.recompute == "auto" and not any(c.fits for c in cands):
        cands += _run(graph, cluster, meshes, options, cones, base, fingerprint, "full", t0, say, shared)
    _refine_best_first(cands, options, t0)
    _keep_alternatives(cands)
    fitting = [c for c in cands if c.fits]
    seconds = time.perf_counter() - t0
    if not fitting:
        unpriced = sorted((c for c in cands if c.estimate is None), key=lambda c: c.model_peak)
        for c in unpriced[:2]:      # the least-memory candidates, priced (and refitted) at last
            c.finish()
        fitting = [c for c in cands if c.fits]
    if not fitting:
        priced = [c for c in cands if c.estimate is not None]
        raise NoPlanFits(no_fit_message(graph, cluster, priced), min(priced, key=_peak) if priced else None)
    best = min(fitting, key=lambda c: c.step_seconds)
    return SearchResult(best.plan, best.estimate, options.level, seconds, cands, best, cones)


#: O1's own budget (seconds, all meshes; less when the time limit is lower). It bounds only the optional
#: descent steps small graphs get; building and pricing each mesh always run.
O1_TIME_BUDGET = 20.0
#: A candidate whose model memory peak is over this many times capacity is not priced exactly unless
#: nothing fits (the model's rows overestimate by under 15% in the tests).
MODEL_MEMORY_SLACK = 1.15


#: Step 4 starts no refinement with less of O1's budget left than this (seconds).
O1_MIN_REFINE_SECONDS = 0.5


def _better(a: Estimate, b: Estimate) -> bool:
    """``a`` prices better than ``b``: it fits where ``b`` does not, or it is faster."""
    return (not a.fits, a.step_seconds) < (not b.fits, b.step_seconds)


def _refine_best_first(cands: list[Candidate], options: SearchOptions, t0: float) -> None:
    """Step 4 (module docstring): one descent round at a time for the fitting candidate that prices
    fastest now, while O1's budget lasts."""
    limit = min(options.time_limit, O1_TIME_BUDGET)
    active = [[c, 0] for c in cands if c.fits and c.refine is not None]    # [candidate, rounds run]
    while active and t0 + limit - time.perf_counter() >= O1_MIN_REFINE_SECONDS:
        entry = min(active, key=lambda e: e[0].step_seconds)
        entry[1] += 1
        if not entry[0].refine(t0 + limit) or entry[1] >= O1_ROUNDS:
            active.remove(entry)


def _keep_alternatives(cands: list[Candidate]) -> None:
    """Rule ``dp_follow``: a candidate's followed data-parallel plan replaces its plan if it prices better."""
    for c in cands:
        if c.alternative is not None and c.estimate is not None and _better(c.alternative[1], c.estimate):
            c.keep(*c.alternative)
            c.status = "data parallel, followed (priced faster than the solver's plan)"


def _peak(c: Candidate) -> float:
    return c.estimate.memory_bytes["peak"] if c.estimate is not None else float("inf")


def _run(graph, cluster, meshes, options, cones, base, fingerprint, mode, t0, say, shared) -> list[Candidate]:
    out = []
    lazy = options.level is Level.O1 and options.o1_priced_meshes < len(meshes) and \
        len(graph.nodes) > O1_DESCENT_NODES     # small graphs price every mesh: it is cheap
    limit = options.time_limit if options.level is Level.O2 else min(options.time_limit, O1_TIME_BUDGET)
    for k, mesh in enumerate(meshes):
        left = limit - (time.perf_counter() - t0)
        budget = max(0.5, left / (len(meshes) - k))
        out.append(search_mesh(graph, cluster, mesh, options, cones=cones, base=base, fingerprint=fingerprint,
                               recompute=mode, budget=budget, progress=say, shared=shared, price=not lazy))
    if lazy:   # price only the meshes the model ranks best (rule o1_priced_meshes)
        ok = sorted((c for c in out if c.model_peak <= MODEL_MEMORY_SLACK * c.model_peak_cap),
                    key=lambda c: c.model_seconds)
        for c in ok[:options.o1_priced_meshes]:
            c.finish()
    return out


def _gb(n: float) -> str:
    from .report import fmt_bytes
    return fmt_bytes(n)


def no_fit_message(graph: Graph, cluster: Cluster, cands: list[Candidate]) -> str:
    """What to change when nothing fits: the best candidate's memory split, and about how many devices
    or how small a batch would fit (memory that shards scales with 1 / devices, activations with batch)."""
    scored = [c for c in cands if c.estimate is not None]
    if not scored:
        return f"no plan for cluster {cluster} could be built"
    best = min(scored, key=_peak)
    mem = best.estimate.memory_bytes
    cap = best.estimate.capacity_bytes
    peak = mem["peak"]
    split = ", ".join(f"{k} {_gb(v)}" for k, v in mem.items() if k != "peak" and v)
    world = cluster.world
    need = world * peak / cap
    dpn = cluster.devices_per_node
    nodes = -(-int(need + 0.999) // dpn)
    act = mem.get("activations", 0)
    batch = next((graph.types[i.value].shape[0] for i in graph.inputs if i.role.value == "batch"
                  and graph.types[i.value].shape), None)
    hint = f"about {nodes * dpn} devices ({nodes} nodes of {dpn})"
    if batch and act and peak - act < cap:
        fit_batch = int(batch * (cap - (peak - act)) / act)
        if fit_batch >= 1:
            hint += f", or a global batch of at most about {fit_batch} (now {batch})"
    return (f"no plan fits {_gb(cap)} per device on {cluster}: the smallest peak found is {_gb(peak)} "
            f"(mesh {best.mesh}, recompute {best.recompute}: {split}); try {hint}")
