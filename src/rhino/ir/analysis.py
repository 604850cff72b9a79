"""What a training-step graph means: the single definition of storages, last uses, the loss boundary
and node roles (pure Python, never imports torch). The cost model (``cost.memory``, ``cost.step``,
``cost.remat``, ``cost.accumulate``), the search (``search.memrows``, ``search.coarsen``) and the
memory planner (``memory.from_graph``) all read it; none of them answers these questions itself.

``analyze(graph)`` computes it once per graph object (memoised per object, held weakly; a graph whose nodes,
inputs or outputs were added, removed or replaced after the first call is analysed again).

Definitions (``n`` nodes in program order, ``graph.nodes[0..n-1]``):

- **View node**: a node whose op has registry kind ``OpKind.VIEW`` and at least one tensor input. It
  allocates nothing: every value it defines aliases the storage of its first tensor input.
- **Storage root** ``root[v]``: the value owning ``v``'s storage: ``v`` itself for graph inputs,
  constants and the outputs of non-view nodes; ``root[first input]`` for a view node's outputs.
  ``born[s]``: index of the node that made storage ``s``, -1 for graph inputs and constants.
- **Readers** ``readers[s]``: the indices of the nodes that read ``s`` through any alias (a view node
  reads its input's storage too), ascending, each once. ``last_read[s]``: the last of them, -1 if none.
- **Last use** ``last_use[s]`` (the end of ``s``'s lifetime in program order): ``n`` ("the end of the
  step") for state inputs (PARAM, FROZEN, BUFFER, OPT_STATE), CONST inputs, constants and the storage
  of any graph output; for a batch input its last reader (-1: never read, never live); for an
  intermediate storage its last reader, or its producer when nobody reads it.
- **View reach** ``view_reach[i]`` of a view node ``i``: the last node reading one of its values
  directly, or through a view node taking it as its first tensor input (that node's reach); ``n - 1``
  when one of them is a graph output; ``i`` when nobody reads them. A redistributed copy a view is
  taken of lives that long (``cost.memory``, ``search.memrows``).
- **Loss boundary** ``boundary``: the index of the node that made the loss output's storage
  (following views back to it); -1 when the graph has no loss output or the loss is an input.
- **Roles** (``NodeRole``). Without a boundary every node is FORWARD. Otherwise the boundary node is
  LOSS, nodes before it are FORWARD, and a node after it is OPTIMIZER when, in this order,

  1. *seed*: it reads (through any alias) an OPT_STATE input, or defines a value that is a graph
     output with a state role (nodes before the loss doing so, BatchNorm's running statistics, are
     forward ops);
  2. *forward closure*: it reads a storage an optimizer node made (the update's arithmetic: the
     square root of the new second moment, bias-corrected steps), decided in program order;
  3. *backward closure*: it is not a view, reads a state input, reads no batch input and no storage
     made at or before the loss (no activation), and every storage it makes is read by optimizer
     nodes only and by at least one (weight decay: ``g + wd * p``, ``p * (1 - lr * wd)``), decided
     in reverse program order;
  4. *non-linear use of gradients*: it is not a view, reads no batch input and no storage made at or
     before the loss, and either reads storages made after the boundary by non-optimizer nodes in a way
     its ``linear`` fact (``registry.Linear``) does not cover (``_nonlinear_in``: Adamax's ``|g| + eps``,
     Shampoo's ``G @ G.T``, a clipping norm, ``g / g.norm()``), or reads a storage made by such a node;
     and every storage it makes is read by optimizer nodes (rules 1-4) only, and by at least one, decided
     in reverse program order. A backward is linear in the gradient it propagates, so such a node is the
     update's arithmetic: the gradient it reads is what gradient accumulation may sum, not ``|g|``. (A
     linear node taken for such a node would still be exact, ``f(sum g) = sum f(g)``; the other way round
     is not, hence unknown ops count as non-linear);

  5. *linear start of the update*: it is not a view, reads no batch input and no storage made at or before
     the loss, reads exactly one storage made after the boundary from the batch by a non-optimizer node (a
     parameter's gradient, or a node of this rule; a copy of a parameter is no such storage), is linear in it
     (Lion's ``g * (1 - beta1)``, Rprop's ``g.clone()``, a user's ``g / world``), and that storage and every
     storage it makes are read (by non-view nodes) by optimizer nodes (rules 1-5) only, the latter by at least
     one: the greatest such set. A gradient of the backward is read by no other backward node (an
     activation's gradient is: a bias's ``sum`` stays BACKWARD), so the update starts at the gradient and
     gradient accumulation sums the gradient, once per step, not its scaled copy per micro-batch (exact either
     way, as rule 4 says). A node reading two such storages (a tied weight's ``g1 + g2``) stays BACKWARD: one
     gradient, not two;

  rules 4, 3 and 5 are applied again until none adds a node (an optimizer's first-step branch,
  ``capture.optim_traced``, copies each parameter and gradient: the copies are rule 3's and rule 5's only once
  their readers are known to be the update's); every other node after the boundary is BACKWARD.
  ``optimizer`` is the set of OPTIMIZER nodes.
- **Activations**: storages made at or before the boundary and live after it (``is_activation``).
- **Gradients**: storages made after the boundary by a non-optimizer node and read by an optimizer
  node (the values the update consumes from the backward; what gradient accumulation accumulates
  and the data-parallel reduction reduces).
- **State**: ``state_inputs`` (values of inputs with a state role), ``updates`` (state input name ->
  the value of the output that replaces it).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from enum import Enum

from .annotation import letter_sizes
from .graph import STATE_ROLES, Graph, Node, Role
from .registry import Linear, OpKind, Values, annotate, call_of, lookup

__all__ = ["NodeRole", "GraphAnalysis", "analyze", "update_feeders", "batch_dependent", "moved_dim", "merged_blocks"]


class NodeRole(str, Enum):
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class GraphAnalysis:
    """The answers of the module docstring for one graph (treat every field as read-only)."""

    n: int
    root: dict[int, int]              # value -> storage root
    born: dict[int, int]              # storage -> producing node index (-1: input or constant)
    producer: dict[int, int]          # value -> index of the node defining it (views included)
    is_view: tuple[bool, ...]         # node index -> view node
    node_roots: tuple[tuple[int, ...], ...]  # node -> storage of each tensor input, in argument order
    readers: dict[int, list[int]]     # storage -> reading node indices (ascending, each once)
    last_read: dict[int, int]         # storage -> last reader (-1: none)
    last_use: dict[int, int]          # storage -> end of its lifetime (``n``: the end of the step)
    boundary: int                     # loss node index, -1 if none
    roles: tuple[NodeRole, ...]
    optimizer: frozenset[int]
    gradients: frozenset[int]         # storages (module docstring)
    input_role: dict[int, Role]       # graph input value -> its role
    state_inputs: frozenset[int]      # values of inputs with a state role
    opt_state_inputs: frozenset[int]
    batch_inputs: frozenset[int]
    persistent: frozenset[int]        # state and CONST inputs and constants (live all step)
    state_outputs: frozenset[int]     # values of outputs with a state role
    output_roots: frozenset[int]      # storages of graph outputs
    updates: dict[str, int]           # state input name -> value of its new-state output
    view_reach: dict[int, int]        # view node index -> last node reading its values (module docstring)

    def is_forward(self, i: int) -> bool:
        """Node ``i`` runs in the forward pass (FORWARD or LOSS; every node of a graph without a loss)."""
        return self.boundary < 0 or i <= self.boundary

    @property
    def loss_node(self) -> int | None:
        """The loss node's index (``boundary``), None when the graph has no loss node."""
        return self.boundary if self.boundary >= 0 else None

    def at_or_before_loss(self, i: int) -> bool:
        """Node ``i`` is the loss node or runs before it (False for every node of a graph without a loss,
        where ``is_forward`` is True)."""
        return i <= self.boundary

    def last_forward_use(self, s: int) -> int:
        """The last forward node (``is_forward``) reading storage ``s`` through any alias, or the node
        that made ``s`` when no forward node reads it (-1 for an unread input or constant)."""
        return max((u for u in self.readers.get(s, ()) if self.is_forward(u)), default=self.born[s])

    def is_activation(self, s: int, last_use: int | None = None) -> bool:
        """Whether storage ``s`` is an activation: made at or before the loss node and still live after
        it (saved for the backward), with ``last_use`` (default: ``self.last_use[s]``) as its end."""
        b = self.born[s]
        return 0 <= b <= self.boundary < (self.last_use[s] if last_use is None else last_use)

    def end_of(self, s: int, last_read: int) -> int:
        """The last-use rule for storage ``s`` given its last read ``last_read`` (-1: none): ``last_use``
        is ``end_of(s, self.last_read[s])``; a caller whose reads differ (a plan's redistributed copies
        read instead of the storage) applies the same rule to its own last read."""
        if s in self.persistent or s in self.output_roots:
            return self.n
        b = self.born[s]
        return max(b, last_read) if b >= 0 else last_read


