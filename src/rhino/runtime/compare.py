"""Sharded training against single-device PyTorch, every rank compared.

A sharded run is correct when, after every step, each rank's loss equals the single-device loss and
each rank's local piece of every state tensor (parameters, buffers, optimizer state) equals the
matching piece of the single-device tensor, as ``shard_tensor`` cuts it from the plan's placement.
Comparing each rank's own shards (instead of a gathered copy from one rank) catches replicas that
drifted apart and shards that landed on the wrong rank.

Tolerances follow the state's floating dtype (``tolerance_for``): float64 runs are compared at 1e-9,
where a wrong sharding rule cannot hide in rounding noise; float32 runs keep the looser contract,
because Adam turns 1e-8 gradient noise from a different summation order into 1e-5 differences.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..capture import Captured, default_dtype
from ..capture.optim import state_name
from ..check import eager_steps
from ..ir.graph import Role
from ..sharding.plan import ResolvedPlan
from .collectives import shard_tensor

__all__ = ["Tolerance", "TOLERANCES", "tolerance_for", "state_dtype", "Reference", "reference_run",
           "Comparison", "compare_ranks"]


@dataclass(frozen=True)
class Tolerance:
    """``|a - b| <= atol + rtol * |b|`` elementwise (``torch.allclose``)."""

    rtol: float
    atol: float


TOLERANCES = {
    # issue #13: float64 sharded training equals one device to 1e-9 (float64 unit roundoff is 1.1e-16;
    # a different summation order over a few thousand terms stays far below 1e-9).
    torch.float64: Tolerance(1e-9, 1e-9),
    # issue #3 contract for float32: distributed sums may run in another order than on one device.
    torch.float32: Tolerance(1e-4, 1e-5),
}


def state_dtype(cap: Captured) -> torch.dtype:
    """The least precise floating dtype among the model's parameters and buffers (float32 if none)."""
    dtypes = {t.dtype for t in list(cap.workload.model.parameters()) + list(cap.workload.model.buffers())
              if t.is_floating_point()}
    return max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else torch.float32


def tolerance_for(cap: Captured) -> Tolerance:
    """The tolerance of the state's dtype (``state_dtype``)."""
    dtype = state_dtype(cap)
    if dtype not in TOLERANCES:
        raise ValueError(f"no comparison tolerance is defined for parameters of dtype {dtype}; "
                         f"compare in float32 or float64")
    return TOLERANCES[dtype]


@dataclass
class Reference:
    """Single-device training: the loss of each step and the final state by graph input name."""

    losses: list[float]
    state: dict[str, torch.Tensor]


def reference_run(cap: Captured, steps: int) -> Reference:
    """``steps`` steps of plain eager PyTorch on a deep copy of the workload (a float64 workload under
    float64 as default dtype, as it was built: optimizers make scalar tensors in the default dtype)."""
    w = cap.workload
    model, optimizer = copy.deepcopy((w.model, w.optimizer))
    with default_dtype(torch.float64 if state_dtype(cap) is torch.float64 else None):
        losses = [float(x) for x in eager_steps(model, optimizer, w.loss_fn, w.batch, steps)]
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    state = {n: params[n].detach() for n in cap.param_names + cap.frozen_names}
    state.update({n: buffers[n].detach() for n in cap.buffer_names})
    for u in cap.updates:
        tstate = optimizer.state.get(params[u.name], {})
        for key in u.torch_keys:
            if tstate.get(key) is not None:
                state[state_name(u.name, key)] = tstate[key].detach()
    return Reference(losses, state)


@dataclass
class Comparison:
    ok: bool
    max_abs_diff: float
    first_mismatch: str | None
    compared: int  # (rank, tensor) pairs compared, losses included


def compare_ranks(rp: ResolvedPlan, ranks: dict[int, dict], ref: Reference, tol: Tolerance) -> Comparison:
    """``ranks``: rank -> {"losses": its loss per step, "local": its final local state by input name} (every
    rank of the mesh, or under torchrun this process's rank only)."""
    mesh = rp.plan.mesh
    inputs = {i.name: i for i in rp.graph.inputs if i.role is not Role.BATCH}
    out = Comparison(True, 0.0, None, 0)

    def visit(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        out.compared += 1
        a, b = got.detach().cpu().double(), want.detach().cpu().double()
        same_shape = a.shape == b.shape
        diff = float((a - b).abs().max()) if same_shape and a.numel() else (0.0 if same_shape else float("inf"))
        out.max_abs_diff = max(out.max_abs_diff, diff)
        if out.ok and not (same_shape and torch.allclose(a, b, rtol=tol.rtol, atol=tol.atol, equal_nan=True)):
            out.ok = False
            shapes = "" if same_shape else f" (shape {list(a.shape)} vs {list(b.shape)})"
            out.first_mismatch = (f"{what} differs from single-device training{shapes} "
                                  f"(max abs diff {diff:.3g}, rtol {tol.rtol:g}, atol {tol.atol:g})")

    for rank in sorted(ranks):
        losses, local = ranks[rank]["losses"], ranks[rank]["local"]
        if len(losses) != len(ref.losses):
            raise ValueError(f"rank {rank} ran {len(losses)} steps, the reference {len(ref.losses)}")
        for step, (a, b) in enumerate(zip(losses, ref.losses)):
            visit(f"rank {rank}: loss[step {step + 1}]", torch.tensor(a, dtype=torch.float64),
                  torch.tensor(b, dtype=torch.float64))
        for name, full in ref.state.items():
            want = shard_tensor(full, rp.value[inputs[name].value], mesh, rank)
            got = local[name]
            visit(f"rank {rank}: {name}", got.reshape(want.shape) if got.numel() == want.numel() else got, want)
    return out
