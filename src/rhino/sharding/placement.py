"""Placements of a tensor on one mesh axis, and of a tensor on a whole mesh.

- ``Replicate()``: every rank of the axis holds the whole tensor.
- ``Shard(dim, blocks)``: the dim is cut in ``blocks`` equal blocks and each block in ``n`` equal
  pieces (``n`` = axis size); rank i holds piece i of every block, concatenated. ``blocks=1`` is the
  usual contiguous split; ``blocks>1`` is strided partitioning (a fused QKV weight ``[3H, H]`` with
  ``blocks=3`` gives each rank its slice of Q, K and V).
- ``Partial(op)``: every rank holds a full-shaped tensor; the true value is their sum (or max/min;
  ``avg`` = sum / n).

Several mesh axes may shard the same dim: the earlier axis is the outer split.

Precise semantics of a sharding ``(p_0, ..., p_{k-1})`` on a mesh with sizes ``n_a``, for the rank
with coordinates ``(c_0, ..., c_{k-1})``:

1. Partial axes, in axis order, decompose the value: axis ``a`` with ``Partial(op)`` splits what
   it is given into ``n_a`` parts whose ``op``-reduction (avg: mean) is that thing; later Partial
   axes split each part again. So the value is ``op_0 over c_0 ( op_1 over c_1 ( ... local ))``
   with the reductions nested in axis order (only the Partial axes take part; the innermost is
   reduced first). Partial ops that commute (sum with avg, max with max, min with min) may be
   reduced in any order; others may not.
2. Shard axes, in axis order, slice the rank's part: for axis ``a`` with ``Shard(d, b)`` view the
   *current* local dim ``d`` (length ``L``) as ``[b, n_a, L/(b*n_a)]``, keep index ``c_a`` of the
   middle and flatten back. Slicing commutes with the Partial decomposition, so the order of 1
   and 2 does not matter; on one dim, the order of the Shard axes does.
3. Replicate axes do nothing: the ranks along them hold the same tensor.

An axis of size 1 is the same as Replicate whatever its placement (a Partial over one rank is the
value itself). ``simulate`` implements exactly this definition.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence, Union

from .mesh import Mesh

__all__ = ["ReduceOp", "Replicate", "Shard", "Partial", "Placement", "Sharding", "local_shape",
           "format_sharding", "parse_placement", "replicated"]


class ReduceOp(str, Enum):
    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int
    blocks: int = 1

    def __post_init__(self) -> None:
        if self.blocks < 1:
            raise ValueError(f"Shard blocks must be >= 1, got {self.blocks}")

    def __str__(self) -> str:
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim},{self.blocks})"


@dataclass(frozen=True)
class Partial:
    op: ReduceOp = ReduceOp.SUM

    def __str__(self) -> str:
        return f"P({self.op.value})"


Placement = Union[Replicate, Shard, Partial]
Sharding = tuple  # tuple[Placement, ...], one per mesh axis


def replicated(mesh: Mesh) -> Sharding:
    return tuple(Replicate() for _ in range(mesh.ndim))


def local_shape(shape: Sequence[int], sharding: Sharding, mesh: Mesh) -> tuple[int, ...]:
    """Shape each rank holds. Raises ValueError when a sharded dim does not divide evenly."""
    out = list(shape)
    for axis, p in enumerate(sharding):
        if isinstance(p, Shard):
            n = mesh.sizes[axis]
            if p.dim >= len(out):
                raise ValueError(f"Shard({p.dim}) on a tensor of rank {len(out)}")
            if out[p.dim] % (n * p.blocks):
                raise ValueError(f"dim {p.dim} of size {out[p.dim]} does not split into {p.blocks} block(s) "
                                 f"x {n} pieces on mesh axis {mesh.names[axis]!r}")
            out[p.dim] //= n
    return tuple(out)


def format_sharding(sharding: Sharding) -> str:
    return "[" + ", ".join(str(p) for p in sharding) + "]"


def parse_placement(text: str) -> Placement:
    """``"R"``, ``"S(0)"``, ``"S(0,3)"``, ``"P(sum)"``."""
    t = text.strip()
    if t == "R":
        return Replicate()
    if t.startswith("S(") and t.endswith(")"):
        parts = [int(x) for x in t[2:-1].split(",")]
        return Shard(*parts)
    if t.startswith("P(") and t.endswith(")"):
        return Partial(ReduceOp(t[2:-1]))
    raise ValueError(f"cannot parse placement {text!r}; use R, S(dim), S(dim,blocks) or P(sum|avg|max|min)")