# id(graph) -> (weak reference to the graph, signature, analysis); an entry leaves with its graph
_CACHE: dict[int, tuple] = {}


def _signature(graph: Graph) -> tuple:
    """Changes when a node, input or output is added, removed or replaced (nodes are not edited in place)."""
    return (hash(tuple(map(id, graph.nodes))), tuple(map(id, graph.inputs)), tuple(map(id, graph.outputs)),
            len(graph.types), len(graph.constants))


def analyze(graph: Graph) -> GraphAnalysis:
    """The analysis of ``graph`` (module docstring), computed once per graph object."""
    if not isinstance(graph, Graph):
        raise ValueError(f"analyze expects a rhino Graph, got {type(graph).__name__}")
    sig = _signature(graph)
    key = id(graph)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is graph and hit[1] == sig:
        return hit[2]
    out = _analyze(graph)
    if hit is None or hit[0]() is not graph:
        weakref.finalize(graph, _CACHE.pop, key, None)
    _CACHE[key] = (weakref.ref(graph), sig, out)
    return out


#: Op kinds ``update_feeders`` extends through (a gradient's squared norm for clipping: pow, then sum).
FEEDER_KINDS = frozenset({OpKind.ELEMENTWISE, OpKind.VIEW, OpKind.REDUCTION, OpKind.INDEX})


