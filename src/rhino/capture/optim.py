"""Functional versions of torch.optim updates, traced into the step graph.

Each mirrors the single-tensor implementation of ``torch.optim`` (2.13) op for
op, with the optimizer's real hyper-parameters read from its param groups, so
a captured step matches ``optimizer.step()``: SGD, Adam, AdamW, RMSprop, Adagrad,
NAdam, RAdam, Adamax and Adadelta (``foreach`` and ``fused`` are ignored: the
same math in another rounding order). Step counters and NAdam's ``mu_product``
are 0-dim state tensors; the scalars torch computes from them in Python doubles
(bias corrections, RAdam's rectification, NAdam's momentum schedule) are
float64 0-dim tensors here, and torch's Python branch on the step (RAdam's
``rho_t > 5``) is a ``torch.where``.
"""
from __future__ import annotations

import copy
import types

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer   # torch's global step hooks

from .workload import WorkloadError

__all__ = ["ParamUpdate", "SCALAR_KEYS", "plan_updates", "initial_state", "lazy_value", "scalar_dtype",
           "state_meta", "apply_update", "state_name", "mirrored_kind", "unhooked", "copy_training", "copy_model",
           "hyperparameters", "changed_hyperparameter", "SCHEDULABLE", "scheduled_name",
           "scheduled_values", "group_value", "set_group_value", "mirrored_names"]


@dataclass
class ParamUpdate:
    """How one parameter is updated: the algorithm, its hyper-parameters, its state keys."""

    name: str
    kind: str                      # a value of _KINDS: "sgd", "adam", "nadam", ...
    hp: dict[str, Any]
    state_keys: list[str] = field(default_factory=list)
    torch_keys: list[str] = field(default_factory=list)  # keys torch keeps in optimizer.state
    init: Any = None   # kind "traced": the optimizer_traced.TracedInit of its lazily made state
    group: int = 0     # index of its param group (a scheduled learning rate is read per group)


def _scalar(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def plan_updates(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[ParamUpdate]:
    """One ParamUpdate per parameter the optimizer updates, in param-group order."""
    kind = _kind(optimizer)
    plans: list[ParamUpdate] = []
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if p.is_complex():
                raise WorkloadError(f"parameter {names[id(p)]} is complex, which Rhino does not support; hold its "
                                    f"real and imaginary parts as two real parameters (torch.complex(re, im) in "
                                    f"forward)")
            hp, keys, tkeys = _PLANNERS[kind](group, kind, optimizer)
            if kind == "nadam":
                hp["mu_product_dtype"] = _mu_product_dtype(optimizer.state.get(p, {}).get("mu_product"))
            plans.append(ParamUpdate(names[id(p)], kind, hp, keys, tkeys, group=index))
    return plans


def _mu_product_dtype(held) -> torch.dtype:
    """NAdam's mu_product: the held tensor's dtype, else what torch creates at the first step (float64 under a
    float64 default dtype, as ``torch.optim.optimizer._get_scalar_dtype``)."""
    if isinstance(held, torch.Tensor):
        return held.dtype
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _plan_sgd(group: dict, kind: str, optimizer) -> tuple[dict, list[str], list[str]]:
    hp = {k: _scalar(group[k]) for k in ("lr", "momentum", "dampening", "weight_decay")}
    hp.update(nesterov=bool(group["nesterov"]), maximize=bool(group.get("maximize", False)))
    keys, tkeys = [], []
    if hp["momentum"] != 0:
        keys, tkeys = ["momentum_buffer"], ["momentum_buffer"]
        if hp["dampening"] != 0:  # torch's first step copies the gradient: track it
            keys.append("started")
    return hp, keys, tkeys


def _plan_rmsprop(group: dict, kind: str, optimizer) -> tuple[dict, list[str], list[str]]:
    hp = {k: _scalar(group[k]) for k in ("lr", "alpha", "eps", "weight_decay", "momentum")}
    hp.update(centered=bool(group["centered"]), maximize=bool(group.get("maximize", False)))
    keys = ["step", "square_avg"] + (["momentum_buffer"] if hp["momentum"] > 0 else []) + \
        (["grad_avg"] if hp["centered"] else [])
    return hp, keys, list(keys)


def _plan_adagrad(group: dict, kind: str, optimizer) -> tuple[dict, list[str], list[str]]:
    hp = {k: _scalar(group[k]) for k in ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value")}
    hp.update(maximize=bool(group.get("maximize", False)))
    return hp, ["step", "sum"], ["step", "sum"]


def _plan_adam_family(group: dict, kind: str, optimizer) -> tuple[dict, list[str], list[str]]:
    """Adam(W), NAdam, RAdam and Adamax: betas, eps, weight decay, maximize, and each one's extras."""
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    hp = {"lr": _scalar(group["lr"]), "beta1": beta1, "beta2": beta2, "eps": _scalar(group["eps"]),
          "weight_decay": _scalar(group["weight_decay"]), "maximize": bool(group.get("maximize", False)),
          "decoupled": bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))}
    if kind == "adam":
        hp["amsgrad"] = bool(group["amsgrad"])
        keys = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if hp["amsgrad"] else [])
    elif kind == "nadam":
        hp["momentum_decay"] = _scalar(group["momentum_decay"])
        keys = ["step", "mu_product", "exp_avg", "exp_avg_sq"]
    elif kind == "radam":
        keys = ["step", "exp_avg", "exp_avg_sq"]
    else:
        keys = ["step", "exp_avg", "exp_inf"]
    return hp, keys, list(keys)


