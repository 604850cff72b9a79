"""Overlapped communication: a post-pass on a per-rank ``torch.fx`` program (``SpmdProgram``).

``lower_rank`` emits every redistribution step as one blocking ``redistribute(x, kind, axis, ...)``
call, placed just before the node that needs it. This pass rewrites each communication step into
``h = start([x, ...], kind, axis, ...)`` (the collective issued with ``async_op=True``) and
``y = wait(h)[i]`` (blocking until it completed), so that compute runs while it travels:

- **start as soon as the input exists**: right after the node that produces ``x`` (local
  redistribution steps feeding it, e.g. a ``LocalScale``, are moved up with it);
- **wait just before the first use** of the result;
- **buckets**: consecutive (in production order) all-reduces or reduce-scatters with the same
  kind, mesh axis, parameters and dtype (reduce-scatters: and the same block, ``ir.modules.value_blocks``,
  as FSDP2 reduce-scatters one module's gradients together, so that the full-size gradients of
  one block at a time wait for their reduction) share one flat buffer and one collective while the bucket
  stays under its cap and no member is needed before the last member is produced (then a
  bucket's start precedes all its waits). The first bucket is capped at ``first_bucket_mb``, later
  ones at ``bucket_cap_mb``: DDP's defaults (``bucket_cap_mb=25`` and the 1 MiB first bucket,
  ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``; PyTorch docs of
  ``torch.nn.parallel.DistributedDataParallel``), so that the first gradients travel while the
  rest of the backward runs;
- **stored state (ZeRO-3 parameters)**: gathers whose input is a graph input (a parameter stored
  sharded) are bucketed per module as FSDP2 gathers one ``fully_shard`` unit in one all-gather:
  consecutive all-gathers (in order of first use) of the same block (``ir.modules.block_of``: the
  name's prefix through its first numeric component, ``blocks.3``) with the same step and dtype share
  one collective while the bucket stays under ``gather_bucket_mb``; a bucket is issued
  ``prefetch_depth`` buckets ahead: its start is issued when the bucket ``prefetch_depth`` places
  before it is waited for, as FSDP2 prefetches the next module's all-gather; and with ``reshard_after_forward`` a gathered parameter is gathered
  again for a later group of uses (FSDP2's default ``reshard_after_forward=True``): the uses of one
  gathered value (following views such as ``t`` that keep its storage alive) are split wherever
  another gathered parameter is used in between, and each later group gets its own copy of the
  gather (and of the views), so the gathered copy of the forward is freed after its last forward
  use instead of living until the backward; a reduce-scatter bucket holds its full-size packed
  gradients until it completes, so at most ``reduce_scatters_in_flight`` are pending: the previous
  one is waited for before the next starts (as FSDP2 does). (A reduction of a graph input, a gradient accumulated
  outside the program, starts at once and is bucketed like any other.)

The pass only moves and groups communication; what is computed is unchanged. Each element of a
bucketed reduction is reduced over the same ranks as alone (bit-identical on 2 ranks; see
``runtime.collectives``). Collectives are issued in the same order on every rank because every rank's
program has the same structure and the pass is deterministic.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

import torch
import torch.fx

from ..ir.modules import block_of
from .spmd_ops import COMM_KINDS, redistribute, start, wait

__all__ = ["OverlapOptions", "overlap_program", "release_inputs", "BUCKETABLE"]

MB = 1 << 20
BUCKETABLE = frozenset({"AllReduce", "ReduceScatter"})
REDUCTIONS = BUCKETABLE
GATHERABLE = frozenset({"AllGather"})      # stored-state steps that share one collective per bucket


@dataclass(frozen=True)
class OverlapOptions:
    """Heuristics of the pass, each a named option (defaults: DDP's and FSDP2's)."""

    bucket_cap_mb: float = 25.0       # DDP bucket_cap_mb default
    first_bucket_mb: float = 1.0      # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
    prefetch_depth: int = 1           # FSDP2 prefetches one module ahead
    reduce_scatters_in_flight: int = 1  # FSDP2 waits for the previous reduce-scatter before the next
    reshard_after_forward: bool = True  # FSDP2 default
    gather_bucket_mb: float = 25.0    # cap of one stored-state gather bucket (DDP's bucket_cap_mb reused)


@dataclass
class OverlapStats:
    collectives: int = 0              # communication steps made asynchronous
    buckets: int = 0                  # collectives issued for them (a bucket counts once)
    regathers: int = 0                # extra gathers of stored state (reshard after forward)
    bucket_bytes: list[int] = field(default_factory=list)    # per issued collective
    bucket_members: list[int] = field(default_factory=list)  # tensors in it


def _is_redistribute(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target is redistribute


def _is_comm(n: torch.fx.Node) -> bool:
    return _is_redistribute(n) and n.args[1] in COMM_KINDS


def _is_view(n: torch.fx.Node) -> bool:
    """A node whose result may share the storage of its first input (views, and items of a view)."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return _is_view(n.args[0])
    return bool(getattr(n.target, "is_view", False))


