"""Memory planning after ROAM (pure Python, never imports torch): an operator order and an offset for
every intermediate tensor in one arena, minimising the peak. Works on plain data (``problem.py``)."""
from __future__ import annotations

import importlib
from typing import Any

from .problem import MemOp, MemProblem, MemTensor, OpRole, TensorKind, buffers, lifetimes
from .simulate import Replay, check_order, replay

# Heavier modules (CP-SAT, the layout solvers) load on first use.
_LAZY = {
    "AllocatorStats": "allocator", "CachingAllocator": "allocator", "simulate_allocator": "allocator",
    "OptLevel": "order", "OrderOptions": "order", "OrderResult": "order", "least_peak_order": "order",
    "order_ops": "order", "program_order": "order", "rule_order": "order",
    "MemoryPlan": "plan", "plan_memory": "plan",
    "StepMemoryReport": "step_report", "plan_step_memory": "step_report",
    "Buffer": "layout", "GreedyOrder": "layout", "LayoutResult": "layout", "greedy_layout": "layout",
    "LayoutStatus": "layout", "lower_bound": "layout", "solve_layout": "layout", "validate_layout": "layout",
}

__all__ = [
    "MemOp", "MemProblem", "MemTensor", "OpRole", "TensorKind", "buffers", "lifetimes",
    "Replay", "check_order", "replay",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'rhino.memory' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