def _plan_adadelta(group: dict, kind: str, optimizer) -> tuple[dict, list[str], list[str]]:
    hp = {k: _scalar(group[k]) for k in ("lr", "rho", "eps", "weight_decay")}
    hp.update(maximize=bool(group.get("maximize", False)))
    return hp, ["step", "square_avg", "acc_delta"], ["step", "square_avg", "acc_delta"]


_PLANNERS = {"sgd": _plan_sgd, "adam": _plan_adam_family, "rmsprop": _plan_rmsprop, "adagrad": _plan_adagrad,
             "nadam": _plan_adam_family, "radam": _plan_adam_family, "adamax": _plan_adam_family,
             "adadelta": _plan_adadelta}

# The optimizer classes mirrored (by exact type: a subclass may change the update) and their kinds.
_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam",
          torch.optim.RMSprop: "rmsprop", torch.optim.Adagrad: "adagrad", torch.optim.NAdam: "nadam",
          torch.optim.RAdam: "radam", torch.optim.Adamax: "adamax", torch.optim.Adadelta: "adadelta"}

# State keys held as 0-dim tensors, not parameter-shaped (torch's counters and mu_product; rhino's ``started``).
SCALAR_KEYS = ("step", "started", "mu_product")


def mirrored_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """The kind of the update mirrored here, if ``optimizer`` runs one: a class of ``_KINDS`` or a subclass that
    overrides none of its update (else None: its own step() is traced, ``optim_traced``). An optimizer with step
    hooks (``register_step_pre_hook``, ``register_step_post_hook``, or torch's global ones) is traced with them."""
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or \
            torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks:
        return None
    cls = type(optimizer)
    for base, kind in _KINDS.items():
        if issubclass(cls, base) and all(unhooked(getattr(cls, m, None)) is unhooked(getattr(base, m, None))
                                         for m in ("step", "_init_group")):
            return kind
    return None


def unhooked(method):
    """A class's method without the profiling wrapper torch.optim puts around ``step`` (per class)."""
    return method.__wrapped__ if getattr(method, "hooked", False) else method


def _kind(optimizer: torch.optim.Optimizer) -> str:
    kind = mirrored_kind(optimizer)
    if kind is None:
        raise WorkloadError(f"optimizer {type(optimizer).__name__} is not mirrored; capture traces its step()")
    return kind


