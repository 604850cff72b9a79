"""Memory accounting of one training step with liveness (pure Python, never imports torch).

The model (what ``estimate_memory`` assumes):

- The program runs in the graph's node order, one node at a time, on one rank.
- Sizes are per-rank: with a resolved plan each value takes its LOCAL shape (``ResolvedPlan.local_shape``;
  a Partial value is full-sized); without a plan, its global shape.
- State inputs (params, frozen params, buffers, optimizer state) and constants are live for the whole
  step. Batch inputs are live from the start until their last use.
- A non-view node output is allocated when its node runs and freed right after its last consumer
  (an output nobody reads lives only during its node). Graph outputs (loss and new state) stay live to
  the end of the step.
- No in-place update: the new state values produced by the optimizer coexist with the old state
  inputs until the end of the step (as in the functional captured graph; a runtime that updates in
  place needs less).
- A view (``OpKind.VIEW``) allocates nothing: it aliases the storage of its first tensor input and
  extends that storage's lifetime to the view's last use.
- While a node runs, its inputs (including the ones freed after it) and its outputs are all live;
  the peak is the maximum over nodes of these "during-node" bytes. ``timeline[i]`` is the live bytes
  after node ``i`` once its dead values are freed.
- With a plan, an input a node needs in another sharding than the value's own is redistributed
  into a copy (local size under the required sharding), one per value and target sharding as the
  lowering caches them: made just before the first node that needs it (while its source is live),
  freed after the last one (a temporary). A source whose last reader is such a redistribution is
  freed as soon as the copy exists, before the node runs. A view of a copy aliases the copy: the copy
  lives to the view's last use. Allocator fragmentation, workspaces inside ops and communication
  buffers are not modelled.

Categories: the forward/backward boundary is the node producing the loss (following views back to
the storage they alias). An *optimizer node* reads an optimizer-state input or produces a new state
value. New state values are ``updated_state``; a value produced after the boundary by a
non-optimizer node and read (directly or through a view) by an optimizer node is a *gradient*; a
value produced at or before the boundary and still live after it is an *activation* (saved for
backward); every other intermediate (and every redistributed copy) is a *temporary*.

``params`` (PARAM + FROZEN), ``optimizer``, ``buffers`` (+ constants), ``batch``, ``gradients``,
``activations`` and ``updated_state`` are total bytes of the values in that category; ``temporaries``
is the most temporary bytes live at once; ``breakdown`` gives each category's bytes live at the peak.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.graph import Graph, Role
from ..ir.registry import OpKind, lookup
from ..sharding.placement import local_shape

__all__ = ["MemoryEstimate", "estimate_memory", "CATEGORIES"]

CATEGORIES = ("params", "optimizer", "buffers", "batch", "activations", "gradients", "updated_state",
              "temporaries")
_PARAMS, _OPT, _BUF, _BATCH, _ACT, _GRAD, _NEW, _TMP = range(len(CATEGORIES))
_INPUT_CAT = {Role.PARAM: _PARAMS, Role.FROZEN: _PARAMS, Role.OPT_STATE: _OPT, Role.BUFFER: _BUF,
              Role.CONST: _BUF, Role.BATCH: _BATCH}


@dataclass
class MemoryEstimate:
    """Bytes of one rank's training step (see the module docstring for the model)."""

    params: int
    gradients: int
    optimizer: int
    buffers: int
    activations: int
    temporaries: int
    peak: int
    peak_node: str
    batch: int = 0
    updated_state: int = 0
    timeline: list[int] = field(default_factory=list)    # live bytes after each node
    breakdown: dict[str, int] = field(default_factory=dict)  # category -> bytes live at the peak
    # activations as (producer index, last use at or before the loss node, bytes): what recomputation
    # and pipeline models need to know about the forward pass; ``boundary`` is the loss node's index
    activation_spans: list[tuple[int, int, int]] = field(default_factory=list)
    boundary: int = -1
    # ``estimate_memory(..., windows=...)``: per window of node indices [lo, hi), (peak bytes, breakdown there)
    window_peaks: list[tuple[int, dict[str, int]]] = field(default_factory=list)
    # the other storages made at or before the loss node and read by a later forward node (not saved for
    # backward), as (producer index, last forward use, bytes): with the activations, what a cut of the
    # forward pass must keep (``cost.remat.segment_choices``)
    forward_only_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # the storage (value id) of each span, in the same order
    activation_values: list[int] = field(default_factory=list)
    forward_only_values: list[int] = field(default_factory=list)

    @property
    def state(self) -> int:
        """Bytes of the state inputs (params, optimizer state, buffers)."""
        return self.params + self.optimizer + self.buffers


