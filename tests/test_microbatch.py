"""Gradient accumulation (``microbatches``) and the plan fields it travels in (issue #11)."""
import json
import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import capture, default_dtype, load_workload
from rhino.cost.cluster import parse_cluster
from rhino.cost.estimate import estimate, estimate_strategy
from rhino.sharding.plan import PlanError, ShardingPlan
from rhino.sharding.presets import parse_strategy, preset_plan

MLP = str(ROOT / "examples" / "mlp.py")


def _cap(path=MLP, dtype=torch.float64):
    with warnings.catch_warnings(), default_dtype(dtype):
        warnings.simplefilter("ignore")
        return capture(load_workload(path, dtype=dtype))


@pytest.fixture(scope="module")
def mlp():
    return _cap()


# -- plan fields -------------------------------------------------------------------------------------------
def test_presets_carry_microbatches_and_recompute_through_the_plan_json(mlp):
    plan = preset_plan(mlp.graph, parse_strategy("dp=2,microbatches=4,recompute=full"))
    assert (plan.microbatches, plan.recompute) == (4, "full")
    d = json.loads(plan.to_json())
    assert d["pipeline"] == {"stages": 1, "microbatches": 4} and d["recompute"] == "full"
    back = ShardingPlan.from_json(plan.to_json())
    assert (back.microbatches, back.recompute) == (4, "full")
    assert back.inputs == plan.inputs and back.strategies == plan.strategies


def test_an_old_plan_file_without_the_fields_reads_as_one_microbatch_no_recompute(mlp):
    d = json.loads(preset_plan(mlp.graph, parse_strategy("dp=2")).to_json())
    del d["pipeline"], d["recompute"]
    back = ShardingPlan.from_json(json.dumps(d))
    assert (back.microbatches, back.recompute) == (1, "none")


@pytest.mark.parametrize("edit, match", [({"pipeline": {"stages": 2, "microbatches": 4}}, "pipeline stages"),
                                         ({"pipeline": {"stages": 1, "microbatches": 0}}, "microbatches"),
                                         ({"recompute": "some"}, "recompute")])
def test_bad_plan_fields_are_one_clear_error(mlp, edit, match):
    d = json.loads(preset_plan(mlp.graph, parse_strategy("dp=2")).to_json())
    d.update(edit)
    with pytest.raises(PlanError, match=match):
        ShardingPlan.from_json(json.dumps(d))


def test_pp_stays_rejected_by_the_presets(mlp):
    with pytest.raises(ValueError, match="pp > 1"):
        preset_plan(mlp.graph, parse_strategy("dp=2,pp=2,microbatches=4"))


def test_estimate_prices_a_plan_files_microbatches_like_the_strategy_string(mlp):
    cluster = parse_cluster("cpu:2")
    plan = ShardingPlan.from_json(preset_plan(mlp.graph, parse_strategy("dp=2,microbatches=4")).to_json())
    from_plan = estimate(mlp.graph, cluster, plan)
    from_string = estimate_strategy(mlp.graph, cluster, "dp=2,microbatches=4")
    one = estimate_strategy(mlp.graph, cluster, "dp=2")
    assert from_plan.microbatches == 4
    assert from_plan.memory_bytes == from_string.memory_bytes
    assert from_plan.step_seconds == pytest.approx(from_string.step_seconds, rel=1e-12)
    assert from_plan.memory_bytes != one.memory_bytes
