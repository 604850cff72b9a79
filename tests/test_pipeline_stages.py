"""Pipeline stage partitioning (search/stages.py) and the cut's pricing (cost/pipeline.py)."""
from __future__ import annotations

import random
import warnings

import pytest

from conftest import ROOT
from rhino.capture import capture, load_workload
from rhino.cost.cluster import parse_cluster
from rhino.cost.estimate import estimate, estimate_microbatches
from rhino.cost.pipeline import Schedule, simulate
from rhino.ir.analysis import analyze
from rhino.sharding.presets import StrategySpec, preset_plan
from rhino.search.stages import (StageProblem, brute_force, cut_bytes, loads, solve_contiguous, solve_cpsat,
                                 solve_stages, stage_cut)

_CACHE = {}


def graph(name):
    if name not in _CACHE:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _CACHE[name] = capture(load_workload(str(ROOT / "examples" / f"{name}.py"))).graph
    return _CACHE[name]


def two_branch(pp, capacity=None, flight=None):
    """0 -> {1 -> 3, 2 -> 4} -> 5 -> 6, with a skip 0 -> 5 (U-Net-like) and unequal branches."""
    edges = [(0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 5), (0, 5), (5, 6)]
    values = [(0, [1, 2, 5], 8), (1, [3], 6), (2, [4], 2), (3, [5], 5), (4, [5], 1), (5, [6], 3)]
    return StageProblem([4, 3, 5, 2, 6, 3, 4], [3, 1, 2, 3, 1, 2, 2], [4, 2, 2, 1, 1, 1, 1], edges, values, pp,
                        flight=flight or [], capacity=capacity, last=[6])


def random_dag(seed, n=7, pp=3):
    rng = random.Random(seed)
    edges = sorted({(u, v) for v in range(1, n) for u in rng.sample(range(v), min(v, rng.randint(1, 2)))})
    values = []
    for u in range(n):
        readers = [v for (a, v) in edges if a == u]
        if readers:
            values.append((u, readers, rng.randint(1, 9)))
    return StageProblem([rng.randint(1, 9) for _ in range(n)], [rng.randint(0, 5) for _ in range(n)],
                        [rng.randint(0, 3) for _ in range(n)], edges, values, pp,
                        flight=[min(pp - k, 4) for k in range(pp)], capacity=rng.choice([None, 30]),
                        last=[n - 1] if seed % 2 else [])


def _monotone(p, stage):
    return all(stage[u] <= stage[v] for u, v in p.edges) and set(stage) == set(range(p.pp))


@pytest.mark.parametrize("pp", [2, 3])
def test_cpsat_matches_brute_force_on_a_two_branch_dag(pp):
    p = two_branch(pp)
    sol = solve_cpsat(p, seconds=10)
    assert sol is not None and sol.optimal and _monotone(p, sol.stage)
    assert (sol.least, sol.cut) == brute_force(p)
    assert sol.bottleneck <= sol.least * (1 + p.tolerance)


@pytest.mark.parametrize("seed", range(6))
def test_cpsat_matches_brute_force_on_random_dags(seed):
    p = random_dag(seed)
    try:
        best = brute_force(p)
    except ValueError:      # no valid assignment fits the capacity: the solvers must not claim one
        assert solve_cpsat(p, seconds=5) is None
        return
    sol = solve_cpsat(p, seconds=10)
    assert _monotone(p, sol.stage)
    assert (sol.least, sol.cut) == best and sol.bottleneck <= sol.least * (1 + p.tolerance)
    dp = solve_contiguous(p)     # contiguous windows: valid, never better than the optimum
    assert _monotone(p, dp.stage) and dp.least >= best[0] - 1e-6
    assert solve_stages(p).cut <= dp.cut or solve_stages(p).bottleneck <= dp.bottleneck


def _stage_memory(p, stage):
    mem = [0] * p.pp
    for u, s in enumerate(stage):
        mem[s] += p.state[u] + p.act[u] * p.flight[s]
    return mem


def test_memory_rows_move_units_off_the_first_stage():
    # 1F1B: stage 0 holds 2 micro-batches, stage 1 one; a capacity just below the free cut's worst stage
    free = solve_cpsat(two_branch(2, flight=[2, 1]), seconds=10)
    cap = max(_stage_memory(two_branch(2, flight=[2, 1]), free.stage)) - 1
    tight = two_branch(2, capacity=cap, flight=[2, 1])
    sol = solve_cpsat(tight, seconds=10)
    assert max(_stage_memory(tight, sol.stage)) <= cap and (sol.least, sol.cut) == brute_force(tight)
    assert sol.stage != free.stage


