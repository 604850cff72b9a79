"""IR graph -> :class:`MemProblem`: one op per IR node, one tensor per storage (pure; imports only ``rhino.ir``).

The conversion (what every planner and the arena executor of ``lower/arena.py`` assume):

- **Ops.** Op id ``i`` is ``graph.nodes[i]``; program order is the node order. A view node (registry kind
  ``OpKind.VIEW`` with a tensor input) creates no tensor: it lists the storage it aliases as its input,
  and every reader of the view lists that storage (views are followed to their root, as
  ``cost/memory.py`` does) and gets an ``after`` edge from the view node (the view must exist first).
- **Tensors.** Tensor id = the value id of the storage's root (the value its producer defined). Size:
  the root's ``TensorType.nbytes`` rounded up to ``align`` bytes (default 64), so that every offset a
  layout builds from sums of sizes is aligned for every dtype; ``GraphMemory.nbytes`` keeps the exact
  bytes. The executor still checks each offset against its dtype.
- **Persistent state outside the arena.** Inputs with role PARAM, FROZEN, BUFFER, OPT_STATE or CONST and
  the graph's constant tensors live in their own memory for the whole step (as in ROAM, whose memory is
  parameter bytes + the planned peak of the graph's tensors). They are not tensors of the problem unless
  ``include_state=True``, where each becomes an INPUT with ``also_output`` (live the whole step).
  ``GraphMemory.state_bytes`` / ``param_bytes`` give their total.
- **Batch inputs** are INPUT tensors (live from the start to their last reader).
- **In-place state update** (option ``inplace_state``, default on; what ``optimizer.step()`` does in
  eager PyTorch). A new state value (output ``n`` replacing input ``n``) is written straight into the
  storage of input ``n`` when it is safe: the value's root is produced by a non-view node, has the input's
  shape and dtype, is the root of no other graph output; the old input's storage is not itself (through
  views) a graph output other than its own unchanged value; and every other reader of the old storage
  comes before the producer in program order. The root then takes no arena bytes; the producer gets
  ``after`` edges from every other reader of the old storage (they must read the old value first), and
  every reader of the new value gets an ``after`` edge from the producer (the data edge that the missing
  tensor would have given). With ``include_state=True`` the producer lists the state INPUT as an input
  (an in-place write, as ``problem.py`` says).
- **Graph outputs otherwise.** A loss or new-state value with an intermediate root: that root is an
  OUTPUT tensor (the executor copies it out at the end). A graph output that is a batch input, or a view
  of one: that INPUT gets ``also_output`` (live to the end). A graph output that is (a view of) a state
  input or constant: nothing is added; that state's storage is *pinned* (never updated in place, so
  its old value is still there at the end).
- **Random ops** (dropout, bernoulli, rand, ...) keep their relative program order through ``after``
  edges (option ``keep_random_order``, default on), so a reordered step draws the same random numbers.
- **Roles**: ``ir.analysis.NodeRole`` (forward, loss, backward, optimizer), the definition the cost
  model uses too. Storages, views and readers are ``ir.analysis``'s as well.

Relation to ``cost.memory.estimate_memory`` (tested): with ``inplace_state=False`` and ``align=1`` the
program-order replay peak of the problem plus ``state_bytes`` equals ``estimate_memory(graph).peak``
(both count the same storages with the same lifetimes); with in-place updates the replay peak can only
be lower.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.analysis import GraphAnalysis, analyze
from ..ir.graph import STATE_ROLES, Graph, Role
from ..ir.registry import draws_rng
from .problem import MemOp, MemProblem, MemTensor, OpRole, TensorKind, lifetimes

__all__ = ["GraphMemory", "problem_from_graph", "aligned_offsets", "PERSISTENT_ROLES", "DEFAULT_ALIGN"]

PERSISTENT_ROLES = (*STATE_ROLES, Role.CONST)
DEFAULT_ALIGN = 64  # bytes; >= every dtype's item size (and a cache line)


@dataclass
class GraphMemory:
    """How the graph's values map onto the problem (what the arena executor needs besides the plan)."""

    root: dict[int, int]              # value id -> storage root value id (views -> their base's root)
    tensor_of: dict[int, int]         # value id -> problem tensor id (only values stored in the arena)
    nbytes: dict[int, int]            # tensor id -> exact bytes (problem sizes are rounded up to ``align``)
    persistent: set[int]              # root value ids of state inputs and constants (outside the arena)
    inplace: dict[int, str] = field(default_factory=dict)   # root value id -> state input name it is written into
    state_value: dict[str, int] = field(default_factory=dict)  # state input name -> its input value id
    view_nodes: set[int] = field(default_factory=set)        # op ids of view nodes
    align: int = DEFAULT_ALIGN
    state_bytes: int = 0              # bytes of the persistent state (params, optimizer state, buffers, constants)
    param_bytes: int = 0              # bytes of PARAM + FROZEN inputs
    include_state: bool = False

    def is_view(self, op_id: int) -> bool:
        return op_id in self.view_nodes


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align if align > 1 else n


