"""The functions a per-rank program calls for communication. The runtime sets the context (mesh,
rank, process groups, collectives) once; the emitted code names each step and its parameters, e.g.
``redistribute(x, 'AllGather', 1, 0, 3)`` = all-gather dim 0 (3 blocks) along mesh axis 1.

Overlapped programs (``lower.overlap``) split a communication step into ``start([x, ...], kind, axis,
*params)``, which issues it on one or more tensors (a bucket) and returns a handle, and ``wait(handle)``,
which returns the list of results; ``COMM_KINDS`` are the step kinds that communicate.

The collectives themselves are injected: ``set_context`` receives a ``Collectives`` (the runtime passes
``runtime.collectives.TORCH_COLLECTIVES``, on ``torch.distributed``), so ``lower/`` never imports
``runtime/``."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..sharding.mesh import Mesh
from ..sharding.placement import ReduceOp
from ..sharding.steps import (AllGather, AllReduce, AllToAll, LocalScale, LocalSlice, ReduceScatter, Step,
                              ZeroUnlessFirst)

__all__ = ["Collectives", "set_context", "clear_context", "redistribute", "step_args", "step_from_args", "start", "wait",
           "COMM_KINDS"]

COMM_KINDS = frozenset({"AllReduce", "ReduceScatter", "AllGather", "AllToAll"})

_CTX: dict = {}


@dataclass(frozen=True)
class Collectives:
    """The communication a per-rank program calls: ``apply(x, step, mesh, rank, groups, native=...)``
    returns this rank's result of one step; ``start(xs, step, mesh, rank, groups, native=...)`` issues it on
    a bucket and returns a handle whose ``wait()`` gives the results."""

    apply: Callable
    start: Callable


def set_context(mesh: Mesh, rank: int, groups, collectives: Collectives, native: bool | None = None) -> None:
    """What ``redistribute`` and ``start`` run on in this process: the mesh, this rank, its process groups
    and the collective implementation."""
    _CTX.update(mesh=mesh, rank=rank, groups=groups, collectives=collectives, native=native)


def clear_context() -> None:
    """Forget the context (its process groups with it): the runtime calls it before destroying the process
    group, so no group outlives ``destroy_process_group`` (a gloo group still alive at interpreter exit can
    abort the process when one of its threads frees a finished collective's tensors)."""
    _CTX.clear()


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


def step_from_args(kind: str, axis: int, *p) -> Step:
    """The inverse of ``step_args``."""
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


def _collectives() -> Collectives:
    if "collectives" not in _CTX:
        raise RuntimeError("a per-rank program communicated before set_context(mesh, rank, groups, collectives) "
                           "was called in this process")
    return _CTX["collectives"]


def redistribute(x: torch.Tensor, kind: str, axis: int, *params) -> torch.Tensor:
    """One communication step on ``x`` (this rank's result), e.g. ``redistribute(x, 'AllGather', 1, 0, 3)``."""
    return _collectives().apply(x, step_from_args(kind, axis, *params), _CTX["mesh"], _CTX["rank"],
                                _CTX["groups"], native=_CTX.get("native"))


def start(xs: list, kind: str, axis: int, *params):
    """Issue one communication step on every tensor of ``xs`` (one bucket); ``wait`` the handle."""
    return _collectives().start(list(xs), step_from_args(kind, axis, *params), _CTX["mesh"], _CTX["rank"],
                                _CTX["groups"], native=_CTX.get("native"))


def wait(handle) -> list:
    """The results of a ``start``, one per tensor, once the collective has completed."""
    return handle.wait()
