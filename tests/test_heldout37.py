"""Held-out cases of session 37 (tests/workloads/heldout37.py): a creation op traced without a dtype."""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import ROOT
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


def _eager_losses(name: str, steps: int) -> list[float]:
    """The workload's own objects trained by a plain PyTorch loop (no copy: a deep copy drops tensor hooks)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("heldout37_eager", HELDOUT37)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with default_dtype(torch.float64):
        model, opt, loss_fn, batch = getattr(module, name)()
        out = []
        for _ in range(steps):
            opt.zero_grad()
            loss = loss_fn(model, *batch)
            loss.backward()
            opt.step()
            out.append(float(loss.detach()))
    return out


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
    eager = _eager_losses(name, 4)
    assert r.losses == pytest.approx(eager, abs=1e-12) and r.eager_losses == pytest.approx(eager, abs=1e-12)
    with default_dtype(torch.float64):
        res, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy("dp=2,tp=2")), 3)
    assert res.ok and res.max_abs_diff < 1e-12, res.first_mismatch


def test_a_post_accumulate_grad_hook_is_refused_in_one_sentence():
    from rhino.capture import WorkloadError
    with pytest.raises(WorkloadError, match="register_post_accumulate_grad_hook") as info:
        _cap("post_accumulate_hook")
    assert "\n" not in str(info.value)
