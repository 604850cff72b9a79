"""Plan + IR -> one ``torch.fx`` program per rank.

Each node runs its aten op on local shards. Before it, every input whose sharding differs from what
the node's strategy requires is redistributed (one cached redistribution per value and target);
size-bearing arguments (view/expand sizes, creation sizes, split sizes, ...) are rewritten to the
local shapes; a mean-reduced ``nll_loss`` over a split batch becomes a local sum plus all-reduces.
At the end the loss is made replicated and each state output is brought back to the sharding of
its input, so the next step sees the same layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..ir.graph import Node
from ..sharding.placement import Sharding, local_shape, replicated
from ..sharding.plan import ResolvedPlan
from ..sharding.redistribute import comm_bytes, plan_redistribution
from ..sharding.steps import is_communication
from ..ir.modules import value_blocks
from .fx import py_name, add_constants, convert_arg, emit_node
from ..ir.registry import Lowering, SizeArg, SizeRule, annotate, call_of, lookup
from ..sharding.vocab import is_split, split_letter
from .spmd_custom import emit_custom
from .spmd_ops import redistribute, step_args
from .overlap import OverlapOptions, overlap_program
from .accumulate import fuse_matmul_accumulation
from ..sharding.steps import after_step

__all__ = ["SpmdProgram", "Part", "lower_rank"]


@dataclass
class Part:
    """A subset of the step to lower as its own program (gradient accumulation, ``cost/accumulate.py``).

    ``nodes``: the node names to emit (in graph order); ``inputs``: (placeholder name, value id) in
    order, each arriving in the value's own sharding; ``outputs``: (name, value id, sharding to deliver,
    None for the value's own, i.e. as produced: a partial gradient stays partial); ``accumulate``:
    (name, value id) of values added in place (``Tensor.add_``) into an extra trailing input each, as
    soon as they are computed, instead of being returned (a matmul's product is added by the matmul:
    ``lower.accumulate``)."""

    nodes: set[str]
    inputs: list[tuple[str, int]]
    outputs: list[tuple[str, int, Sharding | None]]
    accumulate: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class SpmdProgram:
    module: torch.fx.GraphModule
    rank: int
    input_names: list[str]
    output_names: list[str]
    comm_bytes: int = 0
    collectives: dict[str, int] = field(default_factory=dict)
    value_nodes: dict[int, str] = field(default_factory=dict)  # IR value id -> fx node holding its local shard
    value_numels: dict[int, int] = field(default_factory=dict)  # IR value id -> global element count
    overlap: object = None         # lower.overlap.OverlapStats when the program was overlapped


def _local_args(node: Node, rp: ResolvedPlan, need: dict[int, Sharding]) -> tuple[list, dict]:
    """Rewrite the arguments that carry global sizes (the op's ``size_args`` fact) to this rank's local sizes."""
    args, kwargs = list(node.args), dict(node.kwargs)
    opdef = lookup(node.op)
    if opdef is None or not opdef.size_args:
        return args, kwargs
    outs = [rp.local_shape(v) if v is not None else None for v in node.outputs]
    for size_arg in opdef.size_args:
        _REWRITE[size_arg.rule](size_arg, node, rp, need, outs, args, kwargs)
    return args, kwargs


def _local_dim(node: Node, rp: ResolvedPlan, need: dict[int, Sharding], index: int, dim: int) -> tuple[int, int]:
    """(local, global) size of dim ``dim`` of the tensor argument ``index``."""
    ref = node.args[index]
    shape = rp.graph.types[ref.id].shape
    return local_shape(shape, need[ref.id], rp.plan.mesh)[dim], shape[dim]


def _split_dim(args: list, kwargs: dict) -> int:
    return args[2] if len(args) > 2 else kwargs.get("dim", 0)


def _out_shape(sa: SizeArg, node, rp, need, outs, args, kwargs) -> None:
    args[sa.at] = list(outs[sa.index])


def _out_dim(sa: SizeArg, node, rp, need, outs, args, kwargs) -> None:
    args[sa.at] = outs[sa.index][sa.dim]


def _out_dim_list(sa: SizeArg, node, rp, need, outs, args, kwargs) -> None:
    if outs[sa.index] is not None:
        args[sa.at] = [outs[sa.index][sa.dim]]


def _out_dim_in_list(sa: SizeArg, node, rp, need, outs, args, kwargs) -> None:
    size = list(args[sa.at])
    size[sa.dim] = outs[sa.index][sa.dim]
    args[sa.at] = size


def _split_size(sa: SizeArg, node, rp, need, outs, args, kwargs) -> None:
    if len(outs) > 1:
        dim = _split_dim(args, kwargs)
        full = [o for o in outs[:-1] if o is not None]   # every chunk but the last has the split size
        if full:
            args[sa.at] = full[0][dim]
        else:                        # only the last chunk is used (a rewritten step drops the others)
            local, whole = _local_dim(node, rp, need, 0, dim)
            args[sa.at] = args[sa.at] * local // whole


def _split_sizes(sa: SizeArg, node, rp, need, outs, args, kwargs) -> None:
    dim = _split_dim(args, kwargs)
    args[sa.at] = [o[dim] for o in outs]


def _in_dim(sa: SizeArg, node, rp, need, outs, args, kwargs) -> None:
    args[sa.at] = _local_dim(node, rp, need, sa.index, sa.dim)[0]


def _groups(sa: SizeArg, node, rp, need, outs, args, kwargs) -> None:
    """Whole groups per rank: the local group count."""
    if args[sa.at] != 1:
        local, whole = _local_dim(node, rp, need, sa.index, sa.dim)
        args[sa.at] = args[sa.at] * local // whole


def _squeezed(sa: SizeArg, node, rp, need, outs, args, kwargs) -> None:
    """The dims of global size 1 the op removes (a split dim may have size 1 locally)."""
    shape = rp.graph.types[node.args[0].id].shape
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        dims = [d for d, n in enumerate(shape) if n == 1]
    else:
        dims = [dims] if isinstance(dims, int) else list(dims)
        dims = sorted({d % len(shape) for d in dims if shape[d % len(shape)] == 1}) if shape else []
    args[sa.at:] = [dims]
    kwargs.clear()


_REWRITE = {SizeRule.OUT_SHAPE: _out_shape, SizeRule.OUT_DIM: _out_dim, SizeRule.OUT_DIM_LIST: _out_dim_list,
            SizeRule.SPLIT_SIZE: _split_size, SizeRule.SPLIT_SIZES: _split_sizes, SizeRule.IN_DIM: _in_dim,
            SizeRule.GROUPS: _groups, SizeRule.SQUEEZED: _squeezed, SizeRule.OUT_DIM_IN_LIST: _out_dim_in_list}


def whole_step(rp: ResolvedPlan) -> Part:
    """The whole step: every node; the loss replicated, each state output in its input's sharding."""
    graph = rp.graph
    state_in = {i.name: i.value for i in graph.inputs}
    return Part({n.name for n in graph.nodes}, [(i.name, i.value) for i in graph.inputs],
                [(o.name, o.value, replicated(rp.plan.mesh) if o.name not in state_in else rp.value[state_in[o.name]])
                 for o in graph.outputs])


def lower_rank(rp: ResolvedPlan, rank: int, device: torch.device | str = "cpu", part: Part | None = None, *,
               overlap: bool | OverlapOptions = False) -> SpmdProgram:
    """This rank's program for ``part`` of the step (default: the whole step, ``whole_step``). ``overlap``:
    communication asynchronous and bucketed (``lower.overlap``; ``True`` for the default
    ``OverlapOptions``); else every step blocks where it is needed."""
    graph, mesh = rp.graph, rp.plan.mesh
    part = part or whole_step(rp)
    device = torch.device(device)
    fg = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[int, torch.fx.Node] = {}
    cache: dict[tuple, torch.fx.Node] = {}
    stats = {"bytes": 0, "collectives": {}}
    for name, vid in part.inputs:
        env[vid] = fg.placeholder(py_name(name))
        env[vid].meta["rhino_name"] = name       # the state input's name (lower.overlap's gather buckets)
    accumulators = {vid: fg.placeholder(py_name(name)) for name, vid in part.accumulate}
    add_constants(graph, root, fg, env, device)
    blocks = value_blocks(graph)

    def moved(vid: int, want: Sharding) -> torch.fx.Node:
        have = rp.value[vid]
        if have == want:
            return env[vid]
        key = (vid, want)
        if key not in cache:
            t = graph.types[vid]
            steps = plan_redistribution(t.shape, have, want, mesh)
            x = env[vid]
            shape = local_shape(t.shape, have, mesh)
            for step in steps:
                x = fg.call_function(redistribute, (x,) + step_args(step))
                x.meta["rhino_local"] = (shape, t.dtype.value)   # the step's input (lower.overlap buckets)
                x.meta["rhino_block"] = blocks.get(vid)          # its module (reduce-scatter buckets)
                shape = after_step(shape, step, mesh.sizes)
                if is_communication(step):
                    kind = type(step).__name__
                    stats["collectives"][kind] = stats["collectives"].get(kind, 0) + 1
            stats["bytes"] += comm_bytes(t.shape, t.dtype.itemsize, steps, have, mesh)
            cache[key] = x
        return cache[key]

    def conv(a, need: dict[int, Sharding]):
        return convert_arg(a, lambda r: moved(r.id, need[r.id]) if r.id in need else env[r.id], device)

    for node in graph.nodes:
        if node.name not in part.nodes:
            continue
        _emit(fg, node, rp, rank, env, moved, conv)
        for vid in node.outputs:
            if vid in accumulators:
                fg.call_function(torch.Tensor.add_, (accumulators[vid], env[vid]))

    outs = [env[vid] if want is None else moved(vid, want) for _, vid, want in part.outputs]
    fg.output(outs)
    if accumulators:       # a gradient made by a matmul is added into its accumulator by the matmul
        removed = fuse_matmul_accumulation(fg)
        env = {v: n for v, n in env.items() if n not in removed}
    gm = torch.fx.GraphModule(root, fg)
    prog = SpmdProgram(gm, rank, [n for n, _ in part.inputs] + [n for n, _ in part.accumulate],
                       [n for n, _, _ in part.outputs], stats["bytes"], stats["collectives"],
                       {v: n.name for v, n in env.items()}, {v: graph.types[v].numel for v in env})
    if overlap:
        prog = overlap_program(prog, overlap if isinstance(overlap, OverlapOptions) else None)
    return prog


def _emit(fg, node: Node, rp: ResolvedPlan, rank: int, env: dict, moved, conv) -> None:
    """Emit one IR node (with the redistributions its inputs need) into ``fg``."""
    graph, mesh = rp.graph, rp.plan.mesh
    ns = rp.node[node.name]
    refs = node.input_refs()
    need: dict[int, Sharding] = {}
    for ref, req in zip(refs, ns.inputs):
        if ref.id in need and need[ref.id] != req:
            raise AssertionError(f"{node.name} needs value {ref.id} in two shardings")
        need[ref.id] = req
    args, kwargs = _local_args(node, rp, need)
    strategy = rp.plan.strategies.get(node.name, (None,) * mesh.ndim)
    opdef = lookup(node.op)
    if opdef is not None and opdef.lowering is not None:
        ann = annotate(call_of(graph, node))
        split = {split_letter(e)[0] for e in strategy if is_split(e)}
        mean_nll = opdef.lowering is Lowering.NLL_LOSS and node.args[3] == 1 and split & ann.reduced
        if split & ann.custom or mean_nll:
            env.update(emit_custom(fg, node, conv(args, need), conv(kwargs, need), strategy, ann, rp, rank))
            return
    # local shards may be laid out differently from the global tensor: views become reshapes
    op = opdef.local_op if opdef is not None and opdef.local_op else node.op
    emit_node(fg, node, op, conv(args, need), conv(kwargs, need), env)
