"""Plan search, unit level: the strategy space, cones and tied layers, the ILP against brute force,
each pruning rule on and off, memory rows against the cost model, and the outer search's errors."""
import itertools
import time
import warnings

import pytest

from conftest import ROOT
from rhino.capture import capture, load_workload
from rhino.cost.cluster import parse_cluster
from rhino.cost.memory import estimate_memory
from rhino.ir.graph import Graph
from rhino.search import Level, NoPlanFits, SearchOptions, candidate_meshes, search
from rhino.search.coarsen import ConeKind, build_cones
from rhino.search.ilp import memory_over, objective_of, row_bytes, solve_ilp
from rhino.search.local import local_search
from rhino.search.problem import Builder, MemRow, Problem, Term
from rhino.search.space import Space
from rhino.sharding.mesh import Mesh
from rhino.sharding.placement import Partial, Replicate, Shard
from rhino.sharding.plan import resolve

_CAPTURED = {}


def graph_of(spec: str) -> Graph:
    if spec not in _CAPTURED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _CAPTURED[spec] = capture(load_workload(str(ROOT / "examples" / spec))).graph
    return _CAPTURED[spec]


def node_named(graph, prefix):
    return next(i for i, n in enumerate(graph.nodes) if n.name.split("_", 1)[1].startswith(prefix))


# -- strategy space -------------------------------------------------------------------------------
def test_matmul_candidates_cover_batch_contracting_output_and_strided_splits():
    g = graph_of("gpt.py")
    space = Space(g, Mesh(("a",), (2,)))
    qkv = next(i for i, n in enumerate(g.nodes) if n.op == "aten.addmm.default")   # the fused QKV projection
    cands = {s[0] for s in space.candidates(qkv)}
    assert {None, "m", "k", "n"} <= cands          # replicate, rows, contracting (partial), columns
    assert "n/3" in cands                           # strided: each rank keeps its slice of Q, K and V
    ns = space.shardings(qkv, ("k",))
    assert isinstance(ns.outputs[0][0], Partial)
    ns = space.shardings(qkv, ("n/3",))
    assert ns.inputs[2][0] == Shard(1, 3)           # the transposed weight [H, 3H], strided columns


def test_matmul_after_a_merging_view_may_keep_the_strided_batch_split():
    """BERT's sequence-first attention flattens ``(seq, batch, d)`` to ``(seq batch, d)`` before the packed
    in-projection: a batch split arrives as the rows split in ``seq`` blocks (``m/seq``); its output is viewed
    as ``(..., 3, E)``. The matmul's candidates include both strided splits, so the search's data-parallel plans
    need not gather there (on 8x8xH100 the followed data-parallel plan priced 153.5 ms against the dp=64 preset's
    24.9 ms without it)."""
    from rhino.ir.graph import Role
    g = graph_of("bert.py")
    space = Space(g, Mesh(("a",), (2,)))
    ids = next(i for i in g.inputs if i.role is Role.BATCH)
    batch, seq = g.types[ids.value].shape[:2]
    mm = next(i for i, n in enumerate(g.nodes) if n.op in ("aten.mm.default", "aten.addmm.default")
              and g.types[n.input_refs()[-2 if n.op == "aten.addmm.default" else 0].id].shape[0] == seq * batch)
    cands = {s[0] for s in space.candidates(mm)}
    assert f"m/{seq}" in cands, sorted(map(str, cands))
    assert "n/3" in cands   # the packed projection viewed as (..., 3, E): Q, K and V each split
    x = g.nodes[mm].input_refs()[-2 if g.nodes[mm].op == "aten.addmm.default" else 0]
    k = [r.id for r in g.nodes[mm].input_refs()].index(x.id)
    assert space.shardings(mm, (f"m/{seq}",)).inputs[k] == (Shard(0, seq),)


def test_follow_takes_an_input_as_it_arrives():
    g = graph_of("gpt.py")
    space = Space(g, Mesh(("a", "b"), (2, 2)))
    gelu = next(i for i, n in enumerate(g.nodes) if n.op == "aten.gelu.default")
    s = space.follow(gelu, 0, (Shard(0), Shard(2)))
    ns = space.shardings(gelu, s)
    assert ns.inputs[0] == (Shard(0), Shard(2)) and ns.outputs[0] == (Shard(0), Shard(2))
    # a Partial input of a non-linear op is reduced first (replicated on that axis)
    s = space.follow(gelu, 0, (Partial(), Shard(0)))
    assert s[0] is None and space.shardings(gelu, s).inputs[0][1] == Shard(0)


