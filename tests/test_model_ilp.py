"""The MODeL baseline (``memory.model_ilp``): its joint order-and-address program finds the best plan of
small problems (checked by brute force: every order, each laid out exactly), honours its time limit and
its size guard, and is reachable as ``plan_memory(..., method="model")``."""
from __future__ import annotations

import dataclasses
import random

import pytest

from rhino.memory.layout import solve_layout, validate_layout
from rhino.memory.model_ilp import ModelOptions, solve_model
from rhino.memory.order_graph import IndexedProblem
from rhino.memory.plan import plan_memory
from rhino.memory.problem import MemOp, MemProblem, MemTensor, TensorKind, buffers
from rhino.memory.simulate import check_order
from test_memory_order import all_orders, random_problem, training_problem

K = TensorKind


def _problem(seed: int) -> MemProblem:
    rng = random.Random(seed)
    p = random_problem(seed, rng.randint(2, 6), n_inputs=rng.randint(0, 3), p_edge=0.3)
    for tid, t in list(p.tensors.items()):
        if t.kind is K.INPUT and rng.random() < 0.3:
            p.tensors[tid] = dataclasses.replace(t, also_output=True)
    p.validate()
    return p


def _best_plan(p: MemProblem) -> int:
    """The lowest arena over every order, each with its exact layout."""
    return min(solve_layout(buffers(p, o), time_limit=10).height for o in all_orders(p))


def _valid(p: MemProblem, order, offsets, height) -> None:
    check_order(p, order)
    bufs = buffers(p, order)
    assert not validate_layout(bufs, offsets, capacity=height)


@pytest.mark.parametrize("seed", range(0, 40, 2))  # 20 of the 120 seeds checked by hand (all equal)
def test_model_finds_the_best_joint_plan(seed):
    p = _problem(seed)
    best = _best_plan(p)
    r = solve_model(p, time_limit=20)
    assert r.status == "optimal" and r.valid and r.height == best
    _valid(p, r.order, r.offsets, r.height)
    assert IndexedProblem(p).lower_bound() <= r.bound == best


def test_model_beats_the_order_bound_when_layout_matters():
    # two same-size tensors alternate with a big one: orders reach the live-bytes bound, but the joint
    # optimum is where the layout also fits; brute force decides
    t = {0: MemTensor(0, 64, K.INPUT), 1: MemTensor(1, 128, K.INTERMEDIATE), 2: MemTensor(2, 64, K.INTERMEDIATE),
         3: MemTensor(3, 128, K.INTERMEDIATE), 4: MemTensor(4, 64, K.OUTPUT)}
    ops = [MemOp(0, "a", (0,), (1,)), MemOp(1, "b", (0,), (2,)), MemOp(2, "c", (1, 2), (3,)),
           MemOp(3, "d", (3,), (4,))]
    p = MemProblem(ops, t)
    r = solve_model(p, time_limit=10)
    assert r.status == "optimal" and r.valid and r.height == _best_plan(p)


def test_time_limit_is_honoured():
    p = training_problem(0, layers=6)  # 67 ops: not proven in a few seconds
    for limit in (0.5, 3.0):
        r = solve_model(p, time_limit=limit)
        assert r.seconds <= limit + 1.0
        assert r.status in ("no solution", "feasible", "optimal")
        if r.order is not None:
            assert r.valid
            _valid(p, r.order, r.offsets, r.height)


def test_hint_gives_a_plan():
    p = training_problem(0, layers=4)  # 45 ops; without the hint CP-SAT found no plan in 20 s (by hand)
    r = solve_model(p, time_limit=20.0)
    assert r.status in ("feasible", "optimal") and r.valid
    _valid(p, r.order, r.offsets, r.height)
    assert IndexedProblem(p).lower_bound() <= r.bound <= r.height


def test_size_guard_and_a_deadline_while_building():
    p = training_problem(0, layers=6)
    r = solve_model(p, time_limit=10, options=ModelOptions(max_size=1000))
    assert r.status == "too large" and r.order is None and r.size > 1000 and r.seconds < 2
    r = solve_model(p, time_limit=0.0)
    assert r.status == "no solution" and r.order is None and r.seconds < 1.0


def test_plan_memory_method_model():
    p = training_problem(0, layers=2)
    plan = plan_memory(p, time_limit=20, method="model")
    assert plan.valid and plan.source == "model" and plan.order_source == "model"
    assert plan.order_lower_bound == IndexedProblem(p).lower_bound() <= plan.lower_bound <= plan.height
    assert plan.height == plan.stats["model_bound"]  # solved to optimality on 22 ops
    ours = plan_memory(p, time_limit=20)
    assert ours.height >= plan.height  # MODeL's joint optimum is a bound on every plan
    with pytest.raises(ValueError, match="MODeL found no plan"):
        plan_memory(training_problem(0, layers=6), time_limit=0.001, method="model")
    with pytest.raises(ValueError, match="unknown planning method"):
        plan_memory(p, method="olla")


def test_memory_report_method_model_is_one_device_only():
    import rhino
    with pytest.raises(ValueError, match="plans one device"):
        rhino.memory_report(None, method="model", strategy="dp=2")
