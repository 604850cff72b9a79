"""Time of one SPMD training step of a resolved plan on a cluster (pure Python, no torch).

Per rank (all ranks run the same program on equal shards, so one rank stands for all):

- **Compute** of a node = the roofline ``op_time`` of the node's op scaled by the fraction of its
  iteration space the rank executes: ``prod(1 / size(axis))`` over the mesh axes whose strategy
  splits one of the annotation's letters (a contracted letter too: each rank then does 1/n of the
  multiply-adds and holds a partial sum). A replicated axis or a partial passthrough (``~``) does
  the whole op. Views cost nothing.
- **Communication** of a node = the redistributions of its inputs into the shardings its strategy
  requires (``plan_redistribution``, the very function the lowering uses, one per value and target,
  as the lowering caches them), priced by ``collectives.steps_seconds`` on the mesh axes' links;
  plus the row-statistics all-reduces the custom SPMD lowerings emit (vocabulary-parallel
  log-softmax and nll: a few values per row; batch norm over a split batch: two values per channel,
  once forward and once backward), and at the end of the step the loss made replicated
  and the new state brought back to its input's sharding (as ``lower_rank`` does).
- **Overlap** (explicit assumptions, each a named option of ``StepOptions``; they describe the
  overlapped per-rank programs of ``lower/overlap.py``, which the runtime runs): one compute stream and
  one communication stream per rank, collectives executed in issue order on the latter.
  ``overlap_gradient_reduction``: redistributions of values produced after the loss and read by
  optimizer nodes (gradient all-reduce / reduce-scatter) are grouped into buckets as the runtime
  groups them (production order, same single step and dtype, reduce-scatters of one block,
  ``ir.modules.value_blocks``, ``first_bucket_mb`` for the first bucket that fills, ``bucket_cap_mb``
  after: DDP's defaults); a bucket is one collective of its summed bytes
  (one latency), issued when its last gradient exists, running while later backward nodes compute;
  the optimizer nodes that read it wait for it; before a reduce-scatter bucket is issued the compute
  stream waits for the previous one (one in flight, as FSDP2 and the runtime bound the full-size
  gradients pending). ``prefetch_parameters``: a redistribution of a state
  input (ZeRO-3 parameter all-gather) is issued when the previous one is waited for (one use ahead,
  as FSDP2 prefetches), the first when it is needed; consecutive (in order of first use) single
  all-gathers of state inputs of one block (``ir.modules.block_of``) with the same step and dtype
  are one collective of their summed bytes while under ``gather_bucket_mb`` (the runtime's
  per-module buckets, as FSDP2 gathers a ``fully_shard`` unit); with ``reshard_after_forward`` a state input
  redistributed before the loss is redistributed again for its uses after it (FSDP2's default, the
  runtime's re-gather). ``start_after_producer``: every other redistribution of a computed value
  starts when the value exists (its steps through the first collective right after the producer,
  later collectives of the chain once the reader waited for the first, as ``lower/overlap.py`` places
  them) and the compute stream waits for it at its first reader; a tensor-parallel all-reduce read by the
  node after its producer therefore sits on the critical path (as in Megatron-LM), one read later
  travels while the nodes in between compute. Without the option (and for redistributions of batch
  inputs) a redistribution starts at its reader.
- The step time is when both streams are done; exposed communication = step time - compute.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from ..ir.analysis import GraphAnalysis, analyze
from ..ir.graph import Graph, Role
from ..ir.modules import block_of, value_blocks
from ..ir.registry import OpKind, annotate, call_of, lookup
from ..sharding.placement import ReduceOp, replicated
from ..sharding.plan import ResolvedPlan
from ..sharding.redistribute import local_numel, plan_redistribution
from ..sharding.vocab import is_split, split_letter
from ..sharding.steps import AllGather, AllReduce, ReduceScatter, Step, is_communication
from .cluster import AxisLink
from .collectives import each_step_seconds, step_seconds
from .compute import Profile, op_time
from .devices import DeviceSpec

__all__ = ["StepOptions", "StepTime", "NodeCost", "step_time", "node_compute", "node_scale"]

def custom_reduces(op: str) -> int:
    """All-reduces that the custom SPMD lowering of ``op`` (lower/spmd_custom.py) emits when a custom
    letter is split: the op's ``reduces`` fact (0 for none)."""
    opdef = lookup(op)
    return opdef.reduces if opdef is not None else 0