def test_input_candidates_include_zero_style_state_splits_only_when_allowed():
    mesh = Mesh(("a", "b"), (2, 4))
    from rhino.ir.graph import Role
    on = Space(graph_of("mlp.py"), mesh).input_candidates((8, 16), Role.OPT_STATE)
    off = Space(graph_of("mlp.py"), mesh, SearchOptions(shard_state=False)).input_candidates((8, 16), Role.OPT_STATE)
    assert (Shard(0), Shard(1)) in on and off == [(Replicate(), Replicate())]


# -- cones and tied layers --------------------------------------------------------------------------
def test_every_node_in_one_cone_and_optimizer_cones_own_their_state():
    g = graph_of("gpt.py")
    space = Space(g, Mesh(("a",), (2,)))
    cones = build_cones(g, space)
    assert all(c >= 0 for c in cones.cone_of_node)
    members = sorted(i for c in cones.cones for i in c.members)
    assert members == list(range(len(g.nodes)))
    opt = [c for c in cones.cones if c.kind is ConeKind.OPTIMIZER and c.owned]
    params = [i for i in g.inputs if i.role.value == "param"]
    assert len(opt) == len(params)                 # one update cone per parameter
    for c in opt:
        assert len({n.split("/")[1] for n in c.owned}) == 1   # exp_avg and exp_avg_sq of one parameter


def test_identical_layers_share_classes_and_the_rule_saves_work():
    g = graph_of("llama.py")
    space = Space(g, Mesh(("a",), (2,)))
    tied = build_cones(g, space, SearchOptions(tie_radius=1))
    untied = build_cones(g, space, SearchOptions(tie_layers=False))
    assert len(tied.cones) == len(untied.cones)
    assert len(tied.classes) < len(untied.classes) == len(untied.cones)
    # tied cones are the same computation: members with the same call signatures
    for members in tied.classes:
        sigs = {tuple(space.info(i).sig for i in tied.cones[c].members) for c in members}
        assert len(sigs) == 1


# -- the integer program against brute force ---------------------------------------------------------
def _toy_problem(capacity=100):
    """Three classes in a chain with compute, one consumer each, and a memory row."""
    comm = lambda: {"blocking": 0.0, "gradient": 0.0, "prefetch": 0.0, "state": 0.0}  # noqa: E731
    compute = [[(3.0, 0, 0), (1.0, 0, 0), (1.5, 0, 0)],
               [(2.0, 0, 0), (0.7, 0, 0), (0.6, 0, 0)],
               [(1.0, 0, 0), (0.5, 0, 0)]]
    terms = [Term(0, [0, 1, 2], [(1, [(0,), (1,), (2,)])], [], [[0, 2, 2], [2, 0, 1], [2, 1, 0]], "blocking", 1),
             Term(1, [0, 1, 1], [(2, [(0,), (1,)])], [], [[0, 1.5], [1.5, 0]], "blocking", 1)]
    mem = [MemRow(0, {0: [50, 30, 30], 1: [40, 25, 60], 2: [30, 20]}, 0)]
    return Problem([3, 3, 2], [1, 1, 1], compute, [[comm() for _ in r] for r in compute], terms, mem, capacity,
                   ["a", "b", "c"], [[(c,) for c in range(n)] for n in (3, 3, 2)], ["node"] * 3, [0, 1, 2], [])


@pytest.mark.parametrize("capacity", [1000, 100, 80])
def test_ilp_matches_brute_force(capacity):
    p = _toy_problem(capacity)
    best = min((objective_of(p, list(c))["T"], c) for c in itertools.product(*(range(n) for n in p.n_cands))
               if memory_over(p, list(c)) <= 0)
    sol = solve_ilp(p, time_limit=5, workers=1)
    assert sol.status == "optimal"
    assert objective_of(p, sol.choice)["T"] == pytest.approx(best[0], rel=1e-6)
    assert memory_over(p, sol.choice) <= 0
    # local search finds a point that fits too (it may be worse)
    choice, (over, _) = local_search(p, [0, 0, 0])
    assert over == 0


