"""``rhino check``: a captured step against plain PyTorch, step by step."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .capture import Captured
from .capture.amp import autocast_on
from .capture.optim import copy_training, state_name
from .capture.schedule import LrSchedule, set_rates
from .capture.workload import WorkloadError
from .lower import StepProgram

__all__ = ["CheckResult", "as_float64", "check_captured", "eager_steps"]


def as_float64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float64 for a comparison: a complex tensor as its real and imaginary parts (``.double()``
    would drop the imaginary part)."""
    return torch.view_as_real(t.resolve_conj()).double() if t.is_complex() else t.double()


# torch.testing.assert_close's float32 defaults.
RTOL, ATOL = 1.3e-6, 1e-5


@dataclass
class CheckResult:
    ok: bool
    steps: int
    max_abs_diff: float
    losses: list[float] = field(default_factory=list)
    eager_losses: list[float] = field(default_factory=list)
    first_mismatch: str | None = None
    compared: int = 0


def eager_steps(model, optimizer, loss_fn, batch, steps: int, after=None) -> list[torch.Tensor]:
    """``steps`` eager training steps; on the CPU an autocast region written for an accelerator acts on
    the CPU, as in capture (``capture.amp.autocast_on``). ``after()``, if given, runs after each
    ``optimizer.step()`` (a learning-rate scheduler's step)."""
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with autocast_on("cpu") if on_cpu else contextlib.nullcontext():
            loss = loss_fn(model, *batch)
        loss.backward()
        optimizer.step()
        if after is not None:
            after()
        losses.append(loss.detach().clone())
    return losses


def check_captured(cap: Captured, steps: int = 2, seed: int = 0, rtol: float = RTOL, atol: float = ATOL) -> CheckResult:
    """Run ``steps`` steps through Rhino and through eager PyTorch (on a deep copy); compare everything."""
    w = cap.workload
    model, optimizer = copy_training(w.model, w.optimizer)
    state = cap.initial_state()
    program = StepProgram(cap.graph)
    schedule = LrSchedule(optimizer, w.lr_scheduler, cap.scheduled, w.spec) if cap.scheduled else None
    rates = [schedule.rates() if schedule else None]       # each step's, as the eager loop's scheduler gives them

    def advance():
        schedule.advance()
        rates.append(schedule.rates())
    # plain PyTorch first: a step that fails there (capture's fake tensors are more lenient than some
    # kernels: a float32 target beside float64 logits) is the workload's mistake, said in one sentence
    torch.manual_seed(seed)
    try:
        theirs = eager_steps(model, optimizer, w.loss_fn, w.batch, steps, advance if schedule else None)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise WorkloadError(f"the training step fails in plain PyTorch ({first}); fix the workload so that "
                            f"one eager step runs") from None
    torch.manual_seed(seed)
    ours = []
    for k in range(steps):
        set_rates(state, rates[k] if schedule else None)
        ours.append(program.step(state, w.batch).detach().clone())

    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    pairs += [(f"loss[step {i + 1}]", a, b) for i, (a, b) in enumerate(zip(ours, theirs))]
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    pairs += [(n, state[n], params[n].detach()) for n in cap.param_names + cap.frozen_names]
    pairs += [(n, state[n], buffers[n]) for n in cap.buffer_names]
    for u in cap.updates:
        torch_state = optimizer.state.get(params[u.name], {})
        for key in u.torch_keys:
            if key in torch_state and torch_state[key] is not None:
                pairs.append((state_name(u.name, key), state[state_name(u.name, key)], torch_state[key]))
    result = CheckResult(True, steps, 0.0, [float(x) for x in ours], [float(x) for x in theirs],
                         compared=len(pairs))
    for name, a, b in pairs:
        a = a.reshape(b.shape) if a.numel() == b.numel() else a
        if a.shape != b.shape or a.dtype != b.dtype and a.is_floating_point() != b.is_floating_point():
            result.ok, result.first_mismatch = False, f"{name}: shape {list(a.shape)} vs {list(b.shape)}"
            break
        a64, b64 = as_float64(a), as_float64(b.to(a.device))
        diff = float((a64 - b64).abs().max()) if a.numel() else 0.0
        result.max_abs_diff = max(result.max_abs_diff, diff)
        if result.ok and not torch.allclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True):
            result.ok = False
            result.first_mismatch = f"{name} differs (max abs diff {diff:.3g})"
    return result