def custom_reduce_bytes(op: str, local: tuple, itemsize: int) -> int:
    """Bytes of one custom all-reduce of ``op`` whose first input has local shape ``local``: a value
    per row (log-softmax, nll), or two per channel (the ``per_channel`` fact: batch norm statistics,
    at least float32)."""
    opdef = lookup(op)
    if opdef is not None and opdef.per_channel:
        return 2 * local[1] * max(itemsize, 4)
    return (prod(local[:-1]) if len(local) > 1 else 1) * itemsize


@dataclass(frozen=True)
class StepOptions:
    overlap_gradient_reduction: bool = True
    prefetch_parameters: bool = True
    allow_tf32: bool = False
    profile: Profile | None = None
    bucket_cap_mb: float = 25.0          # lower/overlap.py OverlapOptions: DDP's bucket_cap_mb default
    first_bucket_mb: float = 1.0         # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
    reshard_after_forward: bool = True   # ZeRO-3 parameters gathered again for the backward (FSDP2 default)
    gather_bucket_mb: float = 25.0       # lower/overlap.py OverlapOptions: cap of one per-block gather bucket
    start_after_producer: bool = True    # a blocking redistribution starts when its input exists (lower/overlap.py)


@dataclass
class NodeCost:
    name: str
    compute: float                 # seconds on the compute stream
    comm: float                    # seconds of its input redistributions on the comm stream
    kind: str                      # "blocking" | "gradient" | "prefetch" | "" (no comm)
    flops: float = 0.0
    optimizer: bool = False


@dataclass
class StepTime:
    step_seconds: float
    compute_seconds: float
    comm_seconds: float            # total communication time (overlapped or not)
    exposed_comm_seconds: float
    flops: float                   # per rank
    forward_backward_compute: float
    optimizer_compute: float
    collectives: dict[str, int] = field(default_factory=dict)   # collective kind -> count
    comm_by_kind: dict[str, float] = field(default_factory=dict)  # blocking/gradient/prefetch -> s
    nodes: list[NodeCost] = field(default_factory=list)


def node_scale(strategy, mesh) -> float:
    """Fraction of a node's iteration space one rank executes under ``strategy``."""
    if strategy is None:
        return 1.0
    return 1.0 / prod(mesh.sizes[a] for a, e in enumerate(strategy) if is_split(e))


def node_compute(graph: Graph, node, strategy, mesh, device: DeviceSpec, *, allow_tf32: bool = False,
                 profile: Profile | None = None, extra_scale: float = 1.0, min_dim: float | None = None):
    """``OpTime`` of ``node`` on one rank under ``strategy`` (see the module docstring); ``min_dim``: a
    matrix product's smallest dimension as it runs (``compute.op_time``)."""
    return op_time(call_of(graph, node), device, allow_tf32=allow_tf32, profile=profile,
                   scale=node_scale(strategy, mesh) * extra_scale, min_dim=min_dim)


def _custom_comm(graph: Graph, node, strategy, mesh, links, rp: ResolvedPlan) -> tuple[float, int]:
    count = custom_reduces(node.op)
    if not count or strategy is None:
        return 0.0, 0
    ann = annotate(call_of(graph, node))
    if ann is None:
        return 0.0, 0
    axes = [a for a, e in enumerate(strategy)
            if is_split(e) and split_letter(e)[0] in ann.custom]
    if not axes:
        return 0.0, 0
    ref = node.input_refs()[0]
    shape = rp.local_shape(ref.id) if ref.id in rp.value else graph.types[ref.id].shape
    nbytes = custom_reduce_bytes(node.op, shape, graph.types[ref.id].dtype.itemsize)
    secs = sum(step_seconds(AllReduce(a, ReduceOp.SUM), nbytes, mesh, links) for a in axes)
    return count * secs, count * len(axes)


@dataclass
class _Bucket:
    """Gradient redistributions priced as one collective (``lower/overlap.py``'s buckets)."""

    step: Step
    members: list = field(default_factory=list)   # (value id, wanted sharding)
    nbytes: int = 0
    close: int = -1                               # index of the node producing its last gradient
    seconds: float = 0.0
    done: float | None = None

    @property
    def kind(self) -> str:
        return type(self.step).__name__

    def issue(self, t_comm: float, now: float) -> float:
        self.done = max(t_comm, now) + self.seconds
        return self.done


