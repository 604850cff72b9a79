"""Held-out cases of session 38 (tests/workloads/heldout38.py)."""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import CaptureError, capture, default_dtype, load_workload
from rhino.ir.registry import is_random

HELDOUT38 = str(ROOT / "tests" / "workloads" / "heldout38.py")


def _cap(name: str):
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("error")   # an op unknown to the registry warns
        return capture(load_workload(f"{HELDOUT38}:{name}", dtype=torch.float64))


def test_draws_are_registered_random_ops():
    """``exponential_``, ``uniform_``, ``normal_``, ``torch.normal``, ``torch.randint`` and ``random_`` were opaque
    (run whole on every rank, and recomputation did not know they draw)."""
    g = _cap("random_draws").graph
    drawn = {n.op for n in g.nodes if is_random(n.op)}
    assert {"aten.exponential.default", "aten.uniform.default", "aten.normal_functional.default",
            "aten.normal.Tensor_float", "aten.randint.low", "aten.random.to"} <= drawn


def test_random_in_a_range_is_refused_in_one_sentence():
    """torch.fx writes ``aten.random_.from`` as ``torch.ops.aten.random_.from(...)``: a SyntaxError traceback."""
    with pytest.raises(CaptureError, match=r"write x\.random_\(high - low\)\.add_\(low\) instead"):
        _cap("random_in_range")
