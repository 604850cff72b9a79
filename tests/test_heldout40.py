"""Held-out cases of session 40 (tests/workloads/heldout40.py)."""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import ROOT, eager_losses
from rhino.capture import capture, default_dtype, load_workload
from rhino.runtime.exact import simulate_plan
from rhino.sharding.presets import parse_strategy, preset_plan

HELDOUT40 = str(ROOT / "tests" / "workloads" / "heldout40.py")


def _cap(name: str):
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("error", UserWarning)   # an op unknown to the registry warns
        return capture(load_workload(f"{HELDOUT40}:{name}", dtype=torch.float64))


@pytest.mark.parametrize("strategy", ["dp=2,tp=2,sp=on,recompute=full", "dp=4,recompute=full"])
def test_a_recomputed_mean_cross_entropy_that_keeps_only_its_total_weight_lowers(strategy):
    """Recomputation copies ``nll_loss_forward`` for the backward, which reads only its total weight: the copy's
    loss output is unused (None), and the lowering of a mean over split rows read that output's dtype (KeyError:
    None before any rank started). Every rank now matches one device."""
    cap = _cap("uncertainty_weights")
    r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy(strategy)), 2)
    assert r.ok and r.max_abs_diff < 1e-12, (r.first_mismatch, r.max_abs_diff)


def test_a_time_major_batch_under_micro_batches_is_one_sentence():
    """Time-major token ids beside a batch-major padding mask: the loss on a micro-batch fails PyTorch's own shape
    assertion (an AssertionError), which ``rhino run``'s new micro-batch note let through as a traceback; the
    note is now silent there and the check before the ranks start says what to change. A time-major LSTM's step at
    half the rows unrolls half the time steps: the structure check names the sequence-first layout."""
    from rhino.runtime.microbatch import check_microbatch_loss, microbatch_graph, microbatch_note
    from rhino.runtime.rank_step import same_structure
    cap = _cap("time_major_padding_mask")
    assert microbatch_note(cap, 2) is None
    with pytest.raises(ValueError, match=r"the loss fails on a micro-batch \(AssertionError: Expected key_padded_mask"
                                         r".*use microbatches=1"):
        check_microbatch_loss(cap, 2)
    lstm = _cap("time_major_lstm")
    assert microbatch_note(lstm, 2) is None      # the run refuses it (below), so there is nothing to note
    with pytest.raises(ValueError, match="a sequence-first tensor, nn.LSTM's, nn.GRU's and nn.MultiheadAttention's "
                                         "default layout, holds time steps there"):
        same_structure(lstm.graph, microbatch_graph(lstm, 2), 2)


def test_ctc_lengths_longer_than_a_micro_batch_are_refused_not_a_crash():
    """Capture runs ``_ctc_loss_backward``'s real kernel on zeros (it has no fake kernel): at half the time steps the
    input lengths read past the log-probs, and every command with micro-batches died of a segmentation fault. The
    forward's fallback now makes the real kernel's checks, so the trace stops with its sentence."""
    from rhino.runtime.microbatch import microbatch_graph, microbatch_note
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")   # _ctc_loss is an opaque op
        cap = capture(load_workload(f"{HELDOUT40}:ctc_time_major", dtype=torch.float64))
    with pytest.raises(ValueError, match="the step does not trace on a micro-batch .* Expected input_lengths to have "
                                         "value at most 6, but got value 12"):
        microbatch_graph(cap, 2)
    assert microbatch_note(cap, 2) is None


@pytest.mark.parametrize("strategy", ["dp=2,tp=2", "dp=4,zero=3", "tp=4", "dp=2,microbatches=2"])
@pytest.mark.parametrize("optimizer,keys", [("adafactor", ("row_var", "col_var", "variance")), ("asgd", ("ax", "mu"))])
def test_optimizers_reading_numbers_are_captured_and_sharded_exactly(optimizer, keys, strategy):
    """``torch.optim.Adafactor``'s kernel takes ``.item()`` of its step and of two norms, ASGD's branches on
    ``mu.item()``, so every command refused them; their steps are now traced through tensor-only forms of those
    kernels (``capture.optim_kernels``), and every rank of each plan matches torch's own optimizer on one device
    over 3 steps (Adafactor's factored row/column moments, ASGD's averaging once ``mu`` leaves 1)."""
    cap = _cap(optimizer)
    state = {i.name for i in cap.graph.inputs}
    assert all(any(key in n for n in state) for key in keys), state
    r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy(strategy)), 3)
    assert r.ok and r.max_abs_diff < 1e-12, (r.first_mismatch, r.max_abs_diff)


def test_a_scripted_submodule_is_copied_with_trainable_parameters():
    """``rhino check`` and ``rhino run`` failed a model with a ``torch.jit.script`` submodule at step 2 (0.018):
    Rhino's step was right, the reference was not (its deep copy's scripted parameters were not leaves and its
    copied optimizer held other tensors). ``copy_model`` now gives the scripted copies leaf parameters that the
    copied optimizer steps; the reference equals PyTorch on the original model and Rhino matches it."""
    from rhino.capture.optim import copy_training
    from rhino.check import check_captured
    cap = _cap("scripted_submodule")
    # TorchScript's profiling executor specialised the scripted code after its first calls, so the step captured at
    # half the batch (a later call) had 31 nodes for 28 and micro-batches were refused; capture runs it unoptimised
    # (as rhino run does, before any eager run: after one, the executor's cached autodiff graph is traced instead)
    r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy("dp=2,microbatches=2")), 2)
    assert r.ok and r.max_abs_diff < 1e-12, (r.first_mismatch, r.max_abs_diff)
    model, opt = copy_training(cap.workload.model, cap.workload.optimizer)
    held = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.is_leaf and any(p is q for q in held) for p in model.parameters())
    with default_dtype(torch.float64):
        r = check_captured(cap, steps=3, rtol=0.0, atol=1e-12)
    eager = eager_losses(f"{HELDOUT40}:scripted_submodule", 3)
    assert r.ok, r.first_mismatch
    assert r.losses == pytest.approx(eager, abs=1e-12) and len(set(eager)) == 3


def test_compiled_submodules_and_functions_are_traced_as_their_code():
    """Dynamo steps aside under FX tracing while capture traces (``error_on_nested_fx_trace=False``), so the compiled
    parts run their Python code into the step graph; the reference runs them compiled; every rank matches."""
    from rhino.check import check_captured
    cap = _cap("compiled_parts")
    with default_dtype(torch.float64):
        r = check_captured(cap, steps=3, rtol=0.0, atol=1e-12)
    assert r.ok, r.first_mismatch
    r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy("dp=2,tp=2")), 2)
    assert r.ok and r.max_abs_diff < 1e-12, (r.first_mismatch, r.max_abs_diff)


def test_a_loss_that_calls_torch_distributed_is_told_to_leave_reductions_to_the_plan():
    """It failed with PyTorch's "Default process group has not been initialized" and advice about batch shapes."""
    from rhino.capture import CaptureError
    with pytest.raises(CaptureError, match=r"dist.all_reduce\(value\)\): Default process group has not been "
                                           r"initialized.*Write the step as for one device: the plan's collectives "
                                           r"reduce across ranks"):
        _cap("loss_all_reduces")