def lazy_value(plan: ParamUpdate, key: str, held: dict) -> float:
    """The fill value of state ``key`` that torch creates at the first step (``held``: what it holds now)."""
    if key == "started":    # SGD's momentum buffer, or any state a traced step() made (optim_traced), is there
        made = held.get("momentum_buffer") is not None if plan.init is None else \
            any(isinstance(v, torch.Tensor) for v in held.values())
        return 1.0 if made else 0.0
    if key == "sum":
        return plan.hp["initial_accumulator_value"]
    return 1.0 if key == "mu_product" else 0.0


def scalar_dtype(plan: ParamUpdate, key: str) -> torch.dtype:
    """The dtype of 0-dim state ``key`` (one of ``SCALAR_KEYS``): float32 for step counters (exact integers
    either way), torch's own for NAdam's ``mu_product`` (float64 under a float64 default dtype), whose
    rounding enters the update."""
    return plan.hp["mu_product_dtype"] if key == "mu_product" else torch.float32


def state_meta(plan: ParamUpdate, key: str, param: torch.Tensor) -> torch.Tensor:
    """An empty meta tensor shaped and typed as state ``key`` of ``param`` (capture without memory)."""
    if plan.init is not None:
        return plan.init.meta[(plan.name, key)]
    if key in SCALAR_KEYS:
        return torch.empty((), dtype=scalar_dtype(plan, key), device="meta")
    return torch.empty_like(param, device="meta")


