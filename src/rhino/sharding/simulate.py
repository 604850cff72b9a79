"""A numpy simulator of sharded tensors and of the redistribution steps: the oracle for the planner.

Formulation (see ``placement``'s docstring for the sharding semantics it implements):

- ``shard(x, sharding, mesh)`` builds every rank's local tensor straight from the definition:
  the Partial axes, in mesh-axis order, decompose the value into parts (axis 0's parts are
  decomposed again by the next Partial axis, and so on), then each rank takes the part of its
  Partial coordinates and slices it with the Shard axes in mesh-axis order (for ``Shard(d, b)``
  on an axis of size ``n``: view the current local dim ``d`` as ``[b, n, L/(b*n)]`` and keep the
  rank's coordinate of the middle).
- ``assemble(locals, sharding, mesh)`` inverts it: every rank's local tensor is written back to
  the global positions it holds (index arrays built by the same slicing), replicas must agree
  exactly, every position must be covered, then the Partial parts are reduced innermost axis
  first (``op_0 over c_0 ( op_1 over c_1 ( ... ))``).
- ``apply_step(locals, step, mesh)`` runs one ``Step`` on all ranks the way the collective does,
  on local tensors only (it knows nothing about shardings): for each group of ranks along the
  step's axis (ordered by their coordinate on it) it reduces, gathers (piece ``c`` goes to the
  middle index ``c`` of ``[blocks, n, L/blocks]``), or exchanges pieces (all-to-all = gather on
  the source dim, then keep the own piece of the destination dim).

Pure numpy; no torch. Random decompositions are deterministic for a given ``seed`` and use small
integers so that sums are exact in floating point.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .mesh import Mesh
from .placement import Partial, ReduceOp, Replicate, Shard, Sharding, local_shape
from .steps import (AllGather, AllReduce, AllToAll, LocalScale, LocalSlice, ReduceScatter, Step,
                    ZeroUnlessFirst)

__all__ = ["shard", "assemble", "apply_step", "apply_steps", "local_indices", "global_shape"]


def _check(shape: Sequence[int], sharding: Sharding, mesh: Mesh) -> None:
    if len(sharding) != mesh.ndim:
        raise ValueError(f"sharding has {len(sharding)} placements but mesh {mesh} has {mesh.ndim} axes")
    for axis, p in enumerate(sharding):
        if not isinstance(p, (Replicate, Shard, Partial)):
            raise ValueError(f"placement {p!r} on mesh axis {axis} is not Replicate, Shard or Partial")
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            raise ValueError(f"Shard({p.dim}) on mesh axis {mesh.names[axis]!r} but the tensor has rank {len(shape)}")
    local_shape(shape, sharding, mesh)  # raises ValueError naming dim, size and axis


def local_indices(shape: Sequence[int], sharding: Sharding, mesh: Mesh, rank: int) -> list[np.ndarray]:
    """For each dim, the global indices rank ``rank`` holds, in local order."""
    _check(shape, sharding, mesh)
    coords = mesh.coords(rank)
    idx = [np.arange(s) for s in shape]
    for axis, p in enumerate(sharding):
        if isinstance(p, Shard):
            n = mesh.sizes[axis]
            idx[p.dim] = idx[p.dim].reshape(p.blocks, n, -1)[:, coords[axis], :].reshape(-1)
    return idx


def _take(x: np.ndarray, idx: list[np.ndarray]) -> np.ndarray:
    return x.copy() if x.ndim == 0 else x[np.ix_(*idx)]


def _noise(rng: np.random.Generator, shape: tuple, dtype, low: int, high: int) -> np.ndarray:
    return rng.integers(low, high, size=shape).astype(dtype)


def _decompose(v: np.ndarray, op: ReduceOp, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``n`` parts whose ``op``-reduction is ``v`` (avg: mean)."""
    if n == 1:
        return [v.copy()]
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        parts = [_noise(rng, v.shape, v.dtype, -4, 5) for _ in range(n - 1)]
        total = v * n if op is ReduceOp.AVG else v
        return parts + [np.asarray(total - sum(parts), dtype=v.dtype)]
    holder = rng.integers(0, n, size=v.shape)
    sign = -1 if op is ReduceOp.MAX else 1
    return [np.where(holder == c, v, v + sign * _noise(rng, v.shape, v.dtype, 1, 5)) for c in range(n)]


