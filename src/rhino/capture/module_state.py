"""The user's modules as they were before the capture ran their forward.

Tracing runs the workload's ``forward`` on the user's own module objects (parameters swapped for fake
tensors), so whatever ``forward`` stores on them stays there: an activation kept for logging
(``self.last_hidden = h``: a tensor of the trace, which ``copy.deepcopy`` of the model then refuses), a counter
advanced (``self.calls += 1``: the eager reference would start one call ahead). :func:`attributes_kept` puts
every module's attributes back after tracing, and the contents of the lists, dicts and sets they hold.

A Python number that ``forward`` changes (a warm-up counter, an annealed temperature) is a constant of the
captured graph: the step would run with the value seen while tracing, forever. That is refused in one
sentence (:func:`changed_numbers`). A number set where there was none (a cache made on the first call) is not.
Likewise a draw from Python's ``random`` (a ``random.Random`` the module holds, NumPy's global generator) in
``forward`` (LayerDrop written with ``random.random() < p``) is a branch taken once, while tracing: refused
(:func:`python_draws`); the generators are put back too.
"""
from __future__ import annotations

import contextlib
import random
import sys

import torch

__all__ = ["attributes_kept", "changed_numbers", "python_draws"]

_NUMBER = (int, float)


class _Before(list):
    """Per module (name, module, its attributes), and the Python-side random generators' states."""

    def __init__(self, model: torch.nn.Module):
        super().__init__((name, m, dict(m.__dict__)) for name, m in model.named_modules(remove_duplicate=True))
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
    """``module.attribute (old -> new)`` for each Python number (not a bool) that changed since ``before``."""
    out = []
    for name, m, saved in before:
        for key, old in saved.items():
            new = m.__dict__.get(key, old)
            if type(old) in _NUMBER and type(new) in _NUMBER and new != old:
                out.append(f"{name + '.' if name else ''}{key} ({old!r} -> {new!r})")
    return out


@contextlib.contextmanager
def attributes_kept(model: torch.nn.Module):
    """Run the body, then give every module of ``model`` back the attributes it had (added ones removed) and the
    Python-side generators their states. Yields the snapshot, for :func:`changed_numbers` and :func:`python_draws`
    (call them before the body ends)."""
    before = _Before(model)
    try:
        yield before
    finally:
        before.restore()