def _gradient_buckets(rp: ResolvedPlan, a: GraphAnalysis, state_in: set[int], links,
                      options: StepOptions) -> list[_Bucket]:
    """Gradient redistributions (one all-reduce or reduce-scatter step each) grouped as the runtime
    groups them: production order, same step and dtype, capped at ``first_bucket_mb`` until a bucket
    first fills, then at ``bucket_cap_mb``. Gradients needing other steps are left to the caller."""
    graph, mesh = rp.graph, rp.plan.mesh
    members: dict[tuple, tuple] = {}
    for i in sorted(a.optimizer):
        node = graph.nodes[i]
        for ref, req in zip(node.input_refs(), rp.node[node.name].inputs):
            src = a.producer.get(ref.id)
            have = rp.value[ref.id]
            if ref.id in state_in or src is None or a.is_forward(src) or have == req or (ref.id, req) in members:
                continue
            t = graph.types[ref.id]
            steps = plan_redistribution(t.shape, have, req, mesh)
            if len(steps) == 1 and isinstance(steps[0], (AllReduce, ReduceScatter)):
                nbytes = local_numel(t.shape, have, mesh) * t.dtype.itemsize
                members[(ref.id, req)] = (src, steps[0], t.dtype, nbytes)
    blocks = value_blocks(graph)
    out: list[_Bucket] = []
    cur: _Bucket | None = None
    cur_dtype, cur_block, first = None, None, True
    for key, (src, step, dtype, nbytes) in sorted(members.items(), key=lambda kv: kv[1][0]):
        cap = (options.first_bucket_mb if first else options.bucket_cap_mb) * 2 ** 20
        block = blocks.get(key[0]) if isinstance(step, ReduceScatter) else None
        joins = cur is not None and cur.step == step and cur_dtype == dtype and cur_block == block
        if joins and cur.nbytes + nbytes > cap:
            joins, first = False, False
        if not joins:
            cur, cur_dtype, cur_block = _Bucket(step), dtype, block
            out.append(cur)
        cur.members.append(key)
        cur.nbytes += nbytes
        cur.close = max(cur.close, src)
    for b in out:
        b.seconds = step_seconds(b.step, b.nbytes, mesh, links)
    return out


def _gather_buckets(rp: ResolvedPlan, a: GraphAnalysis, state_in: set[int], links,
                    options: StepOptions) -> dict[tuple, _Bucket]:
    """(value id, wanted sharding, phase) -> its bucket, for the state-input redistributions that are one
    all-gather, grouped as ``lower/overlap.py`` groups them: in order of first use (per phase: before
    and after the loss when resharded after forward), consecutive gathers of one block, step and dtype
    under ``gather_bucket_mb``. Other state redistributions end a bucket and are left to the caller."""
    graph, mesh = rp.graph, rp.plan.mesh
    names = {i.value: i.name for i in graph.inputs}
    out: dict[tuple, _Bucket] = {}
    seen: set[tuple] = set()
    cur: _Bucket | None = None
    cur_key = None
    for i, node in enumerate(graph.nodes):
        for ref, req in zip(node.input_refs(), rp.node[node.name].inputs):
            have = rp.value[ref.id]
            phase = int(options.reshard_after_forward and not a.is_forward(i))
            if ref.id not in state_in or have == req or (ref.id, req, phase) in seen:
                continue
            seen.add((ref.id, req, phase))
            t = graph.types[ref.id]
            steps = plan_redistribution(t.shape, have, req, mesh)
            if not (len(steps) == 1 and isinstance(steps[0], AllGather)):
                cur = cur_key = None
                continue
            nbytes = local_numel(t.shape, have, mesh) * t.dtype.itemsize
            key = (block_of(names[ref.id]), steps[0], t.dtype)
            if cur is None or key != cur_key or cur.nbytes + nbytes > options.gather_bucket_mb * 2 ** 20:
                cur, cur_key = _Bucket(steps[0]), key
            cur.members.append((ref.id, req, phase))
            cur.nbytes += nbytes
            out[(ref.id, req, phase)] = cur
    for b in {id(b): b for b in out.values()}.values():
        b.seconds = step_seconds(b.step, b.nbytes, mesh, links)
    return out