def _state_root(n: torch.fx.Node) -> torch.fx.Node | None:
    """The graph input ``n`` redistributes, through redistribution steps only; else None."""
    x = n.args[0]
    while isinstance(x, torch.fx.Node) and _is_redistribute(x):
        x = x.args[0]
    return x if isinstance(x, torch.fx.Node) and x.op == "placeholder" else None


def _nbytes(n: torch.fx.Node) -> int | None:
    info = n.meta.get("rhino_local")
    if info is None:
        return None
    shape, dtype = info
    numel = 1
    for s in shape:
        numel *= s
    return numel * getattr(torch, dtype).itemsize


# ----------------------------------------------------------------------------- reshard after forward

def _uses(top: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(consumer, the view-tree node it reads) for every non-view reader of ``top``'s storage."""
    out, stack = [], [top]
    while stack:
        v = stack.pop()
        for u in v.users:
            if _is_view(u) or _is_redistribute(u):
                if not _is_redistribute(u):
                    stack.append(u)
            else:
                out.append((u, v))
    return out


def _reshard(g: torch.fx.Graph, stats: OverlapStats) -> None:
    """Give each later group of uses of a gathered stored tensor its own gather (module docstring)."""
    order = {n: i for i, n in enumerate(g.nodes)}
    tops = [n for n in g.nodes if _is_redistribute(n) and _state_root(n) is not None
            and any(not _is_redistribute(u) for u in n.users)]
    tops = [t for t in tops if _chain_has(t, COMM_KINDS) and not _chain_has(t, REDUCTIONS)]
    uses = {t: sorted(_uses(t), key=lambda cv: order[cv[0]]) for t in tops}
    marks = [(order[c], t) for t in tops for c, _ in uses[t]]   # where each gathered value is used
    for t in tops:
        groups, cur = [], []
        for c, v in uses[t]:
            if cur:
                lo, hi = order[cur[-1][0]], order[c]
                if any(lo < p < hi and other is not t for p, other in marks):   # another one used between
                    groups.append(cur)
                    cur = []
            cur.append((c, v))
        groups.append(cur)
        for group in groups[1:]:
            _copy_for(g, t, group)
            stats.regathers += 1


def _chain_has(t: torch.fx.Node, kinds) -> bool:
    """Whether the chain of redistribution steps ending at ``t`` contains a step of one of ``kinds``."""
    x = t
    while _is_redistribute(x):
        if x.args[1] in kinds:
            return True
        x = x.args[0]
    return False


def _copy_for(g: torch.fx.Graph, top: torch.fx.Node, group) -> None:
    """Copy the redistribution chain of ``top`` and the views between it and ``group``'s consumers,
    just before the group's first consumer, and point the consumers at the copies."""
    chain, x = [], top
    while _is_redistribute(x):
        chain.append(x)
        x = x.args[0]
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    inside = set(chain)
    for c, v in group:                       # every view between top and a consumer
        path, y = [], v
        while y is not top and y not in inside:
            path.append(y)
            y = y.args[0]
        inside.update(path)

    def copy(n: torch.fx.Node) -> torch.fx.Node:
        if n not in copies:
            copies[n] = g.node_copy(n, lambda a: copy(a) if a in inside else a)
        return copies[n]

    with g.inserting_before(group[0][0]):
        for c, v in group:
            c.replace_input_with(v, copy(v))
    dead = [n for n in inside if n not in copies.values() and not n.users]
    while dead:                              # views the copies replaced (they would keep the gather alive)
        n = dead.pop()
        parents = [a for a in n.all_input_nodes if a in inside]
        g.erase_node(n)
        dead.extend(a for a in parents if not a.users and a not in dead)


# ----------------------------------------------------------------------------- start / wait

@dataclass
class _Comm:
    node: torch.fx.Node
    anchor: torch.fx.Node | None       # start goes right after it (None: decided by prefetch)
    need: torch.fx.Node                # wait goes right before it
    key: tuple
    nbytes: int | None


def _first_user(n: torch.fx.Node, order) -> torch.fx.Node:
    return min(n.users, key=order.__getitem__)


def _local_feed(c: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node]:
    """(local redistribution steps feeding ``c``, in order, the node before them)."""
    feed, x = [], c.args[0]
    while _is_redistribute(x) and x.args[1] not in COMM_KINDS and len(x.users) == 1:
        feed.append(x)
        x = x.args[0]
    return feed[::-1], x


def _buckets(comms: list[_Comm], order, opts: OverlapOptions) -> list[list[_Comm]]:
    """Greedy buckets in production order (module docstring); unbucketable steps stand alone. The
    first bucket that reaches its cap is the small first bucket; later ones use ``bucket_cap_mb``."""
    out: list[list[_Comm]] = []
    cur: list[_Comm] = []
    cur_bytes, cur_need, first = 0, 0, True
    for c in sorted(comms, key=lambda c: order[c.anchor]):
        cap = (opts.first_bucket_mb if first else opts.bucket_cap_mb) * MB
        joins = (bool(cur) and c.key == cur[0].key and c.key[0][0] in BUCKETABLE and c.nbytes is not None
                 and order[c.anchor] < cur_need)
        if joins and cur_bytes + c.nbytes > cap:
            joins, first = False, False
        if cur and not joins:
            out.append(cur)
            cur = []
        if not cur:
            cur_bytes, cur_need = 0, order[c.need]
        cur.append(c)
        cur_bytes += c.nbytes or 0
        cur_need = min(cur_need, order[c.need])
    if cur:
        out.append(cur)
    return out


def _convert(g: torch.fx.Graph, bucket: list[_Comm], anchor: torch.fx.Node, stats: OverlapStats) -> torch.fx.Node:
    """Replace the bucket's redistribute calls by one start (after ``anchor``) and one wait; returns the wait."""
    order = {n: i for i, n in enumerate(g.nodes)}
    need = min((c.need for c in bucket), key=order.__getitem__)
    first = bucket[0].node
    with g.inserting_after(anchor):
        h = g.call_function(start, ([c.node.args[0] for c in bucket],) + tuple(first.args[1:]))
    with g.inserting_before(need):
        w = g.call_function(wait, (h,))
    for i, c in enumerate(bucket):
        with g.inserting_after(w):
            item = g.call_function(operator.getitem, (w, i))
        item.meta.update(c.node.meta)
        c.node.replace_all_uses_with(item)
        g.erase_node(c.node)
    stats.collectives += len(bucket)
    stats.buckets += 1
    stats.bucket_bytes.append(sum(c.nbytes or 0 for c in bucket))
    stats.bucket_members.append(len(bucket))
    return w


def _make_async(g: torch.fx.Graph, opts: OverlapOptions, stats: OverlapStats) -> None:
    order = {n: i for i, n in enumerate(g.nodes)}
    stored, chained, free = [], [], []
    for n in list(g.nodes):
        if not _is_comm(n):
            continue
        feed, src = _local_feed(n)
        if _state_root(n) is not None and not any(_is_comm(x) for x in _chain(n)) and n.args[1] not in REDUCTIONS:
            stored.append((n, feed))
        elif _is_comm(src):
            chained.append(n)
        elif src.op == "placeholder":         # a reduction of an input (a gradient accumulated outside)
            last = [m for m in g.nodes if m.op in ("placeholder", "get_attr")][-1]
            prev = last
            for x in feed:
                prev.append(x)
                prev = x
            free.append(n)
            n.meta["rhino_anchor"] = prev
        else:
            prev = src
            for x in feed:                   # move the local steps feeding it up to the producer
                prev.append(x)
                prev = x
            free.append(n)
    order = {n: i for i, n in enumerate(g.nodes)}
    comms = [_Comm(n, n.meta.pop("rhino_anchor", n.args[0]), _first_user(n, order),
                   (tuple(n.args[1:]), _dtype(n), n.meta.get("rhino_block") if n.args[1] == "ReduceScatter" else None,
                    n.meta.get("rhino_owner")),
                   _nbytes(n)) for n in free]
    scatters: list[torch.fx.Node] = []
    for bucket in _buckets(comms, order, opts):
        w = _convert(g, bucket, max((c.anchor for c in bucket), key=order.__getitem__), stats)
        if bucket[0].key[0][0] == "ReduceScatter":
            scatters.append(w)
    _bound_in_flight(g, scatters, opts.reduce_scatters_in_flight)
    _prefetch(g, stored, opts, stats)
    for n in chained:                        # behind another collective: start when its input is there
        order = {m: i for i, m in enumerate(g.nodes)}
        _convert(g, [_Comm(n, n.args[0], _first_user(n, order), (), _nbytes(n))], n.args[0], stats)


def _bound_in_flight(g: torch.fx.Graph, waits: list[torch.fx.Node], limit: int) -> None:
    """Wait for reduce-scatter k - ``limit`` just before reduce-scatter k starts (if not waited before):
    a pending reduce-scatter holds its full-size packed input, its result is 1/n of it, so bounding the
    number in flight bounds the full-size gradients alive to about ``limit`` buckets (FSDP2 keeps one
    reduce-scatter in flight for the same reason)."""
    if limit < 1:
        raise ValueError("reduce_scatters_in_flight must be at least 1")
    order = {n: i for i, n in enumerate(g.nodes)}
    for k in range(limit, len(waits)):
        w, nxt = waits[k - limit], waits[k].args[0]
        if order[w] > order[nxt] > order[w.args[0]]:
            items = sorted(w.users, key=order.__getitem__)
            nxt.prepend(w)
            for item in items:
                nxt.prepend(item)
            order = {n: i for i, n in enumerate(g.nodes)}


def _chain(n: torch.fx.Node) -> list[torch.fx.Node]:
    out, x = [], n.args[0]
    while _is_redistribute(x):
        out.append(x)
        x = x.args[0]
    return out


def _dtype(n: torch.fx.Node):
    info = n.meta.get("rhino_local")
    return None if info is None else info[1]


def _gather_buckets(stored, opts: OverlapOptions) -> list[list]:
    """Stored-state gathers (sorted by first use) grouped: consecutive all-gathers of one block
    (``ir.modules.block_of`` of the stored input's name), one step and dtype, while the bucket stays
    under ``gather_bucket_mb`` (a bucket takes at least one)."""
    out: list[list] = []
    cur_key, cur_bytes = None, 0
    for n, feed in stored:
        nbytes = _nbytes(n)
        root = _state_root(n)
        key = (block_of(root.meta.get("rhino_name", root.name)), tuple(n.args[1:]), _dtype(n))
        joins = (bool(out) and key == cur_key and n.args[1] in GATHERABLE and nbytes is not None
                 and cur_bytes + nbytes <= opts.gather_bucket_mb * MB)
        if not joins:
            out.append([])
            cur_key, cur_bytes = key, 0
        out[-1].append((n, feed))
        cur_bytes += nbytes or 0
    return out


def _prefetch(g: torch.fx.Graph, stored, opts: OverlapOptions, stats: OverlapStats) -> None:
    """Gathers of stored state in buckets (``_gather_buckets``) in order of first use; bucket k starts
    when bucket k - depth is waited for (the first ``depth`` start just before their own wait)."""
    order = {n: i for i, n in enumerate(g.nodes)}
    stored = sorted(stored, key=lambda nf: order[_first_user(nf[0], order)])
    waits: list[torch.fx.Node] = []
    depth = max(1, opts.prefetch_depth)
    for k, bucket in enumerate(_gather_buckets(stored, opts)):
        order = {m: i for i, m in enumerate(g.nodes)}
        need = min((_first_user(n, order) for n, _ in bucket), key=order.__getitem__)
        anchor = waits[k - depth] if k >= depth else need.prev
        if order[anchor] >= order[need]:
            anchor = need.prev
        comms = []
        for n, feed in bucket:
            for x in feed:                   # local steps on the stored tensor go just before the start
                anchor.append(x)
                anchor = x
            comms.append(_Comm(n, anchor, need, (), _nbytes(n)))
        waits.append(_convert(g, comms, anchor, stats))


def overlap_program(prog, options: OverlapOptions | None = None):
    """``prog`` (an ``SpmdProgram``) with asynchronous, bucketed communication (module docstring);
    a new program, the input is left as it is."""
    opts = options or OverlapOptions()
    if opts.prefetch_depth < 1 or min(opts.bucket_cap_mb, opts.first_bucket_mb, opts.gather_bucket_mb) < 0:
        raise ValueError("overlap options need prefetch_depth >= 1 and non-negative bucket caps")
    gm = torch.fx.GraphModule(prog.module, _copy_graph(prog.module.graph))
    g = gm.graph
    stats = OverlapStats()
    if opts.reshard_after_forward:
        _reshard(g, stats)
    _make_async(g, opts, stats)
    g.lint()
    gm.recompile()
    return replace(prog, module=gm, overlap=stats)


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    env: dict = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    for old, n in env.items():
        n.meta.update(old.meta)
    return new


# ----------------------------------------------------------------------------- releasing the inputs

def _release(args: list) -> None:
    """Drop the caller's references to a step's inputs (the program holds its own until their last use)."""
    args.clear()


def release_inputs(prog):
    """``prog`` as a program called with ONE list of its inputs, which it empties once it has read them
    (the boxed calling convention of ``torch._inductor``'s compiled functions). A caller that keeps no
    other reference to the old state (e.g. ``args = [state.pop(n) for n in names]``) then frees each
    old parameter and optimizer moment at its last use in the update, as PyTorch's in-place optimizers
    overwrite theirs, instead of holding the old and the new state together at the end of the step (the cost
    model counts it so: ``cost.memory.released_state``)."""
    gm = torch.fx.GraphModule(prog.module, _copy_graph(prog.module.graph))
    g = gm.graph
    phs = [n for n in g.nodes if n.op == "placeholder"]
    with g.inserting_before(phs[0] if phs else next(iter(g.nodes))):   # a program may read nothing
        boxed = g.placeholder("inputs")
    last = boxed
    for i, ph in enumerate(phs):
        with g.inserting_after(last):
            item = g.call_function(operator.getitem, (boxed, i))
        item.meta.update(ph.meta)
        ph.replace_all_uses_with(item)
        g.erase_node(ph)
        last = item
    with g.inserting_after(last):
        g.call_function(_release, (boxed,))
    g.lint()
    gm.recompile()
    return replace(prog, module=gm)