def test_ilp_reports_infeasible_memory_and_soft_memory_says_by_how_much():
    p = _toy_problem(50)
    assert solve_ilp(p, time_limit=5, workers=1).status == "infeasible"
    soft = solve_ilp(p, time_limit=5, workers=1, soft_memory=True)
    assert soft.choice and soft.over == memory_over(p, soft.choice) > 0


# -- one mesh, end to end ------------------------------------------------------------------------------
def _solve(graph, mesh, cluster, options):
    b = Builder(graph, mesh, parse_cluster(cluster), options)
    p = b.build()
    sol = solve_ilp(p, time_limit=20, workers=2)
    return b, p, sol


def test_fast_resolution_equals_resolve_and_memory_rows_equal_the_cost_model():
    g = graph_of("gpt.py")
    b = Builder(g, Mesh(("a", "b"), (2, 2)), parse_cluster("cpu:4"), SearchOptions())
    p = b.build()
    choice, _ = local_search(p, [0] * len(p.n_cands))
    plan = b.assemble(choice)
    fast, slow = b.resolved(plan), resolve(g, plan)
    assert fast.value == slow.value and fast.node == slow.node
    # memory rows model the cost model's liveness with its redistributed copies; they may only err on
    # the safe side (a source a copy was made from, or a view of such a copy reads, counts until its last
    # use). For the searched plan by under 15%; random plans only on the safe side: since the cost model
    # lets a view of a copy keep the copy (not its source) alive, which choice-independent rows cannot
    # say, one random plan here is over by 19% (module docstring of search/memrows.py).
    import random
    rng = random.Random(0)
    for k, choice in enumerate([choice] + [[rng.randrange(n) for n in p.n_cands] for _ in range(8)]):
        mem = estimate_memory(g, b.resolved(b.assemble(choice)))
        peak = next(i for i, n in enumerate(g.nodes) if n.name == mem.peak_node)
        modelled = row_bytes(b.memory_row(peak), choice)
        assert mem.peak <= modelled, (k, mem.peak, modelled)
        if k == 0:
            assert modelled <= 1.15 * mem.peak, (mem.peak, modelled)


@pytest.mark.parametrize("rule", ["cones", "tie_layers", "optimizer_cones"])
def test_each_rule_saves_work_and_keeps_the_optimum(rule):
    g = graph_of("mlp.py")
    mesh = Mesh(("a",), (2,))
    _, p_on, on = _solve(g, mesh, "cpu:2", SearchOptions())
    _, p_off, off = _solve(g, mesh, "cpu:2", SearchOptions(**{rule: False}))
    assert on.status == off.status == "optimal"
    work_on, work_off = p_on.size(), p_off.size()
    assert work_on["classes"] < work_off["classes"] and work_on["candidates"] < work_off["candidates"], \
        (work_on, work_off)
    # a rule only restricts the space: off is never worse; on this model it is not better either
    assert off.objective <= on.objective * (1 + 1e-9) + 1e-12
    assert on.objective <= off.objective * 1.01


# -- outer search ----------------------------------------------------------------------------------------
def test_meshes_respect_node_boundaries():
    meshes = {m.sizes for m in candidate_meshes(parse_cluster("2x8xA100-80G"))}
    assert (16,) in meshes and (2, 8) in meshes and (8, 2) in meshes and (1, 16) not in meshes
    assert all(len(s) == 1 or 8 % s[1] == 0 or s[1] % 8 == 0 for s in meshes)
    o1 = {m.sizes for m in candidate_meshes(parse_cluster("2x8xA100-80G"), SearchOptions(level=Level.O1))}
    assert o1 == meshes


