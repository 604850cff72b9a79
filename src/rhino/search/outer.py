"""Outer search: logical mesh shapes and recomputation around the per-mesh solvers; the best plan kept.

1. **Meshes** (``candidate_meshes``): the device count as one axis, and as two axes ``outer x inner``
   whose inner groups respect node boundaries (the inner size divides the devices per node, or is a
   whole number of nodes). Axes are named ``all``, or ``outer`` and ``inner``; ranks are row-major,
   so the inner axis is the one inside a node. On large graphs O1 solves every mesh but prices only
   the ``o1_priced_meshes`` its model ranks best.
2. **Per mesh** (``MeshSearch``: solve, price, refit memory, refine): build the problem
   (``problem.Builder``: cones of the graph are shared by all meshes), solve it (O1:
   ``segments.solve_o1``; O2: that, then the axis-wise descent and the joint ILP, ``levels``), assemble
   the plan, and score it with ``cost.estimate.estimate`` (the same numbers ``rhino estimate`` prints).
   When the estimate's memory peak is over capacity, the peak node becomes a memory row (with what the
   model did not see there, e.g. redistribution copies, as a constant) and the problem is solved again
   (``memory_rounds`` times at most). ``Candidate.status`` says what produced the plan (``levels.Status``).
3. **Recomputation**: ``recompute="auto"`` tries ``full`` recomputation only when no mesh fits without
   it; "always" tries both for every mesh. Rule ``pipeline_before_recompute``: when rule ``pipeline`` will
   price pipelines anyway (``pipelines.pipelines_certain``), step 7 runs first, from the plans without
   recomputation (the Megatron start without it), and ``full`` is tried only when no pipelined plan fits
   without recomputation (step 7 then runs again from the recomputing candidates, the Megatron start
   with recomputation only: without it, it did not fit).
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

7. Pipelines (``pipelines``, rule ``pipeline``): the best single-stage plans on stage meshes of
   ``world / pp`` devices, with the stage cut of ``stages`` (an integer stage per forward unit,
   ``stage(u) <= stage(v)`` on every edge, balanced, cut bytes minimised) and the micro-batch count, all
   priced by ``cost.estimate`` (schedule simulation, in-flight activations in the fit check); they
   compete with the single-stage candidates in step 6.

8. Memory fit (option ``fit_memory``): "program" compares the cost model's peak with device memory.
   "planned" (``rank_memory.planned_fit``) also plans, for a priced plan over capacity by at most
   ``fit_memory_margin``, its rank program (order + layout, ``memory.plan_memory`` at O1) and counts it
   as fitting when the arena + state does (no refit then). So that such plans are proposed at all (the
   solver's memory rows hold the program-order peak under capacity), every mesh is also solved with the
   rows' capacity raised by the margin (a second pass of ``_run``, no refit), priced, and kept only when
   its plan fits by one of the two peaks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

from ..cost.cluster import Cluster
from ..cost.estimate import Estimate, estimate
from ..cost.memory import estimate_memory
from ..ir.graph import Graph
from ..sharding.mesh import Mesh
from ..sharding.plan import ShardingPlan
from ..sharding.vocab import Recompute
from .coarsen import Cones, build_cones
from .ilp import memory_over, row_bytes
from .levels import O1_DESCENT_NODES, O1_ROUNDS, LevelResult, Source, Status, refine_o1, solve_problem
from .segments import critical_classes
from .options import FitMemory, Level, RecomputeWhen, SearchOptions
from .pipelines import pipeline_candidates, pipelines_certain, worth_pipelining
from .problem import Builder
from .rank_memory import planned_fit
from .space import Space

__all__ = ["Candidate", "MeshSearch", "SearchResult", "NoPlanFits", "candidate_meshes", "search", "search_mesh"]

Progress = Callable[[str, dict], None]


class NoPlanFits(ValueError):
    """No plan fits device memory; the message says what to change."""

    def __init__(self, message: str, best: "Candidate | None" = None) -> None:
        super().__init__(message)
        self.best = best


@dataclass
class Candidate:
    """One mesh and recomputation mode's plan, priced, with what produced it (``status``)."""
    mesh: Mesh
    recompute: Recompute
    plan: ShardingPlan | None
    estimate: Estimate | None
    seconds: float
    model_seconds: float = 0.0           # the ILP model's step time
    status: Status | None = None
    problem: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    model_peak: float = 0.0              # the ILP model's memory peak (its rows, conservative)
    model_peak_cap: float = 0.0          # the capacity the model planned for
    alternative: tuple | None = field(default=None, repr=False)  # (plan, Estimate): data parallel, followed
    #: the search that made the candidate and continues it (``MeshSearch.finish``); None for a bare record
    search: "MeshSearch | None" = field(default=None, repr=False)
    #: step 4's round (``MeshSearch.refine``, given a deadline) where the candidate may take one, else None
    refine: Callable[[float], bool] | None = field(default=None, repr=False)

    def keep(self, plan: ShardingPlan, est: Estimate) -> None:
        """Make ``plan``, priced ``est``, this candidate's plan."""
        self.plan, self.estimate = plan, est
        plan.meta.update({"predicted_step_seconds": est.step_seconds,
                          "predicted_peak_bytes": est.memory_bytes["peak"]})

    @property
    def fits(self) -> bool:
        return self.estimate is not None and self.estimate.fits

    @property
    def step_seconds(self) -> float:
        return self.estimate.step_seconds if self.estimate is not None else float("inf")

    @property
    def status_text(self) -> str:
        """What produced the plan, in words (``Status.text``)."""
        return self.status.text() if self.status is not None else ""


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