def initial_state(optimizer: torch.optim.Optimizer, plans: list[ParamUpdate],
                  params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The optimizer state before the next step, as named tensors (zeros where torch has none yet)."""
    out: dict[str, torch.Tensor] = {}
    for plan in plans:
        p = params[plan.name]
        state = optimizer.state.get(p, {})
        for key in plan.state_keys:
            existing = state.get(key)
            if plan.init is not None and key == "started":
                value = torch.tensor(lazy_value(plan, key, state), device=p.device, dtype=scalar_dtype(plan, key))
            elif plan.init is not None:
                value = existing.detach().clone() if isinstance(existing, torch.Tensor) else \
                    plan.init.value(plan.name, key, lambda n: params[n].detach())
            elif key == "started":
                value = torch.tensor(lazy_value(plan, key, state), device=p.device)
            elif key in SCALAR_KEYS:   # step counters and NAdam's mu_product, on the parameter's device
                value = existing.detach().clone() if isinstance(existing, torch.Tensor) else \
                    torch.tensor(float(lazy_value(plan, key, state) if existing is None else existing))
                value = value.to(device=p.device, dtype=scalar_dtype(plan, key))
            elif existing is None:
                value = torch.full_like(p, lazy_value(plan, key, state), memory_format=torch.preserve_format)
            else:
                value = existing.detach().clone()
            out[state_name(plan.name, key)] = value
    return out


_PRIMITIVE = (int, float, bool, complex, str, type(None))


# The hyper-parameters a scheduler may move: the learning rate always (with any schedule), and the momentum (SGD,
# RMSprop) or beta1 (the Adam family) where the scheduler cycles it (OneCycleLR's and CyclicLR's
# ``cycle_momentum``). A scheduled one is read from a float64 0-dim graph input (``scheduled_name``).
SCHEDULABLE = ("lr", "momentum", "beta1")
# keys a scheduler adds or sets that the step never reads
_SCHEDULER_KEYS = ("initial_lr",)


def scheduled_name(group: int, key: str = "lr") -> str:
    """The graph input holding param group ``group``'s hyper-parameter ``key`` (one of ``SCHEDULABLE``) when it
    follows a schedule (a float64 0-dim optimizer-state input the step reads and passes on unchanged)."""
    return f"opt/group{group}/{key}"


def group_value(group: dict, key: str) -> float:
    """Param group ``group``'s value of ``key`` (one of ``SCHEDULABLE``; ``beta1`` is ``betas[0]``)."""
    return _scalar(group["betas"][0] if key == "beta1" else group[key])


def set_group_value(group: dict, key: str, value: float) -> None:
    """Set param group ``group``'s ``key`` (one of ``SCHEDULABLE``; ``beta1`` is ``betas[0]``) to ``value``."""
    if key == "beta1":
        group["betas"] = (value, *group["betas"][1:])
    else:
        group[key] = value


def scheduled_values(optimizer: torch.optim.Optimizer, scheduled: dict[str, tuple[int, str]]) -> dict[str, float]:
    """Each scheduled input's value now (``scheduled``: input name -> (param group, key))."""
    return {name: group_value(optimizer.param_groups[g], key) for name, (g, key) in scheduled.items()}


def mirrored_names() -> list[str]:
    """The optimizer classes whose update is mirrored here (``_KINDS``)."""
    return [cls.__name__ for cls in _KINDS]


def hyperparameters(optimizer: torch.optim.Optimizer | None,
                    scheduled: dict[str, tuple[int, str]] | None = None) -> dict[tuple[int, str], Any]:
    """Each param-group entry a captured update reads as a constant, by (group index, key): Python values
    (and tuples of them, such as ``betas``) as they are, tensors by identity and version. ``scheduled``: the
    graph inputs of a schedule (``scheduled_values``); with one, every group's learning rate is left out, and
    a scheduled momentum or beta1 (of ``betas`` only beta2 and the rest are kept)."""
    if optimizer is None:
        return {}
    moved = {(g, key) for g, key in (scheduled or {}).values()}

    def key(i, k, v):
        if k == "betas" and (i, "beta1") in moved:
            v = v[1:]
        return ("tensor", id(v), v._version) if isinstance(v, torch.Tensor) else v

    def fixed(i, k):
        return not (scheduled and (k in ("lr",) + _SCHEDULER_KEYS or (i, k) in moved))
    return {(i, k): key(i, k, v) for i, g in enumerate(optimizer.param_groups) for k, v in g.items()
            if k != "params" and fixed(i, k) and (isinstance(v, _PRIMITIVE + (torch.Tensor,)) or
                                                  isinstance(v, tuple) and all(isinstance(x, _PRIMITIVE) for x in v))}


def changed_hyperparameter(before: dict[tuple[int, str], Any], optimizer: torch.optim.Optimizer | None,
                           scheduled: dict[str, tuple[int, str]] | None = None) -> str | None:
    """A sentence naming the first entry of ``hyperparameters(optimizer, scheduled)`` that differs from
    ``before``."""
    now = hyperparameters(optimizer, scheduled)
    for (i, k), v in before.items():
        if now.get((i, k), v) != v:
            if isinstance(v, tuple) and v[:1] == ("tensor",):
                return f"param_groups[{i}][{k!r}], a tensor, was changed in place"
            return f"param_groups[{i}][{k!r}] changed from {v!r} to {now[(i, k)]!r}"
    return None


def copy_training(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """Deep copies of ``model`` and ``optimizer`` (the optimizer over the copy's parameters), the optimizer's
    own attributes included: ``torch.optim.Optimizer.__getstate__`` keeps only its defaults, state and param
    groups, so a user-written optimizer's ``self.ns_steps`` would be missing from a plain deep copy."""
    memo: dict = {}
    model_copy = copy_model(model, memo)
    optimizer_copy = copy.deepcopy(optimizer, memo)
    for key, value in vars(optimizer).items():
        if key not in vars(optimizer_copy):
            setattr(optimizer_copy, key, copy.deepcopy(value, memo))
    for key in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):   # __getstate__ drops them
        hooks = getattr(optimizer, key, None)
        if hooks:
            setattr(optimizer_copy, key, type(hooks)(hooks))
            _rebind(getattr(optimizer_copy, key), memo)
    return model_copy, optimizer_copy


def copy_model(model: torch.nn.Module, memo: dict | None = None) -> torch.nn.Module:
    """A deep copy of ``model`` whose hooks close over the copy (``_rebind_hooks``)."""
    memo = {} if memo is None else memo
    for m in model.modules():   # torch.nn.utils.weight_norm keeps ``weight`` as a computed tensor, which deepcopy
        for v in vars(m).values():  # refuses: its copy is a detached one, which the copy's pre-hook recomputes
            if isinstance(v, torch.Tensor) and not v.is_leaf:
                memo.setdefault(id(v), v.detach().clone())
    out = copy.deepcopy(model, memo)
    _rebind_hooks(out, memo)
    for m in out.modules():   # a torch.jit.script submodule's deep copy holds parameters that are not leaves (torch
        if isinstance(m, torch.jit.ScriptModule):   # 2.13): no .grad, so an optimizer would never move them
            for name, p in list(m.named_parameters(recurse=False)):
                if not p.is_leaf:
                    setattr(m, name, torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad))
    copies = dict(out.named_parameters())
    # and makes them without ``memo``: point memo at the copies the copied model runs, so that an optimizer copied
    # with the same memo steps them (it stepped orphans)
    for name, p in model.named_parameters():
        memo[id(p)] = copies[name]
    copied_buffers = dict(out.named_buffers())
    for name, b in model.named_buffers():
        memo[id(b)] = copied_buffers[name]
    for name, p in model.named_parameters():   # a tensor's deep copy drops its gradient hooks
        if p._backward_hooks and not copies[name]._backward_hooks:
            for fn in p._backward_hooks.values():
                copies[name].register_hook(fn)
            _rebind(copies[name]._backward_hooks, memo)
    return out


