"""Cheap pricing of redistributions on multi-axis meshes: step lists that stand in for the exact
planner (``sharding.redistribute.plan_redistribution``) when the search prices thousands of
sharding pairs. Pure Python."""
from __future__ import annotations

from ..sharding.mesh import Mesh
from ..sharding.placement import Partial, Replicate, Shard, Sharding
from ..sharding.steps import AllGather, AllReduce, AllToAll, LocalSlice, ReduceScatter

__all__ = ["quick_steps", "volume"]


def quick_steps(src: Sharding, dst: Sharding, mesh: Mesh) -> list[list]:
    """Cheap stand-ins for ``plan_redistribution`` on multi-axis meshes (rule ``exact_redistribution``
    off), for pricing only (the lowering plans exactly; returned plans are priced exactly): slices and
    reduce-scatters first (the tensor shrinks), then all-to-alls, then all-reduces, then all-gathers,
    innermost or outermost axis first. When something is reduced, one more variant first slices along
    the axes replicated on both sides and gathers back at the end (reducing a slice over a slow axis,
    gathering over a fast one). The caller prices every variant and keeps the cheapest."""
    n = mesh.sizes
    slices, rs, a2a, ar, ag = [], [], [], [], []
    for a, (p, q) in enumerate(zip(src, dst)):
        if n[a] == 1 or p == q:
            continue
        if isinstance(p, Partial):
            if isinstance(q, Shard):
                rs.append(ReduceScatter(a, p.op, q.dim, q.blocks))
            else:
                ar.append(AllReduce(a, p.op))
        elif isinstance(p, Shard):
            (a2a if isinstance(q, Shard) else ag).append(
                AllToAll(a, p.dim, p.blocks, q.dim, q.blocks) if isinstance(q, Shard) else AllGather(a, p.dim, p.blocks))
        elif isinstance(q, Shard):
            slices.append(LocalSlice(a, q.dim, q.blocks))
    out = []
    for inner_first in (True, False):                 # gathers: innermost or outermost axis first
        out.append(slices + rs + a2a + ar + sorted(ag, key=lambda s: -s.axis if inner_first else s.axis))
    free = [b for b in range(mesh.ndim) if n[b] > 1 and isinstance(src[b], Replicate)
            and isinstance(dst[b], (Replicate, Partial))]
    if (ar or rs) and free:
        # reduce only a slice along the axes that are replicated on both sides, gather it back after
        out.append([LocalSlice(b, 0) for b in free] + slices + rs + a2a + ar +
                   sorted(ag + [AllGather(b, 0) for b in free], key=lambda s: -s.axis))
    if ar:
        # an all-reduce as a reduce-scatter first and an all-gather last (the tensor is small between)
        out.append(slices + rs + [ReduceScatter(s.axis, s.op, 0) for s in ar] + a2a +
                   sorted(ag + [AllGather(s.axis, 0) for s in ar], key=lambda s: -s.axis))
    for a, (p, q) in enumerate(zip(src, dst)):
        if isinstance(q, Shard) and not isinstance(p, Shard):
            for b in range(a + 1, mesh.ndim):
                if n[b] > 1 and isinstance(src[b], Shard) and src[b].dim == q.dim and src[b].blocks == 1 \
                        and (dst[b] == src[b] or not isinstance(dst[b], Shard)):
                    # the new split nests outside one a later axis already made: re-lay it out
                    extra = [AllToAll(b, q.dim, 1, q.dim, 1), AllToAll(a, q.dim, 1, q.dim, 1)]
                    out = [v[:len(slices) + len(rs)] + extra + v[len(slices) + len(rs):] for v in out]
                    break
    return out


def volume(steps, local: float, sizes) -> float:
    """Elements each rank sends (``redistribute.step_volume``'s ring formulas, in floats)."""
    total = 0.0
    for s in steps:
        n = sizes[s.axis]
        if isinstance(s, AllReduce):
            total += 2 * (n - 1) / n * local
        elif isinstance(s, ReduceScatter):
            total += (n - 1) / n * local
            local /= n
        elif isinstance(s, AllGather):
            total += (n - 1) * local
            local *= n
        elif isinstance(s, AllToAll):
            total += (n - 1) / n * local
        elif isinstance(s, LocalSlice):
            local /= n
    return total