class MeshSearch:
    """One mesh's search (module docstring, step 2) as explicit steps on its state, in this order:

    1. ``solve``: build the problem (``problem.Builder``) and solve it at the options' level
       (``levels.solve_problem``); the candidate holds the assembled plan and the model's numbers.
    2. ``price``: the exact estimate (``cost.estimate``) of the plan; where O2 refined O1's plan, O1's is
       priced too and kept when better; rule ``dp_follow``'s plan is priced and set aside.
    3. ``refit_memory``: while the priced plan is over capacity, its peak node becomes a memory row and
       the problem is solved again (``memory_rounds`` at most).
    4. ``refine`` (O1 on small graphs, rule ``o1_refine_best_first``): one round of O1's axis-wise
       descent from where the last ended, kept when it prices better.

    ``finish`` runs steps 2 and 3 (the outer search may defer them, or skip them for meshes it will
    not price)."""

    def __init__(self, graph: Graph, cluster: Cluster, mesh: Mesh, options: SearchOptions, *, cones: Cones,
                 base: Space, fingerprint: str, recompute: Recompute | str = Recompute.NONE, budget: float = 10.0,
                 progress: Progress | None = None, shared: dict | None = None, capacity_scale: float = 1.0) -> None:
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + budget
        self.graph, self.cluster, self.mesh, self.options, self.cones = graph, cluster, mesh, options, cones
        self.recompute = Recompute(recompute)
        self.say = progress or (lambda event, info: None)
        #: the memory rows' capacity over device memory (step 8's planned pass: above 1, and no refit)
        self.capacity_scale = capacity_scale
        self.shared = shared if shared is not None else {}
        rows = cluster if capacity_scale == 1.0 else replace(
            cluster, device=replace(cluster.device, memory_bytes=cluster.device.memory_bytes * capacity_scale))
        self.builder = Builder(graph, mesh, rows, options, cones=cones, space=Space(graph, mesh, options, like=base),
                               fingerprint=fingerprint, recompute=self.recompute, shared=shared)
        self.problem = None
        self.critical: list[int] = []
        self.sol: LevelResult | None = None       # the solver's answer the plan comes from
        self.walk: list[list[int]] = []           # where each descent round (step 4) ended
        self.cand: Candidate | None = None

    def solve(self) -> Candidate:
        """Step 1: build and solve the problem; the candidate, not yet priced."""
        mesh = self.mesh
        self.say("build", {"mesh": str(mesh), "recompute": self.recompute})
        p = self.problem = self.builder.build()
        self.say("solve", {"mesh": str(mesh), **p.size()})
        self.critical = critical_classes(self.graph, self.cones)
        sol = self.sol = solve_problem(p, self.options, deadline=self.deadline, critical=self.critical)
        self.cand = Candidate(mesh, self.recompute, self._assemble(sol.choice), None, 0.0, sol.objective, sol.status,
                              p.size(), sol.steps, model_peak=p.capacity + memory_over(p, sol.choice),
                              model_peak_cap=p.capacity, search=self)
        if self.options.level is Level.O1 and self.options.o1_refine_best_first and p.nodes <= O1_DESCENT_NODES:
            self.cand.refine = self.refine
        self.cand.seconds = time.perf_counter() - self.t0
        return self.cand

    @property
    def over_model_memory(self) -> bool:
        """The model's rows alone are over capacity (they err only on the safe side, by a little)."""
        return self.cand.model_peak > MODEL_MEMORY_SLACK * self.problem.capacity

    def finish(self) -> None:
        """Steps 2 and 3: price the plan, refit memory while it does not fit; report the score."""
        t1 = time.perf_counter()
        self.price()
        if self.capacity_scale == 1.0:
            self.refit_memory()
        self.cand.seconds += time.perf_counter() - t1
        self._scored()

    def price(self) -> Estimate:
        """Step 2: the exact estimate of the solver's plan. O2 starts from O1's plan; where the model and the
        exact price disagree, the better of the two is kept. Rule ``dp_follow``: the data-parallel split
        followed through the graph is priced now and kept at the end of the search if it prices faster
        (``_keep_alternatives``)."""
        c, sol, p = self.cand, self.sol, self.problem
        c.keep(c.plan, self._estimate(c.plan))
        if sol.o1_choice and sol.o1_choice != sol.choice and memory_over(p, sol.o1_choice) <= 0:
            first = self._assemble(sol.o1_choice)
            alt = self._estimate(first)
            if _better(alt, c.estimate):
                c.keep(first, alt)
                c.status = Status(Source.O1_KEPT)
                sol.choice = sol.o1_choice
        if sol.followed and sol.followed != sol.choice and memory_over(p, sol.followed) <= 0:
            dp = self._assemble(sol.followed)
            c.alternative = (dp, self._estimate(dp))
        return c.estimate

    def refit_memory(self) -> None:
        """Step 3: while the priced plan does not fit, the estimate's peak node becomes a memory row (what
        the model did not see there, e.g. redistribution copies, as a constant) and the problem is solved
        again from the current choice; stops when the model cannot make it fit either."""
        c, p, graph = self.cand, self.problem, self.graph
        rounds = 0
        while not c.estimate.fits and rounds < self.options.memory_rounds and self.sol.choice:
            rounds += 1
            i = _peak_index(graph, self.builder.resolved(c.plan))
            row = self.builder.memory_row(i)
            row.const += max(0, c.estimate.memory_bytes["peak"] - row_bytes(row, self.sol.choice))
            p.memory.append(row)
            self.say("refit", {"mesh": str(self.mesh), "round": rounds, "node": graph.nodes[i].name})
            sol = self.sol = solve_problem(p, self.options, deadline=max(self.deadline, time.perf_counter() + 1.0),
                                           start=self.sol.choice, critical=self.critical)
            if memory_over(p, sol.choice) > 0:
                break               # the model cannot make it fit either: no point pricing again
            plan = self._assemble(sol.choice)
            c.plan, c.model_seconds, c.status, c.steps = plan, sol.objective, sol.status, sol.steps
            c.keep(plan, self._estimate(plan))

    def refine(self, until: float) -> bool:
        """Step 4: one round of O1's descent from where the last ended (first: the plan as it stands),
        kept when it prices better. True when the round changed the choice (another may help)."""
        t1 = time.perf_counter()
        c, p = self.cand, self.problem
        self.say("refine", {"mesh": str(self.mesh), "recompute": self.recompute})
        start = self.walk[-1] if self.walk else self.sol.choice
        d = refine_o1(p, start, self.options, deadline=until, rounds=1)
        c.steps = c.steps + d.steps
        moved = d.choice != start
        if moved:
            self.walk.append(d.choice)
            new = self._assemble(d.choice)
            alt = self._estimate(new)
            if c.estimate is None or _better(alt, c.estimate):
                c.keep(new, alt)
                c.status = replace(c.status, descent=True)
                c.model_seconds = d.objective
                c.model_peak = p.capacity + memory_over(p, d.choice)
                self.sol.choice = d.choice
        c.seconds += time.perf_counter() - t1
        self._scored()
        return moved

    def _assemble(self, choice: list[int]) -> ShardingPlan:
        plan = self.builder.assemble(choice, f"search {self.options.level.value} mesh {self.mesh}")
        plan.meta.update({"level": self.options.level.value, "recompute": self.recompute,
                          "cluster": str(self.cluster)})
        return plan

    def _estimate(self, plan: ShardingPlan) -> Estimate:
        """The cost model's estimate; with ``fit_memory`` planned, its fit check by the planned peak."""
        rp = self.builder.resolved(plan)
        est = estimate(self.graph, self.cluster, rp, recompute=self.recompute)
        return planned_fit(rp, est, self.options, self.shared.setdefault("planned_fit", {}))

    def _scored(self) -> None:
        est = self.cand.estimate
        self.say("scored", {"mesh": str(self.mesh), "step_seconds": est.step_seconds, "fits": est.fits,
                            "peak": est.memory_bytes["peak"]})