def shard(global_array, sharding: Sharding, mesh: Mesh, seed: int = 0) -> list[np.ndarray]:
    """Every rank's local tensor for ``global_array`` under ``sharding`` (index = rank).

    Partial axes get a random decomposition (deterministic in ``seed``): sum: random parts that
    sum to the value; avg: parts whose mean is the value; max/min: the value on one coordinate
    (chosen per element) and strictly smaller/larger values elsewhere.
    """
    x = np.asarray(global_array)
    _check(x.shape, sharding, mesh)
    rng = np.random.default_rng(seed)
    paxes = [a for a, p in enumerate(sharding) if isinstance(p, Partial)]
    parts: dict[tuple, np.ndarray] = {(): x}
    for a in paxes:
        parts = {key + (c,): piece for key, v in parts.items()
                 for c, piece in enumerate(_decompose(v, sharding[a].op, mesh.sizes[a], rng))}
    out = []
    for r in range(mesh.world):
        coords = mesh.coords(r)
        part = parts[tuple(coords[a] for a in paxes)]
        out.append(_take(part, local_indices(x.shape, sharding, mesh, r)))
    return out


def _reduce(stack: np.ndarray, op: ReduceOp, axis: int) -> np.ndarray:
    if op is ReduceOp.SUM:
        return stack.sum(axis=axis)
    if op is ReduceOp.AVG:
        return stack.mean(axis=axis)
    if op is ReduceOp.MAX:
        return stack.max(axis=axis)
    return stack.min(axis=axis)


def global_shape(local: Sequence[int], sharding: Sharding, mesh: Mesh) -> tuple[int, ...]:
    """The global shape whose local shape under ``sharding`` is ``local``."""
    out = list(local)
    for axis, p in enumerate(sharding):
        if isinstance(p, Shard):
            if not 0 <= p.dim < len(out):
                raise ValueError(f"Shard({p.dim}) on mesh axis {mesh.names[axis]!r} but the tensor has rank {len(out)}")
            out[p.dim] *= mesh.sizes[axis]
    return tuple(out)


def assemble(locals_: Sequence[np.ndarray], sharding: Sharding, mesh: Mesh) -> np.ndarray:
    """The global tensor that the per-rank ``locals_`` represent under ``sharding``.

    Raises ValueError when there is not one local tensor per rank, when shapes disagree with the
    sharding, or when two ranks holding the same element of the same Partial part disagree.
    """
    if len(locals_) != mesh.world:
        raise ValueError(f"expected {mesh.world} local tensors for mesh {mesh}, got {len(locals_)}")
    if len(sharding) != mesh.ndim:
        raise ValueError(f"sharding has {len(sharding)} placements but mesh {mesh} has {mesh.ndim} axes")
    arrays = [np.asarray(t) for t in locals_]
    shape = global_shape(arrays[0].shape, sharding, mesh)
    expect = local_shape(shape, sharding, mesh)
    paxes = [a for a, p in enumerate(sharding) if isinstance(p, Partial)]
    pshape = tuple(mesh.sizes[a] for a in paxes)
    dtype = np.result_type(*arrays)
    values = np.zeros(pshape + shape, dtype=dtype)
    filled = np.zeros(pshape + shape, dtype=bool)
    for r, t in enumerate(arrays):
        if t.shape != expect:
            raise ValueError(f"rank {r} holds shape {t.shape}, expected {expect} for global shape {shape}")
        coords = mesh.coords(r)
        key = tuple(coords[a] for a in paxes)
        idx = local_indices(shape, sharding, mesh, r)
        sel = key + ((np.ix_(*idx)) if idx else ())
        have = filled[sel]
        if np.any(have) and not np.array_equal(values[sel][have], t[have]):
            raise ValueError(f"rank {r} disagrees with another replica of the same elements")
        values[sel] = t
        filled[sel] = True
    assert filled.all(), "every element is held by some rank"
    for pos in reversed(range(len(paxes))):
        values = _reduce(values, sharding[paxes[pos]].op, pos)
    return np.asarray(values)