def _local_bytes(t, sharding, mesh) -> int:
    items = 1
    for d in local_shape(t.shape, sharding, mesh):
        items *= d
    return items * t.dtype.itemsize


def _is_view(op: str, cache: dict[str, bool]) -> bool:
    v = cache.get(op)
    if v is None:
        d = lookup(op)
        v = cache[op] = d is not None and d.kind is OpKind.VIEW
    return v


def estimate_memory(graph: Graph, resolved_plan=None, rank: int = 0,
                    windows: list[tuple[int, int]] = ()) -> MemoryEstimate:
    """Liveness-based memory of ``graph`` on ``rank`` (local sizes when ``resolved_plan`` is given).
    ``windows``: node index ranges [lo, hi) whose own peak and breakdown are reported too
    (``MemoryEstimate.window_peaks``; gradient accumulation prices its two programs with them)."""
    if not isinstance(graph, Graph):
        raise ValueError(f"estimate_memory expects a rhino Graph, got {type(graph).__name__}")
    if resolved_plan is not None:
        if resolved_plan.graph is not graph and resolved_plan.graph.fingerprint() != graph.fingerprint():
            raise ValueError("the resolved plan was made for another graph; resolve the plan for this graph")
        world = resolved_plan.plan.mesh.world
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside the mesh (world size {world})")
    elif rank != 0:
        raise ValueError(f"rank {rank} given without a plan; a single device has only rank 0")

    types = graph.types
    nodes = graph.nodes
    n = len(nodes)
    end = n  # "live to the end of the step"

    if resolved_plan is None:
        def size(vid: int) -> int:
            return types[vid].nbytes
    else:
        mesh = resolved_plan.plan.mesh
        rvalue = resolved_plan.value

        def size(vid: int) -> int:
            t = types[vid]
            sh = rvalue.get(vid)
            if sh is None:
                return t.nbytes
            items = 1
            for d in local_shape(t.shape, sh, mesh):
                items *= d
            return items * t.dtype.itemsize

    # -- roots (storages), birth, category seeds --------------------------------------------
    root: dict[int, int] = {}     # value -> storage it lives in
    born: dict[int, int] = {}     # storage -> node index (-1: input/constant)
    cat: dict[int, int] = {}      # storage -> category (inputs fixed now; others later)
    last: dict[int, int] = {}     # storage -> index of last use
    for inp in graph.inputs:
        v = inp.value
        if v not in types:
            raise ValueError(f"graph input {inp.name} refers to value {v}, which has no type")
        root[v] = v
        born[v] = -1
        cat[v] = _INPUT_CAT.get(inp.role, _BUF)
        last[v] = -1 if inp.role in (Role.BATCH,) else end
    for v in graph.constants:
        if v not in root:
            root[v] = v
            born[v] = -1
            cat[v] = _BUF
            last[v] = end

    opt_inputs = {i.value for i in graph.inputs if i.role is Role.OPT_STATE}
    state_out = {o.value for o in graph.outputs if o.role in (Role.PARAM, Role.FROZEN, Role.BUFFER,
                                                              Role.OPT_STATE)}
    view_cache: dict[str, bool] = {}
    node_refs: list[list[int]] = []
    state_in = {i.value for i in graph.inputs if i.role in (Role.PARAM, Role.FROZEN, Role.BUFFER, Role.OPT_STATE)}
    node_roots: list[list[int]] = []
    uses: dict[int, list[int]] = {}   # storage -> indices of the nodes reading it
    is_view = [False] * n
    base_opt = [False] * n
    # redistributed copies (one per value and target sharding, as the lowering caches them): made just
    # before the first node that needs it, live until the last one; key -> [first, last, bytes]
    copies: dict[tuple, list[int]] = {}
    pre_last: dict[int, int] = {}   # storage -> last node before which it is read to make a copy
    via_copy: dict[int, tuple] = {}  # a view of a copy (ZeRO-3's transposed gathered weight) -> the copy
    for i, node in enumerate(nodes):
        refs = [r.id for r in node.input_refs()]
        node_refs.append(refs)
        first_copy = None
        need = resolved_plan.node[node.name].inputs if resolved_plan is not None else None
        rroots = []
        for k, r in enumerate(refs):
            rr = root.get(r)
            if rr is None:
                raise ValueError(f"node {node.name} reads value {r} before it is defined (not in program order)")
            rroots.append(rr)
            uses.setdefault(rr, []).append(i)
            req = tuple(need[k]) if need is not None and need[k] is not None else None
            if req is not None and req != tuple(resolved_plan.value.get(r, req)):
                c = copies.get((r, req))
                if c is None:
                    copies[(r, req)] = [i, i, _local_bytes(types[r], req, resolved_plan.plan.mesh)]
                    pre_last[rr] = max(pre_last.get(rr, -1), i)
                else:
                    c[1] = i
                if k == 0:
                    first_copy = (r, req)
                continue
            if r in via_copy:  # a view of a copy keeps the copy alive, not its source
                copies[via_copy[r]][1] = i
                if k == 0:
                    first_copy = via_copy[r]
                continue
            if last[rr] < i:  # state inputs already live to ``end``
                last[rr] = i
        node_roots.append(rroots)
        base_opt[i] = any(r in opt_inputs for r in refs) or any(v in state_out for v in node.outputs if v is not None)
        view = is_view[i] = _is_view(node.op, view_cache) and bool(rroots)
        if view and first_copy is not None:
            via_copy.update({v: first_copy for v in node.outputs if v is not None})
        for v in node.outputs:
            if v is None:
                continue
            if v not in types:
                raise ValueError(f"node {node.name} defines value {v}, which has no type")
            if view:
                root[v] = rroots[0]
            else:
                root[v] = v
                born[v] = i
                last[v] = i
    for o in graph.outputs:
        if o.value not in root:
            raise ValueError(f"graph output {o.name} refers to value {o.value}, which no node defines")
        last[root[o.value]] = end
        if o.value in via_copy:
            copies[via_copy[o.value]][1] = n - 1
    # a storage whose last reader is a redistribution is freed as soon as the copy exists
    freed_early: dict[int, int] = {}
    for rr, i in pre_last.items():
        if i > last[rr]:
            last[rr] = i
            freed_early[rr] = i

    # -- forward/backward boundary and categories ---------------------------------------------
    boundary = n
    try:
        loss_root = root[graph.loss.value]
        boundary = born[loss_root]
    except StopIteration:
        pass  # no loss output: everything counts as forward
    # Optimizer nodes: read optimizer state or produce new state; also a backward-region node that reads
    # a state input and feeds only optimizer nodes (weight decay, clipping: ``g + wd * w``).
    # One reverse pass: every consumer comes after its producer. Views alias and are not consumers.
    is_opt = [False] * n
    opt_consumed: set[int] = set()     # storages read by an optimizer node
    other_consumed: set[int] = set()   # storages read by another (non-view) node
    for i in range(n - 1, -1, -1):
        if is_view[i]:
            continue
        rroots = node_roots[i]
        opt = base_opt[i]
        if not opt and i > boundary and any(r in state_in for r in rroots):
            outs = [root[v] for v in nodes[i].outputs if v is not None]
            opt = bool(outs) and all(o in opt_consumed and o not in other_consumed for o in outs)
        is_opt[i] = opt
        (opt_consumed if opt else other_consumed).update(rroots)
    sizes: dict[int, int] = {}
    for s, b in born.items():
        sizes[s] = size(s)
        if b < 0:
            continue
        if s in state_out:
            c = _NEW
        elif b > boundary and not is_opt[b] and s in opt_consumed:
            c = _GRAD
        elif b <= boundary < last[s]:
            c = _ACT
        else:
            c = _TMP
        cat[s] = c

    # -- one pass over the program ------------------------------------------------------------
    alloc = [0] * n
    alloc_tmp = [0] * n
    free = [0] * n        # bytes freed right after node i
    free_tmp = [0] * n
    live = 0
    for s, b in born.items():
        la = last[s]
        if la < 0:
            continue  # a batch input nobody reads: never live
        sz = sizes[s]
        t = cat[s] == _TMP
        if b < 0:
            live += sz
        else:
            alloc[b] += sz
            if t:
                alloc_tmp[b] += sz
        if la < end:
            free[la] += sz
            if t:
                free_tmp[la] += sz
    alloc_pre = [0] * n   # copies made before node i runs
    free_pre = [0] * n    # storages freed once node i's copies exist
    free_tmp_pre = [0] * n
    for (first, lst, nbytes) in copies.values():
        alloc_pre[first] += nbytes
        free[lst] += nbytes
        free_tmp[lst] += nbytes
    for rr, i in freed_early.items():
        sz = sizes[rr]
        free[i] -= sz
        free_pre[i] += sz
        if cat[rr] == _TMP:
            free_tmp[i] -= sz
            free_tmp_pre[i] += sz
    timeline: list[int] = []
    peak, peak_i = live, -1
    wpeak = [(-1, lo) for lo, _ in windows]   # (bytes, node index) per window

    def seen(i: int, value: int) -> None:
        for k, (lo, hi) in enumerate(windows):
            if lo <= i < hi and value > wpeak[k][0]:
                wpeak[k] = (value, i)
    tmp_live = tmp_max = 0
    for i in range(n):
        pre = live + alloc_pre[i]          # the copies for node i are made while their sources live
        if windows:
            seen(i, pre)
        if pre > peak:
            peak, peak_i = pre, i
        tmp_live += alloc_pre[i]
        tmp_max = max(tmp_max, tmp_live)
        tmp_live -= free_tmp_pre[i]
        during = pre - free_pre[i] + alloc[i]
        if windows:
            seen(i, during)
        if during > peak:
            peak, peak_i = during, i
        tmp_live += alloc_tmp[i]
        tmp_max = max(tmp_max, tmp_live)
        live = during - free[i]
        tmp_live -= free_tmp[i]
        timeline.append(live)

    # -- totals and the breakdown at the peak --------------------------------------------------
    totals = [0] * len(CATEGORIES)
    for s, b in born.items():
        totals[cat[s]] += sizes[s]

    def breakdown(at: int) -> dict[str, int]:
        out = [0] * len(CATEGORIES)
        for s, b in born.items():
            if b <= at <= last[s] and last[s] >= 0:
                out[cat[s]] += sizes[s]
        for (first, lst, nbytes) in copies.values():
            if first <= at <= lst:
                out[_TMP] += nbytes
        return {name: out[k] for k, name in enumerate(CATEGORIES)}
    spans, fwd_spans, span_values, fwd_values = [], [], [], []
    for s, b in born.items():
        if b < 0 or b > boundary:
            continue
        last_fwd = max([u for u in uses.get(s, ()) if u <= boundary], default=b)
        if cat[s] == _ACT:
            spans.append((b, last_fwd, sizes[s]))
            span_values.append(s)
        elif last_fwd > b:
            fwd_spans.append((b, last_fwd, sizes[s]))
            fwd_values.append(s)
    return MemoryEstimate(
        params=totals[_PARAMS], gradients=totals[_GRAD], optimizer=totals[_OPT], buffers=totals[_BUF],
        activations=totals[_ACT], temporaries=tmp_max, peak=peak,
        peak_node=nodes[peak_i].name if peak_i >= 0 else "", batch=totals[_BATCH],
        updated_state=totals[_NEW], timeline=timeline,
        breakdown=breakdown(peak_i), activation_spans=spans,
        boundary=boundary if boundary < n else -1, forward_only_spans=fwd_spans,
        activation_values=span_values, forward_only_values=fwd_values,
        window_peaks=[(max(b, 0), breakdown(i)) for b, i in wpeak])