def update_feeders(graph: Graph) -> set[str]:
    """Names of the nodes that only feed the state update, the sharding propagator's reading (it keeps a
    Partial gradient in its wider type there, as DDP reduces fp32 ``.grad``): the nodes reading an
    OPT_STATE input directly or defining a value that is a graph output with a state role (anywhere in
    the step, unlike ``NodeRole.OPTIMIZER``), and, in reverse program order, the registered element-wise
    ops, views and reductions (``FEEDER_KINDS``) whose every user (of their values directly, not through
    aliases) is one of them (the casts and sums that form a parameter's gradient, a clipping norm's squares
    and sums)."""
    opt_in = {i.value for i in graph.inputs if i.role is Role.OPT_STATE}
    state_out = {o.value for o in graph.outputs if o.role in STATE_ROLES}
    users = graph.users()
    out = {n.name for n in graph.nodes
           if any(r.id in opt_in for r in n.input_refs()) or any(v in state_out for v in n.outputs)}
    for n in reversed(graph.nodes):
        d = lookup(n.op)
        if n.name in out or d is None or d.kind not in FEEDER_KINDS:
            continue
        us = [u for v in n.outputs if v is not None for u in users.get(v, [])]
        if us and all(u.name in out for u in us):
            out.add(n.name)
    return out


def _is_view_op(op: str, cache: dict[str, bool]) -> bool:
    v = cache.get(op)
    if v is None:
        d = lookup(op)
        v = cache[op] = d is not None and d.kind is OpKind.VIEW
    return v


