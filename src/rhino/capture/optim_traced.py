"""Any optimizer's own ``step()``, traced into the step graph.

An optimizer that ``optim.py`` does not mirror (a user-written one, a subclass with its own ``step``, one of
torch's others such as Rprop, ASGD or Adafactor) is captured by running its ``step()`` inside the trace on a
shadow: a copy of the optimizer object whose parameters are the traced parameters (gradients attached as
``.grad``) and whose state holds the traced state tensors. Its in-place updates are recorded like any other
op and functionalised with the rest of the step, so the captured update is the optimizer's own code.

State: the graph takes every state tensor as an input and returns its new value, so a state that ``step()``
creates lazily at its first step (``state["exp_avg"] = torch.zeros_like(p)``) needs its value before the
first step. ``plan_traced`` finds it by a first trace of ``step()`` over fake tensors (nothing allocated)
with a state dict that records the first tensor stored under each key the optimizer did not hold: the
recorded values, as functions of the parameters (``TracedInit``), are evaluated later on each parameter's
real value. During the captured step the state is already there, so the lazy branch is not taken.

A first value read from the gradient (torch's SGD starts its momentum buffer as ``torch.clone(grad)``, which
with ``dampening`` is not the later rule applied to zeros) is no function of the state before the step. Then
every parameter gets a 0-dim state ``started`` (0 before its first step, as torch holding no state for it) and
the captured step runs ``step()`` twice: on copies of the parameters and gradients with empty state (the
first-step branch) and on the state it holds (the later steps); ``torch.where(started > 0, later, first)``
picks each new parameter and state tensor, so every step is torch's own arithmetic. The state's values before
the first step are then stand-ins of the right shape (the recorded values with the gradient read as the
parameter), which only the discarded branch reads.

Refused with one sentence each: a first value read from a frozen parameter or from state held before, a Python
number in the state, a param group or the optimizer that changes every step (traced once, it would stay at its
first value), a state tensor whose shape or dtype changes, and closures (LBFGS re-evaluates the model inside
``step``). A subclass of a torch optimizer whose own ``step()`` calls ``super().step()`` (clipping first) is
traced with torch's flags as below, and ``capturable`` on (tensor-only arithmetic: Adam's other path reads its
step as a number).

torch's own optimizers read their step counters with ``.item()`` unless ``torch.compiler.is_compiling()``;
their steps are traced as torch.compile would trace them (that flag on, single-tensor code: ``foreach`` and
``fused`` off), the math in tensors instead of Python doubles.
"""
from __future__ import annotations

import contextlib
import re
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensorMode)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

import torch.optim.optimizer as torch_optimizer   # torch's global step hooks

from .optim import ParamUpdate, hyperparameters, scalar_dtype, unhooked
from .optim_kernels import traceable_kernels
from .workload import WorkloadError

__all__ = ["TracedInit", "plan_traced", "traced_update"]

TRACED = "traced"
STARTED = "started"   # the 0-dim state of a first-step branch (0 before the parameter's first step)
_PRIMITIVE = (int, float, bool, complex, str, type(None))


