"""Expert presets from the strategy string, expressed as placements found from the graph's structure.

Grammar (design.md): ``dp=4,tp=2,pp=2,zero=1,sp=on,microbatches=8,recompute=full|selective|none``,
plus ``schedule=1f1b|gpipe|interleaved`` and ``chunks=v`` (model chunks per stage, interleaved) for pipelines; missing keys take defaults. The presets:

- ``dp``: the batch is split on dim 0 along ``dp``; parameters replicated; gradients all-reduced (DDP).
- ``zero=1|2``: optimizer state sharded along ``dp`` (gradients reduce-scattered into it; in a
  functional step gradients are transient, so 1 and 2 place the same tensors); ``zero=3``: parameters
  sharded too (all-gathered before use).
- ``tp``: Megatron. Weights of matmuls are decided where they are used: a matmul whose activation
  arrives split on the contracting dim is row-parallel (weight split on its input dim, output
  partial then all-reduced); otherwise it is column-parallel (weight and bias split on the output
  dim; strided when the output is split into equal chunks, as a fused QKV is). Attention heads
  follow from the column split. Embeddings are vocabulary-parallel; an output layer over the
  vocabulary is column-parallel and the cross-entropy then runs on split logits (log-softmax with
  all-reduced max and sum, targets masked per rank). Anything unrecognised stays replicated.
- ``sp=on``: Megatron sequence parallelism: the batch's sequence dim (dim 1) is split along ``tp``;
  propagation then keeps the residual stream, norms and element-wise regions split on the sequence,
  all-gathers it before each column-parallel matmul and reduce-scatters after each row-parallel one.
- ``pp``: ``pp`` pipeline stages, each running the plan of the other keys on its own mesh of
  ``dp * tp`` devices; the stages come from ``ir.stages.contiguous_cut`` (no hints needed).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Graph, Role
from ..ir.analysis import moved_dim
from ..ir.registry import Family, OpKind, lookup
from ..ir.stages import SCHEDULES, Schedule, contiguous_cut
from .mesh import Mesh
from .placement import Replicate, Shard, Sharding
from .plan import ShardingPlan
from .propagate import Propagator
from .vocab import RECOMPUTE_MODES, Recompute, strided

__all__ = ["StrategySpec", "parse_strategy", "preset_plan", "preset_notes", "unsplit_batch", "unsplit_model"]


@dataclass(frozen=True)
class StrategySpec:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: bool = False
    microbatches: int = 1
    recompute: str = Recompute.NONE
    schedule: str = Schedule.ONE_F_ONE_B.value
    chunks: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        parts = [f"dp={self.dp}"] if self.dp > 1 or self.tp == 1 else []
        parts += [f"tp={self.tp}"] if self.tp > 1 else []
        parts += [f"pp={self.pp}"] if self.pp > 1 else []
        parts += [f"zero={self.zero}"] if self.zero else []
        parts += ["sp=on"] if self.sp else []
        parts += [f"microbatches={self.microbatches}"] if self.microbatches > 1 else []
        parts += [f"recompute={self.recompute}"] if self.recompute != Recompute.NONE else []
        parts += [f"schedule={self.schedule}"] if self.pp > 1 and self.schedule != Schedule.ONE_F_ONE_B.value else []
        parts += [f"chunks={self.chunks}"] if self.chunks > 1 else []
        return ",".join(parts)


_INT_KEYS = ("dp", "tp", "pp", "zero", "microbatches", "chunks")


def parse_strategy(text: str) -> StrategySpec:
    values: dict = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, val = item.partition("=")
        if not sep:
            raise ValueError(f"strategy item {item!r} must be key=value, e.g. dp=4")
        if key in _INT_KEYS:
            if not val.isdigit() or int(val) < (0 if key == "zero" else 1):
                raise ValueError(f"strategy {key}={val!r}: give a positive integer")
            values[key] = int(val)
        elif key == "sp":
            if val not in ("on", "off"):
                raise ValueError(f"strategy sp={val!r}: use sp=on or sp=off")
            values["sp"] = val == "on"
        elif key == "recompute":
            if val not in RECOMPUTE_MODES:
                raise ValueError(f"strategy recompute={val!r}: use full, selective or none")
            values["recompute"] = Recompute(val)
        elif key == "schedule":
            if val not in SCHEDULES:
                raise ValueError(f"strategy schedule={val!r}: use {' or '.join(SCHEDULES)}")
            values["schedule"] = val
        else:
            raise ValueError(f"unknown strategy key {key!r}; known keys: dp, tp, pp, zero, sp, microbatches, recompute, "
                             f"schedule, chunks")
    spec = StrategySpec(**values)
    if spec.zero > 3:
        raise ValueError("zero must be 0, 1, 2 or 3")
    if spec.zero and spec.dp == 1:
        raise ValueError("zero shards over dp: give dp > 1 with zero")
    if spec.sp and spec.tp == 1:
        raise ValueError("sp=on splits the sequence over tp: give tp > 1 with sp=on")
    if spec.chunks > 1 and (spec.schedule != Schedule.INTERLEAVED.value or spec.pp == 1):
        raise ValueError(f"chunks={spec.chunks} splits each pipeline stage into model chunks: give pp > 1 and "
                         f"schedule=interleaved with it")
    return spec


def mesh_for(spec: StrategySpec) -> Mesh:
    names, sizes = [], []
    if spec.dp > 1 or spec.tp == 1:
        names.append("dp"); sizes.append(spec.dp)
    if spec.tp > 1:
        names.append("tp"); sizes.append(spec.tp)
    return Mesh(tuple(names), tuple(sizes))


def _split_first_divisible(shape, n: int, axis: int, ndim: int) -> Sharding:
    for d, size in enumerate(shape):
        if size % n == 0 and size >= n:
            return tuple(Shard(d) if a == axis else Replicate() for a in range(ndim))
    return tuple(Replicate() for _ in range(ndim))


#: Runs of the propagation at most (``reduce_once``): each later run keeps from passing through the Partial values
#: the one before reduced twice, and is kept where its summed cost is lower.
REDUCE_ONCE_RUNS = 3


def preset_plan(graph: Graph, spec: StrategySpec, *, fingerprint: str | None = None) -> ShardingPlan:
    """The expert plan for ``spec`` on this graph (with ``pp > 1``: each stage's plan, the same on every
    stage, and the default stage cut). ``fingerprint``: the graph's, when the caller has it."""
    mesh = mesh_for(spec)
    dp = mesh.names.index("dp") if "dp" in mesh.names else None
    tp = mesh.names.index("tp") if "tp" in mesh.names else None
    fixed: dict[str, Sharding] = {}
    at_rest: dict[str, Sharding] = {}
    lazy: set[str] = set()
    by_param: dict[str, str] = {}
    for inp in graph.inputs:
        shape = graph.types[inp.value].shape
        if inp.role is Role.BATCH:
            sh = [Replicate()] * mesh.ndim
            if dp is not None and shape and shape[0] % mesh.sizes[dp] == 0:
                sh[dp] = Shard(0)
            if spec.sp and tp is not None and len(shape) >= 2 and shape[1] % mesh.sizes[tp] == 0:
                sh[tp] = Shard(1)  # the sequence dim: the residual stream stays split along tp
            fixed[inp.name] = tuple(sh)
        elif tp is not None and inp.role in (Role.PARAM, Role.OPT_STATE) and len(shape) >= 1:
            lazy.add(inp.name)
        elif dp is not None and spec.zero and inp.role is Role.OPT_STATE and len(shape) >= 1:
            fixed[inp.name] = _split_first_divisible(shape, mesh.sizes[dp], dp, mesh.ndim)
        elif dp is not None and spec.zero >= 3 and inp.role is Role.PARAM:
            # stored split, used whole: consumers see it replicated (all-gathered before use), so the
            # compute stays data parallel; only the stored value (and its update) is split
            at_rest[inp.name] = _split_first_divisible(shape, mesh.sizes[dp], dp, mesh.ndim)
        if inp.role is Role.OPT_STATE:
            by_param[inp.name] = inp.name.split("/")[1]
    rule = _megatron_rule(tp, spec.sp) if tp is not None else None
    shape_of = {i.name: graph.types[i.value].shape for i in graph.inputs}
    # a state follows its parameter's split where it has the parameter's shape (not a factored one)
    follows = {name: by_param[name] for name in lazy if name in by_param and
               shape_of.get(by_param[name]) == shape_of[name]}
    plan, no_pass, total = None, frozenset(), None
    for _ in range(REDUCE_ONCE_RUNS):
        prop = Propagator(graph, mesh, fixed, set(lazy), rule, follows, dict(at_rest),
                          zero_axis=dp if spec.zero else None, zero_level=spec.zero, no_pass=no_pass)
        run = prop.run()
        if total is not None and prop.total >= total:
            break
        plan, total = run, prop.total
        again = no_pass | prop.reduced_twice()
        if again == no_pass:
            break
        no_pass = again
    plan.fingerprint = fingerprint or graph.fingerprint()
    plan.strategy_string = str(spec)
    plan.microbatches, plan.recompute = spec.microbatches, spec.recompute
    plan.stages, plan.schedule, plan.chunks = spec.pp, spec.schedule, spec.chunks
    plan.stage_of = contiguous_cut(graph, spec.pp * spec.chunks) if spec.pp > 1 else {}
    return plan