def test_simulated_schedules_match_the_balanced_formula():
    for pp, m in ((2, 4), (4, 8), (3, 3)):
        for sched in Schedule:
            end, busy = simulate([1.0] * pp, [2.0] * pp, [0.0] * (pp - 1), [0.0] * (pp - 1), m, sched)
            assert max(end) == pytest.approx((m + pp - 1) * 3.0)
            assert busy == [m * 3.0] * pp
    # a slow stage: the bubble grows from imbalance, beyond the balanced formula
    end, _ = simulate([1.0, 2.0], [2.0, 4.0], [0.0], [0.0], 4, Schedule.ONE_F_ONE_B)
    assert max(end) > (4 + 1) * 4.5 * 0.999 and max(end) >= 4 * 6.0 + 3.0


@pytest.mark.parametrize("name", ["unet", "bert", "moe", "gpt"])
def test_cut_of_multi_branch_examples_is_monotone_balanced_and_priced(name):
    g = graph(name)
    cluster = parse_cluster("8xA100-80G")
    plan = preset_plan(g, StrategySpec(dp=2, tp=2))
    sols = []
    e = estimate(g, cluster, plan, pp=2, microbatches=4, stages=stage_cut(solutions=sols))
    a = analyze(g)
    stage = e.node_stage
    for i, node in enumerate(g.nodes):       # monotone on every forward edge
        if a.is_forward(i):
            for r in node.input_refs():
                p = a.producer.get(r.id)
                if p is not None and a.is_forward(p):
                    assert stage[p] <= stage[i], (name, g.nodes[p].name, node.name)
    assert {stage[i] for i in range(len(g.nodes)) if a.is_forward(i)} == {0, 1}
    sol = sols[0]
    # balanced within the tolerance of the least bottleneck (bounded above by the contiguous DP's)
    cont = solve_contiguous(StageProblem(*_problem_args(g, plan, cluster)))
    assert sol.bottleneck <= cont.least * 1.08 * (1 + 1e-9)
    assert all(s["forward_ops"] > 0 for s in e.stages) and len(e.stages) == 2
    assert 0 < e.bubble_fraction < 0.5 and e.pp == 2
    # the runtime's default cut (ir.stages.contiguous_cut): when it is as balanced, it crosses no fewer bytes
    contiguous = estimate(g, cluster, plan, pp=2, microbatches=4)
    other_cut, other_bottleneck = _cut_of(g, plan, cluster, contiguous.node_stage)
    if other_bottleneck <= sol.least * 1.08:
        assert sol.cut <= other_cut + 1e-6


def _problem_args(g, plan, cluster):
    from rhino.search.stages import graph_units
    got = {}

    def grab(graph_, rp, st, mem, pp, m):
        got["gu"] = graph_units(graph_, rp, st, mem, pp, m)
        return None
    estimate(g, cluster, plan, pp=2, microbatches=4, stages=grab)
    p = got["gu"].problem
    return p.time, p.state, p.act, p.edges, p.values, p.pp, p.flight, p.capacity, p.tolerance, p.order


def _cut_of(g, plan, cluster, node_stage):
    from rhino.search.stages import graph_units
    got = {}

    def grab(graph_, rp, st, mem, pp, m):
        got["gu"] = graph_units(graph_, rp, st, mem, pp, m)
        return None
    estimate(g, cluster, plan, pp=2, microbatches=4, stages=grab)
    gu = got["gu"]
    unit_stage = [0] * len(gu.problem.time)
    for i, u in enumerate(gu.unit_of):
        if u >= 0:
            unit_stage[u] = node_stage[i]
    return cut_bytes(gu.problem, unit_stage), max(loads(gu.problem, unit_stage))


def test_in_flight_activations_per_schedule():
    g = graph("gpt")
    cluster = parse_cluster("8xA100-80G")
    plan = preset_plan(g, StrategySpec(tp=2))
    one = estimate(g, cluster, plan, pp=4, microbatches=8)
    gp = estimate(g, cluster, plan, pp=4, microbatches=8, schedule="gpipe")
    for s in range(4):
        a1, ag = (e.stages[s]["phases"][0]["memory"]["activations"] for e in (one, gp))   # the pipeline phase
        # 1F1B holds min(pp - s, m) micro-batches, GPipe all m (integer bytes: within one byte per category)
        assert a1 > 0 and ag == pytest.approx(a1 * 8 / min(4 - s, 8), abs=8)