@dataclass
class TracedInit:
    """The state tensors ``step()`` creates at its first step, as a graph over the parameters.

    ``module.graph``: inputs are the trained parameters (in ``names`` order); output ``index[(param, key)]`` is
    that state's first value. ``meta``: the shape and dtype of every state tensor (held ones included)."""

    module: torch.fx.GraphModule      # its graph; constants (``torch.tensor(0.0)``) are its attributes
    names: list[str]
    index: dict[tuple[str, str], int]
    meta: dict[tuple[str, str], torch.Tensor]
    constants: dict[str, dict[str, object]] = field(default_factory=dict)   # non-tensor state, fixed
    from_gradient: bool = False   # a first value reads the gradient: the step keeps a first-step branch
    _param_of: dict = field(default_factory=dict, repr=False)              # placeholder -> parameter name

    def value(self, name: str, key: str, param_value: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The first value of state ``key`` of parameter ``name``, from the parameters' values
        (``param_value(name)``, asked only for those it is computed from)."""
        graph = self.module.graph
        out = list(graph.nodes)[-1].args[0][self.index[(name, key)]]
        needed: set[torch.fx.Node] = set()
        todo = [out]
        while todo:
            node = todo.pop()
            if node in needed:
                continue
            needed.add(node)
            todo.extend(node.all_input_nodes)
        env: dict[torch.fx.Node, object] = {}
        if not self._param_of:
            placeholders = [n for n in graph.nodes if n.op == "placeholder"]
            self._param_of.update(zip(placeholders, self.names))
        for node in graph.nodes:
            if node not in needed:
                continue
            if node.op == "placeholder":
                env[node] = param_value(self._param_of[node])
            elif node.op == "get_attr":
                env[node] = getattr(self.module, node.target)
            elif node.op == "call_function":
                args = torch.fx.node.map_arg(node.args, env.__getitem__)
                kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
                env[node] = node.target(*args, **kwargs)
        return env[out].detach().clone()


class _Recording(dict):
    """A parameter's state dict that remembers the first value stored under each key it did not hold."""

    def __init__(self, held: dict, first: dict) -> None:
        super().__init__(held)
        self.first = first

    def __setitem__(self, key, value) -> None:
        if key not in self.first and not dict.__contains__(self, key):
            self.first[key] = value.clone() if isinstance(value, torch.Tensor) else value
        super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args, **kwargs) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v


def _raw_step(optimizer: torch.optim.Optimizer):
    """The class's ``step`` without torch's profiling wrapper (which would record profiler ops)."""
    return unhooked(type(optimizer).step)


@contextlib.contextmanager
def _compiling(on: bool):
    """``torch.compiler.is_compiling()`` answers True: torch's optimizers keep their scalars in tensors."""
    if not on:
        yield
        return
    before = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = before


@contextlib.contextmanager
def _data_assignment_copies():
    """``t.data = x`` as ``t.copy_(x)`` (same shape and dtype): tracing does not see a tensor's data swapped,
    so the update ``p.data = p.data - lr * g`` (older optimizer code) would be lost."""
    base = torch._C.TensorBase.data

    def assign(t, value):
        if not isinstance(value, torch.Tensor) or value.shape != t.shape or value.dtype != t.dtype:
            raise WorkloadError("the optimizer assigns .data a tensor of another shape or dtype; Rhino traces "
                                "step() and can only follow t.data = x as t.copy_(x)")
        with torch.no_grad():
            t.copy_(value)

    torch.Tensor.data = property(lambda t: base.__get__(t, type(t)), assign)
    try:
        yield
    finally:
        del torch.Tensor.data


@contextlib.contextmanager
def _foreach_per_tensor():
    """``torch._foreach_*`` ops as loops of their per-tensor ops over the lists (a list argument of the same
    length taken item by item, any other argument given to each): the same arithmetic per tensor, and ops
    the registry shards, where a foreach op over all parameters would run opaque and replicated."""
    saved = {}
    for name in [n for n in dir(torch) if n.startswith("_foreach_")]:
        base = name[len("_foreach_"):]
        per = _per_tensor_op(base)
        if per is not None:
            saved[name] = getattr(torch, name)
            value_at = 2 if base.rstrip("_") in ("addcmul", "addcdiv") else None   # their scalar is positional
            setattr(torch, name, _looped(per, name.endswith("_"), value_at))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)


def _per_tensor_op(base: str):
    """The per-tensor op of ``torch._foreach_<base>``: the tensor method, or the out-of-place function written
    back with ``copy_`` for an in-place name without a method (``_foreach_maximum_``)."""
    method = getattr(torch.Tensor, base, None)
    if method is not None:
        return method
    pure = getattr(torch, base[:-1], None) if base.endswith("_") else None
    if pure is None:
        return None
    return lambda t, *args, **kwargs: t.copy_(pure(t, *args, **kwargs))


def _looped(per, in_place: bool, value_at: int | None):
    def run(tensors, *args, **kwargs):
        n = len(tensors)
        if value_at is not None and len(args) > value_at:     # foreach's positional scalar(s): value= per tensor
            args, kwargs = args[:value_at], dict(kwargs, value=args[value_at])

        def item(a, i):
            return a[i] if isinstance(a, (list, tuple)) and len(a) == n else a
        outs = [per(t, *[item(a, i) for a in args], **{k: item(v, i) for k, v in kwargs.items()})
                for i, t in enumerate(tensors)]
        return None if in_place else outs
    return run


