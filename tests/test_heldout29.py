"""Session 29's held-out models: a crash of the single-device lowering, and ops that made data parallelism
gather the batch (``tests/workloads/heldout29.py``). Checked in float64, every rank in-process."""
import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import capture, default_dtype, load_workload
from rhino.check import check_captured
from rhino.lower.spmd import lower_rank
from rhino.runtime.exact import simulate_plan
from rhino.sharding.plan import resolve
from rhino.sharding.presets import parse_strategy, preset_plan

FILE = str(ROOT / "tests" / "workloads" / "heldout29.py")


def _capture(func):
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        return capture(load_workload(f"{FILE}:{func}"))


def test_a_view_of_a_gradient_laid_out_otherwise_than_traced_runs():
    """The traced ``view`` of softplus_backward's (transposed) result runs as a reshape."""
    res = check_captured(_capture("softplus_transposed"))
    assert res.ok and res.max_abs_diff == 0, res


@pytest.mark.parametrize("func", ["focal_gather", "bce_sum_and_kl", "fno"])
def test_data_parallelism_keeps_the_batch_split(func):
    """No opaque op, no gather under dp=4 (only the gradients' all-reduces), equal to one device."""
    cap = _capture(func)
    assert cap.opaque_ops == []
    assert not any(n.op.startswith("aten.new_") for n in cap.graph.nodes)
    plan = preset_plan(cap.graph, parse_strategy("dp=4"))
    prog = lower_rank(resolve(cap.graph, plan), 0)
    assert set(prog.collectives) == {"AllReduce"}, prog.collectives
    r, _ = simulate_plan(cap, plan, 2)
    assert r.ok, r.first_mismatch