def _rebind_hooks(model_copy: torch.nn.Module, memo: dict) -> None:
    """A hook written as a closure over the model (``l1.register_forward_hook(lambda m, i, o: self.feats.append(o))``)
    is copied as the same function, still pointing at the original module: the copy's hooks get closures over the
    copies of what they captured (bound methods are rebound by ``copy.deepcopy`` itself)."""
    for m in model_copy.modules():
        for hooks in (v for k, v in vars(m).items() if "hooks" in k and isinstance(v, dict)):
            _rebind(hooks, memo)


def _rebind(hooks: dict, memo: dict) -> None:
    """Each closure in ``hooks`` over something ``memo`` copied, as a closure over the copy."""
    for key, fn in list(hooks.items()):
        cells = getattr(fn, "__closure__", None)
        held = [_content(c) for c in cells or ()]
        if not isinstance(fn, types.FunctionType) or not any(id(x) in memo for x in held if x is not _EMPTY):
            continue
        new = tuple(types.CellType() if x is _EMPTY else types.CellType(memo.get(id(x), x)) for x in held)
        hooks[key] = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, new)
        hooks[key].__kwdefaults__ = fn.__kwdefaults__


_EMPTY = object()


def _content(cell):
    try:
        return cell.cell_contents
    except ValueError:    # a cell whose variable was never assigned
        return _EMPTY


def state_name(param: str, key: str) -> str:
    return f"opt/{param}/{key}"


