"""Custom SPMD lowerings for ops whose split letters the plain op cannot compute locally.

- ``embedding`` with a split vocabulary: indices outside this rank's rows are looked up as row 0 and
  their result zeroed (a partial sum over ranks);
- ``embedding_dense_backward`` with a split vocabulary: gradients of other ranks' rows are dropped;
- ``_log_softmax`` over a split dim: the row max and the sum of exponentials are all-reduced;
  its backward all-reduces the row sum of the gradient;
- ``nll_loss`` with split classes: targets of other ranks' classes (and ignored targets) become a local
  ignore index; a mean over split rows or classes is an all-reduced sum over the all-reduced total
  weight (replicated);
- ``mse_loss_backward`` with ``reduction=mean`` over split dims: the local sum-reduced gradient divided
  by the global element count;
- ``convolution_backward`` with split input channels: the bias gradient (which does not depend on the
  input channels) is kept on the first coordinate of those axes only, so its Partial(sum) is exact.
- batch norm in training mode over a split batch: all-reduced per-channel statistics (``spmd_bn``).
Split dims of indices (embedding rows, classes) may be strided or split over several axes: an index
is mapped to this rank's local position axis by axis, the way ``sharding.simulate`` slices.
The emitted code is plain aten ops and ``redistribute`` calls, so ``--emit`` shows it. Which lowering an
op gets is its registry entry's ``lowering`` fact (``ir.registry.Lowering``), so a new op with one of
these lowerings is registered in ``ir/`` only.
"""
from __future__ import annotations

import operator

import torch

from ..ir.graph import Node
from ..ir.ops_nn import LOSS_BACKWARD_REDUCTION
from ..ir.registry import Lowering, lookup
from ..sharding.placement import ReduceOp, Shard, local_shape
from ..sharding.vocab import is_split, split_letter
from ..sharding.steps import AllReduce
from .fx import resolve_op
from .spmd_bn import emit_batch_norm
from .spmd_ops import redistribute, step_args

__all__ = ["emit_custom"]

aten = torch.ops.aten


def _axes(strategy, letters) -> list[int]:
    """Mesh axes splitting one of ``letters`` (plain or strided)."""
    return [axis for axis, entry in enumerate(strategy)
            if is_split(entry) and split_letter(entry)[0] in letters]


def _all_reduce(fg, x, axes, op: ReduceOp, local: tuple[tuple[int, ...], str], owner: str):
    """``x`` all-reduced over ``axes``. ``local``: its (local shape, dtype name), which ``lower.overlap``
    reads to size and bucket the step (as ``lower_rank`` records it for a plan's redistributions);
    ``owner``: the IR node lowered, so that ``lower.overlap`` buckets its all-reduces only together
    (the two sums of a split ``nll_loss``), never with gradients."""
    for a in axes:
        x = fg.call_function(redistribute, (x,) + step_args(AllReduce(a, op)))
        x.meta["rhino_local"] = local
        x.meta["rhino_owner"] = owner
    return x


def _input_local(node: Node, k: int, rp) -> tuple[tuple[int, ...], str]:
    """(local shape, dtype name) of ``node``'s input ``k`` as the node reads it on one rank."""
    t = rp.graph.types[node.args[k].id]
    return local_shape(t.shape, rp.node[node.name].inputs[k], rp.plan.mesh), t.dtype.value


def _reduced_local(node: Node, k: int, dim: int, rp) -> tuple[tuple[int, ...], str]:
    """That of input ``k`` reduced over ``dim`` with the dim kept."""
    shape, dtype = _input_local(node, k, rp)
    return tuple(1 if d == dim % len(shape) else s for d, s in enumerate(shape)), dtype


def _pieces(placements, dim: int, size: int, mesh, rank: int):
    """For each mesh axis splitting ``dim`` (in axis order): (current size, blocks, ranks, coordinate)."""
    coords = mesh.coords(rank)
    for a, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim == dim:
            yield size, p.blocks, mesh.sizes[a], coords[a]
            size //= mesh.sizes[a]


