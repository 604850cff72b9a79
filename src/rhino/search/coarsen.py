"""Coarsening and reuse: cones (the units the solvers choose strategies for) and the structural hash
that ties identical layers.

**Cones** (rule ``cones``). Walking the program in order, a node *follows* the cone of its one big
input (the tensor input with strictly the most elements; scalars and repeated uses of one value do not
count) unless it is a driver (``space.DRIVER_KINDS``: matmul, convolution, attention, embedding,
losses, opaque ops), which starts a cone of its own, as does a node with two or more equally big
inputs (a residual add, a norm's backward) and one that may not split its big input's first dim
(batch norm: it cannot follow a batch split, so it chooses, e.g., a channel split). A cone is thus a driver (or a multi-input root) plus the
chains of views, element-wise ops, norms and reductions hanging below it; its strategy is the
driver's, the followers take their input as it arrives (``Space.follow``). A graph input is a cone
too (its choice is its sharding), and the views of a parameter follow it.

**Optimizer cones** (rule ``optimizer_cones``). The optimizer nodes (``ir.analysis``)
connected through non-scalar values, with the optimizer-state inputs they read, form one cone per
parameter; its choice is the sharding of that optimizer state (ZeRO when it is split along a
data-parallel axis); each member takes an in-cone input as it arrives, or produces that sharding.

**Structural hash** (rule ``tie_layers``). Each node and input starts from its call signature (op,
constant arguments, tensor types; inputs: role and type); ``tie_radius`` rounds of Weisfeiler-Lehman
refinement mix in the hashes of producers (by argument position) and users (as a multiset). Cones
whose members and recipe (who follows whom) hash alike form one *class*: identical layers, solved
once with one set of variables. Tying only restricts the search (tied cones take the same strategy),
so every plan of the tied problem is a plan of the untied one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..ir.analysis import analyze
from ..ir.graph import Graph, Role
from .options import SearchOptions
from .space import Space

__all__ = ["ConeKind", "Cone", "Cones", "build_cones"]


class ConeKind(str, Enum):
    NODE = "node"            # a driver or multi-input root with its followers
    INPUT = "input"          # a graph input (its views follow it)
    OPTIMIZER = "optimizer"  # one parameter's optimizer update and state


@dataclass
class Cone:
    kind: ConeKind
    members: list[int] = field(default_factory=list)       # node indices in program order
    owned: list[str] = field(default_factory=list)         # graph inputs whose sharding the cone decides
    # member position -> ("in", tensor input slot followed) | ("out",): follow that input / produce the
    # cone's sharding; absent for the driver of a NODE cone
    recipe: dict[int, tuple] = field(default_factory=dict)
    cls: int = -1

    @property
    def name(self) -> str:
        return self.owned[0] if self.kind is not ConeKind.NODE and self.owned else f"#{self.members[0]}"


@dataclass
class Cones:
    cones: list[Cone]
    cone_of_node: list[int]                 # node index -> cone index
    cone_of_input: dict[str, int]           # graph input name -> cone index
    pos_of_node: list[int]                  # node index -> position among its cone's members
    classes: list[list[int]]                # class -> cone indices (first is the representative)
    optimizer: set[int]                     # optimizer node indices


def _numel(graph: Graph, vid: int) -> int:
    n = 1
    for d in graph.types[vid].shape:
        n *= d
    return n


def _primary(graph: Graph, node) -> int | None:
    """Tensor input slot of the node's one strictly biggest non-scalar input value, or None."""
    best: dict[int, int] = {}
    for k, r in enumerate(node.input_refs()):
        if graph.types[r.id].rank == 0 or r.id in graph.constants:
            continue
        best.setdefault(r.id, k)
    if not best:
        return None
    sizes = sorted(((_numel(graph, v), k) for v, k in best.items()), reverse=True)
    if len(sizes) > 1 and sizes[0][0] == sizes[1][0]:
        return None
    return sizes[0][1]


