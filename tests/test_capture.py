"""Capture + single-device execution against plain PyTorch (the oracle)."""
import warnings

import pytest
import torch

from conftest import EXAMPLES, ROOT
from rhino.capture import Workload, capture, load_workload
from rhino.check import check_captured
from rhino.ir import Graph, Role, verify
from rhino.ir.verify import is_inplace_op
from rhino.lower import StepProgram

VARIANTS = ["sgd_dampening", "sgd_nesterov_maximize", "sgd_plain", "adam_amsgrad", "adamw_stepped",
            "sgd_stepped", "convs", "inplace_clamps", "routing", "rmsprop_centered", "rmsprop_plain", "adagrad",
            "user_checkpoint", "distribution_nll", "maxnorm_embedding"]


def _capture(spec: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(load_workload(spec))


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_match_pytorch(name):
    cap = _capture(str(ROOT / "examples" / f"{name}.py"))
    r = check_captured(cap, steps=2)
    assert r.ok, r.first_mismatch
    assert r.losses[0] != r.losses[1], "the step must change the model"
    assert not cap.opaque_ops


@pytest.mark.parametrize("name", VARIANTS)
def test_variants_match_pytorch(name):
    cap = _capture(str(ROOT / "tests" / "workloads" / f"variants.py:{name}"))
    r = check_captured(cap, steps=3)
    assert r.ok, r.first_mismatch


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit"])
def test_huggingface_models_match_pytorch(name):
    hf = pytest.importorskip("hf_workloads")
    m, opt, loss_fn, batch = getattr(hf, name)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(Workload(m, opt, loss_fn, tuple(batch), "hf_workloads.py", name))
    r = check_captured(cap, steps=2)
    assert r.ok, r.first_mismatch


def test_inplace_relu6_backward_reads_the_output():
    """No activation copy is kept for the backward of an in-place ReLU6 / hardtanh (results are checked
    against PyTorch by test_variants_match_pytorch)."""
    graph = _capture(str(ROOT / "tests" / "workloads" / "variants.py:inplace_clamps")).graph
    made = {v: n for n in graph.nodes for v in n.outputs}
    backwards = [n for n in graph.nodes if n.op == "aten.hardtanh_backward.default"]
    assert len(backwards) == 2
    for n in backwards:
        assert made[n.args[1].id].op == "aten.hardtanh.default"
    assert not any(n.op == "aten.clone.default" for n in graph.nodes)


def test_check_detects_a_wrong_graph():
    """The oracle can fail: change one optimizer constant in the IR and the check must notice."""
    cap = _capture(str(ROOT / "examples" / "mlp.py"))
    node = next(n for n in cap.graph.nodes if n.op == "aten.add.Tensor" and n.kwargs.get("alpha", 1) < 0)
    node.kwargs["alpha"] *= 10  # the learning rate of one parameter
    r = check_captured(cap, steps=1)
    assert not r.ok and "differs" in r.first_mismatch


def test_graph_is_pure_and_state_is_threaded():
    cap = _capture(str(ROOT / "examples" / "resnet.py"))
    g = cap.graph
    assert not any(is_inplace_op(n.op) for n in g.nodes)
    roles = {i.role for i in g.inputs}
    assert {Role.PARAM, Role.BUFFER, Role.OPT_STATE, Role.BATCH} <= roles
    # BatchNorm running statistics are state: updated by the step
    out = {o.name: o.value for o in g.outputs}
    inp = {i.name: i.value for i in g.inputs}
    running = [n for n in inp if n.endswith("running_mean")]
    assert running and all(out[n] != inp[n] for n in running)
    nbt = [n for n in inp if n.endswith("num_batches_tracked")]
    assert nbt and all(out[n] != inp[n] for n in nbt)
    # SGD momentum buffers, one per trained parameter
    assert sum(1 for i in g.inputs if i.name.endswith("/momentum_buffer")) == len(cap.param_names)


def test_tied_parameter_is_one_input_with_summed_gradient():
    cap = _capture(str(ROOT / "examples" / "gpt.py"))
    model = cap.workload.model
    assert model.head.weight is model.tok.weight if hasattr(model, "head") else True
    params = [i.name for i in cap.graph.inputs if i.role is Role.PARAM]
    assert len(params) == len({id(p) for p in model.parameters()})
    r = check_captured(cap, steps=2)
    assert r.ok


def test_optimizer_hyperparameters_are_read_per_group():
    cap = _capture(str(ROOT / "tests" / "workloads" / "variants.py:adam_amsgrad"))
    by_name = {u.name: u.hp for u in cap.updates}
    assert by_name["a.weight"]["weight_decay"] == 0.05 and by_name["a.weight"]["lr"] == 1e-2
    assert by_name["a.bias"]["lr"] == 0.02 and by_name["a.bias"]["weight_decay"] == 0.0
    assert by_name["a.weight"]["beta1"] == 0.8 and by_name["a.weight"]["amsgrad"]
    assert "frozen.weight" in cap.frozen_names and "scale" in cap.frozen_names


def test_json_round_trip_runs_identically():
    cap = _capture(str(ROOT / "examples" / "bert.py"))
    text = cap.graph.to_json()
    again = Graph.from_json(text)
    verify(again)
    assert again.to_json() == text
    assert again.fingerprint() == cap.graph.fingerprint()
    batch = cap.workload.batch
    s1, s2 = cap.initial_state(), cap.initial_state()
    p1, p2 = StepProgram(cap.graph), StepProgram(again)
    for _ in range(2):
        l1, l2 = p1.step(s1, batch), p2.step(s2, batch)
        assert torch.equal(l1, l2)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_opaque_op_is_kept_and_reported():
    with pytest.warns(UserWarning, match="aten.special_erfcx.default"):
        cap = capture(load_workload(str(ROOT / "tests" / "workloads" / "variants.py:routing")))
    assert cap.opaque_ops == ["aten.special_erfcx.default"]


def test_meta_capture_of_a_model_larger_than_ram():
    cap = _capture(str(ROOT / "tests" / "workloads" / "variants.py:huge_meta"))
    params = sum(cap.graph.types[i.value].nbytes for i in cap.graph.inputs if i.role is Role.PARAM)
    assert params > 24 * 2**30  # more than the 24 GiB of RAM here, never allocated
    assert len(cap.graph.nodes) > 50


def test_meta_and_real_capture_agree_on_structure():
    real = _capture(str(ROOT / "examples" / "llama.py"))
    wl = load_workload(str(ROOT / "examples" / "llama.py"))
    meta = capture(Workload(*_build_meta_llama(), wl.path, "meta"))
    assert [n.op for n in real.graph.nodes] == [n.op for n in meta.graph.nodes]


def _build_meta_llama():
    import importlib.util
    spec = importlib.util.spec_from_file_location("llama_ex", ROOT / "examples" / "llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.workload(device="meta")


@pytest.mark.parametrize("name", ["adam_amsgrad", "adamw_stepped", "adagrad"])
def test_adam_and_adagrad_steps_are_bitwise_pytorch_in_float64(name):
    """The learning rate over a bias correction is one division, as torch's Python floats compute it
    (``lr / tensor`` is a reciprocal and a product: one unit in the last place apart on ~1 step in 5)."""
    from rhino.capture import default_dtype
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        cap = capture(load_workload(str(ROOT / "tests" / "workloads" / f"variants.py:{name}"), dtype=torch.float64))
        r = check_captured(cap, steps=10)
    assert r.ok and r.max_abs_diff == 0.0, r.max_abs_diff
