"""``rhino.memory_report`` (what ``rhino memory`` prints, from Python) and its independent checks
(``memory.step_report``: ``align_plan``, ``check_plan``)."""
from __future__ import annotations

import copy

import pytest

import rhino
from conftest import ROOT
from rhino.memory.from_graph import problem_from_graph
from rhino.memory.step_report import align_plan, check_plan, plan_step_memory

MLP = str(ROOT / "examples" / "mlp.py")


@pytest.fixture(scope="module")
def cap():
    return rhino.capture_step(MLP)


def test_memory_report_plans_checks_and_executes(cap):
    lines = []
    rep = rhino.memory_report(cap, level="O1", execute=True, name="mlp", status=lines.append)
    d = rep.to_dict()
    assert rep.ok and d["ok"] and d["valid"] and d["workload"] == "mlp" and d["level"] == "O1"
    assert d["lower_bound_bytes"] <= d["rhino_peak_bytes"] <= d["pytorch_peak_bytes"]
    assert d["execute"]["equal"] and d["execute"]["arena_bytes"] == d["rhino_peak_bytes"]
    assert [line.split(" ")[0] for line in lines] == ["planning", "executing"]
    assert all(off % rep.mapping.align == 0 for off in rep.plan.offsets.values())


def test_check_plan_names_an_overlap_and_a_broken_order(cap):
    problem, mapping = problem_from_graph(cap.graph)
    rep = plan_step_memory(problem, mapping, level="O1")
    assert check_plan(problem, rep.plan) is None
    bad = copy.deepcopy(rep.plan)
    bad.offsets = {t: 0 for t in bad.offsets}          # every tensor at offset 0: live ones overlap
    assert check_plan(problem, bad).startswith("layout: ")
    bad = copy.deepcopy(rep.plan)
    bad.order = list(reversed(bad.order))
    assert check_plan(problem, bad).startswith("order: ")


def test_align_plan_realigns_without_raising_the_arena(cap):
    problem, mapping = problem_from_graph(cap.graph)
    rep = plan_step_memory(problem, mapping, level="O1")
    plan = copy.deepcopy(rep.plan)
    assert not align_plan(problem, plan, mapping.align)          # already aligned: untouched
    moved = next(t for t, x in problem.tensors.items() if x.size)
    plan.offsets[moved] += 1
    assert align_plan(problem, plan, mapping.align)
    assert all(plan.offsets[t] % mapping.align == 0 for t, x in problem.tensors.items() if x.size)
    assert plan.height == rep.plan.height and check_plan(problem, plan) is None
