"""Functional versions of torch.optim updates, traced into the step graph.

Each mirrors the single-tensor implementation of ``torch.optim`` (2.13) op for
op, with the optimizer's real hyper-parameters read from its param groups, so
a captured step matches ``optimizer.step()``. The step counters of Adam(W)
are state tensors; bias corrections are computed in float64 0-dim tensors as
torch computes them in Python doubles.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .workload import WorkloadError

__all__ = ["ParamUpdate", "plan_updates", "initial_state", "apply_update"]


@dataclass
class ParamUpdate:
    """How one parameter is updated: the algorithm, its hyper-parameters, its state keys."""

    name: str
    kind: str                      # "sgd" | "adam" | "rmsprop" | "adagrad"
    hp: dict[str, Any]
    state_keys: list[str] = field(default_factory=list)
    torch_keys: list[str] = field(default_factory=list)  # keys torch keeps in optimizer.state


def _scalar(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def plan_updates(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[ParamUpdate]:
    """One ParamUpdate per parameter the optimizer updates, in param-group order."""
    kind = _kind(optimizer)
    plans: list[ParamUpdate] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if p.is_complex():
                raise WorkloadError("complex parameters are not supported; use real tensors")
            if kind == "sgd":
                hp = {k: _scalar(group[k]) for k in ("lr", "momentum", "dampening", "weight_decay")}
                hp.update(nesterov=bool(group["nesterov"]), maximize=bool(group.get("maximize", False)))
                keys, tkeys = [], []
                if hp["momentum"] != 0:
                    keys, tkeys = ["momentum_buffer"], ["momentum_buffer"]
                    if hp["dampening"] != 0:  # torch's first step copies the gradient: track it
                        keys.append("started")
            elif kind == "rmsprop":
                hp = {k: _scalar(group[k]) for k in ("lr", "alpha", "eps", "weight_decay", "momentum")}
                hp.update(centered=bool(group["centered"]), maximize=bool(group.get("maximize", False)))
                keys = ["step", "square_avg"] + (["momentum_buffer"] if hp["momentum"] > 0 else []) + \
                    (["grad_avg"] if hp["centered"] else [])
                tkeys = list(keys)
            elif kind == "adagrad":
                hp = {k: _scalar(group[k]) for k in ("lr", "lr_decay", "weight_decay", "eps",
                                                      "initial_accumulator_value")}
                hp.update(maximize=bool(group.get("maximize", False)))
                keys, tkeys = ["step", "sum"], ["step", "sum"]
            else:
                beta1, beta2 = (_scalar(b) for b in group["betas"])
                hp = {"lr": _scalar(group["lr"]), "beta1": beta1, "beta2": beta2, "eps": _scalar(group["eps"]),
                      "weight_decay": _scalar(group["weight_decay"]), "amsgrad": bool(group["amsgrad"]),
                      "maximize": bool(group.get("maximize", False)),
                      "decoupled": bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))}
                keys = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if hp["amsgrad"] else [])
                tkeys = list(keys)
            plans.append(ParamUpdate(names[id(p)], kind, hp, keys, tkeys))
    return plans


def _kind(optimizer: torch.optim.Optimizer) -> str:
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return "adam"
    if type(optimizer) is torch.optim.SGD:
        return "sgd"
    if type(optimizer) is torch.optim.RMSprop:
        return "rmsprop"
    if type(optimizer) is torch.optim.Adagrad:
        return "adagrad"
    raise WorkloadError(f"optimizer {type(optimizer).__name__} is not supported yet; use torch.optim.SGD, Adam, "
                        f"AdamW, RMSprop or Adagrad")


def initial_state(optimizer: torch.optim.Optimizer, plans: list[ParamUpdate],
                  params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The optimizer state before the next step, as named tensors (zeros where torch has none yet)."""
    out: dict[str, torch.Tensor] = {}
    for plan in plans:
        p = params[plan.name]
        state = optimizer.state.get(p, {})
        for key in plan.state_keys:
            existing = state.get(key)
            if key == "started":
                value = torch.tensor(1.0 if state.get("momentum_buffer") is not None else 0.0, device=p.device)
            elif key == "step":
                value = existing.detach().clone().float() if isinstance(existing, torch.Tensor) else \
                    torch.tensor(float(existing or 0.0), dtype=torch.float32, device=p.device)
                value = value.to(p.device)
            elif existing is None and key == "sum":
                value = torch.full_like(p, plan.hp["initial_accumulator_value"], memory_format=torch.preserve_format)
            elif existing is None:
                value = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                value = existing.detach().clone()
            out[state_name(plan.name, key)] = value
    return out


def state_name(param: str, key: str) -> str:
    return f"opt/{param}/{key}"


