"""Custom SPMD lowerings for ops whose split letters the plain op cannot compute locally.

- ``embedding`` with a split vocabulary: indices outside this rank's rows are looked up as row 0 and
  their result zeroed (a partial sum over ranks);
- ``embedding_dense_backward`` with a split vocabulary: gradients of other ranks' rows are dropped;
- ``_log_softmax`` over a split dim: the row max and the sum of exponentials are all-reduced;
  its backward all-reduces the row sum of the gradient;
- ``nll_loss`` with split classes: targets of other ranks' classes become ``ignore_index``; a mean
  over split rows or classes is an all-reduced sum over the all-reduced total weight (replicated);
- batch norm in training mode over a split batch: all-reduced per-channel statistics (``spmd_bn``).
The emitted code is plain aten ops and ``redistribute`` calls, so ``--emit`` shows it.
"""
from __future__ import annotations

import operator

import torch

from ..ir.graph import Node
from ..sharding.placement import ReduceOp
from ..sharding.rules import PASS, split_letter
from ..sharding.steps import AllReduce
from .fx import resolve_op
from .spmd_bn import BN_CUSTOM_OPS, emit_batch_norm
from .spmd_ops import redistribute, step_args

__all__ = ["CUSTOM_OPS", "emit_custom"]

aten = torch.ops.aten
_NLL = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")
_NLL_BACKWARD = ("aten.nll_loss_backward.default", "aten.nll_loss2d_backward.default")
CUSTOM_OPS = frozenset({"aten.embedding.default", "aten.embedding_dense_backward.default",
                        "aten._log_softmax.default", "aten._log_softmax_backward_data.default",
                        *_NLL, *_NLL_BACKWARD, *BN_CUSTOM_OPS})


def _axes(strategy, letters, contiguous: bool = True) -> list[int]:
    """Mesh axes splitting one of ``letters``; ``contiguous``: the lowering needs index offsets, so a
    strided split is refused."""
    out = []
    for axis, entry in enumerate(strategy):
        if entry is None or entry.startswith(PASS):
            continue
        letter, extra = split_letter(entry)
        if letter in letters:
            if extra != 1 and contiguous:
                raise ValueError(f"a strided split of {letter!r} is not supported by the custom lowering")
            out.append(axis)
    return out


def _range(mesh, rank: int, axes: list[int], size: int) -> tuple[int, int]:
    """(first index, count) of this rank's contiguous piece of a dim split over ``axes`` in order."""
    start, coords = 0, mesh.coords(rank)
    for a in axes:
        size //= mesh.sizes[a]
        start += coords[a] * size
    return start, size


def _all_reduce(fg, x, axes, op: ReduceOp):
    for a in axes:
        x = fg.call_function(redistribute, (x,) + step_args(AllReduce(a, op)))
    return x


def _local_index(fg, idx, start: int, count: int):
    """(index - start, mask of indices outside [start, start + count))."""
    rel = fg.call_function(aten.sub.Tensor, (idx, start))
    outside = fg.call_function(aten.logical_or.default, (fg.call_function(aten.lt.Scalar, (rel, 0)),
                                                         fg.call_function(aten.ge.Scalar, (rel, count))))
    return rel, outside


def emit_custom(fg, node: Node, args: list, kwargs: dict, strategy, ann, rp, rank: int) -> dict[int, object]:
    """Emit the custom lowering; returns value id -> fx node for the node's outputs."""
    mesh, graph = rp.plan.mesh, rp.graph
    op = node.op
    if op == "aten.embedding.default":
        axes = _axes(strategy, {"v"})
        start, count = _range(mesh, rank, axes, graph.types[node.args[0].id].shape[0])
        rel, outside = _local_index(fg, args[1], start, count)
        safe = fg.call_function(aten.masked_fill.Scalar, (rel, outside, 0))
        emb = fg.call_function(aten.embedding.default, (args[0], safe, *args[2:]), kwargs)
        mask = fg.call_function(aten.unsqueeze.default, (outside, -1))
        return {node.outputs[0]: fg.call_function(aten.masked_fill.Scalar, (emb, mask, 0.0))}
    if op == "aten.embedding_dense_backward.default":
        axes = _axes(strategy, {"v"})
        start, count = _range(mesh, rank, axes, graph.types[node.outputs[0]].shape[0])
        rel, outside = _local_index(fg, args[1], start, count)
        safe = fg.call_function(aten.masked_fill.Scalar, (rel, outside, 0))
        grad = fg.call_function(aten.masked_fill.Scalar,
                                (args[0], fg.call_function(aten.unsqueeze.default, (outside, -1)), 0.0))
        pad = args[3]
        pad = pad - start if 0 <= pad - start < count else -1
        out = fg.call_function(aten.embedding_dense_backward.default, (grad, safe, count, pad, args[4]))
        return {node.outputs[0]: out}
    if op == "aten._log_softmax.default":
        x, dim = args[0], args[1]
        axes = _axes(strategy, ann.custom)
        top = _all_reduce(fg, fg.call_function(aten.amax.default, (x, [dim], True)), axes, ReduceOp.MAX)
        shifted = fg.call_function(aten.sub.Tensor, (x, top))
        total = fg.call_function(aten.sum.dim_IntList, (fg.call_function(aten.exp.default, (shifted,)), [dim], True))
        total = _all_reduce(fg, total, axes, ReduceOp.SUM)
        return {node.outputs[0]: fg.call_function(aten.sub.Tensor, (shifted, fg.call_function(aten.log.default,
                                                                                              (total,))))}
    if op == "aten._log_softmax_backward_data.default":
        grad, out, dim = args[0], args[1], args[2]
        axes = _axes(strategy, ann.custom)
        total = _all_reduce(fg, fg.call_function(aten.sum.dim_IntList, (grad, [dim], True)), axes, ReduceOp.SUM)
        scaled = fg.call_function(aten.mul.Tensor, (fg.call_function(aten.exp.default, (out,)), total))
        return {node.outputs[0]: fg.call_function(aten.sub.Tensor, (grad, scaled))}
    if op in BN_CUSTOM_OPS:
        return emit_batch_norm(fg, node, args, _axes(strategy, ann.custom, contiguous=False), rp, _all_reduce)
    if op in _NLL or op in _NLL_BACKWARD:
        return _nll(fg, node, args, kwargs, strategy, rp, rank)
    raise AssertionError(f"no custom lowering for {op}")


def _nll(fg, node: Node, args, kwargs, strategy, rp, rank: int) -> dict[int, object]:
    mesh, graph = rp.plan.mesh, rp.graph
    backward = node.op in _NLL_BACKWARD
    x_at, target_at, red_at, ignore_at = (1, 2, 4, 5) if backward else (0, 1, 3, 4)
    args = list(args)
    class_axes = _axes(strategy, {"c"})
    if class_axes:
        x_shape = graph.types[node.args[x_at].id].shape
        classes = x_shape[0] if len(x_shape) == 1 else x_shape[1]
        start, count = _range(mesh, rank, class_axes, classes)
        rel, outside = _local_index(fg, args[target_at], start, count)
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
    axes = _axes(strategy, {"n", "c"}, contiguous=False)
    total = _all_reduce(fg, total, axes, ReduceOp.SUM)
    weight = _all_reduce(fg, weight, axes, ReduceOp.SUM)
    out = {node.outputs[0]: fg.call_function(aten.div.Tensor, (total, weight))}
    if node.outputs[1] is not None:
        out[node.outputs[1]] = weight
    return out