@dataclass
class _Storage:
    """The analysis' storages, split as the problem needs them."""

    a: GraphAnalysis
    born: dict[int, int]              # intermediate root -> producing node index
    node_roots: list[tuple[int, ...]]  # node -> distinct storages it reads, in argument order
    batch: list[int]                  # batch input values (arena INPUT tensors)
    state_value: dict[str, int]       # state input name -> value
    state_bytes: int
    param_bytes: int


def _storage(graph: Graph) -> _Storage:
    a = analyze(graph)
    types = graph.types
    batch = [i.value for i in graph.inputs if i.value not in a.persistent]
    state_value = {i.name: i.value for i in graph.inputs if i.role in STATE_ROLES}
    state_bytes = sum(types[v].nbytes for v in a.persistent)
    param_bytes = sum(types[i.value].nbytes for i in graph.inputs if i.role in (Role.PARAM, Role.FROZEN))
    born = {s: b for s, b in a.born.items() if b >= 0}
    node_roots = [tuple(dict.fromkeys(rr)) for rr in a.node_roots]
    return _Storage(a, born, node_roots, batch, state_value, state_bytes, param_bytes)


def _inplace(graph: Graph, st: _Storage, out_roots: dict[int, int]) -> dict[int, str]:
    """Intermediate root -> the state input name it is written into (module docstring)."""
    a, types = st.a, graph.types
    pinned: set[int] = set()           # persistent roots whose old value must survive the step
    for o in graph.outputs:
        r = a.root[o.value]
        if r in a.persistent and not (o.role in STATE_ROLES and st.state_value.get(o.name) == r):
            pinned.add(r)
    inplace: dict[int, str] = {}
    for o in graph.outputs:
        if o.role not in STATE_ROLES:
            continue
        s_in = st.state_value.get(o.name)
        r = a.root[o.value]
        if s_in is None or r not in st.born or s_in in pinned or out_roots[r] != 1 or r in inplace:
            continue
        if types[r] != types[s_in]:
            continue
        p = st.born[r]
        if any(j > p for j in a.readers.get(s_in, []) if j != p):
            continue
        inplace[r] = o.name
    return inplace


def _tensors(graph: Graph, st: _Storage, out_roots, inplace, include_state: bool, align: int):
    """(problem tensors, exact bytes per tensor)."""
    types, nodes = graph.types, graph.nodes
    tensors: dict[int, MemTensor] = {}
    nbytes: dict[int, int] = {}
    for v in st.batch:
        nbytes[v] = types[v].nbytes
        tensors[v] = MemTensor(v, _round_up(nbytes[v], align), TensorKind.INPUT, _input_name(graph, v),
                               also_output=v in out_roots)
    if include_state:
        for v in sorted(st.a.persistent):
            nbytes[v] = types[v].nbytes
            tensors[v] = MemTensor(v, _round_up(nbytes[v], align), TensorKind.INPUT, _input_name(graph, v),
                                   also_output=True)
    for r, i in st.born.items():
        if r in inplace:
            continue
        nbytes[r] = types[r].nbytes
        kind = TensorKind.OUTPUT if r in out_roots else TensorKind.INTERMEDIATE
        tensors[r] = MemTensor(r, _round_up(nbytes[r], align), kind, f"{nodes[i].name}:{nodes[i].outputs.index(r)}")
    return tensors, nbytes


