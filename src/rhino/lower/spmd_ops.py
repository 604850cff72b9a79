"""The functions a per-rank program calls for communication. The runtime sets the context (mesh,
rank, process groups) once; the emitted code names each step and its parameters, e.g.
``redistribute(x, 'AllGather', 1, 0, 3)`` = all-gather dim 0 (3 blocks) along mesh axis 1.

Overlapped programs (``lower.overlap``) split a communication step into ``start([x, ...], kind, axis,
*params)``, which issues it on one or more tensors (a bucket) and returns a handle, and ``wait(handle)``,
which returns the list of results; ``COMM_KINDS`` are the step kinds that communicate."""
from __future__ import annotations

import torch

from ..sharding.mesh import Mesh
from ..sharding.placement import ReduceOp
from ..sharding.steps import (AllGather, AllReduce, AllToAll, LocalScale, LocalSlice, ReduceScatter, Step,
                              ZeroUnlessFirst)

__all__ = ["set_context", "redistribute", "step_args", "start", "wait", "COMM_KINDS"]

COMM_KINDS = frozenset({"AllReduce", "ReduceScatter", "AllGather", "AllToAll"})

_CTX: dict = {}


def set_context(mesh: Mesh, rank: int, groups, native: bool | None = None) -> None:
    _CTX.update(mesh=mesh, rank=rank, groups=groups, native=native)


def step_args(step: Step) -> tuple:
    """A step as plain arguments: (kind, axis, *fields)."""
    if isinstance(step, AllReduce):
        return ("AllReduce", step.axis, step.op.value)
    if isinstance(step, ReduceScatter):
        return ("ReduceScatter", step.axis, step.op.value, step.dim, step.blocks)
    if isinstance(step, AllGather):
        return ("AllGather", step.axis, step.dim, step.blocks)
    if isinstance(step, AllToAll):
        return ("AllToAll", step.axis, step.src_dim, step.src_blocks, step.dst_dim, step.dst_blocks)
    if isinstance(step, LocalSlice):
        return ("LocalSlice", step.axis, step.dim, step.blocks)
    if isinstance(step, LocalScale):
        return ("LocalScale", step.axis, float(step.factor))
    if isinstance(step, ZeroUnlessFirst):
        return ("ZeroUnlessFirst", step.axis)
    raise ValueError(f"unknown step {step!r}")


def _step(kind: str, axis: int, *p) -> Step:
    if kind == "AllReduce":
        return AllReduce(axis, ReduceOp(p[0]))
    if kind == "ReduceScatter":
        return ReduceScatter(axis, ReduceOp(p[0]), p[1], p[2])
    if kind == "AllGather":
        return AllGather(axis, p[0], p[1])
    if kind == "AllToAll":
        return AllToAll(axis, *p)
    if kind == "LocalSlice":
        return LocalSlice(axis, p[0], p[1])
    if kind == "LocalScale":
        return LocalScale(axis, p[0])
    if kind == "ZeroUnlessFirst":
        return ZeroUnlessFirst(axis)
    raise ValueError(f"unknown step kind {kind!r}")


def redistribute(x: torch.Tensor, kind: str, axis: int, *params) -> torch.Tensor:
    from ..runtime.collectives import apply_step
    return apply_step(x, _step(kind, axis, *params), _CTX["mesh"], _CTX["rank"], _CTX["groups"],
                      native=_CTX.get("native"))


def start(xs: list, kind: str, axis: int, *params):
    """Issue one communication step on every tensor of ``xs`` (one bucket); ``wait`` the handle."""
    from ..runtime.collectives import start_step
    return start_step(list(xs), _step(kind, axis, *params), _CTX["mesh"], _CTX["rank"], _CTX["groups"],
                      native=_CTX.get("native"))


def wait(handle) -> list:
    """The results of a ``start``, one per tensor, once the collective has completed."""
    return handle.wait()
