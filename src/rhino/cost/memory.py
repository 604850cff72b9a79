"""Memory accounting of one training step with liveness (pure Python, never imports torch).

The model (what ``estimate_memory`` assumes):

- The program runs in the graph's node order, one node at a time, on one rank.
- Sizes are per-rank: with a resolved plan each value takes its LOCAL shape (``ResolvedPlan.local_shape``;
  a Partial value is full-sized); without a plan, its global shape.
- State inputs (params, frozen params, buffers, optimizer state) and constants are live from the start
  (until their last read where replaced: below). Batch inputs are live from the start until their last use.
- A non-view node output is allocated when its node runs and freed right after its last consumer
  (an output nobody reads lives only during its node). Graph outputs (loss and new state) stay live to
  the end of the step.
- The update is in place, as the runtime runs it: a state input that an output replaces (a parameter,
  an optimizer moment, a running statistic) is freed at its last read (``released_state``; the runtime
  hands it to the program that replaces it and keeps no reference, as PyTorch's in-place optimizers
  overwrite theirs); the new value lives from its node to the end of the step. Inputs nothing replaces
  (frozen parameters, constants) live all step.
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
- ``copy_rule``: the two bullets above are ``CopyRule.RUNTIME`` (the default: what the lowering does).
  ``CopyRule.SOURCE_HELD`` is the search's memory rows' safe side (``search.memrows``), whose
  liveness cannot depend on the choice: every storage lives to its last reader, a read through a copy
  included (never freed once its copy exists), and a copy a view is taken of lives to the view's
  reach (``ir.analysis``: its last reader through any reader, not only those reading the copy), the
  source too (through the view's readers), and replaced state lives to its last read through any reader
  (``last_uses``). Under it the rows and this model give the same bytes at every node (tests/test_analysis.py).

Storages, views, last uses, the loss boundary, optimizer nodes and gradients are those of
``ir.analysis`` (the single definition the search and the memory planner use too). Categories: new
state values are ``updated_state``; ``ir.analysis`` gradients are *gradients*; a value produced at or
before the boundary and still live after it is an *activation* (saved for backward); every other
intermediate (and every redistributed copy) is a *temporary*.

``params`` (PARAM + FROZEN), ``optimizer``, ``buffers`` (+ constants), ``batch``, ``gradients``,
``activations`` and ``updated_state`` are total bytes of the values in that category; ``temporaries``
is the most temporary bytes live at once; ``breakdown`` gives each category's bytes live at the peak.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..ir.analysis import GraphAnalysis, analyze
from ..ir.graph import Graph, Role
from ..sharding.placement import local_shape

__all__ = ["MemoryEstimate", "estimate_memory", "program_peaks", "released_state", "last_uses", "CATEGORIES",
           "CopyRule"]


class CopyRule(str, Enum):
    """How a redistributed copy and its source live (module docstring)."""

    RUNTIME = "runtime"            # as the lowering runs: source freed once its last copy exists
    SOURCE_HELD = "source_held"    # the search rows' safe side: source held to its last reader

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


def _check(graph: Graph, resolved_plan, rank: int) -> None:
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


def _sizes(graph: Graph, a: GraphAnalysis, resolved_plan) -> dict[int, int]:
    """Bytes of every storage on this rank (local shapes under the plan)."""
    types = graph.types
    if resolved_plan is None:
        return {s: types[s].nbytes for s in a.born}
    mesh, rvalue = resolved_plan.plan.mesh, resolved_plan.value
    return {s: (types[s].nbytes if rvalue.get(s) is None else _local_bytes(types[s], rvalue[s], mesh))
            for s in a.born}


@dataclass
class _Lifetimes:
    """Last uses on this rank: ``ir.analysis``'s rule applied to the reads of the storage itself (a read
    through a redistributed copy reads the copy), and the copies (module docstring)."""

    last: dict[int, int]
    copies: dict[tuple, list[int]] = field(default_factory=dict)  # (value, sharding) -> [first, last, bytes]
    freed_early: dict[int, int] = field(default_factory=dict)     # storage -> node its last copy is made for


def released_state(graph: Graph, a: GraphAnalysis) -> frozenset[int]:
    """Storages of the state inputs the runtime frees at their last read: those an output of another storage
    replaces (``runtime.rank_step``/``runtime.pipeline`` hand them to the program that replaces them and keep
    no reference, as PyTorch's in-place optimizers overwrite theirs)."""
    value = {i.name: i.value for i in graph.inputs}
    return frozenset(value[name] for name, v in a.updates.items()
                     if a.root[v] != value[name] and value[name] not in a.output_roots)


def last_uses(graph: Graph, a: GraphAnalysis, release_state: bool = True) -> dict[int, int]:
    """``ir.analysis``'s last uses, with the replaced state (``released_state``) ending at its last read
    through any reader (copies included) where ``release_state``: the runtime's liveness without a plan, and
    the search rows' at any plan (``search.memrows``)."""
    last = dict(a.last_use)
    if release_state:
        last.update({s: a.last_read[s] for s in released_state(graph, a)})
    return last


def _lifetimes(graph: Graph, a: GraphAnalysis, resolved_plan, rule: CopyRule = CopyRule.RUNTIME,
               release_state: bool = True) -> _Lifetimes:
    held = rule is CopyRule.SOURCE_HELD
    if resolved_plan is None:
        return _Lifetimes(last_uses(graph, a, release_state))
    mesh, rvalue = resolved_plan.plan.mesh, resolved_plan.value
    read: dict[int, int] = {}         # storage -> last node reading it directly
    copies: dict[tuple, list[int]] = {}
    pre_last: dict[int, int] = {}     # storage -> last node before which it is read to make a copy
    via_copy: dict[int, tuple] = {}   # a view of a copy (ZeRO-3's transposed gathered weight) -> the copy
    for i, node in enumerate(graph.nodes):
        need = resolved_plan.node[node.name].inputs
        first_copy = None
        for k, r in enumerate(node.input_refs()):
            rr = a.root[r.id]
            req = tuple(need[k]) if need[k] is not None else None
            if req is not None and req != tuple(rvalue.get(r.id, req)):
                end = a.view_reach[i] if held and k == 0 and a.is_view[i] else i
                c = copies.get((r.id, req))
                if c is None:
                    copies[(r.id, req)] = [i, end, _local_bytes(graph.types[r.id], req, mesh)]
                    pre_last[rr] = max(pre_last.get(rr, -1), i)
                else:
                    c[1] = max(c[1], end)
                first_copy = (r.id, req) if k == 0 else first_copy
            elif r.id in via_copy and not held:   # a view of a copy keeps the copy alive, not its source
                copies[via_copy[r.id]][1] = i
                first_copy = via_copy[r.id] if k == 0 else first_copy
            else:
                read[rr] = i
        if a.is_view[i] and first_copy is not None:
            via_copy.update({v: first_copy for v in node.outputs if v is not None})
    if held:                          # every storage to its last reader (``ir.analysis``), copies as made
        return _Lifetimes(last_uses(graph, a, release_state), copies)
    for o in graph.outputs:
        if o.value in via_copy:
            copies[via_copy[o.value]][1] = a.n - 1
    out = _Lifetimes({s: a.end_of(s, read.get(s, -1)) for s in a.born}, copies)
    if release_state:
        out.last.update({s: read.get(s, -1) for s in released_state(graph, a)})
    for rr, i in pre_last.items():    # a storage whose last reader is a redistribution: freed once the copy exists
        if i > out.last[rr]:
            out.last[rr] = i
            out.freed_early[rr] = i
    return out


def _categories(graph: Graph, a: GraphAnalysis, last: dict[int, int]) -> dict[int, int]:
    """Storage -> category index (module docstring)."""
    cat: dict[int, int] = {}
    for inp in graph.inputs:
        cat[inp.value] = _INPUT_CAT.get(inp.role, _BUF)
    for s, b in a.born.items():
        if b < 0:
            cat.setdefault(s, _BUF)   # constants
        elif s in a.state_outputs:
            cat[s] = _NEW
        elif s in a.gradients:
            cat[s] = _GRAD
        elif a.is_activation(s, last[s]):
            cat[s] = _ACT
        else:
            cat[s] = _TMP
    return cat


@dataclass
class _Events:
    """Bytes allocated and freed around each node (``pre``: before it runs, for its copies)."""

    start: int                        # live before the first node (inputs and constants)
    alloc: list[int]
    alloc_tmp: list[int]
    free: list[int]                   # right after node i
    free_tmp: list[int]
    alloc_pre: list[int]              # copies made before node i runs
    free_pre: list[int]               # storages freed once node i's copies exist
    free_tmp_pre: list[int]


def _events(a: GraphAnalysis, life: _Lifetimes, sizes: dict[int, int], cat: dict[int, int]) -> _Events:
    n = a.n
    ev = _Events(0, *([0] * n for _ in range(7)))
    for s, b in a.born.items():
        la = life.last[s]
        if la < 0:
            continue  # a batch input nobody reads: never live
        sz, t = sizes[s], cat[s] == _TMP
        if b < 0:
            ev.start += sz
        else:
            ev.alloc[b] += sz
            ev.alloc_tmp[b] += sz if t else 0
        if la < n:
            ev.free[la] += sz
            ev.free_tmp[la] += sz if t else 0
    for (first, lst, nbytes) in life.copies.values():
        ev.alloc_pre[first] += nbytes
        ev.free[lst] += nbytes
        ev.free_tmp[lst] += nbytes
    for rr, i in life.freed_early.items():
        sz = sizes[rr]
        ev.free[i] -= sz
        ev.free_pre[i] += sz
        if cat[rr] == _TMP:
            ev.free_tmp[i] -= sz
            ev.free_tmp_pre[i] += sz
    return ev


def _replay(ev: _Events, n: int, windows) -> tuple[int, int, int, list[int], list[tuple[int, int]]]:
    """One pass over the program: (peak, peak node or -1, most temporary bytes live at once, timeline,
    (peak bytes, node) per window)."""
    live = ev.start
    timeline: list[int] = []
    peak, peak_i = live, -1
    wpeak = [(-1, lo) for lo, _ in windows]

    def seen(i: int, value: int) -> None:
        for k, (lo, hi) in enumerate(windows):
            if lo <= i < hi and value > wpeak[k][0]:
                wpeak[k] = (value, i)
    tmp_live = tmp_max = 0
    for i in range(n):
        pre = live + ev.alloc_pre[i]          # the copies for node i are made while their sources live
        if windows:
            seen(i, pre)
        if pre > peak:
            peak, peak_i = pre, i
        tmp_live += ev.alloc_pre[i]
        tmp_max = max(tmp_max, tmp_live)
        tmp_live -= ev.free_tmp_pre[i]
        during = pre - ev.free_pre[i] + ev.alloc[i]
        if windows:
            seen(i, during)
        if during > peak:
            peak, peak_i = during, i
        tmp_live += ev.alloc_tmp[i]
        tmp_max = max(tmp_max, tmp_live)
        live = during - ev.free[i]
        tmp_live -= ev.free_tmp[i]
        timeline.append(live)
    return peak, peak_i, tmp_max, timeline, wpeak


def _breakdown(a: GraphAnalysis, life: _Lifetimes, sizes, cat, at: int) -> dict[str, int]:
    """Bytes per category live at node ``at``."""
    out = [0] * len(CATEGORIES)
    for s, b in a.born.items():
        if b <= at <= life.last[s] and life.last[s] >= 0:
            out[cat[s]] += sizes[s]
    for (first, lst, nbytes) in life.copies.values():
        if first <= at <= lst:
            out[_TMP] += nbytes
    return {name: out[k] for k, name in enumerate(CATEGORIES)}


def _spans(a: GraphAnalysis, sizes, cat) -> tuple[list, list, list, list]:
    """(activation spans, forward-only spans, their storages) for ``MemoryEstimate``."""
    spans, fwd_spans, span_values, fwd_values = [], [], [], []
    for s, b in a.born.items():
        if b < 0 or not a.is_forward(b):
            continue
        last_fwd = a.last_forward_use(s)
        if cat[s] == _ACT:
            spans.append((b, last_fwd, sizes[s]))
            span_values.append(s)
        elif last_fwd > b:
            fwd_spans.append((b, last_fwd, sizes[s]))
            fwd_values.append(s)
    return spans, fwd_spans, span_values, fwd_values


_LIVENESS: dict = {}


def _liveness(graph: Graph, a: GraphAnalysis, resolved_plan, rule: CopyRule, release_state: bool) -> tuple:
    """(sizes, lifetimes, categories) of ``graph`` under ``resolved_plan``, remembered for the last (analysis,
    plan, rule): an estimate and the update programs priced after it (``program_peaks``, once per micro-batch
    count) share one pass. Nothing downstream mutates them."""
    key = (rule, release_state)
    hit = _LIVENESS.get("last")
    if hit is not None and hit[0] is a and hit[1] is resolved_plan and hit[2] == key:
        return hit[3]
    life = _lifetimes(graph, a, resolved_plan, rule, release_state)
    out = (_sizes(graph, a, resolved_plan), life, _categories(graph, a, life.last))
    _LIVENESS["last"] = (a, resolved_plan, key, out)
    return out


def estimate_memory(graph: Graph, resolved_plan=None, rank: int = 0,
                    windows: list[tuple[int, int]] = (), copy_rule: CopyRule = CopyRule.RUNTIME,
                    release_state: bool = True) -> MemoryEstimate:
    """Liveness-based memory of ``graph`` on ``rank`` (local sizes when ``resolved_plan`` is given).
    ``windows``: node index ranges [lo, hi) whose own peak and breakdown are reported too
    (``MemoryEstimate.window_peaks``; gradient accumulation prices its two programs with them).
    ``copy_rule``: how redistributed copies and their sources live (``CopyRule``, module docstring).
    ``release_state``: the replaced state dies at its last read, as the runtime runs the update (module
    docstring); False keeps it to the end of the step beside the new state (the functional program, as the
    memory planner's ``inplace_state=False`` problem holds it)."""
    _check(graph, resolved_plan, rank)
    a = analyze(graph)
    sizes, life, cat = _liveness(graph, a, resolved_plan, CopyRule(copy_rule), release_state)
    peak, peak_i, tmp_max, timeline, wpeak = _replay(_events(a, life, sizes, cat), a.n, windows)
    totals = [0] * len(CATEGORIES)
    for s in a.born:
        totals[cat[s]] += sizes[s]
    spans, fwd_spans, span_values, fwd_values = _spans(a, sizes, cat)
    return MemoryEstimate(
        params=totals[_PARAMS], gradients=totals[_GRAD], optimizer=totals[_OPT], buffers=totals[_BUF],
        activations=totals[_ACT], temporaries=tmp_max, peak=peak,
        peak_node=graph.nodes[peak_i].name if peak_i >= 0 else "", batch=totals[_BATCH],
        updated_state=totals[_NEW], timeline=timeline,
        breakdown=_breakdown(a, life, sizes, cat, peak_i), activation_spans=spans,
        boundary=a.boundary, forward_only_spans=fwd_spans,
        activation_values=span_values, forward_only_values=fwd_values,
        window_peaks=[(max(b, 0), _breakdown(a, life, sizes, cat, i)) for b, i in wpeak])



def program_peaks(graph: Graph, resolved_plan, programs) -> list[dict[str, int]]:
    """Bytes per category (``CATEGORIES``) at the peak of each program of ``programs``: ``(nodes, held)``, a
    program that runs only ``nodes`` of ``graph`` (indices; a pipeline stage's update, ``cost.pipeline``) with
    the storages ``held`` (state, accumulators, the batch) live from its start: one the runtime frees at its
    last read (``released_state``) goes there, the others stay. A storage one of ``nodes`` makes lives from it
    to its last use, a copy made for one of them from its first use to its last (this module's runtime rules;
    a node's inputs and outputs count while it runs). Nothing else counts: the rest of the step has run or runs
    apart. The liveness is computed once for all programs."""
    a = analyze(graph)
    sizes, life, cat = _liveness(graph, a, resolved_plan, CopyRule.RUNTIME, True)
    released = released_state(graph, a)
    return [_program_peak(a, sizes, life, cat, released, set(nodes), held) for nodes, held in programs]


def _program_peak(a: GraphAnalysis, sizes, life: _Lifetimes, cat, released, inside: set, held) -> dict[str, int]:
    spans = [(-1, life.last[s] if s in released else a.n, sizes[s], cat[s]) for s in set(held)]
    spans += [(b, life.last[s], sizes[s], cat[s]) for s, b in a.born.items() if b in inside and life.last[s] >= b]
    spans += [(first, last, nbytes, _TMP) for first, last, nbytes in life.copies.values() if first in inside]
    adds, ends = sorted(spans, key=lambda x: x[0]), sorted(spans, key=lambda x: x[1])
    live, best, ai, ei = [0] * len(CATEGORIES), None, 0, 0
    for i in sorted(inside):
        while ai < len(adds) and adds[ai][0] <= i:
            live[adds[ai][3]] += adds[ai][2]
            ai += 1
        while ei < len(ends) and ends[ei][1] < i:
            live[ends[ei][3]] -= ends[ei][2]
            ei += 1
        if best is None or sum(live) > sum(best):
            best = list(live)
    return {name: (best or live)[k] for k, name in enumerate(CATEGORIES)}