def apply_update(plan: ParamUpdate, param: torch.Tensor, grad: torch.Tensor,
                 state: dict[str, torch.Tensor], scalars: dict | None = None,
                 scheduled: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """New parameter and state (out of place) from one optimizer step.

    ``scalars`` caches step-derived scalars (step + 1, bias corrections) by the identity of the step
    tensor and the hyper-parameters, so parameters sharing one step counter compute them once. ``scheduled``:
    float64 0-dim tensors read in place of the captured hyper-parameters they name (a schedule's learning rate,
    momentum or beta1: ``scheduled_name``).
    """
    hp = {**plan.hp, **scheduled} if scheduled else plan.hp
    return _UPDATES[plan.kind](hp, param, grad, state, {} if scalars is None else scalars)


def _cached(scalars: dict, key: tuple, make):
    if key not in scalars:
        scalars[key] = make()
    return scalars[key]


def _sgd(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, scalars: dict) -> tuple[torch.Tensor, dict]:
    grad = -grad if hp["maximize"] else grad
    if hp["weight_decay"] != 0:
        grad = grad.add(param, alpha=hp["weight_decay"])
    new_state = {}
    momentum = hp["momentum"]
    if _on(momentum):
        buf = state["momentum_buffer"].mul(_as_scalar(momentum, grad.dtype)).add(grad, alpha=1 - hp["dampening"])
        if "started" in state:
            buf = torch.where(state["started"] > 0, buf, grad)
            new_state["started"] = torch.ones_like(state["started"])
        new_state["momentum_buffer"] = buf
        grad = _add_scaled(grad, buf, momentum) if hp["nesterov"] else buf
    return _descend(param, grad, hp["lr"]), new_state


def _adam(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, scalars: dict) -> tuple[torch.Tensor, dict]:
    grad = -grad if hp["maximize"] else grad
    lr, beta1, beta2, eps = hp["lr"], hp["beta1"], hp["beta2"], hp["eps"]

    def bias_corrections():
        step = state["step"] + 1
        step64 = step.to(torch.float64)
        bias_correction1 = 1 - torch.pow(beta1, step64)
        bias_correction2 = 1 - torch.pow(beta2, step64)
        step_size = _rdiv(lr, bias_correction1)
        # in the parameter's compute type: torch divides by a Python float, which never promotes (a float64
        # 0-dim tensor would promote a 0-dim parameter such as CLIP's logit_scale to float64)
        return step, (-step_size).to(_opmath(param.dtype)), bias_correction2.sqrt().to(_opmath(param.dtype))

    step, neg_step_size, bias_correction2_sqrt = _cached(
        scalars, ("adam", id(state["step"]), lr, beta1, beta2, param.dtype), bias_corrections)
    param, _, exp_avg, exp_avg_sq = _moments(hp, param, grad, state, lr, beta1, beta2)
    new_state = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if hp["amsgrad"]:
        second = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq)
        new_state["max_exp_avg_sq"] = second
    denom = (second.sqrt() / bias_correction2_sqrt).add(eps)
    # torch: param.addcdiv_(exp_avg, denom, value=-step_size), i.e. param + (value * exp_avg) / denom,
    # computed in float32 for bf16/fp16 tensors and rounded once (the CPU kernel's opmath type)
    return _addcdiv(param, exp_avg, denom, neg_step_size), new_state


def _moments(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, lr, beta1: float,
             beta2: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam's, NAdam's and RAdam's weight decay (decoupled: the parameter shrinks by ``lr * wd``; else added
    to the gradient) and their two moments: the parameter, the gradient, ``exp_avg`` and ``exp_avg_sq``."""
    wd = hp["weight_decay"]
    if wd != 0:
        if hp["decoupled"]:
            param = param.mul(_as_scalar(1 - lr * wd, param.dtype))
        else:
            grad = grad.add(param, alpha=wd)
    exp_avg = _lerp(state["exp_avg"], grad, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(grad, grad, value=1 - beta2)
    return param, grad, exp_avg, exp_avg_sq


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
    if _on(hp["momentum"]):
        buf = state["momentum_buffer"].mul(_as_scalar(hp["momentum"], grad.dtype)).addcdiv(grad, avg)
        new_state["momentum_buffer"] = buf
        return _descend(param, buf, hp["lr"]), new_state
    # torch: param.addcdiv_(grad, avg, value=-lr)
    return _addcdiv(param, grad, avg, _as_scalar(-hp["lr"], param.dtype)), new_state


def _adagrad(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, scalars: dict) -> tuple[torch.Tensor, dict]:
    def step_and_lr():
        step = state["step"] + 1
        clr = _rdiv(hp["lr"], 1 + (step.to(torch.float64) - 1) * hp["lr_decay"])
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


def _rdiv(num, t: torch.Tensor) -> torch.Tensor:
    """Python's ``num / t`` with one rounding (``num / tensor`` is ``tensor.reciprocal() * num``: two); ``num``
    a float or a float64 0-dim tensor (a scheduled learning rate)."""
    return (num if isinstance(num, torch.Tensor) else torch.full_like(t, num)) / t


def _as_scalar(value, dtype: torch.dtype):
    """A float as it is; a float64 0-dim tensor (a scheduled learning rate, or a value computed from one) in the
    compute type of ``dtype``'s kernels, as the kernel converts a Python scalar (a float64 0-dim tensor would
    promote a 0-dim parameter to float64)."""
    return value.to(_opmath(dtype)) if isinstance(value, torch.Tensor) else value


def _descend(param: torch.Tensor, direction: torch.Tensor, lr) -> torch.Tensor:
    """torch's ``param.add_(direction, alpha=-lr)``."""
    return _add_scaled(param, direction, -lr)


