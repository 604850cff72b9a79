"""Recomputation as a graph transform (pure Python, never imports torch).

``remat(graph, mode) -> (graph', origin)`` rewrites a captured training step so that forward values
are recomputed in the backward pass instead of kept, as ``cost.recompute`` defines the modes; the
per-rank programs run ``graph'`` (``lower_rank`` on ``remat_plan``'s plan) and the cost model prices
``graph'`` (``cost.recompute.remat_effect``: the same liveness estimate on the transformed program). It lives in
``cost/``, not ``ir/``: it needs the activation spans (``cost.memory``), and imports only point down the
pipeline; storages, views and the loss boundary are ``ir.analysis``'s.

Formulation. Forward nodes are ``0..b`` (``b``: the loss node, ``ir.analysis``); every node
after ``b`` (backward and optimizer) is a *reader*. The forward is
cut after the nodes ``p_1 < .. < p_{K-1}`` (segment ``s`` holds the nodes ``(p_s, p_{s+1}]``): of
the model's best ``_EXACT_TRIES`` segmentations (``segment_choices``), the one whose rewritten graph has
the least ``estimate_memory`` peak; the chosen cuts are recorded in ``graph'.meta["recompute"]``. A forward storage (a node's non-view output; a view follows the storage it
aliases) is **kept** when

- a forward node of a later segment reads it (it crosses a cut: the checkpoints), or
- it is made in the last segment (whose backward comes first: rerunning it saves nothing at the
  forward/backward crossover), or
- its producer draws random numbers (``registry.is_random``: dropout masks are never redrawn) or is
  opaque (unknown to the registry), or it is a graph output (the loss, new buffers), or
- ``selective`` only: its producer's kind is in ``KEEP_KINDS`` (matmul, conv, attention, index,
  loss: the expensive ops), or its producer reads a kept value the backward did not read before
  (recomputing it would keep more than it frees: a residual add reading a matmul output only the add
  read), decided in forward order.

Every other forward storage a reader needs is **dropped**: the reader reads a copy. The copies of
segment ``s`` are the nodes of ``s`` that make the dropped values its readers need (and,
transitively, the dropped values those nodes read), in forward order, inserted once, just before
the first reader that needs one of them (one segment at a time). A copy reads kept values from the
forward and dropped ones from earlier copies; an output no one reads is left undefined (``None``).
Dropped values only depend on kept values and on dropped values of the same segment (a value a
later segment reads is kept), so a segment's copies never need another segment's.
"""
from __future__ import annotations

import weakref
from bisect import bisect_left
from dataclasses import dataclass, replace
from math import isqrt

from ..ir.analysis import analyze
from ..ir.graph import Graph, Node, Ref
from ..ir.registry import OpKind, is_random, lookup
from ..sharding.plan import ResolvedPlan, ShardingPlan
from ..sharding.vocab import Recompute
from .memory import MemoryEstimate, estimate_memory

__all__ = ["Recompute", "KEEP_KINDS", "Segments", "forward_cuts", "full_segments", "segment_choices", "remat",
           "remat_plan",
           "remat_resolved", "RECOMPUTE_SUFFIX"]

#: Suffix of a copy's node name (``origin`` maps it back to the original node).
RECOMPUTE_SUFFIX = "_rc"
# the last rewrites by graph identity (graphs are not mutated once captured; the search and ``estimate``
# price many plans of one graph)
_CACHE: dict[tuple, tuple] = {}
#: How many segment counts ``segment_choices`` tries between 1 and ``2 sqrt(A / c)``.
_K_TRIES = 16
#: How many of the model's best segmentations ``remat`` rewrites and compares on ``estimate_memory``
#: (the model leaves out backward temporaries: on ResNet at batch 32, whose first layers dominate, its
#: first choice estimates 0.85x of the peak without recomputation, the best of six 0.67x).
_EXACT_TRIES = 6

#: Op kinds whose outputs selective recomputation keeps.
KEEP_KINDS = frozenset({OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION, OpKind.INDEX, OpKind.LOSS, OpKind.OPAQUE})


def forward_cuts(mem: MemoryEstimate, spans: list[tuple[int, int, int]] | None = None) -> list[int]:
    """``cuts[p]``: bytes of the ``spans`` (default: the activations) produced at or before forward node
    ``p`` and read by a forward node after ``p`` (what a checkpoint after ``p`` must keep)."""
    b = mem.boundary
    if b < 0:
        return []
    diff = [0] * (b + 2)
    for born, last_fwd, size in (mem.activation_spans if spans is None else spans):
        if born < 0 or last_fwd <= born:
            continue
        diff[born] += size
        diff[min(last_fwd, b + 1)] -= size
    cuts, run = [], 0
    for p in range(b + 1):
        run += diff[p]
        cuts.append(run)
    return cuts


