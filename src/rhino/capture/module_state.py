"""The user's modules as they were before the capture ran their forward.

Tracing runs the workload's ``forward`` on the user's own module objects (parameters swapped for fake
tensors), so whatever ``forward`` stores on them stays there: an activation kept for logging
(``self.last_hidden = h``: a tensor of the trace, which ``copy.deepcopy`` of the model then refuses), a counter
advanced (``self.calls += 1``: the eager reference would start one call ahead). :func:`attributes_kept` puts
every module's attributes back after tracing, and the contents of the lists, dicts and sets they hold.

A Python number that ``forward`` changes (a warm-up counter, an annealed temperature) is a constant of the
captured graph: the step would run with the value seen while tracing, forever. That is refused in one
sentence (:func:`changed_numbers`). A number set where there was none (a cache made on the first call) is not.
Besides module attributes, the numbers the loss function and the user's module classes' functions reach by
name are watched the same way (:class:`_Reached`): their closure variables and the module-level globals their
code names, each a number or a list or dict holding numbers (``state["step"] += 1`` in the loss function's
closure, a global call counter); they are put back too.
Likewise a draw from Python's ``random`` (a ``random.Random`` the module holds, NumPy's global generator) in
``forward`` (LayerDrop written with ``random.random() < p``) is a branch taken once, while tracing: refused
(:func:`python_draws`); the generators are put back too.
"""
from __future__ import annotations

import contextlib
import random
import sys
import types
from pathlib import Path

import torch

__all__ = ["attributes_kept", "changed_numbers", "python_draws"]

_NUMBER = (int, float)


class _Reached:
    """The numbers that functions reach by name (closure cells, and the globals their code names, nested code
    included) holding a number, a list or a dict, by (name, where: ``"in the closure of loss"``); a user function
    reached so (``kl_weight()`` called by the loss function) is followed, ``_DEPTH`` calls deep."""

    def __init__(self, fns) -> None:
        self.places: dict[tuple[str, str], tuple] = {}  # (name, where) -> (holder or None, object, value or copy)
        seen: set[int] = set()
        todo = [(fn, 0) for fn in fns]
        while todo:
            fn, depth = todo.pop()
            code = getattr(fn, "__code__", None)
            if code is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            label = getattr(fn, "__qualname__", "loss_fn")
            reached = []
            for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
                try:
                    reached.append(((var, f"in the closure of {label}"), cell.cell_contents, cell))
                except ValueError:    # an empty cell
                    continue
            where = f"in the globals of {Path(fn.__globals__.get('__file__') or '?').name}"
            reached += [((name, where), fn.__globals__[name], (fn.__globals__, name)) for name in _names(code)
                        if name in fn.__globals__]
            for key, value, holder in reached:
                self._add(key, value, holder)
                if depth < _DEPTH and _user_function(value):
                    todo.append((value, depth + 1))

    def _add(self, where: tuple[str, str], value, holder) -> None:
        if type(value) in _NUMBER:
            self.places.setdefault(where, (holder, value, value))
        elif type(value) in (list, dict):
            self.places.setdefault(where, (None, value, value.copy()))

    def changed(self) -> list[str]:
        out = []
        for (name, where), (holder, obj, old) in self.places.items():
            if holder is not None:
                new = _held(holder)
                if type(new) in _NUMBER and new != old:
                    out.append(f"{name} ({old!r} -> {new!r}) {where}")
                continue
            keys = range(min(len(old), len(obj))) if isinstance(old, list) else [k for k in old if k in obj]
            out += [f"{name}[{k!r}] ({old[k]!r} -> {obj[k]!r}) {where}" for k in keys
                    if type(old[k]) in _NUMBER and type(obj[k]) in _NUMBER and obj[k] != old[k]]
        return out

    def restore(self) -> None:
        for holder, obj, old in self.places.values():
            if holder is None:
                obj.clear()
                obj.extend(old) if isinstance(obj, list) else obj.update(old)
            elif isinstance(holder, tuple):
                holder[0][holder[1]] = old
            else:
                holder.cell_contents = old


