"""ir/stages: stage derivation rules, holders, crossings, the default cut, and the plan's pipeline fields."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from rhino.capture import capture, default_dtype, load_workload
from rhino.ir.analysis import NodeRole, analyze
from rhino.ir.registry import call_of, flops_of
from rhino.ir.stages import (DEFAULT_SLACK, Phase, StageError, assign_stages, contiguous_cut)
from rhino.sharding.plan import PlanError, ShardingPlan
from rhino.sharding.presets import parse_strategy, preset_plan


def _cap(name: str):
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        return capture(load_workload(f"examples/{name}.py", dtype=torch.float64))


@pytest.fixture(scope="module")
def mlp():
    return _cap("mlp")


@pytest.fixture(scope="module")
def gpt():
    return _cap("gpt")


def _check_rules(graph, sa) -> None:
    """Rules 1 and 2 of ir/stages and the crossings, recomputed from the graph edges."""
    a = analyze(graph)
    nodes = graph.nodes
    assert sa.node_stage[nodes[a.boundary].name] == sa.stages - 1
    want = set()
    for i, node in enumerate(nodes):
        if a.roles[i] is NodeRole.OPTIMIZER:
            assert node.name not in sa.node_stage and node.name in sa.update_stages
            continue
        s = sa.node_stage[node.name]
        for r in node.input_refs():
            p = a.producer.get(r.id)
            if p is None:
                continue
            ps = sa.node_stage[nodes[p].name]
            if a.is_forward(i):
                assert ps <= s, (nodes[p].name, node.name)
            elif not a.is_forward(p):
                assert ps >= s, (nodes[p].name, node.name)
            if ps != s:
                want.add((r.id, ps, s, Phase.FORWARD if a.is_forward(p) else Phase.BACKWARD))
    got = {(c.value, c.src, c.dst, c.phase) for c in sa.crossings if c.phase is not Phase.UPDATE}
    assert got == want
    for c in sa.crossings:
        if c.phase is Phase.BACKWARD:
            assert c.src > c.dst


@pytest.mark.parametrize("stages", [2, 3])
def test_default_cut_gives_every_node_a_stage_that_obeys_the_rules(mlp, gpt, stages):
    for cap in (mlp, gpt):
        sa = assign_stages(cap.graph, contiguous_cut(cap.graph, stages), stages)
        _check_rules(cap.graph, sa)
        assert set(sa.node_stage.values()) == set(range(stages))


def test_gradients_and_updates_stay_with_their_parameters_on_an_untied_model(mlp):
    sa = assign_stages(mlp.graph, contiguous_cut(mlp.graph, 2), 2)
    assert all(len(h) == 1 for h in sa.holders.values()), sa.holders
    assert not [c for c in sa.crossings if c.phase is Phase.UPDATE]
    assert sa.held_by(0) and sa.held_by(1) and not set(sa.held_by(0)) & set(sa.held_by(1))


def test_a_tied_weight_is_held_by_both_stages_and_its_summed_gradient_crosses_once(gpt):
    g = gpt.graph
    sa = assign_stages(g, contiguous_cut(g, 2), 2)
    assert sa.holders["tok.weight"] == {0, 1}
    new_value = next(o.value for o in g.outputs if o.name == "tok.weight" and o.role.value == "param")
    producer = analyze(g).producer[new_value]
    assert sa.update_stages[g.nodes[producer].name] == {0, 1}
    update = [c for c in sa.crossings if c.phase is Phase.UPDATE]
    assert [(c.src, c.dst, c.nbytes) for c in update] == [(0, 1, g.types[update[0].value].nbytes)]
    assert g.types[update[0].value].shape == g.types[next(i.value for i in g.inputs if i.name == "tok.weight")].shape


def test_a_weight_gradient_runs_with_its_matmul_when_the_input_came_from_the_stage_before(mlp):
    g = mlp.graph
    a = analyze(g)
    cut = contiguous_cut(g, 2)
    sa = assign_stages(g, cut, 2)
    first_of_stage1 = min(i for i in range(a.boundary + 1) if cut[g.nodes[i].name] == 1)
    # move the cut one matmul later so that a stage-1 matmul reads an activation made on stage 0
    mm = next(i for i in range(first_of_stage1, a.boundary) if g.nodes[i].op == "aten.addmm.default")
    weight = g.nodes[mm].args[2]
    for i, node in enumerate(g.nodes):
        if not a.is_forward(i) and weight in node.input_refs():
            assert sa.node_stage[node.name] == 1
    params = {i.value for i in g.inputs if i.role.value == "param"}
    for name, h in sa.holders.items():
        assert len(h) == 1, name
    assert params


def test_a_backward_node_reading_a_weight_runs_where_the_weight_is_read():
    """A ``convolution_backward`` whose input was sent on to the next stage (for the gate conv) stays with
    its forward convolution's weight: every parameter has one holder, and the rules hold."""
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        cap = capture(load_workload("tests/workloads/heldout29.py:gated_conv", dtype=torch.float64))
    g = cap.graph
    forward = g.nodes[:analyze(g).boundary + 1]
    gate = [i for i, n in enumerate(forward) if n.op == "aten.convolution.default"][2]   # l0, filt, gate, out
    sa = assign_stages(g, {n.name: int(i >= gate) for i, n in enumerate(forward)}, 2)
    _check_rules(g, sa)
    assert all(len(h) == 1 for h in sa.holders.values()), sa.holders
    assert sa.held_by(0) and sa.held_by(1)