def _batch_fixed(space: Space, i: int, k: int) -> bool:
    """The node may not split its input ``k``'s first dim (batch norm: statistics over the batch), so it
    cannot follow a batch split: it chooses its own strategy (e.g. a channel split) instead."""
    ann = space.info(i).ann
    if ann is None or k >= len(ann.inputs) or not ann.inputs[k]:
        return False
    return all(x in ann.fixed for x in ann.inputs[k][0])


class _Assembly:
    """The cones as they are built: ``add`` a cone, ``join`` a node to one (``build_cones``)."""

    def __init__(self, n: int) -> None:
        self.cones: list[Cone] = []
        self.cone_of_node = [-1] * n
        self.pos_of_node = [-1] * n
        self.cone_of_input: dict[str, int] = {}

    def add(self, cone: Cone) -> int:
        self.cones.append(cone)
        return len(self.cones) - 1

    def join(self, c: int, i: int, how: tuple | None) -> None:
        """Node ``i`` becomes the next member of cone ``c``; ``how``: its recipe entry (None: the driver)."""
        cone = self.cones[c]
        self.pos_of_node[i] = len(cone.members)
        if how is not None:
            cone.recipe[len(cone.members)] = how
        cone.members.append(i)
        self.cone_of_node[i] = c


def build_cones(graph: Graph, space: Space, options: SearchOptions = SearchOptions()) -> Cones:
    """Cones and their classes (module docstring): optimizer cones first, then a cone per graph input
    not in one, then the nodes in program order."""
    producer: dict[int, int] = {v: i for i, nd in enumerate(graph.nodes) for v in nd.outputs if v is not None}
    input_of_value = {i.value: i for i in graph.inputs}
    acc = _Assembly(len(graph.nodes))
    opt = set(analyze(graph).optimizer) if options.optimizer_cones else set()
    for members in _optimizer_components(graph, opt, producer, input_of_value):
        _add_optimizer_cone(acc, graph, members, input_of_value)
    for inp in graph.inputs:
        if inp.name not in acc.cone_of_input:
            acc.cone_of_input[inp.name] = acc.add(Cone(ConeKind.INPUT, owned=[inp.name]))
    _add_node_cones(acc, graph, space, options, producer, input_of_value)
    classes = _classes(graph, acc.cones, acc.cone_of_node, acc.pos_of_node, producer, input_of_value, space, options)
    return Cones(acc.cones, acc.cone_of_node, acc.cone_of_input, acc.pos_of_node, classes, opt)


def _optimizer_components(graph: Graph, opt: set[int], producer: dict[int, int],
                          input_of_value: dict) -> list[list[int]]:
    """The optimizer nodes grouped (union-find) by the non-scalar values linking them and the optimizer
    state they share, each group in program order."""
    parent = {i: i for i in opt}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    state_reader: dict[int, int] = {}
    for i in sorted(opt):
        for r in graph.nodes[i].input_refs():
            if graph.types[r.id].rank == 0:
                continue
            p = producer.get(r.id)
            if p in parent:
                parent[find(i)] = find(p)
            inp = input_of_value.get(r.id)
            if inp is not None and inp.role is Role.OPT_STATE:
                if r.id in state_reader:
                    parent[find(i)] = find(state_reader[r.id])
                else:
                    state_reader[r.id] = i
    comps: dict[int, list[int]] = {}
    for i in sorted(opt):
        comps.setdefault(find(i), []).append(i)
    return list(comps.values())