def _storages(graph: Graph):
    """(root, born, producer, is_view, node_roots, readers) in one pass over the program."""
    types = graph.types
    root: dict[int, int] = {}
    born: dict[int, int] = {}
    for inp in graph.inputs:
        if inp.value not in types:
            raise ValueError(f"graph input {inp.name} refers to value {inp.value}, which has no type")
        root[inp.value] = inp.value
        born[inp.value] = -1
    for v in graph.constants:
        if v not in root:
            root[v] = v
            born[v] = -1
    producer: dict[int, int] = {}
    is_view: list[bool] = []
    node_roots: list[tuple[int, ...]] = []
    readers: dict[int, list[int]] = {}
    cache: dict[str, bool] = {}
    for i, node in enumerate(graph.nodes):
        rr = []
        for r in node.input_refs():
            s = root.get(r.id)
            if s is None:
                raise ValueError(f"node {node.name} reads value {r.id} before it is defined (not in program order)")
            rr.append(s)
            lst = readers.setdefault(s, [])
            if not lst or lst[-1] != i:
                lst.append(i)
        node_roots.append(tuple(rr))
        view = _is_view_op(node.op, cache) and bool(rr)
        is_view.append(view)
        for v in node.outputs:
            if v is None:
                continue
            if v not in types:
                raise ValueError(f"node {node.name} defines value {v}, which has no type")
            if v in root:
                raise ValueError(f"value {v} is defined twice (node {node.name})")
            producer[v] = i
            if view:
                root[v] = rr[0]
            else:
                root[v] = v
                born[v] = i
    for o in graph.outputs:
        if o.value not in root:
            raise ValueError(f"graph output {o.name} refers to value {o.value}, which no node defines")
    return root, born, producer, is_view, node_roots, readers


def _optimizer_nodes(graph: Graph, boundary: int, root, born, is_view, node_roots, opt_in, state_in,
                     batch, state_out) -> set[int]:
    """Rules 1-5 of the module docstring; rules 4, 3 and 5 repeated until none adds a node (a first-step
    branch, ``capture.optim_traced``: its copy of a parameter is rule 3's once a rule-5 node reads it, its
    clipping norm rule 4's once the clipped gradient's copy is rule 5's)."""
    nodes = graph.nodes
    opt: set[int] = set()
    made: set[int] = set()            # storages made by optimizer (non-view) nodes
    for i in range(boundary + 1, len(nodes)):  # rules 1 and 2, program order
        rr = node_roots[i]
        outs = [v for v in nodes[i].outputs if v is not None]
        if any(s in opt_in or s in made for s in rr) or any(v in state_out for v in outs):
            opt.add(i)
            if not is_view[i]:
                made.update(outs)
    dep = set(batch)                  # storages computed from the batch (the backward's, recomputed ones)
    for i in range(len(nodes)):
        if any(s in dep for s in node_roots[i]):
            dep.update(_made(nodes[i], born, i))
    while True:
        size = len(opt)
        _nonlinear_uses(graph, boundary, root, born, is_view, node_roots, batch, opt)
        _state_closure(nodes, boundary, root, born, is_view, node_roots, state_in, batch, opt)
        _linear_prefix(graph, boundary, root, born, is_view, node_roots, batch, dep, opt)
        if len(opt) == size:
            return opt


def _state_closure(nodes, boundary: int, root, born, is_view, node_roots, state_in, batch, opt: set[int]) -> None:
    """Rule 3 of the module docstring, in reverse program order: adds its nodes to ``opt``."""
    opt_read: set[int] = set()        # storages read by optimizer nodes
    other_read: set[int] = set()      # storages read by other non-view nodes
    for i in range(len(nodes) - 1, boundary, -1):
        if is_view[i]:
            continue
        rr = node_roots[i]
        if i not in opt and any(s in state_in for s in rr) and \
                not any(s in batch or 0 <= born[s] <= boundary for s in rr):
            outs = [root[v] for v in nodes[i].outputs if v is not None]
            if outs and all(o in opt_read and o not in other_read for o in outs):
                opt.add(i)
        (opt_read if i in opt else other_read).update(rr)