@pytest.mark.parametrize("edit, match", [("swap", "later stage"), ("loss", "last stage"), ("missing", "no pipeline stage"),
                                         ("empty", "no forward node")])
def test_bad_stage_assignments_are_one_clear_error(mlp, edit, match):
    g = mlp.graph
    a = analyze(g)
    cut = contiguous_cut(g, 2)
    names = [g.nodes[i].name for i in range(a.boundary + 1)]
    if edit == "swap":
        cut[names[0]] = 1
    elif edit == "loss":
        cut = {n: 0 for n in names}
        with pytest.raises(StageError, match=match):
            assign_stages(g, cut, 2)
        return
    elif edit == "missing":
        del cut[names[3]]
    elif edit == "empty":
        cut = {n: (0 if n != names[-1] else 2) for n in names}
        with pytest.raises(StageError, match=match):
            assign_stages(g, cut, 3)
        return
    with pytest.raises(StageError, match=match):
        assign_stages(g, cut, 2)


def test_default_cut_is_flop_balanced_and_the_slack_option_never_adds_cut_bytes(gpt):
    g = gpt.graph
    a = analyze(g)
    fwd = range(a.boundary + 1)
    flops = {g.nodes[i].name: flops_of(call_of(g, g.nodes[i])) for i in fwd}
    total = sum(flops.values())
    prefix = [sum(list(flops.values())[:c]) for c in range(len(flops) + 1)]
    for stages in (2, 3):
        cut = contiguous_cut(g, stages)
        for s in range(stages - 1):
            before = sum(f for n, f in flops.items() if cut[n] <= s)
            target = total * (s + 1) / stages
            closest = min(abs(p - target) for p in prefix)   # one large node can make the window empty
            assert abs(before - target) <= max(DEFAULT_SLACK * total / stages, closest)
        tight = contiguous_cut(g, stages, slack=0.0)

        def fwd_bytes(c):
            return sum(x.nbytes for x in assign_stages(g, c, stages).crossings if x.phase is Phase.FORWARD
                       and x.dst > x.src)
        assert fwd_bytes(cut) <= fwd_bytes(tight)


def test_preset_pp_writes_the_default_cut_into_a_plan_file_that_round_trips(mlp):
    plan = preset_plan(mlp.graph, parse_strategy("pp=2,dp=2,microbatches=4,schedule=gpipe"))
    assert (plan.stages, plan.schedule, plan.mesh.world, plan.world) == (2, "gpipe", 2, 4)
    assert plan.stage_of == contiguous_cut(mlp.graph, 2)
    d = json.loads(plan.to_json())
    assert d["pipeline"] == {"stages": 2, "microbatches": 4, "schedule": "gpipe", "stage_of": plan.stage_of}
    back = ShardingPlan.from_json(plan.to_json())
    assert (back.stages, back.schedule, back.stage_of, back.microbatches) == (2, "gpipe", plan.stage_of, 4)
    one = json.loads(preset_plan(mlp.graph, parse_strategy("dp=2")).to_json())
    assert one["pipeline"] == {"stages": 1, "microbatches": 1, "schedule": "1f1b"}


@pytest.mark.parametrize("pipeline, match", [({"stages": 0}, "stages"), ({"stages": 2, "schedule": "zb"}, "schedule"),
                                             ({"stages": 2, "stage_of": {"n1_t": 2}}, "stage"),
                                             ({"stages": 2, "stage_of": [1]}, "stage_of")])
def test_bad_pipeline_fields_in_a_plan_file_are_one_clear_error(mlp, pipeline, match):
    d = json.loads(preset_plan(mlp.graph, parse_strategy("dp=2")).to_json())
    d["pipeline"] = pipeline
    with pytest.raises(PlanError, match=match):
        ShardingPlan.from_json(json.dumps(d))


def test_strategy_schedule_key_is_checked():
    assert parse_strategy("pp=2,microbatches=4,schedule=gpipe").schedule == "gpipe"
    assert str(parse_strategy("pp=2,microbatches=4,schedule=gpipe")) == "dp=1,pp=2,microbatches=4,schedule=gpipe"
    with pytest.raises(ValueError, match="schedule"):
        parse_strategy("pp=2,schedule=zigzag")