def _add_scaled(x: torch.Tensor, y: torch.Tensor, alpha) -> torch.Tensor:
    """torch's ``x.add(y, alpha=alpha)``. With a scheduled (tensor) factor a product, then a sum: the kernel's
    fused multiply-add cannot take a tensor factor, so results may differ from torch's in the last bit."""
    if not isinstance(alpha, torch.Tensor):
        return x.add(y, alpha=alpha)
    wide = _opmath(x.dtype)
    return x.to(wide).add(y.to(wide) * alpha.to(wide)).to(x.dtype)


def _lerp(start: torch.Tensor, end: torch.Tensor, weight) -> torch.Tensor:
    """``start.lerp(end, weight)``; a scheduled (tensor) weight in the kernel's compute type, as it converts a
    Python scalar (the same formula either way)."""
    if not isinstance(weight, torch.Tensor):
        return start.lerp(end, weight)
    wide = _opmath(start.dtype)
    return start.to(wide).lerp(end.to(wide), weight.to(wide)).to(start.dtype)


def _on(momentum) -> bool:
    """Whether a momentum term runs: a scheduled momentum always (the schedule keeps it above 0,
    ``capture.schedule``), a constant one where it is not 0."""
    return isinstance(momentum, torch.Tensor) or momentum != 0


def _nadam(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, scalars: dict) -> tuple[torch.Tensor, dict]:
    grad = -grad if hp["maximize"] else grad
    lr, beta1, beta2, decay = hp["lr"], hp["beta1"], hp["beta2"], hp["momentum_decay"]

    def step_scalars():   # torch: Python doubles from the step count
        step = state["step"] + 1
        step64 = step.to(torch.float64)
        bias_correction2 = 1 - torch.pow(beta2, step64)
        mu = beta1 * (1.0 - 0.5 * torch.pow(0.96, step64 * decay))
        mu_next = beta1 * (1.0 - 0.5 * torch.pow(0.96, (step64 + 1) * decay))
        return step, bias_correction2.to(_opmath(param.dtype)), mu, mu_next

    step, bias_correction2, mu, mu_next = _cached(
        scalars, ("nadam", id(state["step"]), beta1, beta2, decay, param.dtype), step_scalars)
    param, grad, exp_avg, exp_avg_sq = _moments(hp, param, grad, state, lr, beta1, beta2)
    # torch: mu_product *= mu on a float32 tensor (mu rounded to float32), then read back as a double
    mu_product = state["mu_product"].mul(mu.to(state["mu_product"].dtype))
    product64 = mu_product.to(torch.float64)
    value = ((1.0 - mu) * -lr) / (1.0 - product64)
    value_next = (mu_next * -lr) / (1.0 - product64 * mu_next)
    denom = exp_avg_sq.div(bias_correction2).sqrt().add(hp["eps"])
    opmath = _opmath(param.dtype)
    param = _addcdiv(param, grad, denom, value.to(opmath))
    param = _addcdiv(param, exp_avg, denom, value_next.to(opmath))
    return param, {"step": step, "mu_product": mu_product, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _radam(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, scalars: dict) -> tuple[torch.Tensor, dict]:
    grad = -grad if hp["maximize"] else grad
    lr, beta1, beta2 = hp["lr"], hp["beta1"], hp["beta2"]

    def step_scalars():
        # torch branches in Python on rho_t > 5 (a function of the step count); here one torch.where
        step = state["step"] + 1
        step64 = step.to(torch.float64)
        beta2_power = torch.pow(beta2, step64)
        bias_correction1 = 1 - torch.pow(beta1, step64)
        bias_correction2 = 1 - beta2_power
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step64 * beta2_power / bias_correction2
        rectified = rho_t > 5.0
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / (rho_t * ((rho_inf - 4) * (rho_inf - 2)))).sqrt()
        rect = torch.where(rectified, rect, 1.0)   # no NaN in the branch not taken (rho_t in (2, 4))
        opmath = _opmath(param.dtype)
        return step, rectified, bias_correction1.to(opmath), bias_correction2.sqrt().to(opmath), rect.to(opmath)

    step, rectified, bias_correction1, bias_correction2_sqrt, rect = _cached(
        scalars, ("radam", id(state["step"]), beta1, beta2, param.dtype), step_scalars)
    param, _, exp_avg, exp_avg_sq = _moments(hp, param, grad, state, lr, beta1, beta2)
    scaled = exp_avg / bias_correction1 * _as_scalar(lr, param.dtype)
    # torch: (bias_correction2 ** 0.5) / (exp_avg_sq.sqrt() + eps), a float over a tensor: reciprocal, times
    adaptive_lr = exp_avg_sq.sqrt().add(hp["eps"]).reciprocal() * bias_correction2_sqrt
    update = torch.where(rectified, scaled * adaptive_lr * rect, scaled)
    return param.add(update, alpha=-1.0), {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _adamax(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, scalars: dict) -> tuple[torch.Tensor, dict]:
    lr, beta1 = hp["lr"], hp["beta1"]

    def step_and_lr():
        step = state["step"] + 1
        bias_correction = 1 - torch.pow(beta1, step.to(torch.float64))
        return step, (-_rdiv(lr, bias_correction)).to(_opmath(param.dtype))

    step, neg_clr = _cached(scalars, ("adamax", id(state["step"]), lr, beta1, param.dtype), step_and_lr)
    grad = -grad if hp["maximize"] else grad
    if hp["weight_decay"] != 0:
        grad = grad.add(param, alpha=hp["weight_decay"])
    exp_avg = _lerp(state["exp_avg"], grad, 1 - beta1)
    exp_inf = torch.maximum(state["exp_inf"].mul(hp["beta2"]), grad.abs().add(hp["eps"]))
    # torch: param.addcdiv_(exp_avg, exp_inf, value=-clr)
    return _addcdiv(param, exp_avg, exp_inf, neg_clr), {"step": step, "exp_avg": exp_avg, "exp_inf": exp_inf}


def _adadelta(hp: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, scalars: dict
              ) -> tuple[torch.Tensor, dict]:
    step = _cached(scalars, ("step", id(state["step"])), lambda: state["step"] + 1)
    grad = -grad if hp["maximize"] else grad
    if hp["weight_decay"] != 0:
        grad = grad.add(param, alpha=hp["weight_decay"])
    rho, eps = hp["rho"], hp["eps"]
    square_avg = state["square_avg"].mul(rho).addcmul(grad, grad, value=1 - rho)
    std = square_avg.add(eps).sqrt()
    delta = state["acc_delta"].add(eps).sqrt().div(std).mul(grad)
    acc_delta = state["acc_delta"].mul(rho).addcmul(delta, delta, value=1 - rho)
    return _descend(param, delta, hp["lr"]), {"step": step, "square_avg": square_avg, "acc_delta": acc_delta}


_UPDATES = {"sgd": _sgd, "adam": _adam, "rmsprop": _rmsprop, "adagrad": _adagrad, "nadam": _nadam,
            "radam": _radam, "adamax": _adamax, "adadelta": _adadelta}
