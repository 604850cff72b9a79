"""Hugging Face coverage (issue 13): every architecture of tests/hf_workloads.py is captured, matches eager
PyTorch (``rhino check``), and trains sharded exactly like one device, in float64 with every rank
compared at 1e-9. The suite runs one preset per model, alternating ``dp=2,tp=2`` and ``dp=4,zero=3``
so each preset covers half the models (both presets on every model, and ``rhino plan``, are in
benchmarks/hf_coverage.py, whose table is in docs/benchmarks.md)."""
import pytest
import torch

import hf_workloads as hf
from hf_exact import capture64, check64, exact_under

PRESETS = ("dp=2,tp=2", "dp=4,zero=3")
CASES = [(name, PRESETS[k % 2]) for k, name in enumerate(hf.MODELS)]
# The suite's sizes (the benchmark runs the workloads' defaults): one layer where one layer has every op
# of the architecture, two Swin blocks (the second is the shifted-window one), narrower original four.
SIZES = {"gpt2": dict(hidden=32, seq=16), "llama": dict(hidden=32, seq=16, inner=64),
         "bert": dict(hidden=32, seq=16), "vit": dict(hidden=32), "t5": dict(layers=1), "bart": dict(layers=1),
         "clip": dict(layers=1), "mamba": dict(layers=1), "swin": dict(depths=(2,), heads=(2,)),
         "deberta": dict(layers=1), "mixtral": dict(layers=1), "qwen2_moe": dict(layers=1)}


@pytest.mark.parametrize("name,preset", CASES)
def test_huggingface_model_exact_in_float64(name, preset):
    cap = capture64(name, **SIZES.get(name, {}))
    assert cap.graph.types[cap.graph.inputs[0].value].dtype.value == "float64"
    c = check64(cap, steps=2)
    assert c.ok, c.first_mismatch
    assert c.losses[0] != c.losses[1], "the step must change the model"
    r = exact_under(cap, preset, steps=1)
    assert r.ok, f"{preset}: {r.first_mismatch}"


def test_every_family_is_covered():
    assert len(hf.MODELS) >= 15
    assert set(hf.FAMILIES.values()) >= {"decoder", "encoder", "encoder-decoder", "MoE", "vision",
                                         "windowed attention", "state-space", "contrastive"}


def test_grouped_mm_fallback_is_scoped_to_capture():
    """transformers' MoE experts call ``torch._grouped_mm``, whose fake kernel accepts bfloat16 only while
    the CPU kernel takes float32: capture traces it (the op stays in the graph, opaque, so it runs
    replicated), and outside capture the fake kernel is torch's own again."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rhino.capture import Workload, capture
    m, opt, loss_fn, batch = hf.mixtral(layers=1)
    cap = capture(Workload(m, opt, loss_fn, tuple(batch), "hf_workloads.py", "mixtral"))
    assert "aten._grouped_mm.default" in cap.opaque_ops
    with FakeTensorMode():
        a, b = torch.empty(8, 16), torch.empty(2, 16, 32)
        offs = torch.tensor([4, 8], dtype=torch.int32)
        with pytest.raises(RuntimeError, match="BF16"):
            torch._grouped_mm(a, b, offs=offs)