@dataclass(frozen=True)
class Segments:
    """How ``full`` (and ``selective``) cut the forward pass: ``k`` segments, the representative cut
    ``cut`` (bytes), and ``positions``: the forward node indices after which it is cut (ascending)."""

    k: int
    cut: int
    positions: tuple[int, ...]


def full_segments(mem: MemoryEstimate) -> Segments:
    """The segmentation the model ranks first (``segment_choices``)."""
    return segment_choices(mem)[0]


def segment_choices(mem: MemoryEstimate) -> list[Segments]:
    """Candidate segmentations, best predicted first (``K = sqrt(A / c)``; ``k`` from 1 to ``2K``, cuts
    at the least-crossed positions near equal activation bytes, ranked by ``_peak_of``)."""
    total = sum(s for _, _, s in mem.activation_spans)
    b = mem.boundary
    if total == 0 or b < 0:
        return [Segments(1, 0, ())]
    cuts = forward_cuts(mem, mem.activation_spans + mem.forward_only_spans)  # all a later forward node reads
    lo, hi = b // 10, max(b // 10 + 1, b - b // 10)
    middle = [c for c in cuts[lo:hi] if c > 0]
    c = min(middle) if middle else total
    k = max(1, isqrt(max(1, total // max(1, c))))
    made = [0] * (b + 1)   # activation bytes made at or before each forward node
    for born, _, size in mem.activation_spans:
        if 0 <= born <= b:
            made[born] += size
    for p in range(1, b + 1):
        made[p] += made[p - 1]
    tries = sorted({max(1, round(2 * k * t / _K_TRIES)) for t in range(1, _K_TRIES + 1)} | {k}
                   | set(range(1, min(2 * k, _K_TRIES) + 1)))
    ranked: dict[tuple[int, ...], int] = {}
    for j in tries:
        positions = tuple(_positions(made, cuts, total, j, b))
        ranked.setdefault(positions, _peak_of(mem, list(positions)))
    order = sorted(ranked, key=lambda p: (ranked[p], len(p)))
    return [Segments(len(p) + 1, c, p) for p in order]


def _positions(made: list[int], cuts: list[int], total: int, k: int, b: int) -> list[int]:
    """Cut positions for ``k`` segments: each next cut at the least-crossed position whose activation
    bytes made so far are within ``A / 2k`` of the previous cut's plus ``A / k`` (the first position
    past that window when a single node jumps over it)."""
    positions: list[int] = []
    step, half = total / k, total / (2 * k)
    target, best = step, None
    for p in range(b):
        if target >= total - half:
            break
        if made[p] < target - half:
            continue
        if made[p] <= target + half or best is None:
            if best is None or (cuts[p], abs(made[p] - target)) < (cuts[best], abs(made[best] - target)):
                best = p
            if made[p] <= target + half:
                continue
        positions.append(best)
        target, best = made[best] + step, None
    if best is not None:
        positions.append(best)
    return positions


def _peak_of(mem: MemoryEstimate, positions: list[int]) -> int:
    """Forward bytes live at the worst moment with these cuts: every checkpoint (a span crossing a cut)
    and the last segment's activations at the loss, or while segment ``s`` is recomputed the
    checkpoints made up to it and its dropped activations."""
    n = len(positions) + 1
    kept, dropped = [0] * n, [0] * n
    for spans, act in ((mem.activation_spans, True), (mem.forward_only_spans, False)):
        for born, last_fwd, size in spans:
            s = bisect_left(positions, born)
            if s < n - 1 and positions[s] < last_fwd:
                kept[s] += size
            elif act:
                dropped[s] += size
    worst, run = 0, 0
    for s in range(n - 1):
        run += kept[s]
        worst = max(worst, run + dropped[s])
    return max(worst, run + kept[-1] + dropped[-1])


def _map_refs(obj, m: dict[int, int]):
    if isinstance(obj, Ref):
        return Ref(m[obj.id]) if obj.id in m else obj
    if isinstance(obj, list):
        return [_map_refs(x, m) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_map_refs(x, m) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_refs(v, m) for k, v in obj.items()}
    return obj


def _roots(graph: Graph, upto: int) -> tuple[dict[int, int], dict[int, int]]:
    """(storage root of each value, producing node index of each value) for the inputs, constants and
    the values of nodes ``0..upto`` (``ir.analysis``)."""
    a = analyze(graph)
    made = {v: i for v, i in a.producer.items() if i <= upto}
    root = {v: s for v, s in a.root.items() if a.producer.get(v, -1) <= upto}
    return root, made


def _kept(graph: Graph, mode: Recompute, b: int, cuts: list[int], root: dict[int, int],
          made: dict[int, int]) -> set[int]:
    """Forward storages the backward reads from the forward (see the module docstring)."""
    seg = [bisect_left(cuts, i) for i in range(b + 1)]
    last = len(cuts)
    keep = {o.value for o in graph.outputs if o.value in made} | {root[o.value] for o in graph.outputs
                                                                  if o.value in root}
    for i, node in enumerate(graph.nodes[:b + 1]):
        d = lookup(node.op)
        own = [v for v in node.outputs if v is not None and root[v] == v]
        if seg[i] == last or d is None or d.kind is OpKind.OPAQUE or is_random(node.op) or \
                (mode is Recompute.SELECTIVE and d.kind in KEEP_KINDS):
            keep.update(own)
        for r in node.input_refs():
            s = root.get(r.id, r.id)
            if s in made and seg[made[s]] < seg[i]:
                keep.add(s)   # crosses a cut
    if mode is Recompute.SELECTIVE:
        _keep_costly_cheap(graph, b, root, made, keep)
    return keep


def _keep_costly_cheap(graph: Graph, b: int, root: dict[int, int], made: dict[int, int], keep: set[int]) -> None:
    """``selective``: a cheap value is recomputed only from what the backward keeps anyway (values it
    already read, state, batch, constants) and other recomputed values; one that needs a value the
    backward did not keep (a matmul output only an add read) is kept instead, in forward order."""
    saved = {root[r.id] for node in graph.nodes[b + 1:] for r in node.input_refs() if r.id in root}
    saved |= {root[o.value] for o in graph.outputs if o.value in root}
    for node in graph.nodes[:b + 1]:
        own = [v for v in node.outputs if v is not None and root[v] == v and v not in keep]
        if not own:
            continue
        for r in node.input_refs():
            s = root[r.id]
            if s in made and s in keep and s not in saved:
                keep.update(own)
                break


def remat(graph: Graph, mode: Recompute | str, mem: MemoryEstimate | None = None) -> tuple[Graph, dict[str, str]]:
    """``(graph', origin)``: ``graph`` with the forward values ``mode`` drops recomputed before the
    backward reads them (module docstring); ``origin[copy name] = original node name``. ``mem``: the
    estimate whose activation spans place the cuts (default: ``estimate_memory(graph)``, global
    sizes, so every rank and the cost model cut the same program)."""
    mode = Recompute(mode)
    a = analyze(graph)
    if mode is Recompute.NONE or a.loss_node is None:
        return graph, {}
    b = a.boundary
    if mem is not None:
        return _remat(graph, mode, b, mem)
    key = (id(graph), len(graph.nodes), mode)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is graph:
        return hit[1]
    out = _remat(graph, mode, b, estimate_memory(graph))
    if len(_CACHE) >= 4:
        _CACHE.clear()
    _CACHE[key] = (weakref.ref(graph), out)
    return out


def _remat(graph: Graph, mode: Recompute, b: int, mem: MemoryEstimate) -> tuple[Graph, dict[str, str]]:
    """The rewrite with the least estimated peak among the model's best ``_EXACT_TRIES`` segmentations
    (fewer cuts on a tie)."""
    best = None
    for seg in segment_choices(mem)[:_EXACT_TRIES]:
        out = _remat_at(graph, mode, b, seg)
        peak = estimate_memory(out[0]).peak
        if best is None or peak < best[0]:
            best = (peak, out)
    return best[1]


def _remat_at(graph: Graph, mode: Recompute, b: int, seg: Segments) -> tuple[Graph, dict[str, str]]:
    cuts = list(seg.positions)
    root, made = _roots(graph, b)
    keep = _kept(graph, mode, b, cuts, root, made)

    def dropped(v: int) -> bool:
        # a view of an input or a constant (a weight's transpose) aliases what is live anyway: never dropped,
        # so a later segment's copy never needs one made in an earlier segment
        return v in made and root[v] in made and root[v] not in keep

    # which values to recompute: those readers need, and transitively what their producers need
    want: set[int] = set()
    first: dict[int, int] = {}      # segment -> index of its first reader
    stack = []
    for j in range(b + 1, len(graph.nodes)):
        for r in graph.nodes[j].input_refs():
            if dropped(r.id):
                s = bisect_left(cuts, made[r.id])
                first[s] = min(first.get(s, j), j)
                stack.append(r.id)
    while stack:
        v = stack.pop()
        if v in want:
            continue
        want.add(v)
        stack.extend(r.id for r in graph.nodes[made[v]].input_refs() if dropped(r.id))
    if not want:
        return graph, {}
    new, origin = _rewrite(graph, b, cuts, made, want, first)
    new.meta["recompute"] = {"mode": mode.value, "segments": seg.k, "cuts": cuts}
    return new, origin


def _rewrite(graph: Graph, b: int, cuts: list[int], made: dict[int, int], want: set[int],
             first: dict[int, int]) -> tuple[Graph, dict[str, str]]:
    new = Graph(dict(graph.types), list(graph.inputs), [], list(graph.outputs), dict(graph.constants),
                dict(graph.meta))
    names = {n.name for n in graph.nodes}
    copy_of: dict[int, int] = {}
    origin: dict[str, str] = {}
    by_segment: dict[int, list[int]] = {}
    for i in sorted({made[v] for v in want}):
        s = bisect_left(cuts, i)
        assert s in first, f"recomputed node {graph.nodes[i].name} has no reader in its segment"
        by_segment.setdefault(s, []).append(i)
    insert_at: dict[int, list[int]] = {}
    for s in sorted(by_segment):
        insert_at.setdefault(first[s], []).extend(by_segment[s])
    for j, node in enumerate(graph.nodes):
        for i in insert_at.get(j, ()):
            orig = graph.nodes[i]
            outs = []
            for v in orig.outputs:
                if v is not None and v in want:
                    copy_of[v] = new.new_value(graph.types[v])
                    outs.append(copy_of[v])
                else:
                    outs.append(None)
            name = orig.name + RECOMPUTE_SUFFIX
            while name in names:
                name += "_"
            names.add(name)
            origin[name] = orig.name
            new.nodes.append(Node(name, orig.op, _map_refs(orig.args, copy_of), _map_refs(orig.kwargs, copy_of),
                                  outs, orig.multi))
        if j > b:
            node = Node(node.name, node.op, _map_refs(node.args, copy_of), _map_refs(node.kwargs, copy_of),
                        list(node.outputs), node.multi)
        new.nodes.append(node)
    _drop_unread_forward(new, b, want)
    return new, origin


def _drop_unread_forward(graph: Graph, b: int, want: set[int]) -> None:
    """Recomputed forward outputs only the backward read are now read by nobody: mark them absent
    (``None``) and drop forward nodes left without a read output (they ran only for the backward). One
    reverse pass: readers come after producers."""
    reads: dict[int, int] = {}
    for o in graph.outputs:
        reads[o.value] = reads.get(o.value, 0) + 1
    for node in graph.nodes[b + 1:]:
        for r in node.input_refs():
            reads[r.id] = reads.get(r.id, 0) + 1
    kept: list[Node] = []
    for node in reversed(graph.nodes[:b + 1]):
        unread = {v for v in node.outputs if v in want and not reads.get(v)}
        if unread and all(v is None or v in unread for v in node.outputs):
            continue
        if unread:
            node = Node(node.name, node.op, node.args, node.kwargs,
                        [None if v in unread else v for v in node.outputs], node.multi)
        for r in node.input_refs():
            reads[r.id] = reads.get(r.id, 0) + 1
        kept.append(node)
    graph.nodes[:b + 1] = kept[::-1]


def remat_plan(plan: ShardingPlan, origin: dict[str, str]) -> ShardingPlan:
    """``plan`` for the transformed graph: every copy runs with its original node's strategy. The
    fingerprint is cleared (the plan was checked against the original graph) and ``recompute`` is
    ``none`` (the transformed graph recomputes by itself)."""
    strategies = dict(plan.strategies)
    for new, old in origin.items():
        if old in plan.strategies:
            strategies[new] = plan.strategies[old]
    return replace(plan, strategies=strategies, fingerprint="", recompute=Recompute.NONE.value)


def remat_resolved(rp: ResolvedPlan, new: Graph, origin: dict[str, str]) -> ResolvedPlan:
    """``resolve(new, remat_plan(rp.plan, origin))`` without re-deriving: a copy has its original's
    strategy and input types, so its required and produced shardings are its original's (a node's
    entry for an output the rewrite left undefined is its original's, where ``resolve`` may say None)."""
    nodes = {n.name: n for n in rp.graph.nodes}
    value = {i.value: rp.value[i.value] for i in new.inputs}
    value.update({v: rp.value[v] for v in new.constants})
    node = {}
    for c in new.nodes:
        o = origin.get(c.name, c.name)
        node[c.name] = rp.node[o]
        for v, ov in zip(c.outputs, nodes[o].outputs):
            if v is not None:
                value[v] = rp.value[ov]
    return ResolvedPlan(remat_plan(rp.plan, origin), new, value, node)



