"""O1: critical-node segmentation, per-segment solves chained by dynamic programming, and the rules
learned from the structure.

**Critical nodes.** On the forward pass (the cones up to the loss, in program order, linked by the
values they pass), a cone is *critical* when every path from the batch to the loss passes through it:
no value jumps over it (in a transformer, the residual-stream adds). Critical cones cut the forward
pass into segments (a layer's attention half, its MLP half, ...); each segment owns its backward
and optimizer cones by the values they share.

**Segments and the chain.** With repeated layers tied (``coarsen``), every segment between two
instances of a critical class is the same segment, so the chain of segments is periodic: the
dynamic program over the critical class's state (its candidate) ``s`` is
``min_s  pre(s) + L * layer(s, s) + post(s)``, and each term is a segment solve with the boundary
fixed to ``s``. A segment solve is greedy propagation plus local search (``local``) on the classes
with the boundary class frozen, which solves all segments of a chain at once (the classes of
identical segments are the same classes). The ``boundary_states`` cheapest states of the most
repeated critical class are tried (rule ``boundary_states``); the states of other critical classes
(segments that do not repeat) are left to the local search rather than enumerated, which would
multiply the starts.

**Rules.** Repeated layers: one set of classes per layer kind (``tie_layers``). Data parallel first
(``dp_first``): one more start splits the batch over every axis it divides and propagates that;
when it fits, it is usually what the boundary states compete against. The best of all starts wins.

**Data parallel, followed** (``dp_follow``, ``followed_data_parallel``): the batch split propagated
keeping every value as it arrives wherever a candidate can (``local.propagate(follow=True)``), as it
is (not improved: the point is the pure data-parallel plan). Not a start that competes on the model's score: the outer search prices it exactly beside
the winner and keeps the faster (``outer.MeshSearch.price``). It keeps pure data parallelism in view where
one layer's own cost (a batch norm's statistics all-reduce) makes the greedy step leave it for a
split whose gathers come later.
"""
from __future__ import annotations

from ..ir.analysis import analyze
from ..ir.graph import Graph
from .coarsen import ConeKind, Cones
from .local import local_search, propagate, seed_data_parallel
from .options import SearchOptions
from .problem import Problem

__all__ = ["critical_classes", "solve_o1", "followed_data_parallel"]


def critical_classes(graph: Graph, cones: Cones) -> list[int]:
    """Classes of the critical forward cones (of the nodes at or before the loss: none without a loss),
    the most repeated first."""
    a = analyze(graph)
    producer = a.producer
    spine = sorted({c for i, c in enumerate(cones.cone_of_node)
                    if a.at_or_before_loss(i) and cones.cones[c].kind is ConeKind.NODE},
                   key=lambda c: cones.cones[c].members[0])
    pos = {c: k for k, c in enumerate(spine)}
    n = len(spine)
    if n < 3:
        return []
    jumped = [0] * (n + 1)
    linked_in = [False] * n
    linked_out = [False] * n
    for i, node in enumerate(graph.nodes):
        if not a.at_or_before_loss(i):
            continue
        w = pos.get(cones.cone_of_node[i])
        if w is None:
            continue
        for r in node.input_refs():
            p = producer.get(r.id)
            u = pos.get(cones.cone_of_node[p]) if p is not None else None
            if u is None or u == w:
                continue
            lo, hi = min(u, w), max(u, w)
            linked_out[lo] = linked_in[hi] = True
            if hi - lo > 1:
                jumped[lo + 1] += 1
                jumped[hi] -= 1
    run = 0
    critical = []
    for k in range(n):
        run += jumped[k]
        if run == 0 and linked_in[k] and linked_out[k]:
            critical.append(spine[k])
    count: dict[int, int] = {}
    for c in critical:
        cls = cones.cones[c].cls
        count[cls] = count.get(cls, 0) + 1
    return sorted(count, key=lambda k: -count[k])


def solve_o1(p: Problem, options: SearchOptions, critical: list[int], start: list[int] | None = None
             ) -> tuple[list[int], tuple[float, float], str]:
    """The best of the starts (module docstring): (choice, (bytes over, model step time), which start)."""
    order = sorted(range(len(p.n_cands)), key=lambda k: p.positions[k] if p.positions else k)
    n = len(p.n_cands)
    starts: list[tuple[str, list[int], list[int]]] = [("replicated", [0] * n, [])]
    if start is not None:
        starts.append(("previous", list(start), []))
    if options.dp_first and p.batch_classes:
        starts.append(("data parallel", seed_data_parallel(p, p.batch_classes, p.axis_keys), list(p.batch_classes)))
    if critical:
        k = critical[0]
        ranked = sorted(range(p.n_cands[k]), key=lambda c: sum(p.compute[k][c]) + sum(p.comm[k][c].values()))
        dp = seed_data_parallel(p, p.batch_classes, p.axis_keys) if options.dp_first else [0] * n
        for c in ranked[:options.boundary_states]:
            seed = list(dp)
            seed[k] = c
            starts.append((f"boundary {p.names[k]}={p.axis_keys[k][c]}", seed, [k] + list(p.batch_classes)))
    best = None
    for name, seed, frozen in starts:
        choice, sc = local_search(p, seed, order, frozen)
        if best is None or sc < best[1]:
            best = (choice, sc, name)
    return best


def followed_data_parallel(p: Problem, options: SearchOptions) -> list[int] | None:
    """The data-parallel split followed through the graph (module docstring); None when
    the rule is off or there is no batch."""
    if not (options.dp_first and options.dp_follow and p.batch_classes):
        return None
    order = sorted(range(len(p.n_cands)), key=lambda k: p.positions[k] if p.positions else k)
    seed = seed_data_parallel(p, p.batch_classes, p.axis_keys)
    return propagate(p, seed, list(p.batch_classes), order, follow=True)