def _trained(optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


def _with_grads(trained, params, grads) -> dict[int, torch.Tensor]:
    """The traced parameter standing for each trained one (by id), its gradient as ``.grad``."""
    out = {}
    for p, q, g in zip(trained, params, grads):
        q = q.detach()
        q.grad = g
        out[id(p)] = q
    return out


def _run_step(optimizer, shadow) -> None:
    """``optimizer``'s class's own ``step()`` on ``shadow``, as tracing follows it (module docstring), between
    the step hooks registered on it and on every optimizer (``register_step_pre_hook`` and its kind)."""
    with _compiling(_torch_based(optimizer)), _data_assignment_copies(), _foreach_per_tensor(), \
            _unhooked_bases(optimizer), traceable_kernels():
        args, kwargs = (shadow,), {}      # as torch's wrapper calls them: self, (self, ...), {...}
        pre = (*torch_optimizer._global_optimizer_pre_hooks.values(), *optimizer._optimizer_step_pre_hooks.values())
        for hook in pre:
            out = hook(shadow, args, kwargs)
            if out is not None:
                args, kwargs = out
        _raw_step(optimizer)(*args, **kwargs)
        post = (*optimizer._optimizer_step_post_hooks.values(), *torch_optimizer._global_optimizer_post_hooks.values())
        for hook in post:
            hook(shadow, args, kwargs)


@contextlib.contextmanager
def _unhooked_bases(optimizer):
    """torch's classes' ``step`` without its profiling wrapper while tracing (a subclass's ``super().step()``
    would record profiler ops and run the step hooks a second time)."""
    saved = [(c, c.__dict__["step"]) for c in type(optimizer).__mro__[1:]
             if getattr(c.__dict__.get("step"), "hooked", False)]
    for c, method in saved:
        setattr(c, "step", unhooked(method))
    try:
        yield
    finally:
        for c, method in saved:
            setattr(c, "step", method)


def _torch_step(optimizer) -> bool:
    return getattr(_raw_step(optimizer), "__module__", "").startswith("torch.")


def _torch_based(optimizer) -> bool:
    """Its step is torch's, or a subclass's that may call torch's (``super().step()`` after clipping)."""
    return _torch_step(optimizer) or any(
        c is not torch.optim.Optimizer and issubclass(c, torch.optim.Optimizer)
        and c.__module__.startswith("torch.optim") for c in type(optimizer).__mro__)


def _shadow(optimizer: torch.optim.Optimizer, tensor_of: dict[int, torch.Tensor],
            states: dict[int, dict]) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` over other tensors: ``tensor_of[id(p)]`` for each of its parameters (with
    ``.grad`` already set), ``states[id(p)]`` as their state; every other attribute shared."""
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update(optimizer.__dict__)
    groups = []
    for group in optimizer.param_groups:
        g = dict(group, params=[tensor_of[id(p)] for p in group["params"]])
        for flag in ("foreach", "fused"):
            if flag in g and _torch_based(optimizer):
                g[flag] = False
        if "capturable" in g and _torch_based(optimizer) and not _torch_step(optimizer):
            g["capturable"] = True   # a subclass's super().step(): torch's tensor-only path (Adam's reads .item())
        groups.append(g)
    shadow.param_groups = groups
    shadow.state = defaultdict(dict)
    for p_id, st in states.items():
        shadow.state[tensor_of[p_id]] = st
    return shadow


def _snapshot(optimizer) -> dict:
    """What a step could change outside ``self.state``: param-group entries and the optimizer's attributes,
    Python numbers by value and tensors by identity and version (rebound or changed in place)."""
    def key(v):
        return ("tensor", id(v), v._version) if isinstance(v, torch.Tensor) else v
    out = {("group",) + k: v for k, v in hyperparameters(optimizer).items()}
    out.update({("attr", k): key(v) for k, v in vars(optimizer).items()
                if k not in ("state", "param_groups") and isinstance(v, _PRIMITIVE + (torch.Tensor,))})
    return out


def _changed_number(where: str, before, after) -> WorkloadError:
    if isinstance(before, tuple) and before[:1] == ("tensor",):
        return WorkloadError(f"the optimizer changes {where}, a tensor outside self.state, at every step; Rhino "
                             f"traces step() once and reads such tensors as constants: keep what changes per "
                             f"step in self.state[p] (e.g. state['step'] = torch.tensor(0.0))")
    return WorkloadError(f"the optimizer changes {where} at every step ({before!r} -> {after!r}), a Python "
                         f"value that Rhino traces once; keep it in a tensor (torch.tensor({before!r})), as "
                         f"torch.optim keeps its step counters")


def plan_traced(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[ParamUpdate]:
    """One ParamUpdate per trained parameter, all sharing the ``TracedInit`` of the optimizer's state."""
    inner = _inner_optimizer(optimizer)
    if inner is not None:
        raise WorkloadError(f"the optimizer holds another optimizer ({inner}) and steps through it; Rhino traces "
                            f"one step() over the traced parameters, and the inner optimizer's own parameters "
                            f"would not be traced: write the combined update in one optimizer's step()")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise WorkloadError("LBFGS re-evaluates the model several times inside step() through a closure; Rhino "
                            "captures one forward, one backward and one update per step: use another optimizer")
    trained = _trained(optimizer)
    frozen = [p for g in optimizer.param_groups for p in g["params"] if not p.requires_grad]
    complex_ = [names[id(p)] for p in trained if p.is_complex()]
    if complex_:
        raise WorkloadError(f"parameter {complex_[0]} is complex, which Rhino does not support; hold its real and "
                            f"imaginary parts as two real parameters (torch.complex(re, im) in forward)")
    order = [names[id(p)] for p in trained]
    held = {id(p): {k: v for k, v in optimizer.state.get(p, {}).items()} for p in trained}
    held_tensors = [(i, k, v) for i, p in enumerate(trained) for k, v in held[id(p)].items()
                    if isinstance(v, torch.Tensor)]
    firsts: dict[int, dict] = {id(p): {} for p in trained}
    finals: dict[int, dict] = {}
    snapshots: list[dict] = []

    def first_step(*flat):
        n, m = len(trained), len(frozen)
        params, grads, tensors = flat[:n], flat[n:2 * n], flat[2 * n + m:]
        shadow_params, states = _with_grads(trained, params, grads), {}
        for (i, k, _), t in zip(held_tensors, tensors):
            held[id(trained[i])][k] = t
        for p, q in zip(frozen, flat[2 * n:2 * n + m]):     # no gradient: stepped over
            shadow_params[id(p)] = q.detach()
        for p in trained:
            states[id(p)] = _Recording(held[id(p)], firsts[id(p)])
        shadow = _shadow(optimizer, shadow_params, states)
        snapshots.append(_snapshot(shadow))
        _run_step(optimizer, shadow)
        snapshots.append(_snapshot(shadow))
        finals.update({p_id: dict(st) for p_id, st in states.items()})
        return [v for p in trained for v in firsts[id(p)].values() if isinstance(v, torch.Tensor)]

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = lambda t: _fake(mode, t)  # noqa: E731
    flat = [fake(p) for p in trained] + [fake(p) for p in trained] + [fake(p) for p in frozen] + \
        [fake(v) for _, _, v in held_tensors]
    try:
        gm = make_fx(torch.func.functionalize(first_step, remove="mutations"), tracing_mode="fake")(*flat)
    except WorkloadError:
        raise
    except (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode) as exc:
        fix = "torch's own code for it does so: use another optimizer" if _torch_step(optimizer) else \
            "use tensor ops such as torch.where or torch.clamp instead"
        raise WorkloadError(f"{type(optimizer).__name__}.step() reads a tensor's value as a Python number at "
                            f"{_step_frame(exc)} (.item(), float(t), a branch on a tensor), which a "
                            f"training-step graph cannot hold; {fix}") from None
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError, AssertionError,
            NotImplementedError) as exc:
        text = str(exc).strip()
        out = re.search(r"aten::(\w+)\.out\b", text)
        if out:
            raise WorkloadError(f"{type(optimizer).__name__}.step() writes a result into a tensor with out= "
                                f"(aten::{out.group(1)}.out), which cannot be traced as a pure op; assign it or "
                                f"copy it in instead (x.copy_(torch.{out.group(1)}(...)))") from None
        first = text.splitlines()[0].split(". ")[0].rstrip(".") if text else type(exc).__name__
        attrs = [k for k, v in vars(optimizer).items() if isinstance(v, torch.Tensor)]
        # an in-place write of traced values into such a tensor fails inside functionalization, before any check
        held_note = (f"; it holds self.{attrs[0]}, a tensor outside self.state, which Rhino reads as a constant: "
                     f"if step() updates it, keep it in self.state[p]") if attrs and "INTERNAL ASSERT" in text else ""
        raise WorkloadError(f"{type(optimizer).__name__}.step() cannot be traced on the model's parameters "
                            f"({first}); Rhino calls step() once, without a closure, with each gradient as "
                            f"p.grad and the state in self.state[p]{held_note}") from None
    before, after = snapshots[0], snapshots[-1]
    for k, v in before.items():
        if after.get(k, v) != v:
            where = f"param_groups[{k[1]}][{k[2]!r}]" if k[0] == "group" else f"self.{k[1]}"
            raise _changed_number(where, v, after[k])
    return _updates(optimizer, trained, order, held, firsts, finals, *_init_graph(gm, len(trained)))


def _step_frame(exc: BaseException) -> str:
    """The innermost frame of the traceback in the optimizer's code (outside rhino and torch's tracing)."""
    rhino_dir = str(Path(__file__).parents[1])
    torch_dir = Path(torch.__file__).parent
    inner = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(rhino_dir)
             and (not f.filename.startswith(str(torch_dir)) or f.filename.startswith(str(torch_dir / "optim")))]
    if not inner:
        return "its step()"
    f = inner[-1]
    return f"{f.filename}:{f.lineno}" + (f" ({f.line.strip()})" if f.line else "")


def _inner_optimizer(optimizer) -> str | None:
    """The attribute holding another optimizer (Lookahead's, SAM's base optimizer), if any."""
    for k, v in vars(optimizer).items():
        values = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(x, torch.optim.Optimizer) and x is not optimizer for x in values):
            return f"self.{k}"
    return None


def _fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta":
        with mode:
            return torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return mode.from_tensor(t.detach())


_aten = torch.ops.aten
# ops that read only their first argument's shape, dtype and device (the gradient and its parameter agree)
_SHAPE_ONLY = frozenset({_aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default,
                         _aten.empty_like.default, _aten.new_zeros.default, _aten.new_ones.default,
                         _aten.new_full.default, _aten.new_empty.default})


def _init_graph(gm: torch.fx.GraphModule, n: int) -> tuple[torch.fx.GraphModule, bool]:
    """The traced first step reduced to what the recorded first values are computed from, and whether that
    reads a gradient (then read as the parameter: stand-ins, see the module docstring)."""
    graph = gm.graph
    for node in reversed(list(graph.nodes)):     # write-backs of mutated inputs: the step's own effects
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default \
                and node.args[0].op == "placeholder" and not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    placeholders = [p for p in graph.nodes if p.op == "placeholder"]
    if any(p.users for p in placeholders[2 * n:]):
        raise WorkloadError("the optimizer's first step stores state computed from a frozen parameter or from "
                            "state it held before; start it from zeros or from the parameter it belongs to")
    for param, grad in zip(placeholders[:n], placeholders[n:2 * n]):
        for user in list(grad.users):          # torch.full_like(grad, lr): the gradient's shape, not its values
            if user.target in _SHAPE_ONLY and user.args[0] is grad:
                user.args = (param, *user.args[1:])
    from_gradient = any(p.users for p in placeholders[n:2 * n])
    for param, grad in zip(placeholders[:n], placeholders[n:2 * n]):
        grad.replace_all_uses_with(param)
    return gm, from_gradient


def _updates(optimizer, trained, order, held, firsts, finals, module, from_gradient: bool) -> list[ParamUpdate]:
    index, meta, constants, k = {}, {}, {}, 0
    for p, name in zip(trained, order):
        for key, v in firsts[id(p)].items():
            if isinstance(v, torch.Tensor):
                index[(name, key)] = k
                k += 1
    init = TracedInit(module, order, index, meta, constants, from_gradient)
    plans = []
    for p, name in zip(trained, order):
        final = finals[id(p)]
        keys = []
        for key, v in final.items():
            start = held[id(p)][key] if key in held[id(p)] else firsts[id(p)].get(key)
            if isinstance(v, torch.Tensor) != isinstance(start, torch.Tensor):
                raise WorkloadError(f"the optimizer's state {key!r} changes between a tensor and a "
                                    f"{type(v).__name__ if not isinstance(v, torch.Tensor) else 'Python value'}"
                                    f" in its step; keep it a tensor")
            if not isinstance(v, torch.Tensor):
                if v != start:
                    raise _changed_number(f"its state {key!r}", start, v)
                constants.setdefault(name, {})[key] = v
                continue
            if tuple(v.shape) != tuple(start.shape) or v.dtype != start.dtype:
                raise WorkloadError(f"the optimizer's state {key!r} of parameter {name} changes from "
                                    f"{list(start.shape)} {start.dtype} to {list(v.shape)} {v.dtype} in one "
                                    f"step; a state tensor must keep its shape and dtype")
            if key not in held[id(p)] and (name, key) not in index:
                raise WorkloadError(f"the optimizer's state {key!r} of parameter {name} is made without "
                                    f"being stored as state[{key!r}] = tensor; store it so")
            meta[(name, key)] = torch.empty(v.shape, dtype=v.dtype, device="meta")
            keys.append(key)
        torch_keys = list(keys)
        if from_gradient:
            keys.append(STARTED)
            meta[(name, STARTED)] = torch.empty((), dtype=scalar_dtype(None, STARTED), device="meta")
        plans.append(ParamUpdate(name, TRACED, {}, keys, torch_keys, init=init))
    return plans


def traced_update(optimizer: torch.optim.Optimizer, updates: list[ParamUpdate], params: list[torch.Tensor],
                  grads: list, state: dict[str, torch.Tensor], state_name, frozen: dict[int, torch.Tensor]
                  ) -> tuple[list, dict]:
    """Inside the step's trace: the optimizer's own ``step()`` on the traced parameters, gradients and
    state -> (new parameters, new state by graph-input name). ``frozen``: the traced tensor of each frozen
    parameter the optimizer holds, by the id of the workload's parameter."""
    trained = _trained(optimizer)
    branched = bool(updates) and updates[0].init.from_gradient
    if branched:    # before the step below changes the parameters (and a clipping step the gradients) in place
        first = _stepped(optimizer, updates, trained, [p.clone() for p in params],
                         [None if g is None else g.clone() for g in grads], frozen, None, state_name)
    new_params, new_state = _stepped(optimizer, updates, trained, params, grads, frozen, state, state_name)
    if branched:
        for i, (u, g) in enumerate(zip(updates, grads)):
            started = state[state_name(u.name, STARTED)]
            later = started > 0
            new_params[i] = torch.where(later, new_params[i], first[0][i])
            for k in u.state_keys:
                name = state_name(u.name, k)
                if k != STARTED and name in first[1]:
                    new_state[name] = torch.where(later, new_state[name], first[1][name])
            # torch skips a parameter without a gradient: no state made, its first step still to come
            new_state[state_name(u.name, STARTED)] = started if g is None else torch.ones_like(started)
    return new_params, new_state


def _stepped(optimizer, updates, trained, params, grads, frozen, state, state_name) -> tuple[list, dict]:
    """``step()`` on ``params`` with ``grads``: from ``state`` (by graph-input name), or from no state at all
    (``None``: the first step) -> (new parameters, new state by graph-input name, where the step made it)."""
    tensor_of, states = _with_grads(trained, params, grads), {}
    for p, u in zip(trained, updates):
        st = {} if state is None else {k: state[state_name(u.name, k)] for k in u.state_keys if k != STARTED}
        st.update(u.init.constants.get(u.name, {}))
        states[id(p)] = st
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in tensor_of:
                tensor_of[id(p)] = frozen[id(p)].detach()
    shadow = _shadow(optimizer, tensor_of, states)
    _run_step(optimizer, shadow)
    new_state = {}
    for p, u in zip(trained, updates):
        st = shadow.state[tensor_of[id(p)]]
        for k in u.state_keys:
            if k in st:
                new_state[state_name(u.name, k)] = st[k]
    return [tensor_of[id(p)] for p in trained], new_state