class _Streams:
    """The compute and communication streams of one rank while ``step_time`` walks the program."""

    def __init__(self, rp: ResolvedPlan, links, options: StepOptions):
        graph = rp.graph
        a = analyze(graph)
        self.rp, self.links, self.options, self.graph, self.mesh = rp, links, options, graph, rp.plan.mesh
        self.a = a
        self.opt = a.optimizer
        self.state_in = {v for v, r in a.input_role.items() if r is not Role.BATCH}
        self.prod_of = a.producer
        self.cache: dict[tuple, float] = {}
        self.counts: dict[str, int] = {}
        self.by_kind = {"blocking": 0.0, "gradient": 0.0, "prefetch": 0.0}
        buckets = _gradient_buckets(rp, a, self.state_in, links, options) \
            if options.overlap_gradient_reduction else []
        self.bucket_of = {key: b for b in buckets for key in b.members}
        self.gather_of = _gather_buckets(rp, a, self.state_in, links, options) \
            if options.prefetch_parameters else {}
        self.closing: dict[int, list[_Bucket]] = {}
        for b in buckets:
            self.closing.setdefault(b.close, []).append(b)
            self.cache.update({(vid, want, 0): 0.0 for vid, want in b.members})   # priced once, as one collective
        self.t_compute = 0.0     # compute stream clock
        self.t_comm = 0.0        # communication stream clock
        self.last_wait: float | None = None   # when the previous prefetched gather was waited for
        self.last_scatter = 0.0               # when the previous reduce-scatter bucket completes
        self.pending: dict[int, float] = {}   # node index -> when it finished
        self.after = self._after_producer() if options.start_after_producer else {}
        self.issued: dict[tuple, tuple[float, float]] = {}   # (value, sharding, phase) -> (done, seconds)
        self.comm_total = 0.0

    def _after_producer(self) -> dict[int, list[tuple]]:
        """Producer node -> the (value, wanted sharding, phase) redistributions of its results that
        ``inputs`` would price as blocking, in order of first need."""
        out: dict[int, list[tuple]] = {}
        for node in self.graph.nodes:
            for ref, req in zip(node.input_refs(), self.rp.node[node.name].inputs):
                src = self.prod_of.get(ref.id)
                if src is None or ref.id in self.state_in or (ref.id, req) in self.bucket_of \
                        or self.rp.value[ref.id] == req:
                    continue
                key = (ref.id, req, 0)
                keys = out.setdefault(src, [])
                if key not in keys:
                    keys.append(key)
        return out

    def count(self, kind: str, k: int = 1) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + k

    def moved(self, vid: int, want, phase: int = 0) -> float:
        """Seconds of redistributing value ``vid`` into ``want`` (0 once it was priced: the lowering
        redistributes a value once per target sharding and phase)."""
        return sum(self.moved_in_two(vid, want, phase))

    def moved_in_two(self, vid: int, want, phase: int = 0) -> tuple[float, float]:
        """``moved`` split where the overlapped program splits it: (seconds through the first collective,
        which starts after the producer, seconds of the steps after it, which start at the reader)."""
        have = self.rp.value[vid]
        if have == want or (vid, want, phase) in self.cache:
            return 0.0, 0.0
        t = self.graph.types[vid]
        steps: list[Step] = plan_redistribution(t.shape, have, want, self.mesh)
        comm = [k for k, s in enumerate(steps) if is_communication(s)]
        for k in comm:
            self.count(type(steps[k]).__name__)
        secs = each_step_seconds(steps, t.shape, t.dtype.itemsize, have, self.mesh, self.links)
        self.cache[(vid, want, phase)] = sum(secs)
        first = comm[0] if comm else len(steps)
        return sum(secs[:first + 1]), sum(secs[first + 1:])

    def inputs(self, i: int, node) -> tuple[float, float, str, bool]:
        """Redistribute node ``i``'s inputs: (when they are ready, comm seconds, kind, prefetched)."""
        options = self.options
        ready, node_comm, kind, prefetched = self.t_compute, 0.0, "", False
        for ref, req in zip(node.input_refs(), self.rp.node[node.name].inputs):
            if (ref.id, req) in self.bucket_of:
                b = self.bucket_of[(ref.id, req)]
                if b.done is None:                # (not reached: a bucket closes before its readers)
                    self.t_comm = b.issue(self.t_comm, self.t_compute)
                ready = max(ready, b.done)
                continue
            prefetch = options.prefetch_parameters and ref.id in self.state_in
            phase = int(prefetch and options.reshard_after_forward and not self.a.is_forward(i))
            if (ref.id, req, phase) in self.gather_of:     # one collective per bucket, issued at its first use
                b = self.gather_of[(ref.id, req, phase)]
                if b.done is None:
                    self.t_comm = b.issue(self.t_comm, self.t_compute if self.last_wait is None else self.last_wait)
                    kind, prefetched = "prefetch", True
                    self.by_kind["prefetch"] += b.seconds
                    node_comm += b.seconds
                    self.count("AllGather")
                ready = max(ready, b.done)
                continue
            key = (ref.id, req, phase)
            if key in self.issued:                # its first collective started after its producer
                done, head, tail = self.issued[key]
                if tail:                          # the rest starts once the reader waited for the first
                    self.t_comm = max(self.t_comm, self.t_compute, done) + tail
                    done = self.t_comm
                self.issued[key] = (done, 0.0, 0.0)   # its seconds count at the first reader
                ready = max(ready, done)
                if head + tail:
                    kind, node_comm = "blocking", node_comm + head + tail
                continue
            secs = self.moved(ref.id, req, phase)
            if secs <= 0:
                continue
            node_comm += secs
            if prefetch:
                kind, prefetched = "prefetch", True
                self.t_comm = max(self.t_comm, self.t_compute if self.last_wait is None else self.last_wait) + secs
            else:
                kind = "blocking"
                self.t_comm = max(self.t_comm, self.t_compute) + secs
            self.by_kind[kind] += secs
            ready = max(ready, self.t_comm)
        return ready, node_comm, kind, prefetched

    def issue_outputs(self, i: int) -> None:
        """Start the redistributions of node ``i``'s results that its readers need (not gradient buckets,
        not stored state) as soon as it is done, as ``lower/overlap.py`` starts them; a reader waits for
        the one it needs (``inputs``)."""
        for key in self.after.get(i, ()):
            head, tail = self.moved_in_two(*key)
            if head > 0:
                self.t_comm = max(self.t_comm, self.t_compute) + head
            self.by_kind["blocking"] += head + tail
            self.issued[key] = (self.t_comm if head > 0 else 0.0, head, tail)

    def issue_closing(self, i: int) -> float:
        """Issue the gradient buckets whose last gradient node ``i`` made; their seconds."""
        secs = 0.0
        for b in self.closing.get(i, []):
            if b.kind == "ReduceScatter":    # one reduce-scatter in flight: wait for the previous one
                self.t_compute = max(self.t_compute, self.last_scatter)
                self.pending[i] = self.t_compute
            self.t_comm = b.issue(self.t_comm, self.t_compute)
            if b.kind == "ReduceScatter":
                self.last_scatter = b.done
            self.by_kind["gradient"] += b.seconds
            self.comm_total += b.seconds
            self.count(b.kind)
            secs += b.seconds
        return secs

    def run(self, i: int, node, device: DeviceSpec) -> tuple[NodeCost, object]:
        """Node ``i`` on both streams: its cost and its ``OpTime``."""
        rp, options = self.rp, self.options
        strategy = rp.plan.strategies.get(node.name)
        ready, node_comm, kind, prefetched = self.inputs(i, node)
        csecs, ccount = _custom_comm(self.graph, node, strategy, self.mesh, self.links, rp)
        if ccount:
            self.count("AllReduce", ccount)
        t = node_compute(self.graph, node, strategy, self.mesh, device, allow_tf32=options.allow_tf32,
                         profile=options.profile)
        if prefetched:
            self.last_wait = ready
        self.t_compute = ready + t.seconds
        if csecs:  # the custom all-reduces sit inside the node: compute waits for them
            self.t_comm = max(self.t_comm, self.t_compute) + csecs
            self.t_compute = self.t_comm
            self.by_kind["blocking"] += csecs
            node_comm += csecs
        self.pending[i] = self.t_compute
        self.issue_outputs(i)
        gsecs = self.issue_closing(i)
        if gsecs or self.closing.get(i):
            kind = kind or "gradient"
        self.comm_total += node_comm
        return NodeCost(node.name, t.seconds, node_comm + gsecs, kind, t.flops, i in self.opt), t

    def outputs(self) -> None:
        """End of step: loss replicated, new state back in its input's sharding (as the lowering does)."""
        graph, rp = self.graph, self.rp
        inputs = {i.name: i.value for i in graph.inputs}
        for o in graph.outputs:
            want = replicated(self.mesh) if o.name not in inputs else rp.value[inputs[o.name]]
            secs = self.moved(o.value, want)
            if secs:
                src = self.prod_of.get(o.value, -1)
                self.t_comm = max(self.t_comm, self.pending.get(src, 0.0)) + secs
                self.by_kind["blocking"] += secs
                self.comm_total += secs


def step_time(rp: ResolvedPlan, device: DeviceSpec, links: list[AxisLink],
              options: StepOptions = StepOptions()) -> StepTime:
    """Compute, communication and overlap of one step of ``rp`` (see the module docstring)."""
    sim = _Streams(rp, links, options)
    total_compute = fb_compute = opt_compute = flops = 0.0
    costs: list[NodeCost] = []
    for i, node in enumerate(rp.graph.nodes):
        cost, t = sim.run(i, node, device)
        costs.append(cost)
        total_compute += t.seconds
        flops += t.flops
        if cost.optimizer:
            opt_compute += t.seconds
        else:
            fb_compute += t.seconds
    sim.outputs()
    end = max(sim.t_compute, sim.t_comm)
    return StepTime(end, total_compute, sim.comm_total, max(0.0, end - total_compute), flops, fb_compute,
                    opt_compute, sim.counts, sim.by_kind, costs)