def search_mesh(graph: Graph, cluster: Cluster, mesh: Mesh, options: SearchOptions, *, cones: Cones,
                base: Space, fingerprint: str, recompute: Recompute | str = Recompute.NONE, budget: float = 10.0,
                progress: Progress | None = None, shared: dict | None = None, price: bool = True,
                capacity_scale: float = 1.0) -> Candidate:
    """Search one mesh (``MeshSearch``): solve, then price and refit memory unless ``price=False`` or the
    model's memory rows alone are over capacity (then ``candidate.search.finish()`` does it later, in case
    no mesh fits and this is the best there is)."""
    ms = MeshSearch(graph, cluster, mesh, options, cones=cones, base=base, fingerprint=fingerprint,
                    recompute=recompute, budget=budget, progress=progress, shared=shared, capacity_scale=capacity_scale)
    cand = ms.solve()
    if ms.over_model_memory:
        ms.say("scored", {"mesh": str(mesh), "step_seconds": ms.sol.objective, "fits": False,
                          "peak": cand.model_peak})
    elif price:
        ms.finish()
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
    modes = [Recompute.NONE] + ([Recompute.FULL] if options.recompute is RecomputeWhen.ALWAYS else [])
    cands: list[Candidate] = []
    shared: dict = {}
    for mode in modes:
        cands += _run(graph, cluster, meshes, options, cones, base, fingerprint, mode, t0, say, shared)
    if options.fit_memory is FitMemory.PLANNED:     # step 8: plans over capacity that a memory plan may fit
        planned = _run(graph, cluster, meshes, options, cones, base, fingerprint, Recompute.NONE, t0, say, shared,
                       scale=1.0 + options.fit_memory_margin)
        cands += [c for c in planned if c.fits]
    piped, early = False, []
    if options.recompute is RecomputeWhen.AUTO and not any(c.fits for c in cands):
        if options.pipeline_before_recompute and pipelines_certain(options, cluster):   # rule: pipelines first
            early = pipeline_candidates(graph, cluster, cands, options, cones, t0 + options.time_limit, say,
                                        megatron_modes=[Recompute.NONE])
            cands += early
            piped = any(c.fits and c.recompute is Recompute.NONE for c in early)
        if not piped:
            cands += _run(graph, cluster, meshes, options, cones, base, fingerprint, Recompute.FULL, t0, say, shared)
    _refine_best_first(cands, options, t0)
    _keep_alternatives(cands)
    fitting = [c for c in cands if c.fits]
    if not fitting:
        unpriced = sorted((c for c in cands if c.estimate is None), key=lambda c: c.model_peak)
        for c in unpriced[:2]:      # the least-memory candidates, priced (and refitted) at last
            c.search.finish()
    if not piped and worth_pipelining(cands, options, cluster):   # degree, cut and micro-batches (``pipelines``)
        done = {id(c) for c in early}
        single = [c for c in cands if id(c) not in done]
        cands += pipeline_candidates(graph, cluster, single, options, cones, t0 + options.time_limit, say,
                                     megatron_modes=[Recompute.FULL] if early else None)
    fitting = [c for c in cands if c.fits]
    seconds = time.perf_counter() - t0
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
            c.status = Status(Source.DP_FOLLOWED)


