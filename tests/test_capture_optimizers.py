"""NAdam, RAdam, Adamax and Adadelta (capture/optim.py) against PyTorch's own ``optimizer.step()``.

Oracle: eager PyTorch on a copy of the workload (``rhino.check.check_captured``), float64, 10 steps, every
loss, parameter and optimizer state tensor within 1e-12 (they are equal bit for bit on this machine's CPU).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import WorkloadError, capture, default_dtype, load_workload
from rhino.capture.deferred import load_deferred
from rhino.capture.optim import initial_state, plan_updates, state_name
from rhino.check import check_captured, eager_steps
from rhino.ir.graph import Role
from rhino.runtime.collectives import shard_tensor
from rhino.runtime.init import local_state
from rhino.sharding.plan import resolve
from rhino.sharding.presets import parse_strategy, preset_plan

SPEC = str(ROOT / "tests" / "workloads" / "optimizers.py")
WORKLOADS = ["nadam", "nadam_decoupled_maximize", "nadam_stepped", "radam", "radam_decoupled", "adamax",
             "adadelta", "adadelta_maximize"]
STEPS = 10          # RAdam rectifies from step 6 on (betas (0.9, 0.999) and (0.8, 0.99))
TOLERANCE = 1e-12


def _capture(name: str, dtype: torch.dtype = torch.float64):
    with warnings.catch_warnings(), default_dtype(dtype):
        warnings.simplefilter("ignore")
        return capture(load_workload(f"{SPEC}:{name}", dtype=dtype))


@pytest.mark.parametrize("name", WORKLOADS)
def test_matches_pytorch_for_ten_steps(name):
    cap = _capture(name)
    with default_dtype(torch.float64):    # torch creates NAdam's mu_product in the default dtype
        r = check_captured(cap, steps=STEPS, rtol=0.0, atol=TOLERANCE)
    assert r.ok, r.first_mismatch
    assert r.max_abs_diff <= TOLERANCE
    assert len(set(r.losses)) == STEPS, "every step must change the model"
    stepped = [u for u in cap.updates if not u.name.startswith("unused.")]
    assert r.compared >= STEPS + len(cap.param_names) + sum(len(u.torch_keys) for u in stepped)


@pytest.mark.parametrize("name", ["nadam_decoupled_maximize", "radam", "adamax", "adadelta"])
def test_matches_pytorch_in_float32(name):
    cap = _capture(name, torch.float32)
    r = check_captured(cap, steps=STEPS)
    assert r.ok, r.first_mismatch


@pytest.mark.parametrize("name", WORKLOADS)
def test_state_keys_are_torchs(name):
    """``torch_keys`` name exactly what torch keeps in ``optimizer.state[p]`` after a step, with its shapes and
    dtypes at the start (``initial_state``; NAdam's mu_product is 0-dim)."""
    cap = _capture(name)
    with default_dtype(torch.float64):
        w = cap.workload
        model, opt = copy.deepcopy((w.model, w.optimizer))
        eager_steps(model, opt, w.loss_fn, w.batch, 1)
        start = cap.initial_state()
    params = dict(model.named_parameters())
    for u in cap.updates:
        held = opt.state.get(params[u.name], {})
        if u.name.startswith("unused."):
            assert not held
            continue
        assert sorted(held) == sorted(u.torch_keys), u.name
        for key in u.torch_keys:
            ours = start[state_name(u.name, key)]
            assert ours.shape == held[key].shape, (u.name, key)
            assert ours.dtype == held[key].dtype or key == "step", (u.name, key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nadam_mu_product_starts_at_one_in_torchs_dtype(dtype):
    with default_dtype(dtype):
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.NAdam([p])
        (u,) = plan_updates(opt, {id(p): "p"})
        state = initial_state(opt, [u], {"p": p})
        p.sum().backward()
        opt.step()
    assert state["opt/p/mu_product"].item() == 1.0 and state["opt/p/step"].item() == 0.0
    assert state["opt/p/mu_product"].dtype == opt.state[p]["mu_product"].dtype == dtype
    assert state["opt/p/step"].dtype == torch.float32


def test_radam_takes_both_branches():
    """The steps checked above cover both sides of RAdam's ``rho_t > 5`` (torch's Python branch)."""
    for name in ("radam", "radam_decoupled"):
        beta2 = _capture(name).workload.optimizer.param_groups[0]["betas"][1]
        rho_inf = 2 / (1 - beta2) - 1
        rho = [rho_inf - 2 * t * beta2 ** t / (1 - beta2 ** t) for t in range(1, STEPS + 1)]
        assert any(r <= 5 for r in rho) and any(r > 5 for r in rho), name


def test_graph_holds_no_branch_on_the_step():
    """RAdam's choice is a ``where`` in the graph, so one graph serves both branches."""
    graph = _capture("radam").graph
    assert any(n.op.startswith("aten.where") for n in graph.nodes)


@pytest.mark.parametrize("name", ["nadam", "nadam_stepped", "radam_decoupled", "adadelta"])
def test_local_state_equals_shards_of_the_initial_state(name):
    """Each rank's lazily created state (NAdam's mu_product: 1.0) and held state equal ``shard_tensor`` of
    ``initial_state``, bitwise."""
    cap = _capture(name)
    with default_dtype(torch.float64):
        full = cap.initial_state()
    for strategy in ("dp=2,tp=2", "dp=4,zero=3"):
        plan = preset_plan(cap.graph, parse_strategy(strategy))
        rp = resolve(cap.graph, plan)
        for rank in range(plan.mesh.world):
            state = local_state(cap, rp, rank)
            for inp in cap.graph.inputs:
                if inp.role is Role.OPT_STATE:
                    want = shard_tensor(full[inp.name], rp.value[inp.value], plan.mesh, rank)
                    assert want.dtype == state[inp.name].dtype and torch.equal(state[inp.name], want), \
                        (strategy, rank, inp.name)


@pytest.mark.parametrize("name", ["nadam", "radam", "adamax", "adadelta"])
def test_deferred_capture_is_the_plain_capture(name):
    """Capture of the deferred (meta) workload, as ``rhino train`` does it, gives the plain capture's graph."""
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        w, _ = load_deferred(f"{SPEC}:{name}", torch.float64)
        deferred = capture(w)
    assert deferred.graph.fingerprint() == _capture(name).graph.fingerprint()