def _linear_prefix(graph: Graph, boundary: int, roots, born, is_view, node_roots, batch, dep: set[int],
                   opt: set[int]) -> None:
    """Rule 5 of the module docstring: adds its nodes to ``opt`` (rules 1-4 given; ``dep``: the storages computed
    from the batch)."""
    nodes = graph.nodes
    from_loss = {s for s, b in born.items() if b == boundary}
    reads: dict[int, set[int]] = {}       # storage -> its non-view readers after the boundary
    inner: dict[int, int] = {}            # candidate -> the one storage it reads from the backward (or a candidate)
    for i in range(boundary + 1, len(nodes)):
        rr = node_roots[i]
        if not is_view[i]:
            for s in rr:
                reads.setdefault(s, set()).add(i)
        if i not in opt and any(s in from_loss for s in rr):
            from_loss.update(_made(nodes[i], born, i))
        if i in opt or is_view[i] or any(s in batch or 0 <= born[s] <= boundary for s in rr):
            continue
        refs = nodes[i].input_refs()
        flags = [born[roots[r.id]] > boundary and born[roots[r.id]] not in opt and roots[r.id] in dep
                 for r in refs]
        back = {roots[r.id] for r, f in zip(refs, flags) if f}
        if sum(flags) == 1 and back <= from_loss and _made(nodes[i], born, i) and \
                not _nonlinear_in(nodes[i], flags):
            inner[i] = back.pop()
    kept = set(inner)
    while True:   # the greatest set whose inputs and outputs are read by the update (and by it) only
        upd = opt | kept
        keep = {i for i in kept if reads.get(inner[i], set()) <= upd and
                all(reads.get(s) and reads[s] <= upd for s in _made(nodes[i], born, i))}
        if keep == kept:
            break
        kept = keep
    opt.update(kept)


def _nonlinear_uses(graph: Graph, boundary: int, roots, born, is_view, node_roots, batch, opt: set[int]) -> None:
    """Rule 4 of the module docstring: adds its nodes to ``opt`` (rules 1 and 2 given)."""
    nodes = graph.nodes
    from_loss = {s for s, b in born.items() if b == boundary}   # the loss's storage, then the backward's
    seeds: set[int] = set()           # the nodes not linear in what the backward made
    candidates: set[int] = set()      # and the nodes computed from them
    for i in range(boundary + 1, len(nodes)):  # program order
        rr = node_roots[i]
        made = [s for s in rr if born[s] > boundary and born[s] not in opt]
        if i not in opt and any(s in from_loss for s in rr):
            from_loss.update(_made(nodes[i], born, i))
        if i in opt or is_view[i] or any(s in batch or 0 <= born[s] <= boundary for s in rr) or \
                not all(s in from_loss for s in made):   # an activation recomputed in the backward
            continue
        if made and _nonlinear_in(nodes[i], [born[root] > boundary and born[root] not in opt
                                             for root in (roots[r.id] for r in nodes[i].input_refs())]):
            seeds.add(i)
        if i in seeds or any(born[s] in candidates for s in made):
            candidates.add(i)
    readers: dict[int, set[int]] = {}
    for i in range(boundary + 1, len(nodes)):
        if candidates and not is_view[i]:
            for s in node_roots[i]:
                readers.setdefault(s, set()).add(i)
    while candidates:   # shrinks to the nodes read only by the update, each computed from a seed kept
        read_by_update: set[int] = set()
        for i in sorted(candidates, reverse=True):  # readers come later: decided first
            outs = _made(nodes[i], born, i)
            if outs and all(readers.get(s) and readers[s] <= opt | read_by_update for s in outs):
                read_by_update.add(i)
        kept: set[int] = set()
        for i in sorted(read_by_update):
            if i in seeds or any(born[s] in kept for s in node_roots[i]):
                kept.add(i)
        if kept == candidates:
            break
        candidates = kept
    opt.update(candidates)


