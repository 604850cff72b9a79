"""The steps a redistribution is made of. Each acts on one mesh axis; a plan is a list of them,
applied in order to every rank's local tensor. Pure data: the cost model prices them, the lowering
emits the matching ``torch.distributed`` collectives.

Semantics (``n`` = size of ``axis``; "piece" as in ``placement.Shard``):
- ``AllReduce(axis, op)``:              Partial(op) -> Replicate.
- ``ReduceScatter(axis, op, dim, blocks)``: Partial(op) -> Shard(dim, blocks).
- ``AllGather(axis, dim, blocks)``:     Shard(dim, blocks) -> Replicate.
- ``AllToAll(axis, src_dim, src_blocks, dst_dim, dst_blocks)``: Shard(src) -> Shard(dst).
- ``LocalSlice(axis, dim, blocks)``:    Replicate -> Shard(dim, blocks); no communication.
- ``LocalScale(axis, factor)``:         multiply locally (e.g. Partial(avg) -> Partial(sum) by 1/n).
- ``ZeroUnlessFirst(axis)``:            Replicate -> Partial(sum): coordinate 0 keeps the value,
                                        the others hold zeros; no communication.
The ``dim`` of a step is a dim of the tensor's *local* layout at that point (same as the global dim
index: sharding never changes rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .placement import ReduceOp

__all__ = ["after_step", "AllReduce", "ReduceScatter", "AllGather", "AllToAll", "LocalSlice", "LocalScale",
           "ZeroUnlessFirst", "Step", "is_communication"]


@dataclass(frozen=True)
class AllReduce:
    axis: int
    op: ReduceOp = ReduceOp.SUM


@dataclass(frozen=True)
class ReduceScatter:
    axis: int
    op: ReduceOp
    dim: int
    blocks: int = 1


@dataclass(frozen=True)
class AllGather:
    axis: int
    dim: int
    blocks: int = 1


@dataclass(frozen=True)
class AllToAll:
    axis: int
    src_dim: int
    src_blocks: int
    dst_dim: int
    dst_blocks: int


@dataclass(frozen=True)
class LocalSlice:
    axis: int
    dim: int
    blocks: int = 1


@dataclass(frozen=True)
class LocalScale:
    axis: int
    factor: float


@dataclass(frozen=True)
class ZeroUnlessFirst:
    axis: int


Step = Union[AllReduce, ReduceScatter, AllGather, AllToAll, LocalSlice, LocalScale, ZeroUnlessFirst]


def is_communication(step: Step) -> bool:
    return isinstance(step, (AllReduce, ReduceScatter, AllGather, AllToAll))


def after_step(shape: tuple[int, ...], step: Step, sizes) -> tuple[int, ...]:
    """A rank's local shape after one redistribution step on a mesh of axis ``sizes``."""
    out = list(shape)
    n = sizes[step.axis]
    if isinstance(step, AllGather):
        out[step.dim] *= n
    elif isinstance(step, (ReduceScatter, LocalSlice)):
        out[step.dim] //= n
    elif isinstance(step, AllToAll):
        out[step.src_dim] *= n
        out[step.dst_dim] //= n
    return tuple(out)
