"""Alpha-beta time of redistribution steps (``sharding.steps``) on the links of ``axis_links``.

Notation: n ranks on the step's axis; S bytes = the local tensor *before* the step; B bandwidth
(B/s per direction per GPU); alpha per-message latency (s). Flat (one link):

- all-reduce, ring:  ``2 (n-1)/n * S/B + 2 (n-1) alpha``
- all-reduce, tree:  ``2 S/B + 2 log2(n) alpha``      -> the cheaper of the two is used
- reduce-scatter:    ``(n-1)/n * S/B + (n-1) alpha``   (S = input, the full tensor)
- all-gather:        ``(n-1)/n * F/B + (n-1) alpha``   (F = n S, the output)
- all-to-all:        ``(n-1)/n * S/B + (n-1) alpha``
- LocalSlice, LocalScale, ZeroUnlessFirst, and any step on an axis of size 1: 0.

Hierarchical axes (k ranks per node on m = n/k nodes; intra link Bi, ai; inter link Be, ae):

- all-reduce:     intra reduce-scatter of S (k) + inter all-reduce of S/k (m, ring or tree)
                  + intra all-gather back to S (k):
                  ``2 (k-1)/k * S/Bi + 2 (k-1) ai + AR_m(S/k; Be, ae)``
- reduce-scatter: intra RS of S (k), then inter RS of S/k (m):
                  ``(k-1)/k * S/Bi + (k-1) ai + (m-1)/m * (S/k)/Be + (m-1) ae``
- all-gather:     inter AG S -> m S (m), then intra AG m S -> n S (k):
                  ``(m-1)/m * (m S)/Be + (m-1) ae + (k-1)/k * (n S)/Bi + (k-1) ai``
- all-to-all:     k-1 peers in the node, n-k off it, sent one after the other:
                  ``(k-1)/n * S/Bi + (k-1) ai + (n-k)/n * S/Be + (n-k) ae``

With k = n (intra) or k = 1 (inter, mixed) these reduce to the flat formulas on that link.
The local size bookkeeping of ``steps_seconds`` is ``redistribute.step_volume``.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import log2
from typing import Sequence

from ..sharding.mesh import Mesh
from ..sharding.placement import Sharding
from ..sharding.redistribute import local_numel, step_volume
from ..sharding.steps import AllGather, AllReduce, AllToAll, ReduceScatter, Step, is_communication
from .cluster import AxisLink

__all__ = ["StepCost", "ring_all_reduce", "tree_all_reduce", "all_reduce", "step_cost", "step_seconds",
           "steps_seconds"]


@dataclass(frozen=True)
class StepCost:
    """Seconds for one step and the algorithm priced ("ring", "tree", "hierarchical-ring", ...)."""

    seconds: float
    algorithm: str


def ring_all_reduce(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """``2 (n-1)/n * S/B + 2 (n-1) alpha``; 0 for n = 1."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def tree_all_reduce(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """``2 S/B + 2 log2(n) alpha`` (reduce up a binary tree, broadcast down); 0 for n = 1."""
    return 0.0 if n <= 1 else 2 * nbytes / bandwidth + 2 * log2(n) * latency


def all_reduce(nbytes: float, n: int, bandwidth: float, latency: float) -> StepCost:
    """The cheaper of ring and tree (ring on ties)."""
    ring = ring_all_reduce(nbytes, n, bandwidth, latency)
    tree = tree_all_reduce(nbytes, n, bandwidth, latency)
    return StepCost(ring, "ring") if ring <= tree else StepCost(tree, "tree")


def _flat(n: int, nbytes: float, bw: float, lat: float) -> float:
    """``(n-1)/n * nbytes / B + (n-1) alpha``."""
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def step_cost(step: Step, local_bytes: float, mesh: Mesh, links: Sequence[AxisLink]) -> StepCost:
    """Time of ``step`` applied to a local tensor of ``local_bytes`` bytes (formulas above)."""
    if len(links) != mesh.ndim:
        raise ValueError(f"got {len(links)} axis links for mesh {mesh} with {mesh.ndim} axes; "
                         f"build them with axis_links(cluster, mesh)")
    if not 0 <= step.axis < mesh.ndim:
        raise ValueError(f"step {step} names mesh axis {step.axis} but mesh {mesh} has {mesh.ndim} axes")
    if local_bytes < 0:
        raise ValueError(f"step {step}: local size must be non-negative, got {local_bytes} bytes")
    link, n = links[step.axis], mesh.sizes[step.axis]
    if link.size != n:
        raise ValueError(f"axis link {link.name!r} has size {link.size} but mesh {mesh} axis {step.axis} "
                         f"has size {n}; rebuild it with axis_links(cluster, mesh)")
    if not is_communication(step) or n == 1:
        return StepCost(0.0, "local")
    k, m, s = link.intra_size, link.inter_size, float(local_bytes)
    bi, ai, be, ae = link.intra_bandwidth, link.intra_latency, link.inter_bandwidth, link.inter_latency
    hier = k > 1 and m > 1
    if isinstance(step, AllReduce):
        if not hier:
            return all_reduce(s, n, bi, ai) if m == 1 else all_reduce(s, n, be, ae)
        inner = all_reduce(s / k, m, be, ae)
        return StepCost(2 * _flat(k, s, bi, ai) + inner.seconds, f"hierarchical-{inner.algorithm}")
    name = "hierarchical" if hier else "ring"
    if isinstance(step, ReduceScatter):
        return StepCost(_flat(k, s, bi, ai) + _flat(m, s / k, be, ae), name)
    if isinstance(step, AllGather):
        return StepCost(_flat(m, m * s, be, ae) + _flat(k, n * s, bi, ai), name)
    if isinstance(step, AllToAll):
        secs = (k - 1) / n * s / bi + (k - 1) * ai + (n - k) / n * s / be + (n - k) * ae
        return StepCost(secs, "hierarchical" if hier else "pairwise")
    raise ValueError(f"unknown step {step!r}")


def step_seconds(step: Step, local_bytes: float, mesh: Mesh, links: Sequence[AxisLink]) -> float:
    """``step_cost(...).seconds``."""
    return step_cost(step, local_bytes, mesh, links).seconds


def steps_seconds(steps: Sequence[Step], shape: Sequence[int], itemsize: int, src_sharding: Sharding,
                  mesh: Mesh, links: Sequence[AxisLink]) -> float:
    """Total time of ``steps`` run in order on a tensor of global ``shape`` (``itemsize``-byte
    elements) that starts as ``src_sharding``: sum of ``step_seconds`` on each step's input local
    size, the local size tracked with ``redistribute.step_volume``."""
    return sum(each_step_seconds(steps, shape, itemsize, src_sharding, mesh, links))


def each_step_seconds(steps: Sequence[Step], shape: Sequence[int], itemsize: int, src_sharding: Sharding,
                      mesh: Mesh, links: Sequence[AxisLink]) -> list[float]:
    """``steps_seconds`` of each step."""
    if itemsize <= 0:
        raise ValueError(f"itemsize must be a positive number of bytes, got {itemsize}")
    local = local_numel(shape, src_sharding, mesh)
    out = []
    for step in steps:
        out.append(step_seconds(step, local * itemsize, mesh, links))
        _, local = step_volume(step, local, mesh)
    return out
