"""Independent checkers for an operator order: dependency check and an event-by-event memory replay.

``replay`` is written independently of ``problem.lifetimes`` (reference counts, not intervals) so that
the tests can check each against the other. It follows the lifetime rule of ``problem.py``: before the
first step the graph inputs are allocated; at each step the op's outputs are allocated, the live bytes
of the step are recorded (inputs and outputs of the op are all live), then every tensor whose last
reader just ran, and every output nobody reads, is freed (OUTPUT tensors and inputs marked
``also_output`` are never freed; an input nobody reads is freed after step 0).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .problem import MemProblem, TensorKind

__all__ = ["Replay", "check_order", "replay"]


@dataclass(frozen=True)
class Replay:
    """Live bytes per step of an order, their maximum and the first step where it is reached."""

    peak: int
    live: list[int]
    peak_step: int


def check_order(problem: MemProblem, order: Iterable[int]) -> None:
    """Raise ``ValueError`` unless ``order`` is a permutation of the op ids respecting every dependency."""
    order = list(order)
    ids = [op.id for op in problem.ops]
    if len(order) != len(ids) or set(order) != set(ids):
        missing = sorted(set(ids) - set(order))[:5]
        extra = sorted(set(order) - set(ids))[:5]
        raise ValueError(f"the order is not a permutation of the {len(ids)} op ids "
                         f"(length {len(order)}, missing {missing}, unknown {extra})")
    if len(set(order)) != len(order):
        raise ValueError("the order lists an op twice")
    made: set[int] = {tid for tid, t in problem.tensors.items() if t.kind is TensorKind.INPUT}
    ran: set[int] = set()
    for s, o in enumerate(order):
        op = problem.op(o)
        for tid in op.inputs:
            if tid not in made:
                raise ValueError(f"step {s}: op {o} ({op.name!r}) reads tensor {tid} before it is produced")
        for dep in op.after:
            if dep not in ran:
                raise ValueError(f"step {s}: op {o} ({op.name!r}) runs before op {dep}, which it must follow")
        made.update(op.outputs)
        ran.add(o)


def replay(problem: MemProblem, order: Iterable[int]) -> Replay:
    """Live bytes per step, replaying allocations and frees event by event (see the module docstring)."""
    order = list(order)
    remaining: dict[int, int] = {tid: 0 for tid in problem.tensors}
    for o in order:
        for tid in set(problem.op(o).inputs):
            remaining[tid] += 1
    keep = {tid for tid, t in problem.tensors.items()
            if t.kind is TensorKind.OUTPUT or (t.kind is TensorKind.INPUT and t.also_output)}
    allocated: set[int] = set()
    current = 0
    for tid, t in problem.tensors.items():
        if t.kind is TensorKind.INPUT:
            allocated.add(tid)
            current += t.size
    live: list[int] = []
    for s, o in enumerate(order):
        op = problem.op(o)
        for tid in op.outputs:
            allocated.add(tid)
            current += problem.tensors[tid].size
        live.append(current)
        dead: list[int] = []
        for tid in set(op.inputs):
            remaining[tid] -= 1
            if remaining[tid] == 0:
                dead.append(tid)
        dead.extend(tid for tid in op.outputs if remaining[tid] == 0)
        if s == 0:
            dead.extend(tid for tid, t in problem.tensors.items()
                        if t.kind is TensorKind.INPUT and remaining[tid] == 0 and tid not in op.inputs)
        for tid in dead:
            if tid in allocated and tid not in keep:
                allocated.remove(tid)
                current -= problem.tensors[tid].size
    if not live:
        return Replay(0, [], 0)
    peak = max(live)
    return Replay(peak, live, live.index(peak))