def _after_edges(graph: Graph, st: _Storage, inplace, keep_random_order: bool) -> list[set[int]]:
    """Ordering edges: in-place writes, view readers, random ops (module docstring)."""
    a, nodes = st.a, graph.nodes
    after: list[set[int]] = [set() for _ in nodes]
    for r in inplace:
        p = st.born[r]
        for j in a.readers.get(r, []):      # readers of the new value follow its producer
            if j != p:
                after[j].add(p)
    for r, name in inplace.items():
        p = st.born[r]
        for j in a.readers.get(st.state_value[name], []):   # readers of the old value precede the write
            if j != p:
                after[p].add(j)
    for i, node in enumerate(nodes):        # readers of a view run after the view node (it creates no tensor)
        for r in node.input_refs():
            j = a.producer.get(r.id)
            if j is not None and a.is_view[j]:
                after[i].add(j)
    if keep_random_order:
        prev = None
        for i, node in enumerate(nodes):
            if draws_rng(node.op):
                if prev is not None:
                    after[i].add(prev)
                prev = i
    return after


def problem_from_graph(graph: Graph, *, include_state: bool = False, inplace_state: bool = True,
                       keep_random_order: bool = True, align: int = DEFAULT_ALIGN,
                       name: str = "") -> tuple[MemProblem, GraphMemory]:
    """The memory problem of ``graph`` and the value mapping (see the module docstring)."""
    if not isinstance(graph, Graph):
        raise ValueError(f"problem_from_graph expects a rhino Graph, got {type(graph).__name__}")
    if align < 1:
        raise ValueError(f"align must be a positive number of bytes, got {align}")
    st = _storage(graph)
    a = st.a
    out_roots: dict[int, int] = {}     # root -> number of graph outputs stored in it
    for o in graph.outputs:
        out_roots[a.root[o.value]] = out_roots.get(a.root[o.value], 0) + 1
    inplace = _inplace(graph, st, out_roots) if inplace_state else {}
    tensors, nbytes = _tensors(graph, st, out_roots, inplace, include_state, align)
    after = _after_edges(graph, st, inplace, keep_random_order)
    ops: list[MemOp] = []
    for i, node in enumerate(graph.nodes):
        ins = [r for r in st.node_roots[i] if r in tensors]
        if include_state:
            for r, sname in inplace.items():
                if st.born[r] == i and st.state_value[sname] not in ins:
                    ins.append(st.state_value[sname])
        outs = [] if a.is_view[i] else [v for v in node.outputs if v is not None and v in tensors]
        ops.append(MemOp(i, node.name, tuple(ins), tuple(outs), OpRole(a.roles[i].value), tuple(sorted(after[i]))))
    problem = MemProblem(ops, tensors, name or str(graph.meta.get("workload", "")))
    mapping = GraphMemory(root=dict(a.root), tensor_of={v: r for v, r in a.root.items() if r in tensors},
                          nbytes=nbytes, persistent=set(a.persistent), inplace=inplace,
                          state_value=st.state_value, view_nodes={i for i, v in enumerate(a.is_view) if v},
                          align=align, state_bytes=st.state_bytes, param_bytes=st.param_bytes,
                          include_state=include_state)
    return problem, mapping


def _input_name(graph: Graph, v: int) -> str:
    for inp in graph.inputs:
        if inp.value == v:
            return inp.name
    return f"const{v}"


def aligned_offsets(problem: MemProblem, order, offsets: dict[int, int], align: int) -> tuple[dict[int, int], int]:
    """A valid layout with every offset a multiple of ``align``, never higher than the given one.

    For layouts whose offsets are not aligned (an exact solver may leave gaps of any size). Buffers
    are re-placed in increasing offset order, each right on top of the highest already placed buffer
    that is live at the same time (a per-step skyline). When every size is a multiple of ``align`` (the
    sizes ``problem_from_graph`` makes), each new offset is aligned and at most the old one, so the
    height does not grow. Returns ``(offsets, height)``; zero-size tensors keep offset 0.
    """
    life = lifetimes(problem, order)
    items = sorted((offsets[t], t) for t, x in problem.tensors.items() if x.size > 0)
    sky = [0] * (max((hi for lo, hi in life.values()), default=0) + 1)  # per step: top of what is placed
    out = {t: 0 for t in problem.tensors}
    height = 0
    for _, t in items:
        lo, hi = life[t]
        off = _round_up(max(sky[lo:hi], default=0), align)
        end = off + problem.tensors[t].size
        sky[lo:hi] = [end] * (hi - lo)
        out[t] = off
        height = max(height, end)
    return out, height
