"""The strategy space of one graph on one mesh.

A node's *strategy* has one entry per mesh axis (``sharding.rules``): a split annotation letter, a
strided split ``x/k``, ``None`` (replicated on that axis) or a partial passthrough ``~``. This module
says which strategies a node may take and derives the strategy of a node from its neighbours:

- **Enumerated** (``candidates``), for the node that drives a cone (compute-heavy ops: matmul,
  convolution, attention, embedding, losses; and every node that does not follow another): on each
  axis, replicate, split any letter the annotation allows (batch, contracting -> Partial, each output
  dim), strided splits ``x/k`` of letters that are the whole of a fused tensor split into ``k`` equal
  chunks somewhere in the graph (a fused QKV), and partial passthrough where the op is linear; the
  cartesian product over axes, minus what the rules reject (uneven splits, fixed dims). Also strided
  splits ``x/k`` of a letter on an input or output dim that a view merges or takes apart
  (``ir.analysis.merged_blocks``): BERT's sequence-first ``(seq, batch, d) -> (seq batch, d)`` gives its
  projection matmul ``m/seq`` (the batch split, which it could otherwise only take by gathering), and
  nn.MultiheadAttention's packed projection viewed as ``(..., 3, E)`` gives ``n/3``.
- **Followed** (``follow``): a node that takes one input as it arrives: per axis, the letter whose
  split gives exactly that input's placement (a strided shard of a merged dim maps to ``x/k``), a
  passthrough for a Partial input of a linear op, else replicated (the input is then reduced or
  gathered first).
- **Produced** (``producing``): the strategy whose output has a given sharding (an optimizer update
  takes the sharding of its optimizer state).
- **Inputs** (``input_candidates``): per axis replicate or split any evenly divisible dim (strided for
  fused tensors); parameters, optimizer state and buffers only when ``shard_state`` is on.

Everything is cached by the call signature (op, constant arguments, tensor types): the repeated
layers of a model cost one evaluation.
"""
from __future__ import annotations

import itertools
from math import prod

from ..ir.analysis import merged_blocks
from ..ir.annotation import letter_sizes
from ..ir.graph import Graph, Role
from ..ir.registry import Family, OpKind, annotate, call_of, call_signature, lookup
from ..sharding.mesh import Mesh
from ..sharding.placement import Partial, ReduceOp, Replicate, Shard, Sharding, local_shape, replicated
from ..sharding.plan import lowered_outputs
from ..sharding.rules import NodeShardings, StrategyError, candidate_letters, partial_inputs, shardings_for
from ..sharding.vocab import passthrough, strided
from .options import SearchOptions

__all__ = ["Space", "DRIVER_KINDS", "fused_chunks", "normalize"]

#: Op kinds whose nodes always enumerate their own strategies (never follow a neighbour).
DRIVER_KINDS = frozenset({OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION, OpKind.INDEX, OpKind.LOSS})


def normalize(sharding: Sharding, mesh: Mesh) -> Sharding:
    """Placements on axes of size 1 are all the same as Replicate."""
    return tuple(Replicate() if n == 1 else p for p, n in zip(sharding, mesh.sizes))


def fused_chunks(graph: Graph) -> set[tuple[int, int]]:
    """``(k, size)`` for every tensor dim of ``size`` that the graph splits into (or concatenates from)
    ``k > 1`` equal chunks: a fused QKV ``[.., 3H]`` gives ``(3, 3H)``."""
    out: set[tuple[int, int]] = set()
    for node in graph.nodes:
        opdef = lookup(node.op)
        if opdef is None or opdef.family not in (Family.SPLIT, Family.CAT):
            continue
        ann = annotate(call_of(graph, node))
        if ann is not None and "chunks" in ann.sizes and "c" in ann.sizes:
            k = ann.sizes["chunks"]
            out.add((k, k * ann.sizes["c"]))
    return out


class _Info:
    __slots__ = ("call", "ann", "sizes", "shapes", "sig", "kind", "linear", "refs")

    def __init__(self, graph: Graph, node, same: "dict | None" = None) -> None:
        """``same``: signature -> an _Info already made for an identical call (its rules are shared)."""
        self.refs = node.input_refs()
        self.sig = call_signature(graph, node)
        twin = same.get(self.sig) if same is not None else None
        self.call = call_of(graph, node)
        if twin is not None:
            self.ann, self.shapes, self.sizes, self.kind, self.linear = \
                twin.ann, twin.shapes, twin.sizes, twin.kind, twin.linear
            return
        self.ann = annotate(self.call)
        self.shapes = [t.shape for t in self.call.in_types]
        self.sizes = letter_sizes(self.ann, self.shapes) if self.ann is not None else {}
        opdef = lookup(node.op)
        self.kind = opdef.kind if opdef is not None else OpKind.OPAQUE
        n_in = len(self.shapes)
        self.linear = partial_inputs(node.op, self.kind is OpKind.VIEW, n_in, node.args, node.kwargs,
                                     self.call.in_types[0].dtype if self.call.in_types else None) \
            if self.ann else []
        if same is not None:
            same[self.sig] = self