def test_search_result_fits_and_agrees_with_the_cost_model():
    g = graph_of("gpt.py")
    events = []
    t0 = time.perf_counter()
    r = search(g, parse_cluster("cpu:4"), SearchOptions(level=Level.O1, time_limit=10),
               progress=lambda event, info: events.append((event, info)))
    assert time.perf_counter() - t0 < 30
    assert r.estimate.fits and r.plan.fingerprint == g.fingerprint()
    from rhino.cost.estimate import estimate
    assert estimate(g, parse_cluster("cpu:4"), r.plan).step_seconds == pytest.approx(r.estimate.step_seconds)
    assert r.best.step_seconds == min(c.step_seconds for c in r.candidates if c.fits)
    # O1 on a small graph: every mesh priced first, then the descent goes to the fastest priced first
    names = [e for e, _ in events]
    assert "refine" in names and "solve" not in names[names.index("refine"):]
    first = {i["mesh"]: i["step_seconds"] for e, i in events[:names.index("refine")] if e == "scored" and i["fits"]}
    refined = [i["mesh"] for e, i in events if e == "refine"]
    assert refined[0] == min(first, key=first.get)
    firsts = list(dict.fromkeys(refined))       # each mesh's first round: in phase-1 price order
    assert [first[m] for m in firsts] == sorted(first[m] for m in firsts)


def test_o1_refines_the_fastest_priced_candidates_first_while_its_budget_lasts():
    from types import SimpleNamespace
    from rhino.search.outer import Candidate, _refine_best_first
    order = []

    def cand(name, step, fits=True, refine=True, moves=False, then=None):
        c = Candidate(Mesh(("all",), (1,)), "none", None, SimpleNamespace(step_seconds=step, fits=fits), 0.0)

        def refine_once(until):
            order.append(name)
            if then is not None:
                c.estimate = SimpleNamespace(step_seconds=then, fits=True)
            return moves and order.count(name) == 1
        c.refine = refine_once if refine else None
        return c

    cands = [cand("c", 3.0, moves=True, then=0.2), cand("nofit", 0.5, fits=False), cand("a", 1.0, moves=True),
             cand("b", 2.0), cand("unrefinable", 0.1, refine=False)]
    _refine_best_first(cands, SearchOptions(level=Level.O1), time.perf_counter())
    # a round at a time for the fastest priced now; a second only after a round that moved
    assert order == ["a", "a", "b", "c", "c"]
    order.clear()
    _refine_best_first(cands, SearchOptions(level=Level.O1, time_limit=0.1), time.perf_counter())
    assert order == []           # under the minimum left: no refinement started


def _shrunk(cluster_text, memory_bytes):
    import dataclasses
    c = parse_cluster(cluster_text)
    return dataclasses.replace(c, device=dataclasses.replace(c.device, memory_bytes=memory_bytes))


def test_nothing_fits_names_the_memory_split_and_how_many_devices_would():
    g = graph_of("gpt.py")
    with pytest.raises(NoPlanFits) as err:
        search(g, _shrunk("cpu:2", 2e5), SearchOptions(level=Level.O1, time_limit=5, recompute="never"))
    msg = str(err.value)
    assert msg.startswith("no plan fits 200.00 KB per device on cpu:2") and "peak" in msg and "optimizer" in msg
    assert "devices" in msg and err.value.best is not None


def test_nothing_fits_suggests_a_smaller_batch_when_activations_dominate():
    import sys
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt
    from rhino.capture import Workload
    from rhino.cost.estimate import estimate
    from rhino.search.outer import Candidate, no_fit_message
    model, opt, loss_fn, batch = gpt.workload(batch=64, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = capture(Workload(model, opt, loss_fn, batch, "gpt.py", "batch64")).graph
    full = estimate(g, parse_cluster("cpu:1"))
    act = full.memory_bytes["activations"]
    assert act > full.memory_bytes["peak"] / 2
    cluster = _shrunk("cpu:1", full.memory_bytes["peak"] - act / 2)
    est = estimate(g, cluster)
    msg = no_fit_message(g, cluster, [Candidate(Mesh(("dp",), (1,)), "none", None, est, 0.0)])
    assert "global batch of at most about" in msg and "(now 64)" in msg
    suggested = int(msg.split("at most about ")[1].split()[0])
    assert 16 <= suggested < 64


def test_options_are_checked():
    for bad in [dict(time_limit=0), dict(recompute="sometimes"), dict(workers=0), dict(memory_fraction=2)]:
        with pytest.raises(ValueError):
            SearchOptions(**bad)
    assert SearchOptions(level="O1").level is Level.O1