_DEPTH = 3   # calls followed from the loss function and the module classes' functions


_NOT_USER = sys.stdlib_module_names | {"torch", "rhino", "numpy"}


def _user_function(value) -> bool:
    """A plain Python function that is not torch's nor the standard library's (by its module's name)."""
    mod = getattr(value, "__module__", None) or ""
    return isinstance(value, types.FunctionType) and mod.split(".")[0] not in _NOT_USER


def _held(holder):
    return holder[0].get(holder[1]) if isinstance(holder, tuple) else holder.cell_contents


def _names(code) -> set[str]:
    """The global names ``code`` and the code nested in it (lambdas, comprehensions) read."""
    out = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            out |= _names(const)
    return out


def _user_functions(model: torch.nn.Module, loss_fn) -> list:
    """``loss_fn`` and the plain functions of the model's module classes that are not torch's own."""
    out, seen = [loss_fn], set()
    for m in model.modules():
        for cls in type(m).__mro__:
            if cls in seen or cls.__module__.startswith("torch.") or cls is object:
                continue
            seen.add(cls)
            out += [f for f in vars(cls).values() if isinstance(f, types.FunctionType)]
    return out


class _Before(list):
    """Per module (name, module, its attributes), and the Python-side random generators' states."""

    def __init__(self, model: torch.nn.Module, loss_fn=None):
        super().__init__((name, m, dict(m.__dict__)) for name, m in model.named_modules(remove_duplicate=True))
        self.reached = _Reached(_user_functions(model, loss_fn) if loss_fn is not None else [])
        self.random = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None
        # the contents of the lists, dicts and sets they hold (a hook appending features to ``self.feats``)
        self.contents = [(v, v.copy()) for _, _, saved in self for v in saved.values()
                         if isinstance(v, (list, dict, set))]
        # generators the modules hold (``self.rng = random.Random(0)``): their states, by attribute
        self.held = {f"{name + '.' if name else ''}{key}": (g, g.getstate()) for name, _, saved in self
                     for key, g in saved.items() if isinstance(g, random.Random)}

    def restore(self) -> None:
        for _, m, saved in self:
            m.__dict__.clear()
            m.__dict__.update(saved)
        for v, held in self.contents:
            v.clear()
            if isinstance(v, list):
                v.extend(held)
            else:
                v.update(held)
        self.reached.restore()
        random.setstate(self.random)
        for g, state in self.held.values():
            g.setstate(state)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


def python_draws(before: _Before) -> list[str]:
    """The Python-side generators drawn from since ``before``."""
    out = ["Python's random module"] if random.getstate() != before.random else []
    out += [f"the random.Random at {where}" for where, (g, state) in before.held.items() if g.getstate() != state]
    if before.numpy is not None:
        now = sys.modules["numpy"].random.get_state()
        if any((a != b).any() if hasattr(a, "any") else a != b for a, b in zip(now, before.numpy)):
            out.append("NumPy's global random generator")
    return out


def changed_numbers(before: _Before) -> list[str]:
    """``module.attribute (old -> new)`` for each Python number (not a bool) of a module attribute that changed since
    ``before`` (the numbers reached by name: ``before.reached.changed()``)."""
    out = []
    for name, m, saved in before:
        for key, old in saved.items():
            new = m.__dict__.get(key, old)
            if type(old) in _NUMBER and type(new) in _NUMBER and new != old:
                out.append(f"{name + '.' if name else ''}{key} ({old!r} -> {new!r})")
    return out


@contextlib.contextmanager
def attributes_kept(model: torch.nn.Module, loss_fn=None):
    """Run the body, then give every module of ``model`` back the attributes it had (added ones removed) and the
    Python-side generators their states. Yields the snapshot, for :func:`changed_numbers` and :func:`python_draws`
    (call them before the body ends)."""
    before = _Before(model, loss_fn)
    try:
        yield before
    finally:
        before.restore()
