"""Sharded training against single-device PyTorch, every rank compared.

A sharded run is correct when, after every step, each rank's loss equals the single-device loss and
each rank's local piece of every state tensor (parameters, buffers, optimizer state) equals the
matching piece of the single-device tensor, as ``shard_tensor`` cuts it from the plan's placement.
Comparing each rank's own shards (instead of a gathered copy from one rank) catches replicas that
drifted apart and shards that landed on the wrong rank.

Tolerances follow the least precise floating dtype the step holds or computes in (``tolerance_for``): float64
runs are compared at 1e-9,
where a wrong sharding rule cannot hide in rounding noise; float32 runs keep the looser contract,
because Adam turns 1e-8 gradient noise from a different summation order into 1e-5 differences.
A step that computes in bfloat16 (``torch.autocast`` around the forward, or a bf16 model) is compared
with the same autocast / bf16 single-device step at the bf16 tolerance (``bf16_tolerance``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..capture import Captured, default_dtype
from ..capture.amp import autocast_on
from ..capture.optim import copy_training, state_name
from ..capture.schedule import LrSchedule
from ..check import as_float64, eager_steps
from ..ir.graph import Role
from ..sharding.plan import ResolvedPlan
from .collectives import shard_tensor

__all__ = ["Tolerance", "TOLERANCES", "BF16_UNIT_ROUNDOFF", "bf16_tolerance", "computes_in_bf16", "computes_in_float32",
           "least_precise_dtype", "tolerance_for", "state_dtype", "Reference", "reference_run", "accumulation_steps",
           "Comparison", "compare_ranks"]


@dataclass(frozen=True)
class Tolerance:
    """``|a - b| <= atol + rtol * |b|`` elementwise (``torch.allclose``). ``normwise``: instead
    ``|a - b| <= rtol * max|b|`` for state tensors (rounding error of a sum is relative to its terms, which
    the tensor's largest entry bounds), plus for parameters twice the largest change of the reference
    parameter over the run (a gradient below the rounding noise may point either way: Adam then steps by
    ``lr`` in either direction); losses stay ``|a - b| <= rtol * |b|``."""

    rtol: float
    atol: float
    normwise: bool = False


#: bfloat16 unit roundoff: 8 significant bits (7 stored + 1 implicit), u = 2**-8 ~ 3.9e-3.
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def bf16_tolerance(world: int) -> Tolerance:
    """The bf16 tolerance for a run on ``world`` ranks: ``rtol = 4 * world * u`` (u: ``BF16_UNIT_ROUNDOFF``;
    16u = 0.0625 for 4 ranks), normwise. Why: a bf16 value summed over p ranks is rounded once per
    partial result and once per partial sum of the all-reduce, 2p - 1 < 2p roundings where one device
    rounds once; a squared gradient (Adam's second moment) doubles the relative error: 4p u. Measured on
    ``examples/gpt.py:gpt_autocast`` after 2 steps under dp=4, tp=4, dp=2,tp=2 and dp=4,zero=3: losses
    within 2.1e-5 relative, optimizer moments within 0.0152 of their largest entry."""
    return Tolerance(4 * max(world, 1) * BF16_UNIT_ROUNDOFF, 0.0, normwise=True)


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


def computes_in_bf16(cap: Captured) -> bool:
    """Whether the captured step holds any bfloat16 or float16 tensor (autocast, or a 16-bit model)."""
    return any(t.dtype.value in ("bfloat16", "float16") for t in cap.graph.types.values())


def computes_in_float32(cap: Captured) -> bool:
    """Whether the step holds or makes a float32 (or complex64) tensor that is not 0-dim (an optimizer's float32
    step counter counts exactly): a float64 model with a float32 region (``h.float()`` before a matmul) rounds
    there as float32 does."""
    return any(t.shape and t.dtype.value in ("float32", "complex64") for t in cap.graph.types.values())


def least_precise_dtype(cap: Captured) -> torch.dtype:
    """The least precise floating dtype the step holds or computes in: bfloat16 where it computes in 16-bit floats
    (``computes_in_bf16``: bf16 or fp16), float32 where a float64 step computes a float32 region
    (``computes_in_float32``), else the state's (``state_dtype``)."""
    if computes_in_bf16(cap):
        return torch.bfloat16
    dtype = state_dtype(cap)
    return torch.float32 if dtype is torch.float64 and computes_in_float32(cap) else dtype


def tolerance_for(cap: Captured, world: int = 1) -> Tolerance:
    """The tolerance of the least precise dtype the step holds or computes in (``least_precise_dtype``):
    ``bf16_tolerance(world)`` for 16-bit floats, else that dtype's entry of ``TOLERANCES``."""
    dtype = least_precise_dtype(cap)
    if dtype is torch.bfloat16:
        return bf16_tolerance(world)
    if dtype not in TOLERANCES:
        raise ValueError(f"no comparison tolerance is defined for parameters of dtype {dtype}; "
                         f"compare in float32 or float64")
    return TOLERANCES[dtype]


@dataclass
class Reference:
    """Single-device training: the loss of each step and the final state by graph input name."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor] = field(default_factory=dict)  # parameters before the first step


def accumulation_steps(model, optimizer, loss_fn, batch: tuple, steps: int, microbatches: int,
                       after=None) -> list[float]:
    """PyTorch's gradient-accumulation loop (design11.md interface 3): per step, for each of the m
    contiguous micro-batches along dim 0, ``(loss_fn(model, *mb) / m).backward()``; then one
    ``optimizer.step()``. The loss of a step is ``sum_k loss_k / m``."""
    m = microbatches
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in zip(*(b.chunk(m, 0) for b in batch)):
            with autocast_on("cpu") if on_cpu else contextlib.nullcontext():
                loss = loss_fn(model, *mb)
            (loss / m).backward()
            total += float(loss.detach())
        optimizer.step()
        if after is not None:    # a learning-rate scheduler's step
            after()
        losses.append(total / m)
    return losses


def reference_run(cap: Captured, steps: int, microbatches: int = 1) -> Reference:
    """``steps`` steps of plain eager PyTorch on a deep copy of the workload (a float64 workload under
    float64 as default dtype, as it was built: optimizers make scalar tensors in the default dtype);
    with ``microbatches > 1`` the accumulation loop of ``accumulation_steps``."""
    w = cap.workload
    model, optimizer = copy_training(w.model, w.optimizer)
    after = LrSchedule(optimizer, w.lr_scheduler, cap.scheduled, w.spec).advance if cap.scheduled else None
    with default_dtype(torch.float64 if state_dtype(cap) is torch.float64 else None):
        if microbatches > 1:
            losses = accumulation_steps(model, optimizer, w.loss_fn, w.batch, steps, microbatches, after)
        else:
            losses = [float(x) for x in eager_steps(model, optimizer, w.loss_fn, w.batch, steps, after)]
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    state = {n: params[n].detach() for n in cap.param_names + cap.frozen_names}
    state.update({n: buffers[n].detach() for n in cap.buffer_names})
    for u in cap.updates:
        tstate = optimizer.state.get(params[u.name], {})
        for key in u.torch_keys:
            if tstate.get(key) is not None:
                state[state_name(u.name, key)] = tstate[key].detach()
    initial = {n: t for n, t in cap.initial_state().items() if n in cap.param_names}
    return Reference(losses, state, initial)


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

    def visit(what: str, got: torch.Tensor, want: torch.Tensor, bound: float | None = None) -> None:
        out.compared += 1
        a, b = as_float64(got.detach().cpu()), as_float64(want.detach().cpu())
        same_shape = a.shape == b.shape
        diff = float((a - b).abs().max()) if same_shape and a.numel() else (0.0 if same_shape else float("inf"))
        out.max_abs_diff = max(out.max_abs_diff, diff)
        close = same_shape and (torch.allclose(a, b, rtol=tol.rtol, atol=tol.atol, equal_nan=True) if bound is None
                                else diff <= bound)
        if out.ok and not close:
            out.ok = False
            shapes = "" if same_shape else f" (shape {list(a.shape)} vs {list(b.shape)})"
            allowed = f"rtol {tol.rtol:g}, atol {tol.atol:g}" if bound is None else f"allowed {bound:.3g}"
            out.first_mismatch = f"{what} differs from single-device training{shapes} (max abs diff {diff:.3g}, {allowed})"

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
            visit(f"rank {rank}: {name}", got.reshape(want.shape) if got.numel() == want.numel() else got, want,
                  _normwise_bound(tol, full, ref.initial.get(name)) if tol.normwise else None)
    return out


def _normwise_bound(tol: Tolerance, full: torch.Tensor, initial: torch.Tensor | None) -> float:
    """``Tolerance.normwise``'s allowed max abs difference for one state tensor (``full``: the reference)."""
    b = full.detach().cpu().double()
    if not b.numel():
        return 0.0
    bound = tol.rtol * float(b.abs().max())
    if initial is not None:
        bound += 2 * float((b - initial.detach().cpu().double().reshape(b.shape)).abs().max())
    return bound
