"""A plan made for the whole-batch step, applied to the same step at another batch size (micro-batches).

The micro-batch programs are lowered from the step captured at batch B/m, with the whole-batch plan's node
strategies taken by node name. One kind of entry may count batch rows: a strided split ``x/k``
(``sharding.vocab``). Where letter ``x`` is a merged dim with the batch as its major part (the
``(batch heads)`` dim of ``nn.MultiheadAttention``, which splits the heads), ``k`` is the batch size and the
same split at B/m rows is ``x/(k/m)``; where the batch is the minor part (``(time batch)`` of a
sequence-first layout), ``k`` counts time steps and stays. The letter's size cannot tell the two apart.

``rebatch_plan`` decides per node, in graph order: each strided entry whose letter changed size either
keeps ``k`` or scales it with the letter's size; the first combination (keeping first) under which the node
reads every input in the sharding its producer gives, wherever the whole-batch plan had the node read that
input as produced, is taken. Without such a combination the entries stay as they were (``resolve`` then
names what cannot run). Pure: no torch.
"""
from __future__ import annotations

import dataclasses
from itertools import product

from ..ir.annotation import ShapeError, letter_sizes
from ..ir.graph import Graph, Node
from ..ir.registry import annotate, call_of, call_signature
from .placement import local_shape, replicated
from .plan import ResolvedPlan, ShardingPlan, node_shardings
from .vocab import EntryKind, parse_entry, strided

__all__ = ["rebatch_plan"]


def rebatch_plan(full: ResolvedPlan, graph: Graph) -> ShardingPlan:
    """``full.plan`` with its strided entries fitted to ``graph``: ``full.graph`` at another batch size, the
    same nodes, ops and wiring (module docstring)."""
    plan, mesh = full.plan, full.plan.mesh
    value = {i.value: plan.inputs.get(i.name, replicated(mesh)) for i in graph.inputs}
    value.update({vid: replicated(mesh) for vid in graph.constants})
    strategies = dict(plan.strategies)
    full_nodes = {n.name: n for n in full.graph.nodes}
    seen: dict[tuple, object] = {}
    for node in graph.nodes:
        strategy = tuple(strategies.get(node.name, (None,) * mesh.ndim))
        options = _options(full.graph, full_nodes.get(node.name), graph, node, strategy)
        chosen = None
        for option in options:
            ns = _shardings(graph, node, option, mesh, seen)
            if ns is not None and (len(options) == 1 or _reads_as_before(full, node, ns, value)):
                chosen = option, ns
                break
        if chosen is None:
            ns = _shardings(graph, node, strategy, mesh, seen)
            if ns is None:       # resolve names it
                break
            chosen = strategy, ns
        if chosen[0] != strategy:
            strategies[node.name] = chosen[0]
        for vid, sh in zip(node.outputs, chosen[1].outputs):
            if vid is not None:
                value[vid] = sh
    return dataclasses.replace(plan, strategies=strategies)


def _shardings(graph: Graph, node: Node, strategy: tuple, mesh, seen: dict):
    key = (call_signature(graph, node), strategy)
    if key not in seen:
        try:
            ns = node_shardings(graph, node, strategy, mesh)
            for vid, sh in [*zip((r.id for r in node.input_refs()), ns.inputs), *zip(node.outputs, ns.outputs)]:
                if vid is not None:
                    local_shape(graph.types[vid].shape, sh, mesh)   # divisible, as resolve checks
            seen[key] = ns
        except ValueError:     # StrategyError, ShapeError: this option does not run here
            seen[key] = None
    return seen[key]


def _options(full_graph: Graph, full_node: Node | None, graph: Graph, node: Node, strategy: tuple) -> list[tuple]:
    """The strategy, then its variants with strided entries scaled by their letter's change of size."""
    entries = [parse_entry(e) for e in strategy]
    if full_node is None or not any(e.kind is EntryKind.STRIDED for e in entries):
        return [strategy]
    before, after = _letter_sizes(full_graph, full_node), _letter_sizes(graph, node)
    if before is None or after is None:
        return [strategy]
    choices = []
    for raw, e in zip(strategy, entries):
        alts = [raw]
        if e.kind is EntryKind.STRIDED and before.get(e.letter) != after.get(e.letter):
            scaled = e.blocks * after[e.letter]
            if scaled % before[e.letter] == 0 and scaled >= before[e.letter]:
                alts.append(strided(e.letter, scaled // before[e.letter]))
        choices.append(alts)
    return [tuple(c) for c in product(*choices)]


def _letter_sizes(graph: Graph, node: Node) -> dict[str, int] | None:
    call = call_of(graph, node)
    ann = annotate(call)
    if ann is None:
        return None
    try:
        return letter_sizes(ann, [t.shape for t in call.in_types])
    except ShapeError:
        return None


def _reads_as_before(full: ResolvedPlan, node: Node, ns, value: dict) -> bool:
    """Every input the whole-batch plan has ``node`` read as produced is read as produced under ``ns``."""
    before = full.node.get(node.name)
    if before is None:
        return True
    for ref, req, req_before in zip(node.input_refs(), ns.inputs, before.inputs):
        if full.value.get(ref.id) == req_before and value.get(ref.id) != req:
            return False
    return True
