"""What a model's forward stores on its own modules while the capture traces it (``capture.module_state``):
the modules are given back as they were; a Python number changed or a Python random draw is refused."""
import random
import re
import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import CaptureError, capture, default_dtype, load_workload
from rhino.check import check_captured

SPEC = str(ROOT / "tests" / "workloads" / "module_state.py")


def _load(name):
    return load_workload(f"{SPEC}:{name}", dtype=torch.float64)


def test_an_activation_kept_on_the_module_is_given_back():
    """``self.last_hidden = h`` left a tensor of the trace on the module: the reference's deep copy of the model
    raised (every command but memory failed with a traceback)."""
    w = _load("keeps_hidden")
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        cap = capture(w)
        assert w.model.last_hidden is None
        r = check_captured(cap, steps=2)
    assert r.ok and r.max_abs_diff <= 1e-12, r.first_mismatch


@pytest.mark.parametrize("name, phrase", [
    ("warm_up", "the model's forward changes calls (0 -> 1), a Python number"),
    ("layer_drop", "the model's forward draws from Python's random module"),
    ("layer_drop_held_rng", "the model's forward draws from the random.Random at rng"),
])
def test_python_state_a_step_would_freeze_is_refused(name, phrase):
    w = _load(name)
    state = random.getstate()
    held = w.model.rng.getstate() if getattr(w.model, "rng", None) is not None else None
    with warnings.catch_warnings(), default_dtype(torch.float64), pytest.raises(CaptureError, match=re.escape(phrase)):
        warnings.simplefilter("ignore")
        capture(w)
    assert random.getstate() == state                          # nothing drawn for good, nothing counted
    assert getattr(w.model, "calls", 0) == 0
    if held is not None:
        assert w.model.rng.getstate() == held


def test_a_hook_closing_over_the_model_works_on_the_references_copy():
    """The eager reference runs on a deep copy; a hook written as a closure over ``self`` was copied as the same
    function and filled the original's list (the copy's loss read an empty one: IndexError). The copy's hooks
    close over the copy now (``capture.optim.copy_model``), also in the micro-batch check."""
    from rhino.runtime.exact import simulate_plan
    from rhino.runtime.microbatch import check_microbatch_loss
    from rhino.sharding.presets import parse_strategy, preset_plan
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        cap = capture(_load("feature_hooks"))
        r = check_captured(cap, steps=2)
        assert r.ok and r.max_abs_diff <= 1e-12, r.first_mismatch
        check_microbatch_loss(cap, 2)
        s, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy("dp=2,microbatches=2")))
    assert s.ok and s.max_abs_diff <= 1e-12, s.first_mismatch


def test_lazy_modules_get_their_parameters_from_a_first_call():
    """``nn.LazyLinear`` without a dry run: PyTorch's "Attempted to use an uninitialized parameter" came through
    (the capture traced parameters without shapes); eager training makes them at the first forward, so does
    the capture now."""
    w = _load("lazy_linear")
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        cap = capture(w)
        r = check_captured(cap, steps=2)
    assert cap.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert r.ok and r.max_abs_diff <= 1e-12, r.first_mismatch
