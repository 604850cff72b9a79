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


def test_a_float32_region_of_a_float64_step_is_compared_at_float32s_tolerance():
    """A float64 model with one matmul in float32: sharded, its float32 sums run in another order (6.7e-9 apart
    under dp=2,tp=2), and ``rhino run`` failed it at float64's 1e-9. The tolerance is the least precise dtype the
    step computes in; a float64 step whose only float32 tensors are Adam's 0-dim step counters keeps 1e-9."""
    from rhino.runtime.compare import TOLERANCES, tolerance_for
    cap = _cap("float32_region")
    assert tolerance_for(cap, 4) == TOLERANCES[torch.float32]
    r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy("dp=2,tp=2")), 2)
    assert r.ok and 1e-12 < r.max_abs_diff < 1e-6, (r.first_mismatch, r.max_abs_diff)
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        gpt = capture(load_workload(str(ROOT / "examples" / "gpt.py"), dtype=torch.float64))
    assert any(t.dtype.value == "float32" for t in gpt.graph.types.values())     # the counters
    assert tolerance_for(gpt, 4) == TOLERANCES[torch.float64]


def test_an_optimizer_tensor_attribute_written_from_gradients_is_named():
    """``self.scale.add_(sum of gradients)`` fails inside functionalization with a PyTorch INTERNAL ASSERT; the
    sentence now names the attribute and the change (``self.scale.copy_(self.scale / 2)`` was named already)."""
    from rhino.capture.workload import WorkloadError
    with pytest.raises(WorkloadError, match=r"holds self\.scale, a tensor outside self\.state.*keep it in "
                                            r"self\.state\[p\]"):
        _cap("attribute_from_gradients")


def test_a_workload_file_imports_the_modules_beside_it(tmp_path):
    """A workload file that imports a module from its own folder (``from blocks import Block``) failed with "No
    module named 'blocks'": the folder was not on sys.path, as it is for ``python FILE``."""
    (tmp_path / "sibling_blocks_39.py").write_text("import torch.nn as nn\n\nclass Block(nn.Linear):\n    pass\n")
    (tmp_path / "uses_sibling.py").write_text(
        "import torch\nfrom sibling_blocks_39 import Block\n\n"
        "def workload():\n    m = Block(4, 2)\n"
        "    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x: m(x).sum(), (torch.randn(4, 4),)\n")
    w = load_workload(str(tmp_path / "uses_sibling.py"))
    assert type(w.model).__name__ == "Block"