def _made(node, born, i: int) -> list[int]:
    """The storages node ``i`` makes (its outputs that are not views)."""
    return [v for v in node.outputs if v is not None and born.get(v) == i]


def _nonlinear_in(node, from_backward: list[bool]) -> bool:
    """Whether ``node`` is not known to be linear in the inputs flagged in ``from_backward`` (computed after the
    loss by non-optimizer nodes): ops without a ``linear`` fact (``abs``, ``sqrt``, a vector norm, an opaque
    op), ops linear in one input reading two such inputs (``g * g``, ``G @ G.T``), ops linear in their first
    input reading one elsewhere (``g / g.norm()``), ops whose values do not come from their inputs
    (``ones_like(g)``: summed over micro-batches it would grow with their number)."""
    opdef = lookup(node.op)
    if opdef is None or opdef.values is not Values.COMPUTED or opdef.linear is None:
        return True
    if opdef.linear is Linear.ONE:
        return sum(from_backward) > 1
    if opdef.linear is Linear.FIRST:
        return any(from_backward[1:])
    return False


def _view_reach(graph: Graph, is_view) -> dict[int, int]:
    """``view_reach`` (module docstring), in reverse program order."""
    n = len(graph.nodes)
    outputs = {o.value for o in graph.outputs}
    reach: dict[int, int] = {}
    last: dict[int, int] = {}         # value -> last node reading it, through first-input views
    for j in range(n - 1, -1, -1):
        node = graph.nodes[j]
        if is_view[j]:
            r = max([j] + [last.get(v, j) for v in node.outputs if v is not None] +
                    [n - 1 for v in node.outputs if v in outputs])
            reach[j] = r
        for k, ref in enumerate(node.input_refs()):
            far = reach[j] if is_view[j] and k == 0 else j
            last[ref.id] = max(last.get(ref.id, -1), far)
    return reach


def _boundary(graph: Graph, root, born) -> int:
    loss = next((o for o in graph.outputs if o.role is Role.LOSS), None)
    return -1 if loss is None else born[root[loss.value]]


def _analyze(graph: Graph) -> GraphAnalysis:
    n = len(graph.nodes)
    root, born, producer, is_view, node_roots, readers = _storages(graph)
    input_role = {i.value: i.role for i in graph.inputs}
    state_in = frozenset(v for v, r in input_role.items() if r in STATE_ROLES)
    opt_in = frozenset(v for v, r in input_role.items() if r is Role.OPT_STATE)
    batch = frozenset(v for v, r in input_role.items() if r is Role.BATCH)
    persistent = frozenset(state_in | {v for v, r in input_role.items() if r is Role.CONST} | set(graph.constants))
    state_out = frozenset(o.value for o in graph.outputs if o.role in STATE_ROLES)
    output_roots = frozenset(root[o.value] for o in graph.outputs)
    last_read = {s: (readers[s][-1] if s in readers else -1) for s in born}
    boundary = _boundary(graph, root, born)
    if boundary < 0:
        roles = (NodeRole.FORWARD,) * n
        opt: set[int] = set()
    else:
        opt = _optimizer_nodes(graph, boundary, root, born, is_view, node_roots, opt_in, state_in, batch,
                               state_out)
        roles = tuple(NodeRole.FORWARD if i < boundary else NodeRole.LOSS if i == boundary else
                      NodeRole.OPTIMIZER if i in opt else NodeRole.BACKWARD for i in range(n))
    opt_read = {s for i in opt for s in node_roots[i]}
    gradients = frozenset(s for s, b in born.items()
                          if b > boundary >= 0 and b not in opt and s in opt_read and s not in state_out)
    by_name = {i.name: i for i in graph.inputs}
    updates = {o.name: o.value for o in graph.outputs
               if o.role in STATE_ROLES and o.name in by_name and by_name[o.name].role in STATE_ROLES}
    out = GraphAnalysis(n, root, born, producer, tuple(is_view), tuple(node_roots), readers, last_read,
                        {}, boundary, roles, frozenset(opt), gradients, input_role, state_in, opt_in,
                        batch, persistent, state_out, output_roots, updates, _view_reach(graph, is_view))
    out.last_use.update({s: out.end_of(s, r) for s, r in last_read.items()})
    return out


