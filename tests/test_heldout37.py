"""Held-out cases of session 37 (tests/workloads/heldout37.py): a creation op traced without a dtype."""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import ROOT, eager_losses, simulated_pipeline
from rhino.capture import capture, default_dtype, load_workload
from rhino.ir.types import DType
from rhino.sharding.presets import parse_strategy, preset_plan

HELDOUT37 = str(ROOT / "tests" / "workloads" / "heldout37.py")


def _cap(name: str):
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        return capture(load_workload(f"{HELDOUT37}:{name}", dtype=torch.float64))


def test_a_creation_op_keeps_the_dtype_it_was_traced_with():
    """``torch.zeros(n, e)`` in a forward captured under float64 was recorded without its dtype, so a rank
    process (default float32) made float32 counts and ``scatter_add`` of float64 ones into them failed on every
    rank ("scatter(): Expected self.dtype to be equal to src.dtype"). The captured node carries the dtype."""
    g = _cap("routed").graph
    zeros = [n for n in g.nodes if n.op == "aten.zeros.default"]
    assert zeros and all(n.kwargs.get("dtype") is DType.float64 for n in zeros)
    made = [n for n in g.nodes if not n.input_refs() and n.op.split(".")[1] in ("zeros", "ones", "full", "arange")]
    assert all("dtype" in n.kwargs for n in made)


@pytest.mark.multiprocess
def test_a_creation_op_runs_in_rank_processes_of_another_default_dtype():
    from rhino.runtime.run import run_plan
    cap = _cap("routed")
    plan = preset_plan(cap.graph, parse_strategy("dp=2,tp=2"))
    with default_dtype(torch.float64):
        r = run_plan(cap, plan, 4, steps=2)
    assert r.ok and r.max_abs_diff < 1e-9, r.first_mismatch


@pytest.mark.parametrize("name", ["param_hook", "step_hooks"])
def test_gradient_and_step_hooks_are_part_of_the_step(name):
    """A parameter's gradient hook and an optimizer's step hooks were dropped, and ``rhino check`` said OK: its
    reference, a deep copy, dropped them too. Both are traced now (float64, every loss and state tensor against
    the copy, which keeps them; the losses against the workload's own objects trained by a plain loop), and a
    data- and tensor-parallel run equals one device."""
    from rhino.check import check_captured
    from rhino.runtime.exact import simulate_plan
    cap = _cap(name)
    with default_dtype(torch.float64):
        r = check_captured(cap, steps=4, rtol=0.0, atol=1e-12)
    assert r.ok, r.first_mismatch
    eager = eager_losses(f"{HELDOUT37}:{name}", 4)    # the workload's own objects (a deep copy drops tensor hooks)
    assert r.losses == pytest.approx(eager, abs=1e-12) and r.eager_losses == pytest.approx(eager, abs=1e-12)
    with default_dtype(torch.float64):
        res, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy("dp=2,tp=2")), 3)
    assert res.ok and res.max_abs_diff < 1e-12, res.first_mismatch


def test_a_post_accumulate_grad_hook_is_refused_in_one_sentence():
    from rhino.capture import WorkloadError
    with pytest.raises(WorkloadError, match="register_post_accumulate_grad_hook") as info:
        _cap("post_accumulate_hook")
    assert "\n" not in str(info.value)


def test_a_gradient_made_through_a_complex_storage_is_accumulated():
    """An FFT convolution's learned kernel: the gradient is a real view of a complex storage, which gradient
    accumulation refused ("only floating-point gradients can be accumulated"), so micro-batches and every
    pipeline refused the step. Complex storages are summed like real ones; two micro-batches (with dp=2) and a
    two-stage pipeline equal PyTorch's accumulation loop (float64)."""
    from rhino.runtime.exact import simulate_plan
    cap = _cap("fft_kernel")
    with default_dtype(torch.float64):
        for strategy in ("microbatches=2", "dp=2,microbatches=2"):
            res, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy(strategy)), 2)
            assert res.ok and res.max_abs_diff < 1e-12, (strategy, res.first_mismatch)
    cmp = simulated_pipeline(cap, "pp=2,microbatches=2", 2)
    assert cmp.ok and cmp.max_abs_diff < 1e-12, cmp.first_mismatch


@pytest.mark.multiprocess
def test_a_pipeline_sends_complex_values_between_stages():
    """The FFT convolution under pp=2 on gloo: a stage sent a conjugated complex view, which the send refused
    ("view_as_real doesn't work on unresolved conjugated tensors") on every schedule; it is resolved first."""
    from rhino.runtime.pipeline_run import run_pipeline
    cap = _cap("fft_kernel")
    for strategy in ("pp=2,microbatches=2", "pp=2,microbatches=2,chunks=2,schedule=interleaved"):
        plan = preset_plan(cap.graph, parse_strategy(strategy))
        with default_dtype(torch.float64):
            out = run_pipeline(cap, plan, 2)
        assert out.ok and out.max_abs_diff < 1e-9, (strategy, out.first_mismatch)


def test_a_gradient_hook_with_micro_batches_is_refused_in_one_sentence():
    """PyTorch's accumulation loop runs a parameter's hook on each micro-batch's gradient (a clamp of each, not of
    their sum), while the captured step runs it once on the whole batch's: under pp=2 with two micro-batches the
    helper's per-value clipping differed by 0.019 at step 2. Refused, naming the way out."""
    from rhino.runtime.microbatch import microbatch_graph
    cap = _cap("param_hook")
    with pytest.raises(ValueError, match=r"parameter weight has a gradient hook .*use microbatches=1") as info:
        microbatch_graph(cap, 2)
    assert "\n" not in str(info.value)
