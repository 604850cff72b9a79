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
- **Roles** (as the categories of ``cost/memory.py``): LOSS is the node producing the loss's root;
  OPTIMIZER are nodes reading an OPT_STATE input, nodes after the loss producing a new state value
  (before the loss that is a forward op, e.g. BatchNorm's running statistics), nodes after the loss
  that read (through views) a value an optimizer node made (bias corrections, ``sqrt`` of the new second
  moment), and nodes after the loss that read a state input but no forward activation or batch input and
  feed only optimizer nodes (weight decay); FORWARD is every other node up to the loss node, BACKWARD every other node after it. Without
  a loss output every node is FORWARD.

Relation to ``cost.memory.estimate_memory`` (tested): with ``inplace_state=False`` and ``align=1`` the
program-order replay peak of the problem plus ``state_bytes`` equals ``estimate_memory(graph).peak``
(both count the same storages with the same lifetimes); with in-place updates the replay peak can only
be lower.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..ir.graph import STATE_ROLES, Graph, Role
from ..ir.registry import OpKind, lookup
from .problem import MemOp, MemProblem, MemTensor, OpRole, TensorKind, lifetimes

__all__ = ["GraphMemory", "problem_from_graph", "aligned_offsets", "PERSISTENT_ROLES", "DEFAULT_ALIGN"]

PERSISTENT_ROLES = (*STATE_ROLES, Role.CONST)
DEFAULT_ALIGN = 64  # bytes; >= every dtype's item size (and a cache line)
_RANDOM = re.compile(r"(^|\.)(_?native_dropout|dropout|bernoulli|rand|randn|randint|randperm|rand_like|randn_like|"
                     r"randint_like|normal|uniform|multinomial|exponential|geometric|cauchy|log_normal|random)"
                     r"(_|\.|$)")


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


def problem_from_graph(graph: Graph, *, include_state: bool = False, inplace_state: bool = True,
                       keep_random_order: bool = True, align: int = DEFAULT_ALIGN,
                       name: str = "") -> tuple[MemProblem, GraphMemory]:
    """The memory problem of ``graph`` and the value mapping (see the module docstring)."""
    if not isinstance(graph, Graph):
        raise ValueError(f"problem_from_graph expects a rhino Graph, got {type(graph).__name__}")
    if align < 1:
        raise ValueError(f"align must be a positive number of bytes, got {align}")
    types = graph.types
    nodes = graph.nodes
    n = len(nodes)

    # -- storages: roots of every value ---------------------------------------------------------
    root: dict[int, int] = {}
    persistent: set[int] = set()
    batch: list[int] = []
    state_value: dict[str, int] = {}
    state_bytes = param_bytes = 0
    for inp in graph.inputs:
        v = inp.value
        if v not in types:
            raise ValueError(f"graph input {inp.name} refers to value {v}, which has no type")
        root[v] = v
        if inp.role in PERSISTENT_ROLES:
            persistent.add(v)
            state_bytes += types[v].nbytes
            if inp.role in (Role.PARAM, Role.FROZEN):
                param_bytes += types[v].nbytes
            if inp.role in STATE_ROLES:
                state_value[inp.name] = v
        else:
            batch.append(v)
    for v in graph.constants:
        if v not in root:
            root[v] = v
            persistent.add(v)
            state_bytes += types[v].nbytes

    view_nodes: set[int] = set()
    node_roots: list[list[int]] = []
    born: dict[int, int] = {}          # intermediate root -> producing node index
    readers: dict[int, list[int]] = {}  # root -> node indices reading it (views included), in order
    for i, node in enumerate(nodes):
        rroots: list[int] = []
        for r in node.input_refs():
            rr = root.get(r.id)
            if rr is None:
                raise ValueError(f"node {node.name} reads value {r.id} before it is defined (not in program order)")
            if rr not in rroots:
                rroots.append(rr)
        node_roots.append(rroots)
        for rr in rroots:
            readers.setdefault(rr, []).append(i)
        d = lookup(node.op)
        view = d is not None and d.kind is OpKind.VIEW and bool(rroots)
        if view:
            view_nodes.add(i)
            first = root[node.input_refs()[0].id]
        for v in node.outputs:
            if v is None:
                continue
            if v not in types:
                raise ValueError(f"node {node.name} defines value {v}, which has no type")
            if v in root:
                raise ValueError(f"value {v} is defined twice (node {node.name})")
            if view:
                root[v] = first
            else:
                root[v] = v
                born[v] = i
    for o in graph.outputs:
        if o.value not in root:
            raise ValueError(f"graph output {o.name} refers to value {o.value}, which no node defines")

    # -- graph outputs: which roots must survive, which states are updated in place ------------------
    out_roots: dict[int, int] = {}     # root -> number of graph outputs stored in it
    for o in graph.outputs:
        out_roots[root[o.value]] = out_roots.get(root[o.value], 0) + 1
    pinned: set[int] = set()           # persistent roots whose old value must survive the step
    for o in graph.outputs:
        r = root[o.value]
        if r in persistent and not (o.role in STATE_ROLES and state_value.get(o.name) == r):
            pinned.add(r)
    inplace: dict[int, str] = {}       # intermediate root -> state input name
    for o in graph.outputs:
        if not inplace_state or o.role not in STATE_ROLES:
            continue
        s_in = state_value.get(o.name)
        r = root[o.value]
        if s_in is None or r not in born or s_in in pinned or out_roots[r] != 1 or r in inplace:
            continue
        if types[r] != types[s_in]:
            continue
        p = born[r]
        if any(j > p for j in readers.get(s_in, []) if j != p):
            continue
        inplace[r] = o.name

    # -- tensors ----------------------------------------------------------------------------------
    tensors: dict[int, MemTensor] = {}
    nbytes: dict[int, int] = {}
    also_out = {r for r in out_roots if r in batch}
    for v in batch:
        nbytes[v] = types[v].nbytes
        tensors[v] = MemTensor(v, _round_up(nbytes[v], align), TensorKind.INPUT, _input_name(graph, v),
                               also_output=v in also_out)
    if include_state:
        for v in sorted(persistent):
            nbytes[v] = types[v].nbytes
            tensors[v] = MemTensor(v, _round_up(nbytes[v], align), TensorKind.INPUT, _input_name(graph, v),
                                   also_output=True)
    for r, i in born.items():
        if r in inplace:
            continue
        nbytes[r] = types[r].nbytes
        kind = TensorKind.OUTPUT if r in out_roots else TensorKind.INTERMEDIATE
        tensors[r] = MemTensor(r, _round_up(nbytes[r], align), kind, f"{nodes[i].name}:{nodes[i].outputs.index(r)}")

    # -- ops: inputs/outputs by storage, ordering edges ---------------------------------------------
    after: list[set[int]] = [set() for _ in range(n)]
    state_root = {state_value[name]: r for r, name in inplace.items()}  # old state root -> new root
    for r in inplace:
        p = born[r]
        for j in readers.get(r, []):      # readers of the new value follow its producer
            if j != p:
                after[j].add(p)
    for s_in, r in state_root.items():
        p = born[r]
        for j in readers.get(s_in, []):   # readers of the old value precede the in-place write
            if j != p:
                after[p].add(j)
    view_def = {v: i for i in view_nodes for v in nodes[i].outputs if v is not None}
    for i, node in enumerate(nodes):      # readers of a view run after the view node (it creates no tensor)
        for r in node.input_refs():
            j = view_def.get(r.id)
            if j is not None:
                after[i].add(j)
    if keep_random_order:
        prev = None
        for i, node in enumerate(nodes):
            if _RANDOM.search(node.op.split(".", 1)[-1]):
                if prev is not None:
                    after[i].add(prev)
                prev = i

    roles = _roles(graph, node_roots, root, born, view_nodes)
    ops: list[MemOp] = []
    for i, node in enumerate(nodes):
        ins = [r for r in node_roots[i] if r in tensors]
        if include_state:
            for r, name in inplace.items():
                if born[r] == i and state_value[name] not in ins:
                    ins.append(state_value[name])
        outs = [] if i in view_nodes else [v for v in node.outputs if v is not None and v in tensors]
        ops.append(MemOp(i, node.name, tuple(ins), tuple(outs), roles[i], tuple(sorted(after[i]))))

    tensor_of = {v: r for v, r in root.items() if r in tensors}
    problem = MemProblem(ops, tensors, name or str(graph.meta.get("workload", "")))
    mapping = GraphMemory(root=root, tensor_of=tensor_of, nbytes=nbytes, persistent=persistent, inplace=inplace,
                          state_value=state_value, view_nodes=view_nodes, align=align, state_bytes=state_bytes,
                          param_bytes=param_bytes, include_state=include_state)
    return problem, mapping


def _input_name(graph: Graph, v: int) -> str:
    for inp in graph.inputs:
        if inp.value == v:
            return inp.name
    return f"const{v}"


def _roles(graph: Graph, node_roots: list[list[int]], root: dict[int, int], born: dict[int, int],
           view_nodes: set[int]) -> list[OpRole]:
    """Op roles (module docstring; the same categories as ``cost/memory.py``)."""
    nodes = graph.nodes
    n = len(nodes)
    loss = next((o for o in graph.outputs if o.role is Role.LOSS), None)
    boundary = born.get(root[loss.value], -1) if loss is not None else -1
    if loss is None or boundary < 0:
        return [OpRole.FORWARD] * n
    opt_inputs = {i.value for i in graph.inputs if i.role is Role.OPT_STATE}
    state_out = {o.value for o in graph.outputs if o.role in STATE_ROLES}
    state_in = {i.value for i in graph.inputs if i.role in STATE_ROLES}
    batch = {i.value for i in graph.inputs if i.role is Role.BATCH}
    is_opt = [False] * n
    opt_made: set[int] = set(opt_inputs)   # roots produced by optimizer nodes (and optimizer-state inputs)
    for i, node in enumerate(nodes):       # forward: what reads optimizer values after the loss is optimizer
        refs = [r.id for r in node.input_refs()]
        opt = any(r in opt_inputs for r in refs) or \
            (i > boundary and any(v in state_out for v in node.outputs if v is not None))
        if not opt and i > boundary and any(r in opt_made for r in node_roots[i]):
            opt = True
        is_opt[i] = opt
        if opt and i not in view_nodes:
            opt_made.update(v for v in node.outputs if v is not None)
    opt_consumed: set[int] = set()
    other_consumed: set[int] = set()
    for i in range(n - 1, -1, -1):         # backward: weight decay and the like feed only optimizer nodes
        if i in view_nodes:
            continue
        rroots = node_roots[i]
        opt = is_opt[i]
        if not opt and i > boundary and any(r in state_in for r in rroots) and \
                not any(r in batch or born.get(r, boundary + 1) <= boundary for r in rroots):  # no activation
            outs = [root[v] for v in nodes[i].outputs if v is not None]
            opt = bool(outs) and all(o in opt_consumed and o not in other_consumed for o in outs)
        is_opt[i] = opt
        (opt_consumed if opt else other_consumed).update(rroots)
    roles = []
    for i in range(n):
        if i == boundary:
            roles.append(OpRole.LOSS)
        elif is_opt[i]:
            roles.append(OpRole.OPTIMIZER)
        else:
            roles.append(OpRole.FORWARD if i < boundary else OpRole.BACKWARD)
    return roles


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
