"""Held-out cases of session 39 (tests/workloads/heldout39.py)."""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import ROOT, simulated_pipeline
from rhino.capture import capture, default_dtype, load_workload
from rhino.ir.graph import Graph
from rhino.runtime.exact import simulate_plan
from rhino.sharding.presets import parse_strategy, preset_plan

HELDOUT39 = str(ROOT / "tests" / "workloads" / "heldout39.py")


def _cap(name: str):
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("error", UserWarning)   # an op unknown to the registry warns
        return capture(load_workload(f"{HELDOUT39}:{name}", dtype=torch.float64))


@pytest.mark.parametrize("strategy", ["dp=2,tp=2", "dp=4,zero=3", "pp=2,microbatches=2"])
def test_complex_scalars_in_the_step_are_captured_and_sharded_exactly(strategy):
    """``torch.polar`` and ``Tensor.angle`` differentiate to ``aten.mul.Scalar(t, 1j)``: every command failed with
    "unsupported op argument 1j of type complex". The scalar is an IR constant (JSON ``{"complex": [re, im]}``),
    ``complex`` and ``polar`` are element-wise ops (they ran opaque), and every rank matches one device."""
    cap = _cap("phases")
    scalars = [a for n in cap.graph.nodes for a in n.args if isinstance(a, complex)]
    assert scalars and all(a.real == 0 for a in scalars)
    again = Graph.from_json(cap.graph.to_json())
    assert again.fingerprint() == cap.graph.fingerprint()
    assert [n.args for n in again.nodes] == [n.args for n in cap.graph.nodes]
    assert cap.opaque_ops == []
    if "pp=" in strategy:
        r = simulated_pipeline(cap, strategy, 2)
    else:
        r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy(strategy)), 2)
    assert r.ok and r.max_abs_diff < 1e-12, (r.first_mismatch, r.max_abs_diff)