# ---------------------------------------------------------------- steps on local tensors

def _slice(t: np.ndarray, dim: int, blocks: int, n: int, c: int) -> np.ndarray:
    if not 0 <= dim < t.ndim:
        raise ValueError(f"step names dim {dim} of a local tensor of rank {t.ndim}")
    size = t.shape[dim]
    if size % (blocks * n):
        raise ValueError(f"local dim {dim} of size {size} does not split into {blocks} block(s) x {n} pieces")
    v = t.reshape(t.shape[:dim] + (blocks, n, size // (blocks * n)) + t.shape[dim + 1:])
    return v[(slice(None),) * (dim + 1) + (c,)].reshape(t.shape[:dim] + (size // n,) + t.shape[dim + 1:])


def _gather(pieces: list[np.ndarray], dim: int, blocks: int) -> np.ndarray:
    t = pieces[0]
    if not 0 <= dim < t.ndim:
        raise ValueError(f"step names dim {dim} of a local tensor of rank {t.ndim}")
    size = t.shape[dim]
    if size % blocks:
        raise ValueError(f"local dim {dim} of size {size} does not split into {blocks} block(s)")
    if any(p.shape != t.shape for p in pieces):
        raise ValueError("all-gather over pieces of different shapes")
    split = t.shape[:dim] + (blocks, size // blocks) + t.shape[dim + 1:]
    stacked = np.stack([p.reshape(split) for p in pieces], axis=dim + 1)
    return stacked.reshape(t.shape[:dim] + (size * len(pieces),) + t.shape[dim + 1:])


def _groups(mesh: Mesh, axis: int) -> list[list[int]]:
    if not 0 <= axis < mesh.ndim:
        raise ValueError(f"step names mesh axis {axis} but mesh {mesh} has {mesh.ndim} axes")
    return [sorted(g, key=lambda r: mesh.coords(r)[axis]) for g in mesh.groups(axis)]


def apply_step(locals_: Sequence[np.ndarray], step: Step, mesh: Mesh) -> list[np.ndarray]:
    """Every rank's local tensor after ``step`` (see ``steps`` for the semantics)."""
    if len(locals_) != mesh.world:
        raise ValueError(f"expected {mesh.world} local tensors for mesh {mesh}, got {len(locals_)}")
    src = [np.asarray(t) for t in locals_]
    out: list[np.ndarray] = list(src)
    a = step.axis
    groups = _groups(mesh, a)
    n = mesh.sizes[a]
    if isinstance(step, (AllReduce, ReduceScatter)):
        for g in groups:
            total = _reduce(np.stack([src[r] for r in g]), step.op, 0)
            for c, r in enumerate(g):
                out[r] = (total.copy() if isinstance(step, AllReduce)
                          else _slice(total, step.dim, step.blocks, n, c))
    elif isinstance(step, (AllGather, AllToAll)):
        dim, blocks = (step.dim, step.blocks) if isinstance(step, AllGather) else (step.src_dim, step.src_blocks)
        for g in groups:
            full = _gather([src[r] for r in g], dim, blocks)
            for c, r in enumerate(g):
                out[r] = (full.copy() if isinstance(step, AllGather)
                          else _slice(full, step.dst_dim, step.dst_blocks, n, c))
    elif isinstance(step, LocalSlice):
        out = [_slice(t, step.dim, step.blocks, n, mesh.coords(r)[a]) for r, t in enumerate(src)]
    elif isinstance(step, LocalScale):
        out = [t * step.factor for t in src]
    elif isinstance(step, ZeroUnlessFirst):
        out = [t.copy() if mesh.coords(r)[a] == 0 else np.zeros_like(t) for r, t in enumerate(src)]
    else:
        raise ValueError(f"unknown step {step!r}")
    return out


def apply_steps(locals_: Sequence[np.ndarray], steps: Sequence[Step], mesh: Mesh) -> list[np.ndarray]:
    """``apply_step`` for each step in order."""
    out = list(locals_)
    for s in steps:
        out = apply_step(out, s, mesh)
    return out
