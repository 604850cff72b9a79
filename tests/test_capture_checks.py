"""Library calls that read tensor values while tracing (tests/workloads/torch_checks.py): captured steps
equal PyTorch's in float64, or one sentence saying what to change."""
import warnings
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from rhino.capture import CaptureError, WorkloadError, capture, default_dtype, load_workload
from rhino.check import check_captured

CHECKS = str(ROOT / "tests" / "workloads" / "torch_checks.py")


def _capture(name: str):
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        return capture(load_workload(f"{CHECKS}:{name}", dtype=torch.float64))


@pytest.mark.parametrize("name", ["causal_encoder", "ctc_lists", "gaussian_head", "compiled"])
def test_steps_equal_pytorch_in_float64(name):
    cap = _capture(name)
    with default_dtype(torch.float64):
        r = check_captured(cap, steps=3)
    assert r.ok and r.max_abs_diff <= 1e-12, r.first_mismatch
    assert r.losses[0] != r.losses[2]


def test_functionalization_keeps_a_loss_whole_with_its_dtypes():
    """torch.func.functionalize (functorch) traced BCE-with-logits through functorch's out-of-place copy of its
    kernel, computing in the logits' float64 where the kernel rounds to the float32 target's dtype (losses 9e-9
    apart); FunctionalTensorMode keeps the op whole. The backward's formula, traced out of place, still keeps
    float64 where eager autograd rounds in place to float32 (gradients ~2e-10 apart)."""
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        cap = capture(load_workload(str(ROOT / "tests" / "workloads" / "heldout35.py:bce_float32_target"),
                                    dtype=torch.float64))
        r = check_captured(cap, steps=3)
    losses = [n for n in cap.graph.nodes if n.op == "aten.binary_cross_entropy_with_logits.default"]
    assert len(losses) == 1 and str(cap.graph.types[losses[0].outputs[0]].dtype) == "DType.float32"
    assert r.ok and r.losses == r.eager_losses, (r.losses, r.eager_losses)


def test_packed_sequences_and_sparse_embeddings_are_one_sentence():
    with pytest.raises(CaptureError, match="run the RNN on the padded batch and mask"):
        _capture("packed_lstm")
    with pytest.raises(WorkloadError, match="'emb' has sparse=True.*use sparse=False"):
        _capture("sparse_embedding")
    from rhino.capture.workload import validate_workload
    emb = torch.nn.Embedding(30, 8, sparse=True)     # the model itself (its module name is '')
    with pytest.raises(WorkloadError, match=r"w.py:f\(\): the model, an embedding, has sparse=True.*use sparse=False"):
        validate_workload((emb, torch.optim.SparseAdam(list(emb.parameters())), None, (torch.zeros(2, dtype=torch.long),)),
                          Path("w.py"), "f")


def test_ctc_lengths_as_tensors_are_one_sentence():
    with pytest.raises(CaptureError, match="pass input_lengths and target_lengths to F.ctc_loss as lists of ints"):
        _capture("ctc_tensor_lengths")


def test_the_checks_are_back_after_capture():
    """The capture's stand-ins for the causal-mask test and the variance check are removed after tracing."""
    import torch.nn.modules.transformer as tm
    _capture("causal_encoder")
    _capture("gaussian_head")
    mask = torch.nn.Transformer.generate_square_subsequent_mask(4)
    assert tm._detect_is_causal_mask(mask) is True
    with pytest.raises(ValueError, match="var has negative"):
        torch.nn.functional.gaussian_nll_loss(torch.zeros(2), torch.zeros(2), -torch.ones(2))


def test_a_channels_last_step_runs_in_its_arena():
    """``as_strided`` and ``as_strided_scatter`` of slots: offsets from the slot's start, the layouts capture saw."""
    from rhino.api import memory_report
    cap = _capture("channels_last")
    assert any(n.op == "aten.as_strided_scatter.default" for n in cap.graph.nodes)
    with default_dtype(torch.float64):
        rep = memory_report(cap, time_limit=5, execute=True, name="channels_last").to_dict()
    ex = rep["execute"]
    assert ex["equal"] and ex["max_abs_diff"] <= 1e-12 and ex["arena_equals_plan"], ex


@pytest.mark.parametrize("name", ["channels_last", "embedding_bag"])
@pytest.mark.multiprocess
def test_ranks_run_in_their_planned_arenas(capsys, name):
    """Channels-last ``as_strided`` views of slots; ``_embedding_bag``'s outputs with the shapes capture saw
    (meta gave ``max_indices`` no elements)."""
    import json
    from rhino.cli.main import main
    code = main(["run", f"{CHECKS}:{name}", "--nproc", "2", "--strategy", "dp=2", "--memory-plan",
                 "--dtype", "float64", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["ok"], d.get("first_mismatch") or d.get("error")
    assert all(m["arena_bytes"] == m["plan_bytes"] for m in d["memory_plan"])


def test_rank_memory_plans_hold_an_op_without_a_meta_kernel(capsys):
    """``_ctc_loss_backward`` has no meta kernel: the rank graph learns its shapes on fake tensors."""
    import json
    from rhino.cli.main import main
    code = main(["memory", f"{CHECKS}:ctc_lists", "--strategy", "dp=2,tp=2", "--time-limit", "5", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and len(d["ranks"]) == 4 and all(r["valid"] for r in d["ranks"])


def test_a_compiled_model_is_its_module():
    with default_dtype(torch.float64):
        w = load_workload(f"{CHECKS}:compiled", dtype=torch.float64)
    assert type(w.model).__name__ == "Bag"