def _peak(c: Candidate) -> float:
    return c.estimate.memory_bytes["peak"] if c.estimate is not None else float("inf")


def _run(graph, cluster, meshes, options, cones, base, fingerprint, mode, t0, say, shared,
         scale: float = 1.0) -> list[Candidate]:
    out = []
    lazy = options.level is Level.O1 and options.o1_priced_meshes < len(meshes) and \
        len(graph.nodes) > O1_DESCENT_NODES     # small graphs price every mesh: it is cheap
    limit = options.time_limit if options.level is Level.O2 else min(options.time_limit, O1_TIME_BUDGET)
    for k, mesh in enumerate(meshes):
        left = limit - (time.perf_counter() - t0)
        budget = max(0.5, left / (len(meshes) - k))
        out.append(search_mesh(graph, cluster, mesh, options, cones=cones, base=base, fingerprint=fingerprint,
                               recompute=mode, budget=budget, progress=say, shared=shared, price=not lazy,
                               capacity_scale=scale))
    if lazy:   # price only the meshes the model ranks best (rule o1_priced_meshes)
        ok = sorted((c for c in out if c.model_peak <= MODEL_MEMORY_SLACK * c.model_peak_cap),
                    key=lambda c: c.model_seconds)
        for c in ok[:options.o1_priced_meshes]:
            c.search.finish()
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
