"""Tree-based task division of the operator order (``memory/order_tree.py``, ``OrderOptions(division="tree")``)."""
from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT
from test_memory_order import all_orders, random_order, random_problem, training_problem
from rhino.memory.order import Division, OrderOptions, order_ops, program_order
from rhino.memory.order_graph import IndexedProblem
from rhino.memory.order_tree import TaskKind, TreeSettings, build_tree, improve_tree, merge_parts, merge_seam
from rhino.memory.problem import MemOp, MemProblem, MemTensor, OpRole, TensorKind
from rhino.memory.simulate import check_order, replay

K = TensorKind
FAST = settings(derandomize=True, max_examples=25, deadline=None, database=None)


def _interleavings(a: list[int], b: list[int]):
    """Every merge of ``a`` and ``b`` keeping each one's own order."""
    k = len(a) + len(b)
    for picks in itertools.combinations(range(k), len(a)):
        ia, ib, out = iter(a), iter(b), []
        chosen = set(picks)
        for t in range(k):
            out.append(next(ia) if t in chosen else next(ib))
        yield out


# -- the merge's dynamic program ----------------------------------------------------------------------
@FAST
@given(st.integers(0, 10_000), st.integers(4, 14), st.integers(0, 10_000))
def test_merge_is_the_best_valid_interleaving(seed, n, split):
    p = random_problem(seed, n, p_edge=0.3)
    g = IndexedProblem(p)
    order = g.from_ids(random_order(p, seed))
    live = g.profile(order)
    a = split % 3
    b = n - (split // 3) % 3
    if b - a < 2:
        return
    c = a + 1 + split % (b - a - 1)
    res = merge_seam(g, order, live, a, c, b)
    assert res is not None
    ops, wlive = res
    new = order[:a] + ops + order[b:]
    check_order(p, g.to_ids(new))
    assert g.profile(new) == live[:a] + wlive + live[b:]  # nothing outside the window changes
    valid = [m for m in _interleavings(order[a:c], order[c:b]) if g.is_topological(order[:a] + m + order[b:])]
    best = min(max(g.profile(order[:a] + m + order[b:])[a:b]) for m in valid)
    assert max(wlive) == best <= max(live[a:b])
    # any split into two parts (ROAM's sub-graphs need not be runs of positions), e.g. every other op
    in_b = [(t * 7 + split) % 3 == 0 for t in range(a, b)]
    ops, wlive = merge_parts(g, order, live, a, b, in_b)
    new = order[:a] + ops + order[b:]
    check_order(p, g.to_ids(new))
    assert g.profile(new) == live[:a] + wlive + live[b:]
    part_a = [order[t] for t in range(a, b) if not in_b[t - a]]
    part_b = [order[t] for t in range(a, b) if in_b[t - a]]
    valid = [m for m in _interleavings(part_a, part_b) if g.is_topological(order[:a] + m + order[b:])]
    assert max(wlive) == min(max(g.profile(order[:a] + m + order[b:])[a:b]) for m in valid) <= max(live[a:b])


def _edge_problem(with_edge: bool) -> MemProblem:
    """``u`` makes ``U`` (read after the window by ``z``); ``v`` is the last reader of the input ``H``.
    Running ``v`` first frees ``H`` before ``U`` exists (peak 100 instead of 200), which only the
    ordering edge ``u -> v`` forbids."""
    t = {0: MemTensor(0, 100, K.INPUT, "H"), 1: MemTensor(1, 100, K.INTERMEDIATE, "U"),
         2: MemTensor(2, 0, K.INTERMEDIATE, "V"), 3: MemTensor(3, 1, K.OUTPUT, "Z")}
    ops = [MemOp(0, "u", (), (1,), OpRole.FORWARD),
           MemOp(1, "v", (0,), (2,), OpRole.FORWARD, (0,) if with_edge else ()),
           MemOp(2, "z", (1, 2), (3,), OpRole.FORWARD)]
    p = MemProblem(ops, t, "edge")
    p.validate()
    return p


@pytest.mark.parametrize("with_edge", [True, False])
def test_merge_keeps_the_order_constraints_between_children(with_edge):
    p = _edge_problem(with_edge)
    g = IndexedProblem(p)
    order = [0, 1, 2]
    res = merge_seam(g, order, g.profile(order), 0, 1, 2)
    assert res is not None
    ops, wlive = res
    check_order(p, g.to_ids(ops + [2]))
    # with the edge the only valid merge keeps u first (peak 200); without it v goes first (peak 100)
    assert (ops, max(wlive)) == (([0, 1], 200) if with_edge else ([1, 0], 100))
    r = order_ops(p, "O2", OrderOptions(division="tree"), time_limit=5)
    check_order(p, r.order)
    assert r.peak == (200 if with_edge else 101)  # step z holds U and Z


# -- the task tree --------------------------------------------------------------------------------------
def _leaves(t):
    return [t] if t.kind is TaskKind.LEAF else [x for c in t.children for x in _leaves(c)]


def test_tree_cuts_at_key_points_and_the_loss():
    p = training_problem(2, layers=10)
    g = IndexedProblem(p)
    order = list(range(g.n))
    s = TreeSettings(leaf_size=6, merge_span=4)
    root = build_tree(g, order, s)
    leaves = _leaves(root)
    assert [(x.a, x.b) for x in leaves] == list(zip([0] + [x.b for x in leaves[:-1]], [x.b for x in leaves]))
    assert leaves[-1].b == g.n and all(x.b - x.a <= 6 for x in leaves)
    cuts = {x.b for x in leaves}
    assert g.loss + 1 in cuts  # the forward side and the backward side of the loss are different tasks
    assert all(k + 1 in cuts for k in g.chain_points() if k + 1 < g.n)


# -- order_ops(division="tree") ------------------------------------------------------------------------
@settings(derandomize=True, max_examples=30, deadline=None, database=None)
@given(st.integers(0, 10_000), st.integers(2, 7))
def test_tree_is_exact_on_tiny_problems(seed, n):
    p = random_problem(seed, n, p_edge=0.25)
    best = min(replay(p, o).peak for o in all_orders(p))
    r = order_ops(p, "O2", OrderOptions(division=Division.TREE), time_limit=20)
    check_order(p, r.order)
    assert r.peak == replay(p, r.order).peak == best


@FAST
@given(st.integers(0, 10_000), st.integers(10, 60))
def test_tree_valid_and_never_worse_than_program_order(seed, n):
    p = random_problem(seed, n, p_edge=0.15)
    g = IndexedProblem(p)
    opts = OrderOptions(division="tree", segment_size=6, merge_span=5, tree_peak_only=seed % 2 == 0,
                        tree_branch_merge=seed % 3 != 0, window_time_limit=0.5)
    r = order_ops(p, "O2", opts, time_limit=3)
    check_order(p, r.order)
    assert r.peak == replay(p, r.order).peak <= replay(p, program_order(p)).peak
    assert r.peak <= min(r.candidates.values()) and r.peak >= g.lower_bound()
    # the search on its own, from a random order: valid and never above where it started
    start = g.from_ids(random_order(p, seed))
    out, _ = improve_tree(g, start, 0, time.perf_counter() + 3, TreeSettings(leaf_size=5, merge_span=4))
    check_order(p, g.to_ids(out))
    assert g.peak(out) <= g.peak(start)


def test_tree_honours_the_time_limit_and_names_the_division():
    p = training_problem(5, layers=16)
    r = order_ops(p, "O2", OrderOptions(division="tree", window_time_limit=0.05), time_limit=0.3)
    check_order(p, r.order)
    assert r.seconds < 0.3 + 1.0
    assert r.peak <= replay(p, program_order(p)).peak
    with pytest.raises(ValueError, match="division"):
        OrderOptions(division="ring")


def test_tree_on_a_captured_example():
    from rhino.capture import capture, load_workload
    from rhino.memory.from_graph import problem_from_graph

    p, _ = problem_from_graph(capture(load_workload(str(ROOT / "examples" / "mlp.py"))).graph)
    opts = OrderOptions(division="tree", segment_size=20, merge_span=12, window_time_limit=0.5)
    tree = order_ops(p, "O2", opts, time_limit=2)
    check_order(p, tree.order)
    prog = replay(p, program_order(p)).peak
    assert tree.peak == replay(p, tree.order).peak <= prog
    assert tree.lower_bound <= tree.peak and tree.seconds < 2 + 1.0


def test_plan_memory_takes_the_tree_division():
    from rhino.memory.plan import plan_memory

    p = training_problem(4, layers=8)
    plan = plan_memory(p, "O2", time_limit=4, options=OrderOptions(division="tree", window_time_limit=0.5))
    check_order(p, plan.order)
    assert plan.valid and plan.lower_bound == replay(p, plan.order).peak <= replay(p, program_order(p)).peak