def local_position(i: int, placements, dim: int, size: int, mesh, rank: int) -> int | None:
    """This rank's local position of global index ``i`` of ``dim`` (None if another rank holds it)."""
    for cur, b, n, c in _pieces(placements, dim, size, mesh, rank):
        block, piece = cur // b, cur // (b * n)
        if (i % block) // piece != c:
            return None
        i = (i // block) * piece + i % piece
    return i


def _local_index(fg, idx, placements, dim: int, size: int, mesh, rank: int):
    """(local index, mask of indices this rank does not hold), as ``local_position`` elementwise."""
    outside = None
    for cur, b, n, c in _pieces(placements, dim, size, mesh, rank):
        block, piece = cur // b, cur // (b * n)
        rem = fg.call_function(aten.remainder.Scalar, (idx, block))
        which = fg.call_function(aten.div.Scalar_mode, (rem, piece), {"rounding_mode": "floor"})
        other = fg.call_function(aten.ne.Scalar, (which, c))
        outside = other if outside is None else fg.call_function(aten.logical_or.default, (outside, other))
        major = fg.call_function(aten.div.Scalar_mode, (idx, block), {"rounding_mode": "floor"})
        idx = fg.call_function(aten.add.Tensor, (fg.call_function(aten.mul.Scalar, (major, piece)),
                                                 fg.call_function(aten.remainder.Scalar, (rem, piece))))
    if outside is None:
        outside = fg.call_function(aten.ne.Tensor, (idx, idx))
    return idx, outside


def emit_custom(fg, node: Node, args: list, kwargs: dict, strategy, ann, rp, rank: int) -> dict[int, object]:
    """Emit the custom lowering the op's ``lowering`` fact names; returns value id -> fx node for the
    node's outputs."""
    key = lookup(node.op).lowering
    if key in (Lowering.BATCH_NORM, Lowering.BATCH_NORM_NO_STATS, Lowering.BATCH_NORM_BACKWARD):
        channels = _input_local(node, 1 if key is Lowering.BATCH_NORM_BACKWARD else 0, rp)[0][1]
        return emit_batch_norm(fg, node, key, args, _axes(strategy, ann.custom), rp, _all_reduce, channels)
    return _LOWERINGS[key](fg, node, args, kwargs, strategy, ann, rp, rank)


def _embedding(fg, node: Node, args, kwargs, strategy, ann, rp, rank: int) -> dict[int, object]:
    ns = rp.node[node.name]
    rows = rp.graph.types[node.args[0].id].shape[0]
    rel, outside = _local_index(fg, args[1], ns.inputs[0], 0, rows, rp.plan.mesh, rank)
    safe = fg.call_function(aten.masked_fill.Scalar, (rel, outside, 0))
    emb = fg.call_function(aten.embedding.default, (args[0], safe, *args[2:]), kwargs)
    mask = fg.call_function(aten.unsqueeze.default, (outside, -1))
    return {node.outputs[0]: fg.call_function(aten.masked_fill.Scalar, (emb, mask, 0.0))}


def _embedding_backward(fg, node: Node, args, kwargs, strategy, ann, rp, rank: int) -> dict[int, object]:
    mesh = rp.plan.mesh
    rows, held = rp.graph.types[node.outputs[0]].shape[0], rp.node[node.name].outputs[0]
    rel, outside = _local_index(fg, args[1], held, 0, rows, mesh, rank)
    safe = fg.call_function(aten.masked_fill.Scalar, (rel, outside, 0))
    grad = fg.call_function(aten.masked_fill.Scalar,
                            (args[0], fg.call_function(aten.unsqueeze.default, (outside, -1)), 0.0))
    pad = local_position(args[3], held, 0, rows, mesh, rank) if args[3] >= 0 else None
    out = fg.call_function(aten.embedding_dense_backward.default,
                           (grad, safe, rp.local_shape(node.outputs[0])[0], -1 if pad is None else pad, args[4]))
    return {node.outputs[0]: out}


def _mse_loss_backward(fg, node: Node, args, kwargs, strategy, ann, rp, rank: int) -> dict[int, object]:
    """A mean-reduced elementwise loss's backward (mse, smooth L1, Huber, soft margin: ``(grad, x, target, reduction[,
    beta])``) on a shard: the sum-reduced backward over the global element count."""
    numel = rp.graph.types[node.args[1].id].numel
    at = LOSS_BACKWARD_REDUCTION.get(node.op, 3)   # (binary cross-entropy's weight comes before it)
    if len(args) > at:
        args = [*args[:at], 2, *args[at + 1:]]
    else:
        kwargs = {**kwargs, "reduction": 2}
    call = fg.call_function(resolve_op(node.op), tuple(args), kwargs)
    return {node.outputs[0]: fg.call_function(aten.div.Scalar, (call, numel))}


def _convolution_backward(fg, node: Node, args, kwargs, strategy, ann, rp, rank: int) -> dict[int, object]:
    call = fg.call_function(resolve_op(node.op), tuple(args), kwargs)
    out = {v: fg.call_function(operator.getitem, (call, i)) for i, v in enumerate(node.outputs) if v is not None}
    if node.outputs[2] is not None:  # (every rank emits the same code: the lockstep simulation needs it)
        keep = 0.0 if any(rp.plan.mesh.coords(rank)[a] for a in _axes(strategy, {"c"})) else 1.0
        out[node.outputs[2]] = fg.call_function(aten.mul.Scalar, (out[node.outputs[2]], keep))
    return out


def _log_softmax(fg, node: Node, args, kwargs, strategy, ann, rp, rank: int) -> dict[int, object]:
    x, dim = args[0], args[1]
    axes = _axes(strategy, ann.custom)
    local = _reduced_local(node, 0, dim, rp)
    top = _all_reduce(fg, fg.call_function(aten.amax.default, (x, [dim], True)), axes, ReduceOp.MAX, local, node.name)
    shifted = fg.call_function(aten.sub.Tensor, (x, top))
    total = fg.call_function(aten.sum.dim_IntList, (fg.call_function(aten.exp.default, (shifted,)), [dim], True))
    total = _all_reduce(fg, total, axes, ReduceOp.SUM, local, node.name)
    return {node.outputs[0]: fg.call_function(aten.sub.Tensor, (shifted, fg.call_function(aten.log.default,
                                                                                          (total,))))}


def _log_softmax_backward(fg, node: Node, args, kwargs, strategy, ann, rp, rank: int) -> dict[int, object]:
    grad, out, dim = args[0], args[1], args[2]
    axes = _axes(strategy, ann.custom)
    total = _all_reduce(fg, fg.call_function(aten.sum.dim_IntList, (grad, [dim], True)), axes, ReduceOp.SUM,
                        _reduced_local(node, 0, dim, rp), node.name)
    scaled = fg.call_function(aten.mul.Tensor, (fg.call_function(aten.exp.default, (out,)), total))
    return {node.outputs[0]: fg.call_function(aten.sub.Tensor, (grad, scaled))}


def _nll(fg, node: Node, args, kwargs, strategy, ann, rp, rank: int) -> dict[int, object]:
    mesh, graph = rp.plan.mesh, rp.graph
    backward = lookup(node.op).lowering is Lowering.NLL_LOSS_BACKWARD
    x_at, target_at, red_at, ignore_at = (1, 2, 4, 5) if backward else (0, 1, 3, 4)
    args = list(args)
    if _axes(strategy, {"c"}):
        x_shape = graph.types[node.args[x_at].id].shape
        cdim = 0 if len(x_shape) == 1 else 1
        held = rp.node[node.name].inputs[1 if backward else 0]
        target = args[target_at]
        rel, outside = _local_index(fg, target, held, cdim, x_shape[cdim], mesh, rank)
        ignored = fg.call_function(aten.eq.Scalar, (target, args[ignore_at]))
        outside = fg.call_function(aten.logical_or.default, (outside, ignored))
        # a local ignore index no local class has (the global one may name a local class)
        args[ignore_at] = min(args[ignore_at], -1)
        args[target_at] = fg.call_function(aten.masked_fill.Scalar, (rel, outside, args[ignore_at]))
    if backward or args[red_at] != 1:
        call = fg.call_function(resolve_op(node.op), tuple(args), kwargs)
        if node.multi:
            return {v: fg.call_function(operator.getitem, (call, i)) for i, v in enumerate(node.outputs)
                    if v is not None}
        return {node.outputs[0]: call}
    # mean over split rows or classes: local sums, all-reduced, divided (both outputs replicated)
    args[red_at] = 2
    call = fg.call_function(resolve_op(node.op), tuple(args), kwargs)
    total, weight = (fg.call_function(operator.getitem, (call, i)) for i in range(2))
    axes = _axes(strategy, {"n", "c"})
    # the summed loss and total weight: 0-dim, of the input's dtype (a recomputed copy may keep only the weight)
    scalar = ((), graph.types[node.args[x_at].id].dtype.value)
    total = _all_reduce(fg, total, axes, ReduceOp.SUM, scalar, node.name) if node.outputs[0] is not None else None
    weight = _all_reduce(fg, weight, axes, ReduceOp.SUM, scalar, node.name)
    out = {} if node.outputs[1] is None else {node.outputs[1]: weight}
    if total is not None:
        out[node.outputs[0]] = fg.call_function(aten.div.Tensor, (total, weight))
    return out


_LOWERINGS = {Lowering.EMBEDDING: _embedding, Lowering.EMBEDDING_BACKWARD: _embedding_backward,
              Lowering.MSE_LOSS_BACKWARD: _mse_loss_backward, Lowering.CONVOLUTION_BACKWARD: _convolution_backward,
              Lowering.LOG_SOFTMAX: _log_softmax, Lowering.LOG_SOFTMAX_BACKWARD: _log_softmax_backward,
              Lowering.NLL_LOSS: _nll, Lowering.NLL_LOSS_BACKWARD: _nll}