def _megatron_rule(tp: int, sequence_parallel: bool):
    def rule(prop: Propagator, node, ann, axis: int):
        if axis != tp:
            return None
        opdef = lookup(node.op)
        refs = node.input_refs()
        if opdef is not None and opdef.family is Family.EMBEDDING:
            if sequence_parallel:  # tokens arrive split on the sequence: the lookup stays split too
                return None
            return ["v"] if refs[0].id in prop.lazy and prop.input_param(refs[0].id) else None  # vocab-parallel
        if opdef is None or opdef.kind is not OpKind.MATMUL:
            return None
        weights = [k for k, r in enumerate(refs) if r.id in prop.lazy and prop.input_param(r.id)
                   and prop.graph.types[r.id].rank == 2]
        acts = [k for k, r in enumerate(refs) if r.id not in prop.lazy]
        if not weights or not acts:
            return None
        w, a = weights[0], acts[-1]
        w_letters = {x for d in ann.inputs[w] for x in d}
        a_letters = {x for d in ann.inputs[a] for x in d}
        contract = [x for x in w_letters & a_letters if x in ann.reduced]
        out_letters = {x for d in ann.outputs[0] for x in d}
        column = [x for x in w_letters - a_letters if x in out_letters]
        have = prop.actual[refs[a].id][axis]
        if isinstance(have, Shard) and contract:
            spec = ann.inputs[a][have.dim]
            if any(x in contract for x in spec):
                return contract[:1]  # row-parallel
        if not column:
            return None
        blocks = _chunks_downstream(prop.graph, prop.users, node, ann.sizes.get(column[0]) or
                                    prop.graph.types[node.outputs[0]].shape[-1])
        return [strided(column[0], blocks)]  # column-parallel
    return rule


