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