def batch_dependent(graph: Graph) -> set[int]:
    """Values computed from the batch: the batch inputs and every output of a node reading one of them."""
    dep = {i.value for i in graph.inputs if i.role is Role.BATCH}
    for node in graph.nodes:
        if any(r.id in dep for r in node.input_refs()):
            dep.update(v for v in node.outputs if v is not None)
    return dep


def moved_dim(graph: Graph, node: Node, vid: int, dim: int) -> int | None:
    """Where dim ``dim`` of value ``vid`` is in the output of ``node``, a one-input view or element-wise op that
    only moves it (unsqueeze, squeeze, transpose, permute, a copy: the output dim carries exactly the letter
    of that input dim in the op's annotation), else None."""
    opdef = lookup(node.op)
    refs = node.input_refs()
    if opdef is None or opdef.kind not in (OpKind.VIEW, OpKind.ELEMENTWISE) or len(refs) != 1 or \
            refs[0].id != vid or not node.outputs or node.outputs[0] is None:
        return None
    ann = annotate(call_of(graph, node))
    if ann is None:
        return None
    spec = ann.inputs[0][dim]
    return next((j for j, d in enumerate(ann.outputs[0]) if len(spec) == 1 and d == spec), None)


def merged_blocks(graph: Graph) -> dict[int, dict[int, set[int]]]:
    """Value -> dim -> the block counts ``k`` for which a split of that dim in ``k`` strided blocks splits
    only an inner part of it that a view takes apart or put together: a view's output or input dim written
    ``(a b c)`` gives ``|a|`` (``b`` split) and ``|a||b|`` (``c`` split). BERT's sequence-first
    ``(seq, batch, d) -> (seq batch, d)`` gives the rows ``seq`` blocks (the batch split); nn.MultiheadAttention's
    packed projection viewed as ``(..., 3, E)`` gives its columns 3 blocks (Q, K and V each split). Carried
    forward and backward through views and element-wise ops, dim to dim by the same single letter (a
    transpose, a bias add)."""
    out: dict[int, dict[int, set[int]]] = {}

    def add(vid: int, d: int, ks) -> None:
        out.setdefault(vid, {}).setdefault(d, set()).update(ks)

    def blocks(vid: int, spec: tuple, sizes: dict) -> None:
        for d, group in enumerate(spec):
            outer = 1
            for j, x in enumerate(group):
                if j and outer > 1:
                    add(vid, d, (outer,))
                outer *= sizes.get(x, 1)

    moves = []
    for node in graph.nodes:
        opdef = lookup(node.op)
        if opdef is None or opdef.kind not in (OpKind.VIEW, OpKind.ELEMENTWISE) or not node.outputs \
                or node.outputs[0] is None:
            continue
        call = call_of(graph, node)
        ann = annotate(call)
        if ann is None or not ann.outputs:
            continue
        vid, groups = node.outputs[0], ann.outputs[0]
        # (input value, input dim, output dim) pairs carrying one letter
        pairs = [(ref.id, d, j) for ref, dims in zip(node.input_refs(), ann.inputs) for d, g in enumerate(dims)
                 for j, h in enumerate(groups) if len(g) == 1 and g == h]
        moves.append((vid, pairs))
        for src, d, j in pairs:
            if d in out.get(src, {}):
                add(vid, j, out[src][d])
        refs = node.input_refs()
        if opdef.kind is OpKind.VIEW and refs:
            sizes = letter_sizes(ann, [t.shape for t in call.in_types])
            blocks(vid, groups, sizes)
            blocks(refs[0].id, ann.inputs[0], sizes)
    for vid, pairs in reversed(moves):
        for src, d, j in pairs:
            if j in out.get(vid, {}):
                add(src, d, out[vid][j])
    return out
