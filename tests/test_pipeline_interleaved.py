"""Interleaved 1F1B (Megatron-LM, arXiv 2104.04473 section 2.2.2): the order (ir.stages.schedule_order), the
cost model's event simulation against the paper's bubble (pp - 1) (t_f + t_b) / v, the strategy key and plan
file, and exactness of pipelined steps in float64 (runtime.pipeline_sim, every rank compared) on mlp (a value
handed between two chunks of one rank), gpt (tied embedding/head) and unet (skip connections)."""
from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from rhino.capture import capture, load_workload
from rhino.cost.cluster import parse_cluster
from rhino.cost.estimate import estimate
from rhino.cost.pipeline import Schedule, in_flight, simulate
from rhino.cost.step import StepOptions
from rhino.ir.stages import StageError, schedule_order
from rhino.runtime.pipeline import stage_order
from rhino.sharding.plan import PlanError, ShardingPlan
from rhino.sharding.presets import parse_strategy, preset_plan
from test_pipeline import _cap, _check


@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (2, 8, 3), (4, 8, 2), (3, 6, 2)])
def test_order_runs_every_chunk_micro_batch_once_forward_before_backward(pp, m, v):
    for d in range(pp):
        order = schedule_order("interleaved", d, pp, m, v)
        mine = [c * pp + d for c in range(v)]
        assert sorted(order) == sorted((k, s, j) for k in "FB" for s in mine for j in range(m))
        pos = {x: i for i, x in enumerate(order)}
        for s in mine:
            for j in range(m):
                assert pos[("F", s, j)] < pos[("B", s, j)]
                if s + pp in mine:    # a micro-batch's forward climbs the chunks, its backward descends them
                    assert pos[("F", s, j)] < pos[("F", s + pp, j)] and pos[("B", s + pp, j)] < pos[("B", s, j)]
        warm = min((pp - 1 - d) * 2 + (v - 1) * pp, m * v)    # Megatron's warm-up forwards, then F, B, F, ...
        assert next(i for i, x in enumerate(order) if x[0] == "B") == warm + (warm < m * v)


def test_one_chunk_is_1f1b_and_micro_batches_must_fill_the_pipeline():
    for d in range(3):
        assert [(k, j) for k, _, j in schedule_order("interleaved", d, 3, 6, 1)] == stage_order("1f1b", d, 3, 6)
    with pytest.raises(StageError, match="multiple of pp=2"):
        schedule_order("interleaved", 0, 2, 3, 2)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (3, 12)])
def test_simulated_bubble_is_megatrons_divided_by_chunks(pp, m):
    tf, tb = 1.0, 2.0
    for v in (1, 2, 3):
        V = pp * v
        end, busy = simulate([tf / v] * V, [tb / v] * V, [0.0] * (V - 1), [0.0] * (V - 1), m, Schedule.INTERLEAVED, v)
        assert max(end) == pytest.approx(m * (tf + tb) + (pp - 1) * (tf + tb) / v, abs=1e-12)
        assert busy == pytest.approx([m * (tf + tb)] * pp, abs=1e-12)


def test_in_flight_activations_grow_with_chunks_but_stay_below_gpipe():
    for d in range(4):
        one = in_flight(Schedule.ONE_F_ONE_B, 4, 8, d)
        two = in_flight(Schedule.INTERLEAVED, 4, 8, d, 2)
        assert one <= two <= 8
    assert in_flight(Schedule.INTERLEAVED, 4, 8, 0, 2) == (3 * 2 + 4 + 1) / 2    # Megatron: pp (1 + (pp-1)/(pp v))


def test_strategy_key_plan_file_and_errors():
    mlp = _cap("mlp")
    plan = preset_plan(mlp.graph, parse_strategy("pp=2,microbatches=4,schedule=interleaved,chunks=2"))
    assert (plan.stages, plan.chunks, plan.world) == (2, 2, 2) and set(plan.stage_of.values()) == {0, 1, 2, 3}
    back = ShardingPlan.from_json(plan.to_json())
    assert (back.chunks, back.schedule, back.stage_of) == (2, "interleaved", plan.stage_of)
    assert str(parse_strategy("pp=2,microbatches=4,schedule=interleaved,chunks=2")).endswith("chunks=2")
    with pytest.raises(ValueError, match="schedule=interleaved"):
        parse_strategy("pp=2,microbatches=4,chunks=2")
    with pytest.raises(PlanError, match="needs schedule=interleaved"):
        ShardingPlan.from_json(plan.to_json().replace('"interleaved"', '"1f1b"'))


