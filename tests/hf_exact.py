"""Float64 exactness of the Hugging Face workloads: capture + ``rhino check``, and sharded training under a
preset run in one process (every rank's program in lockstep, collectives simulated), where every
rank's loss and every rank's shard of every parameter, buffer and optimizer state is compared with
single-device eager PyTorch (the same workload built in float64, the same seeds)."""
from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

import hf_workloads as hf
from rhino.capture import Workload, capture
from rhino.capture.optim import state_name
from rhino.check import check_captured, eager_steps
from rhino.ir.graph import Role
from rhino.lower.simulate_spmd import simulate_ranks
from rhino.sharding import simulate
from rhino.sharding.placement import Partial
from rhino.sharding.plan import resolve
from rhino.sharding.presets import parse_strategy, preset_plan

TOL = 1e-9   # absolute and relative, float64


@dataclass
class Exact:
    ok: bool
    max_abs_diff: float
    compared: int
    first_mismatch: str | None
    seconds: float


def capture64(name: str, **sizes):
    """Build workload ``name`` with float64 as the default dtype (restored after) and capture it."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        m, opt, loss_fn, batch = getattr(hf, name)(**sizes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return capture(Workload(m, opt, loss_fn, tuple(batch), "hf_workloads.py", name))
    finally:
        torch.set_default_dtype(old)


def check64(cap, steps: int = 2):
    """``rhino check`` at TOL: the captured step against eager PyTorch."""
    return check_captured(cap, steps=steps, rtol=TOL, atol=TOL)


def _reference(cap, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Eager training on a copy: losses and every state tensor by graph-input name."""
    w = cap.workload
    model, optimizer = copy.deepcopy((w.model, w.optimizer))
    losses = [float(x) for x in eager_steps(model, optimizer, w.loss_fn, w.batch, steps)]
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    state = {n: params[n].detach() for n in cap.param_names + cap.frozen_names}
    state.update({n: buffers[n] for n in cap.buffer_names})
    for u in cap.updates:
        tstate = optimizer.state.get(params[u.name], {})
        for key in u.torch_keys:
            if tstate.get(key) is not None:
                state[state_name(u.name, key)] = tstate[key]
    return losses, state


def _close(a: np.ndarray, b: np.ndarray) -> tuple[bool, float]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return False, float("inf")
    diff = float(np.abs(a - b).max()) if a.size else 0.0
    return bool(np.allclose(a, b, rtol=TOL, atol=TOL)), diff


def exact_under(cap, strategy: str, steps: int = 2) -> Exact:
    """``steps`` sharded steps of ``cap`` under preset ``strategy``: every rank compared at TOL."""
    start = time.perf_counter()
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy(strategy)))
    mesh = rp.plan.mesh
    envs, progs, losses, local = simulate_ranks(rp, cap.initial_state(), tuple(cap.workload.batch), steps,
                                                return_state=True)
    want_losses, want = _reference(cap, steps)
    pairs = [(f"loss[step {i + 1}]", np.array(a), np.array(b)) for i, (a, b) in enumerate(zip(losses, want_losses))]
    for r in range(mesh.world):  # each rank's own loss (the last step)
        out = next(n for n in progs[r].module.graph.nodes if n.op == "output").args[0][0]
        pairs.append((f"loss on rank {r}", envs[r][out.name].detach().numpy(), np.array(want_losses[-1])))
    for inp in rp.graph.inputs:
        if inp.role is Role.BATCH or inp.name not in want:
            continue
        sharding = rp.value[inp.value]
        full = want[inp.name].detach().double().numpy().reshape(rp.graph.types[inp.value].shape)
        got = [local[r][inp.name].detach().numpy() for r in range(mesh.world)]
        if any(isinstance(p, Partial) for p in sharding):  # a sum of parts: compare the assembled value
            pairs.append((f"{inp.name} (assembled)", simulate.assemble(got, sharding, mesh), full))
            continue
        expected = simulate.shard(full, sharding, mesh)
        pairs += [(f"{inp.name} on rank {r}", got[r], expected[r]) for r in range(mesh.world)]
    worst, first = 0.0, None
    for name, a, b in pairs:
        ok, diff = _close(a, b)
        worst = max(worst, diff)
        if not ok and first is None:
            first = f"{name} differs from single-device training (max abs diff {diff:.3g})"
    return Exact(first is None, worst, len(pairs), first, time.perf_counter() - start)