def _family(op: str) -> Family | None:
    opdef = lookup(op)
    return opdef.family if opdef is not None else None


def _same_shape_elementwise(user, graph: Graph, vid: int) -> bool:
    """``user`` is an element-wise op whose output has ``vid``'s shape (a bias added, a cast)."""
    opdef = lookup(user.op)
    return (opdef is not None and opdef.kind is OpKind.ELEMENTWISE and len(user.outputs) == 1
            and user.outputs[0] is not None and graph.types[user.outputs[0]].shape == graph.types[vid].shape)


def _taken_apart(graph: Graph, users: dict, vid: int, dim: int, k: int) -> bool:
    """Whether dim ``dim`` (of size ``k``) of ``vid`` is taken apart into its ``k`` slices (a ``select`` of each
    index, an ``unbind``, or a split into ``k``), after ops that only move it (``ir.analysis.moved_dim``):
    nn.MultiheadAttention's packed in-projection is viewed as ``(..., 3, E)``, moved to the front and
    selected three times."""
    for _ in range(8):
        nxt = users.get(vid, [])
        rank = graph.types[vid].rank
        if nxt and all(_family(u.op) is Family.SELECT for u in nxt):
            return (all(int(u.args[1]) % rank == dim for u in nxt)
                    and sorted(int(u.args[2]) % k for u in nxt) == list(range(k)))
        if len(nxt) != 1:
            return False
        user = nxt[0]
        family = _family(user.op)
        if family in (Family.UNBIND, Family.SPLIT):
            at = 1 if family is Family.UNBIND else 2   # unbind(x, dim=0), split(x, sizes, dim=0)
            along = user.args[at] if len(user.args) > at else user.kwargs.get("dim", 0)
            return int(along) % rank == dim and len([v for v in user.outputs if v is not None]) == k
        moved = moved_dim(graph, user, vid, dim)
        if moved is None:
            return False
        vid, dim = user.outputs[0], moved
    return False