def test_estimate_prices_a_smaller_bubble_than_1f1b_with_more_transfers():
    # 8 equal layers on the meta device (balanced chunks; compute well above the transfers' latency)
    mlp = capture(load_workload(str(ROOT / "examples" / "mlp.py:workload"), call=lambda f: f(
        inputs=1024, hidden=1024, layers=8, classes=16, batch=512, device="meta")))
    cluster = parse_cluster("2xA100-80G")
    est = {}
    for s in ("pp=2,microbatches=4", "pp=2,microbatches=4,schedule=interleaved,chunks=2"):
        est[s] = estimate(mlp.graph, cluster, preset_plan(mlp.graph, parse_strategy(s)))
    one, inter = est.values()
    assert inter.schedule == "interleaved" and len(inter.stages) == 2
    assert inter.bubble_fraction < one.bubble_fraction and inter.step_seconds < one.step_seconds
    assert inter.comm_total_seconds > one.comm_total_seconds      # 3 boundaries instead of 1


@pytest.mark.parametrize("name, strategy", [("mlp", "pp=2,microbatches=4,schedule=interleaved,chunks=2"),
                                            ("mlp", "pp=2,dp=2,microbatches=2,schedule=interleaved,chunks=2"),
                                            ("gpt", "pp=2,microbatches=4,schedule=interleaved,chunks=2"),
                                            ("unet", "pp=2,microbatches=2,schedule=interleaved,chunks=2")])
def test_interleaved_pipelines_match_single_device_training_on_every_rank(name, strategy):
    cap = _cap(name)
    cmp, res, plan = _check(cap, strategy)
    assert cmp.ok, cmp.first_mismatch
    assert cmp.max_abs_diff <= 1e-9 and torch.get_default_dtype() is torch.float32
    st = res["steps"][0]
    states = sum(len(st.spec.device_held(d)) for d in range(plan.stages))
    assert cmp.compared == plan.mesh.world * (2 * plan.stages + states)   # every rank: 2 losses + its held state
    if name == "mlp":     # a backward value between the two chunks of rank 0 goes through the local hand-over
        assert any(c.src % 2 == c.dst % 2 for c in st.spec.assignment.crossings)
    if name == "gpt":
        assert st.spec.assignment.holders["tok.weight"] == {0, 3}


def test_a_measured_point_to_point_fit_prices_the_stage_boundaries():
    from rhino.cost.machine_profile import MachineProfile
    mlp = _cap("mlp")
    plan = preset_plan(mlp.graph, parse_strategy("pp=2,microbatches=4"))
    base = MachineProfile("cpu (1 threads)", 1, 1e10, 1e5, 5e9, 3e-6, 0.5, 0.4, 2e9, 2e-5, 2)
    steps = []
    for lat in (1e-5, 1e-3):
        prof = MachineProfile(**{**base.__dict__, "p2p_bandwidth": 1e9, "p2p_latency_s": lat})
        cluster, cost = prof.apply(parse_cluster("cpu:2"))
        assert cost.p2p_latency_s == lat
        steps.append(estimate(mlp.graph, cluster, plan, options=StepOptions(profile=cost)).step_seconds)
    # at least one forward and one backward transfer are on the critical path (fill and drain), at most one
    # round trip per micro-batch (tiny stages: every backward waits for its round trip)
    assert 2 * (1e-3 - 1e-5) - 1e-12 <= steps[1] - steps[0] <= 2 * 4 * (1e-3 - 1e-5) + 1e-12


def test_message_cpu_time_occupies_the_device_but_is_not_busy():
    from rhino.cost.machine_profile import MachineProfile
    mlp = _cap("mlp")
    plan = preset_plan(mlp.graph, parse_strategy("pp=2,microbatches=4"))
    base = MachineProfile("cpu (1 threads)", 1, 1e10, 1e5, 5e9, 3e-6, 0.5, 0.4, 2e9, 2e-5, 2, None, 1e9, 1e-5)
    est = []
    for msg in (None, 1e-3):
        cluster, cost = MachineProfile(**{**base.__dict__, "p2p_message_s": msg}).apply(parse_cluster("cpu:2"))
        est.append(estimate(mlp.graph, cluster, plan, options=StepOptions(profile=cost)))
    (a, b), stages = est, [len(e.stages) for e in est]
    assert [s["forward_seconds"] for s in a.stages] == [s["forward_seconds"] for s in b.stages]
    # every micro-batch's forward and backward sends or receives at least one message on each stage
    assert b.step_seconds >= a.step_seconds + 2 * 4 * 1e-3 - 1e-12
    assert b.step_idle_fraction > a.step_idle_fraction


@pytest.mark.multiprocess
def test_rhino_run_interleaved_on_two_processes(capsys):
    import json
    from rhino.cli.main import main
    code = main(["run", str(ROOT / "tests" / "workloads" / "pipelines.py:mlp"), "--nproc", "2", "--strategy",
                 "pp=2,microbatches=4,schedule=interleaved,chunks=2", "--dtype", "float64", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["ok"], d.get("first_mismatch") or d.get("error")
    assert d["max_abs_diff"] <= 1e-9 and d["pipeline"]["schedule"] == "interleaved"
    assert all(b > 0 for step in d["pipeline"]["busy_s"] for b in step)