class Space:
    """Legal strategies and derived strategies of the nodes of ``graph`` on ``mesh``."""

    def __init__(self, graph: Graph, mesh: Mesh, options: SearchOptions = SearchOptions(),
                 like: "Space | None" = None) -> None:
        """``like``: another Space of the same graph whose mesh-independent facts are reused."""
        self.graph, self.mesh, self.options = graph, mesh, options
        self.none = (None,) * mesh.ndim
        if like is not None:
            self.fused, self.merged, self._info, self._same = like.fused, like.merged, like._info, like._same
        else:
            self.fused = fused_chunks(graph) if options.strided_splits else set()
            self.merged = merged_blocks(graph) if options.strided_splits else {}
            self._info: dict[int, _Info] = {}
            self._same: dict[tuple, _Info] = {}
        self._ns: dict[tuple, NodeShardings | None] = {}
        self._cands: dict[tuple, list[tuple]] = {}
        self._inputs: dict[tuple, list[Sharding]] = {}

    # -- per-node facts -------------------------------------------------------------------------
    def info(self, i: int) -> _Info:
        inf = self._info.get(i)
        if inf is None:
            inf = self._info[i] = _Info(self.graph, self.graph.nodes[i], self._same)
        return inf

    def shardings(self, i: int, strategy: tuple) -> NodeShardings | None:
        """Required input and produced output shardings of node ``i`` under ``strategy``; None if illegal."""
        inf = self.info(i)
        key = (inf.sig, strategy)
        if key in self._ns:
            return self._ns[key]
        ns = self._shardings(i, inf, strategy)
        self._ns[key] = ns
        return ns

    def _shardings(self, i: int, inf: _Info, strategy: tuple) -> NodeShardings | None:
        mesh = self.mesh
        if inf.ann is None:
            if any(s is not None for s in strategy):
                return None
            rep = replicated(mesh)
            return NodeShardings(tuple(rep for _ in inf.shapes),
                                 tuple(rep if t is not None else None for t in inf.call.out_types))
        try:
            ns = shardings_for(inf.ann, inf.shapes, strategy, mesh)
            ns = NodeShardings(ns.inputs, lowered_outputs(inf.call, inf.ann, ns))
            for shape, sh in zip(inf.shapes, ns.inputs):
                local_shape(shape, sh, mesh)
            for t, sh in zip(inf.call.out_types, ns.outputs):
                if t is not None and sh is not None:
                    local_shape(t.shape, sh, mesh)
        except (StrategyError, ValueError):
            return None
        ns = NodeShardings(tuple(normalize(s, mesh) for s in ns.inputs),
                           tuple(normalize(s, mesh) if s is not None else None for s in ns.outputs))
        return ns

    def is_driver(self, i: int) -> bool:
        return self.info(i).kind in DRIVER_KINDS or self.info(i).ann is None

    # -- enumeration ------------------------------------------------------------------------------
    def candidates(self, i: int) -> list[tuple]:
        """Every legal strategy of node ``i`` (module docstring); the all-replicated one first."""
        inf = self.info(i)
        merged = self._merged_letters(i, inf)
        key = (inf.sig, merged)
        hit = self._cands.get(key)
        if hit is not None:
            return hit
        if inf.ann is None:
            out = [self.none]
        else:
            per_axis = [self._axis_options(i, inf, n, merged) for n in self.mesh.sizes]
            out = [s for s in itertools.product(*per_axis) if self.shardings(i, s) is not None]
            if self.none not in out:
                out.insert(0, self.none)
        self._cands[key] = out
        return out

    def _merged_letters(self, i: int, inf: _Info) -> tuple:
        """(letter, k) for each single-letter dim of an input or output with ``merged_blocks`` entries."""
        if inf.ann is None or not self.merged:
            return ()
        out = set()
        values = [(r.id, dims) for r, dims in zip(inf.refs, inf.ann.inputs)]
        values += [(v, dims) for v, dims in zip(self.graph.nodes[i].outputs, inf.ann.outputs) if v is not None]
        for vid, dims in values:
            for d, ks in self.merged.get(vid, {}).items():
                if d < len(dims) and len(dims[d]) == 1:
                    out.update((dims[d][0], k) for k in ks)
        return tuple(sorted(out))

    def _axis_options(self, i: int, inf: _Info, n: int, merged: tuple = ()) -> list:
        if n == 1:
            return [None]
        ann, sizes = inf.ann, inf.sizes
        letters = candidate_letters(ann, sizes, n)
        opts: list = [None] + letters
        for x in letters:
            for k, size in self.fused:
                if sizes.get(x) == size and size % (k * n) == 0:
                    opts.append(strided(x, k))
            for y, k in merged:
                if y == x and sizes[x] % (k * n) == 0 and strided(x, k) not in opts:
                    opts.append(strided(x, k))
        if self.options.partial_passthrough:
            n_in = len(inf.shapes)
            for group in inf.linear:
                opts.append(passthrough(group, n_in))
        return opts

    # -- derivation -------------------------------------------------------------------------------
    def follow(self, i: int, k: int, given: Sharding) -> tuple:
        """The strategy of node ``i`` that takes tensor input ``k`` as ``given`` (module docstring)."""
        inf = self.info(i)
        if inf.ann is None:
            return self.none
        ann = inf.ann
        local = dict(inf.sizes)
        n_in = len(inf.shapes)
        out: list = []
        for a, p in enumerate(given):
            n = self.mesh.sizes[a]
            entry = None
            if n == 1 or isinstance(p, Replicate):
                pass
            elif isinstance(p, Partial):
                if p.op is ReduceOp.SUM and self.options.partial_passthrough:
                    for group in inf.linear:
                        if k in group:
                            entry = passthrough(group, n_in)
                            break
            elif k < len(ann.inputs) and p.dim < len(ann.inputs[k]):
                prefix = 1
                for x in ann.inputs[k][p.dim]:
                    if p.blocks % prefix == 0 and x not in ann.fixed and x in local:
                        extra = p.blocks // prefix
                        if local[x] % (n * extra) == 0 and local[x] >= n * extra:
                            entry = strided(x, extra)
                            local[x] //= n
                            break
                    prefix *= local.get(x, 1)
            out.append(entry)
        return self._repair(i, tuple(out), lambda ns: ns.inputs[k], given)

    def producing(self, i: int, want: Sharding, out_index: int = 0) -> tuple:
        """The strategy of node ``i`` whose output ``out_index`` is ``want`` (replicated where impossible)."""
        inf = self.info(i)
        if inf.ann is None or out_index >= len(inf.ann.outputs) or inf.ann.outputs[out_index] is None:
            return self.none
        ann = inf.ann
        spec = ann.outputs[out_index]
        local = dict(inf.sizes)
        out: list = []
        for a, p in enumerate(want):
            n = self.mesh.sizes[a]
            entry = None
            if n > 1 and isinstance(p, Shard) and p.dim < len(spec):
                prefix = 1
                for x in spec[p.dim]:
                    if p.blocks % prefix == 0 and x not in ann.fixed and x in local:
                        extra = p.blocks // prefix
                        if local[x] % (n * extra) == 0 and local[x] >= n * extra:
                            entry = strided(x, extra)
                            local[x] //= n
                            break
                    prefix *= local.get(x, 1)
            out.append(entry)
        return self._repair(i, tuple(out), lambda ns: ns.outputs[out_index], want)

    def _repair(self, i: int, strategy: tuple, pick, target: Sharding) -> tuple:
        """``strategy`` if legal and matching ``target`` where it splits; else drop axes until legal."""
        target = normalize(target, self.mesh)
        ns = self.shardings(i, strategy)
        if ns is not None:
            got = pick(ns)
            bad = [a for a, e in enumerate(strategy) if e is not None and got is not None and got[a] != target[a]]
            if not bad:
                return strategy
            strategy = tuple(None if a in bad else e for a, e in enumerate(strategy))
            if self.shardings(i, strategy) is not None:
                return strategy
        for a in reversed(range(len(strategy))):
            if strategy[a] is None:
                continue
            strategy = strategy[:a] + (None,) + strategy[a + 1:]
            if self.shardings(i, strategy) is not None:
                return strategy
        return self.none

    # -- graph inputs ---------------------------------------------------------------------------
    def input_candidates(self, shape: tuple, role: Role) -> list[Sharding]:
        """Shardings a graph input of ``shape`` may take (module docstring); replicated first."""
        shardable = role is Role.BATCH or (self.options.shard_state and role is not Role.CONST)
        key = (tuple(shape), shardable)
        hit = self._inputs.get(key)
        if hit is not None:
            return hit
        rep = replicated(self.mesh)
        out = [rep]
        if shardable and shape and prod(shape) > 0:
            per_axis = []
            for n in self.mesh.sizes:
                opts: list = [Replicate()]
                if n > 1:
                    for d, size in enumerate(shape):
                        if size % n == 0:
                            opts.append(Shard(d))
                        for k, fused in self.fused:
                            if size == fused and size % (k * n) == 0:
                                opts.append(Shard(d, k))
                per_axis.append(opts)
            for sh in itertools.product(*per_axis):
                if sh == rep:
                    continue
                try:
                    local_shape(shape, sh, self.mesh)
                except ValueError:
                    continue
                out.append(tuple(sh))
        self._inputs[key] = out
        return out