def _chunks_downstream(graph: Graph, users: dict, node, width: int) -> int:
    """If the matmul's output (through reshapes that keep the last dim, transposes, which move it: Mamba's
    in_proj output is transposed to channels-first before its split, and a bias added) is split into k
    equal chunks along that dim (a fused QKV or gate/up projection), or reshaped to ``(..., k, ...)`` whose
    k slices are then taken apart (``_taken_apart``: nn.MultiheadAttention's packed projection), k; else 1.
    ``users``: ``graph.users()``."""
    vid = node.outputs[0]
    col = graph.types[vid].rank - 1   # where the matmul's output column dim is now
    for _ in range(4):
        nxt = users.get(vid, [])
        if len(nxt) != 1:
            return 1
        user = nxt[0]
        rank = graph.types[vid].rank
        family = _family(user.op)
        if (family is Family.RESHAPE and col == rank - 1
                and graph.types[user.outputs[0]].shape[-1] == graph.types[vid].shape[-1]):
            vid, col = user.outputs[0], graph.types[user.outputs[0]].rank - 1
            continue
        if family is Family.TRANSPOSE:
            a, b = (int(x) % rank for x in user.args[1:3])
            vid, col = user.outputs[0], b if col == a else a if col == b else col
            continue
        out = graph.types[user.outputs[0]].shape if user.outputs and user.outputs[0] is not None else None
        if _same_shape_elementwise(user, graph, vid):  # a bias added to the projection
            vid = user.outputs[0]
            continue
        if (family is Family.RESHAPE and col == rank - 1 and out is not None and len(out) > rank
                and tuple(out[:rank - 1]) == tuple(graph.types[vid].shape[:rank - 1])):
            k = out[rank - 1]   # the column dim reshaped as (k, ...): chunks when its k slices are taken apart
            return k if k > 1 and _taken_apart(graph, users, user.outputs[0], rank - 1, k) else 1
        if family is Family.SPLIT:
            dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
            if dim % rank != col:
                return 1
            k = len([v for v in user.outputs])
            size = graph.types[vid].shape[col]
            return k if k > 1 and size % k == 0 and all(
                graph.types[v].shape[col] == size // k for v in user.outputs if v is not None) else 1
        return 1
    return 1


def unsplit_batch(graph: Graph, plan: ShardingPlan) -> str | None:
    """For a preset plan: a sentence when its data-parallel axis (``dp``, more than one rank) splits no batch tensor
    (the preset keeps a tensor whole when the axis does not divide its rows), so every rank computes the whole
    batch. The plan is correct; the note says why it is not faster."""
    mesh = plan.mesh
    if "dp" not in mesh.names or mesh.sizes[mesh.names.index("dp")] < 2:
        return None
    axis, n = mesh.names.index("dp"), mesh.sizes[mesh.names.index("dp")]
    batch = [i for i in graph.inputs if i.role is Role.BATCH and graph.types[i.value].shape]
    if not batch or any(isinstance(plan.inputs.get(i.name, (None,) * mesh.ndim)[axis], Shard) for i in batch):
        return None
    rows = sorted({graph.types[i.value].shape[0] for i in batch})
    return (f"dp={n} splits no batch tensor (rows along dim 0: {', '.join(map(str, rows))}, not multiples of {n}), "
            f"so every rank computes the whole batch; use a batch size divisible by {n} for data parallelism")


def unsplit_model(graph: Graph, plan: ShardingPlan) -> str | None:
    """For a preset plan: a sentence when its tensor-parallel axis (``tp``, more than one rank) splits no parameter,
    so every rank holds and computes the whole model (the plan is correct; the note says why it is not smaller)."""
    mesh = plan.mesh
    if "tp" not in mesh.names or mesh.sizes[mesh.names.index("tp")] < 2:
        return None
    axis, n = mesh.names.index("tp"), mesh.sizes[mesh.names.index("tp")]
    params = [i for i in graph.inputs if i.role is Role.PARAM]
    if not params or any(isinstance(plan.inputs.get(i.name, (None,) * mesh.ndim)[axis], Shard) for i in params):
        return None
    return (f"tp={n} splits no parameter (the preset splits matmul and embedding weights {n} ways where the sizes, "
            f"head counts and expert counts it splits are divisible by {n}; none is here), so every rank holds and "
            f"computes the whole model; use sizes, heads and experts divisible by {n} for tensor parallelism")


def preset_notes(graph: Graph, plan: ShardingPlan) -> list[str]:
    """What ``unsplit_batch`` and ``unsplit_model`` say about a preset plan (``rhino run`` and the Trainer print it)."""
    return [n for n in (unsplit_batch(graph, plan), unsplit_model(graph, plan)) if n]