def test_search_tries_pipelines_by_rule_and_reports_them():
    from rhino.search import SearchOptions, search
    g = graph("gpt")
    cluster = parse_cluster("4xA100-80G")       # pp=2 and pp=4 candidates; 8 devices only make the search longer
    on = search(g, cluster, SearchOptions(level="O1", pipeline="always", time_limit=20))
    piped = [c for c in on.candidates if c.estimate is not None and c.estimate.pp > 1]
    assert piped
    batch = next(i for i in g.inputs if i.role.value == "batch")
    for c in piped:
        e = c.estimate
        assert c.plan.mesh.world * e.pp == cluster.world and e.microbatches % e.pp == 0
        assert g.types[batch.value].shape[0] % e.microbatches == 0
        assert e.stages and len(e.stages) == e.pp and e.memory_bytes["peak"] == max(s["peak_bytes"] for s in e.stages)
    # the report of a pipelined plan: its mesh is one stage's (a ValueError "mesh ... has 4 devices but cluster
    # ... has 8" from axis_links on the whole cluster, which made `rhino plan` fail whenever a pipeline won)
    from rhino.search.report import build_report
    from rhino.sharding.plan import resolve
    c = piped[0]
    rep = build_report(g, cluster, resolve(g, c.plan), c.estimate, workload="gpt", level="O1", search_seconds=0.0,
                       presets=[], best=None, source="search", recompute=c.recompute, candidates=[])
    assert len(rep.links) == len(c.plan.mesh.sizes) and rep.to_dict()["pipeline"]["stages"] == c.estimate.pp > 1
    assert f"pipeline {c.estimate.pp} stages" in rep.text()
    fitting = [c for c in on.candidates if c.fits]
    assert on.estimate.step_seconds == min(c.step_seconds for c in fitting)
    off = search(g, cluster, SearchOptions(level="O1", pipeline="never", time_limit=20))
    assert all(c.estimate is None or c.estimate.pp == 1 for c in off.candidates)
    assert on.estimate.step_seconds <= off.estimate.step_seconds
    c = off.best
    one = build_report(g, cluster, resolve(g, c.plan), c.estimate, workload="gpt", level="O1", search_seconds=0.0,
                       presets=[], best=None, source="search", recompute=c.recompute, candidates=[]).to_dict()
    assert one["pipeline"] == {"stages": 1, "microbatches": 1, "schedule": "1f1b"}


def test_pipeline_rule_auto():
    from types import SimpleNamespace
    from rhino.search.options import SearchOptions
    from rhino.search.pipelines import worth_pipelining
    one, many = parse_cluster("8xA100-80G"), parse_cluster("2x8xA100-80G")
    est = SimpleNamespace(step_seconds=2.0, compute_seconds=1.0, recompute="none")
    fits = [SimpleNamespace(fits=True, step_seconds=2.0, estimate=est)]
    none = [SimpleNamespace(fits=False, step_seconds=2.0, estimate=est)]
    auto = SearchOptions(pipeline="auto")
    assert worth_pipelining(none, auto, one) and worth_pipelining(none, auto, many)   # nothing fits
    assert not worth_pipelining(fits, auto, one)             # one node: single-stage plans stay
    assert not worth_pipelining(fits, auto, many)            # auto: only when nothing fits
    gain = SearchOptions(pipeline="gain")
    assert worth_pipelining(fits, gain, many)                # half the step exposed on several nodes
    assert not worth_pipelining(fits, gain, one)
    tight = [SimpleNamespace(fits=True, step_seconds=1.01, estimate=SimpleNamespace(step_seconds=1.01,
                                                                                    compute_seconds=1.0,
                                                                                    recompute="none"))]
    assert not worth_pipelining(tight, gain, many)           # within pipeline_min_gain of its compute
    memory = SearchOptions()                                  # the default: "memory"
    assert memory.pipeline == "memory"
    assert not worth_pipelining(fits, memory, many)          # fits without recomputation: stays single-stage
    assert worth_pipelining(none, memory, many)
    full = [SimpleNamespace(fits=True, step_seconds=1.01, estimate=SimpleNamespace(step_seconds=1.01,
                                                                                   compute_seconds=1.0,
                                                                                   recompute="full"))]
    assert worth_pipelining(full, memory, many) and worth_pipelining(full, gain, many)   # fits only recomputing
    assert not worth_pipelining(full, memory, one) and not worth_pipelining(full, auto, many)
    assert not worth_pipelining(none, SearchOptions(pipeline="never"), many)
    assert worth_pipelining(tight, SearchOptions(pipeline="always"), one)


def test_graph_units_remembered_parts_give_the_problem_computed_afresh():
    """``graph_units`` keeps what does not depend on m (per graph and cones, per plan and step pricing): the
    problem at m = 4 after m = 8 equals the one computed with nothing remembered."""
    from rhino.search import stages
    g = graph("gpt")
    plan = preset_plan(g, StrategySpec(dp=2, tp=2))
    got = []

    def grab(graph_, rp, st, mem, pp, m):
        if m == 4:
            stages._BASE.clear()
            stages._COSTS.clear()
            got.append(stages.graph_units(graph_, rp, st, mem, pp, m, capacity=1e9))
        got.append(stages.graph_units(graph_, rp, st, mem, pp, m, capacity=1e9))
        return None
    estimate_microbatches(g, parse_cluster("8xA100-80G"), plan, pp=2, microbatches=[8, 4], stages=grab)
    warm8, fresh, warm4 = got
    assert warm4.unit_of == fresh.unit_of
    for f in ("time", "state", "act", "edges", "values", "flight", "capacity", "order", "last"):
        assert getattr(warm4.problem, f) == getattr(fresh.problem, f), f
    assert warm8.problem.act != warm4.problem.act      # what depends on m is recomputed