def apply_update(plan: ParamUpdate, param: torch.Tensor, grad: torch.Tensor,
                 state: dict[str, torch.Tensor], scalars: dict | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """New parameter and state (out of place) from one optimizer step.

    ``scalars`` caches step-derived scalars (step + 1, bias corrections) by the identity of the step
    tensor and the hyper-parameters, so parameters sharing one step counter compute them once.
    """
    update = {"sgd": _sgd, "adam": _adam, "rmsprop": _rmsprop, "adagrad": _adagrad}[plan.kind]
    return update(plan.hp, param, grad, state, {} if scalars is None else scalars)


def _cached(scalars: dict, key: tuple, make):
    if key not in scalars:
        scalars[key] = make()
    return scalars[key]


def _sgd(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, scalars: dict) -> tuple[torch.Tensor, dict]:
    grad = -grad if hp["maximize"] else grad
    if hp["weight_decay"] != 0:
        grad = grad.add(param, alpha=hp["weight_decay"])
    new_state = {}
    if hp["momentum"] != 0:
        buf = state["momentum_buffer"].mul(hp["momentum"]).add(grad, alpha=1 - hp["dampening"])
        if "started" in state:
            buf = torch.where(state["started"] > 0, buf, grad)
            new_state["started"] = torch.ones_like(state["started"])
        new_state["momentum_buffer"] = buf
        grad = grad.add(buf, alpha=hp["momentum"]) if hp["nesterov"] else buf
    return param.add(grad, alpha=-hp["lr"]), new_state


def _adam(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, scalars: dict) -> tuple[torch.Tensor, dict]:
    grad = -grad if hp["maximize"] else grad
    lr, beta1, beta2, eps, wd = hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"]

    def bias_corrections():
        step = state["step"] + 1
        step64 = step.to(torch.float64)
        bias_correction1 = 1 - torch.pow(beta1, step64)
        bias_correction2 = 1 - torch.pow(beta2, step64)
        step_size = lr / bias_correction1
        # in the parameter's compute type: torch divides by a Python float, which never promotes (a float64
        # 0-dim tensor would promote a 0-dim parameter such as CLIP's logit_scale to float64)
        return step, (-step_size).to(_opmath(param.dtype)), bias_correction2.sqrt().to(_opmath(param.dtype))

    step, neg_step_size, bias_correction2_sqrt = _cached(
        scalars, ("adam", id(state["step"]), lr, beta1, beta2, param.dtype), bias_corrections)
    if wd != 0:
        if hp["decoupled"]:
            param = param.mul(1 - lr * wd)
        else:
            grad = grad.add(param, alpha=wd)
    exp_avg = state["exp_avg"].lerp(grad, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(grad, grad, value=1 - beta2)
    new_state = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if hp["amsgrad"]:
        second = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq)
        new_state["max_exp_avg_sq"] = second
    denom = (second.sqrt() / bias_correction2_sqrt).add(eps)
    # torch: param.addcdiv_(exp_avg, denom, value=-step_size), i.e. param + (value * exp_avg) / denom,
    # computed in float32 for bf16/fp16 tensors and rounded once (the CPU kernel's opmath type)
    return _addcdiv(param, exp_avg, denom, neg_step_size), new_state


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """The type torch's pointwise kernels compute reduced-precision floats in (float32)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _addcdiv(param: torch.Tensor, num: torch.Tensor, den: torch.Tensor, value) -> torch.Tensor:
    """``param + (value * num) / den`` with one rounding, as ``param.addcdiv_(num, den, value=value)``."""
    if _opmath(param.dtype) == param.dtype:
        return param.add((value * num) / den)
    wide = _opmath(param.dtype)
    return param.to(wide).add((value * num.to(wide)) / den.to(wide)).to(param.dtype)


def _rmsprop(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, scalars: dict) -> tuple[torch.Tensor, dict]:
    grad = -grad if hp["maximize"] else grad
    new_state = {"step": _cached(scalars, ("step", id(state["step"])), lambda: state["step"] + 1)}
    if hp["weight_decay"] != 0:
        grad = grad.add(param, alpha=hp["weight_decay"])
    alpha = hp["alpha"]
    square_avg = state["square_avg"].mul(alpha).addcmul(grad, grad, value=1 - alpha)
    new_state["square_avg"] = square_avg
    if hp["centered"]:
        grad_avg = state["grad_avg"].lerp(grad, 1 - alpha)
        new_state["grad_avg"] = grad_avg
        avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt()
    else:
        avg = square_avg.sqrt()
    avg = avg.add(hp["eps"])
    if hp["momentum"] > 0:
        buf = state["momentum_buffer"].mul(hp["momentum"]).addcdiv(grad, avg)
        new_state["momentum_buffer"] = buf
        return param.add(buf, alpha=-hp["lr"]), new_state
    # torch: param.addcdiv_(grad, avg, value=-lr)
    return _addcdiv(param, grad, avg, -hp["lr"]), new_state


def _adagrad(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, scalars: dict) -> tuple[torch.Tensor, dict]:
    def step_and_lr():
        step = state["step"] + 1
        clr = hp["lr"] / (1 + (step.to(torch.float64) - 1) * hp["lr_decay"])
        return step, (-clr).to(_opmath(param.dtype))

    step, neg_clr = _cached(scalars, ("adagrad", id(state["step"]), hp["lr"], hp["lr_decay"], param.dtype),
                            step_and_lr)
    grad = -grad if hp["maximize"] else grad
    if hp["weight_decay"] != 0:
        grad = grad.add(param, alpha=hp["weight_decay"])
    state_sum = state["sum"].addcmul(grad, grad, value=1)
    std = state_sum.sqrt().add(hp["eps"])
    # torch: param.addcdiv_(grad, std, value=-clr)
    return _addcdiv(param, grad, std, neg_clr), {"step": step, "sum": state_sum}
