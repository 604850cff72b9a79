"""Session 29's held-out models: a crash of the single-device lowering, and ops that made data parallelism
gather the batch (``tests/workloads/heldout29.py``). Checked in float64, every rank in-process."""
import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import capture, default_dtype, load_workload
from rhino.capture.workload import WorkloadError
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


@pytest.mark.parametrize("func", ["softplus_transposed", "squeezed_back", "batched_inverse"])
def test_one_device_runs_what_capture_traced(func):
    """The traced ``view`` of softplus_backward's (transposed) result runs as a reshape; ``squeeze(dim)``
    keeps its traced op on one device; a node returning nothing (``_linalg_check_errors``) runs."""
    res = check_captured(_capture(func))
    assert res.ok and res.max_abs_diff == 0, res


def test_an_op_returning_nothing_lowers_on_every_rank():
    cap = _capture("batched_inverse")
    r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy("dp=4")), 2)
    assert r.ok, r.first_mismatch


@pytest.mark.parametrize("func", ["focal_gather", "bce_sum_and_kl", "fno", "prelu_shuffle"])
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


def test_a_step_that_fails_in_plain_pytorch_is_one_sentence():
    with pytest.raises(WorkloadError, match=r"fails in plain PyTorch \(Found dtype Float but expected Double\)"):
        check_captured(_capture("float32_target"))