def _add_optimizer_cone(acc: _Assembly, graph: Graph, members: list[int], input_of_value: dict) -> None:
    """One optimizer cone: it owns the non-scalar optimizer state its members read (not owned yet); each
    member takes an in-cone input as it arrives, or produces the cone's sharding."""
    nodes = graph.nodes
    c = acc.add(Cone(ConeKind.OPTIMIZER))
    owned: list[str] = []
    for i in members:
        for r in nodes[i].input_refs():
            inp = input_of_value.get(r.id)
            if inp is not None and inp.role is Role.OPT_STATE and graph.types[r.id].rank > 0 \
                    and inp.name not in owned and inp.name not in acc.cone_of_input:
                owned.append(inp.name)
                acc.cone_of_input[inp.name] = c
    acc.cones[c].owned = owned
    value_of = {x.name: x.value for x in graph.inputs}
    inside = {value_of[o] for o in owned}
    for i in members:
        how: tuple = ("out",)
        for k, r in enumerate(nodes[i].input_refs()):
            if graph.types[r.id].rank > 0 and r.id in inside:
                how = ("in", k)
                break
        acc.join(c, i, how)
        inside.update(v for v in nodes[i].outputs if v is not None)


def _add_node_cones(acc: _Assembly, graph: Graph, space: Space, options: SearchOptions, producer: dict[int, int],
                    input_of_value: dict) -> None:
    """The nodes not in an optimizer cone, in program order: each follows the cone of its one big input
    (rule ``cones``) or starts a cone (module docstring)."""
    for i, node in enumerate(graph.nodes):
        if acc.cone_of_node[i] >= 0:
            continue
        k = None if (not options.cones or space.is_driver(i)) else _primary(graph, node)
        if k is not None and _batch_fixed(space, i, k):
            k = None
        if k is not None:
            vid = node.input_refs()[k].id
            src = acc.cone_of_node[producer[vid]] if vid in producer else acc.cone_of_input.get(
                input_of_value[vid].name) if vid in input_of_value else None
            if src is not None:
                acc.join(src, i, ("in", k))
                continue
        acc.join(acc.add(Cone(ConeKind.NODE)), i, None)


def _classes(graph: Graph, cones: list[Cone], cone_of_node, pos_of_node, producer, input_of_value, space: Space,
             options: SearchOptions) -> list[list[int]]:
    if not options.tie_layers:
        for c, cone in enumerate(cones):
            cone.cls = c
        return [[c] for c in range(len(cones))]
    nodes = graph.nodes
    n = len(nodes)
    # initial labels: call signatures (nodes), role and type (inputs)
    node_sig = [hash(space.info(i).sig) for i in range(n)]
    in_sig = {i.value: hash((i.role.value, graph.types[i.value].shape, graph.types[i.value].dtype))
              for i in graph.inputs}
    users: dict[int, list[tuple[int, int]]] = {}
    for i in range(n):
        for k, r in enumerate(space.info(i).refs):
            users.setdefault(r.id, []).append((i, k))
    out_slot = {v: (i, j) for i, nd in enumerate(nodes) for j, v in enumerate(nd.outputs) if v is not None}

    def value_sig(vid: int, sigs: list[int]) -> int:
        if vid in out_slot:
            i, j = out_slot[vid]
            return hash((sigs[i], j))
        return in_sig.get(vid, 0)

    for _ in range(options.tie_radius):
        new_nodes = []
        for i, nd in enumerate(nodes):
            ins = tuple(value_sig(r.id, node_sig) for r in space.info(i).refs)
            outs = tuple(tuple(sorted(hash((node_sig[u], k)) for u, k in users.get(v, ())))
                         for v in nd.outputs if v is not None)
            new_nodes.append(hash((node_sig[i], ins, outs)))
        new_in = {}
        for vid, s in in_sig.items():
            new_in[vid] = hash((s, tuple(sorted(hash((node_sig[u], k)) for u, k in users.get(vid, ())))))
        node_sig, in_sig = new_nodes, new_in
    by_name = {i.name: i.value for i in graph.inputs}
    keys: dict[tuple, int] = {}
    classes: list[list[int]] = []
    for c, cone in enumerate(cones):
        key = (cone.kind, tuple(node_sig[i] for i in cone.members), tuple(sorted(cone.recipe.items())),
               tuple(in_sig[by_name[o]] for o in cone.owned))
        cls = keys.get(key)
        if cls is None:
            cls = keys[key] = len(classes)
            classes.append([])
        classes[cls].append(c)
        cone.cls = cls
    return classes
