"""SPMD lowering of batch norm in training mode with a split batch (SyncBatchNorm semantics).

Forward, per channel over the ``R`` ranks splitting the batch (and spatial) dims, each holding
``n_l = N / R`` of the ``N`` values (splits are even): each rank takes the local mean ``m_l`` and
biased variance ``v_l`` (``var_mean``, two-pass, so locally stable), shifted by a value ``K`` every rank
holds (the running mean, or 0 without running statistics); one all-reduce (sum) of the ``[2, C]``
tensor ``[d_l, v_l + d_l^2] / R`` with ``d_l = m_l - K`` gives the global ``d = mean - K`` and
``E[(x - K)^2]``, so ``var = E[(x - K)^2] - d^2`` (biased). The rank normalises its shard with the
global mean and variance (the eval-mode kernel, which computes ``x * a + b`` per channel exactly as
the training kernel does); ``save_mean``, ``save_invstd`` and the running statistics
(``(1 - momentum) * r + momentum * s``, with the unbiased ``var * N / (N - 1)``) are the single-device
values, replicated.

Backward: the local kernel (input gradient not requested) gives the local ``sum(dy)`` and
``sum(dy * xhat)`` (``xhat`` from the global ``save_mean``/``save_invstd``); one all-reduce of both
makes them global: they are the bias and weight gradients (replicated), and the input gradient is
``(dy - sum(dy) / N - (x - mean) * invstd * sum(dy * xhat) / N) * invstd * weight``.
"""
from __future__ import annotations

import operator

import torch

from ..ir.graph import Node
from ..ir.registry import Lowering
from ..sharding.placement import ReduceOp

__all__ = ["emit_batch_norm"]

aten = torch.ops.aten

def _channel_view(fg, t, rank: int):
    """A per-channel [C] tensor viewed as [1, C, 1, ...] to broadcast against an [N, C, *] input."""
    return fg.call_function(aten.view.default, (t, [1, -1] + [1] * (rank - 2)))


def _dtype(graph, v):
    """torch dtype of an IR value id or Ref (None for anything else)."""
    vid = getattr(v, "id", v)
    return getattr(torch, graph.types[vid].dtype.value) if isinstance(vid, int) else None


def _cast(fg, t, have, want):
    """``t`` (of dtype ``have``) as ``want``; no op when they agree."""
    if t is None or have is None or want is None or have == want:
        return t
    return fg.call_function(aten._to_copy.default, (t,), {"dtype": want})


def emit_batch_norm(fg, node: Node, key: Lowering, args: list, axes: list[int], rp, all_reduce,
                    channels: int) -> dict[int, object]:
    """Emit the lowering of ``node`` whose batch/spatial dims are split over mesh ``axes``;
    ``all_reduce(fg, x, axes, op, (local shape, dtype name), node name)`` emits the all-reduces;
    ``channels``: the input's local channel count (two statistics per channel are all-reduced). Returns
    value id -> fx node. Reduced-precision inputs get their statistics and per-channel arithmetic in
    float32 (the kernels accumulate in it); every output takes the dtype the op gives it on one device."""
    graph, mesh = rp.graph, rp.plan.mesh
    backward = key is Lowering.BATCH_NORM_BACKWARD
    x_type = graph.types[node.args[1 if backward else 0].id]
    count = x_type.numel // x_type.shape[1]          # N * H * W of the global input
    acc = torch.float32 if x_type.dtype.name in ("float16", "bfloat16") else getattr(torch, x_type.dtype.value)
    stats = ((2, channels), str(acc).removeprefix("torch."))    # two statistics per channel, in ``acc``

    def reduce(fg, x, axes, op):
        return all_reduce(fg, x, axes, op, stats, node.name)
    if backward:
        return _backward(fg, node, args, axes, x_type.rank, count, acc, graph, reduce)
    ranks = 1
    for a in axes:
        ranks *= mesh.sizes[a]
    return _forward(fg, node, args, axes, x_type.rank, count, ranks, acc, graph, reduce,
                    key is Lowering.BATCH_NORM_NO_STATS)


def _forward(fg, node: Node, args: list, axes, rank: int, count: int, ranks: int, acc, graph, all_reduce,
             no_stats: bool) -> dict:
    call = fg.call_function
    at = (0, 1, 2, None, None, 4, 5) if no_stats else (0, 1, 2, 3, 4, 6, 7)
    x, w, b, rm, rv, momentum, eps = (None if i is None else args[i] for i in at)
    cast = [None if i is None else _cast(fg, args[i], _dtype(graph, node.args[i]), acc) for i in at[:5]]
    xs, w, b, rm, rv = cast
    dims = [0] + list(range(2, rank))
    var_l, mean_l = (call(operator.getitem, (vm, i)) for vm in [call(aten.var_mean.correction, (xs, dims),
                                                                     {"correction": 0})] for i in range(2))
    d_l = call(aten.sub.Tensor, (mean_l, rm)) if rm is not None else mean_l
    sq_l = call(aten.add.Tensor, (var_l, call(aten.mul.Tensor, (d_l, d_l))))
    stats = call(aten.div.Scalar, (call(aten.stack.default, ([d_l, sq_l],)), float(ranks)))
    stats = all_reduce(fg, stats, axes, ReduceOp.SUM)
    d, sq = call(operator.getitem, (stats, 0)), call(operator.getitem, (stats, 1))
    var = call(aten.sub.Tensor, (sq, call(aten.mul.Tensor, (d, d))))
    mean = call(aten.add.Tensor, (d, rm)) if rm is not None else d
    # only the outputs the graph defines: a recomputed copy (cost.remat) may need the statistics alone,
    # and an emitted value nobody reads would stay alive to the end of the program
    outs = list(node.outputs) + [None] * (5 - len(node.outputs))
    out = {}
    if outs[0] is not None:
        out[outs[0]] = call(operator.getitem, (call(aten._native_batch_norm_legit_no_training.default,
                                                    (x, w, b, mean, var, momentum, eps)), 0))
    if outs[1] is not None:
        out[outs[1]] = mean
    if outs[2] is not None:
        out[outs[2]] = call(aten.rsqrt.default, (call(aten.add.Scalar, (var, eps)),))
    if outs[3] is not None:  # functional variant: the new running statistics
        out[outs[3]] = _running(fg, rm, mean, momentum)
    if outs[4] is not None:
        out[outs[4]] = _running(fg, rv, call(aten.mul.Scalar, (var, count / max(count - 1, 1))), momentum)
    return {v: _cast(fg, t, acc if v != outs[0] else None, _dtype(graph, v)) for v, t in out.items()}


def _running(fg, r, s, momentum: float):
    """``(1 - momentum) * r + momentum * s``."""
    call = fg.call_function
    return call(aten.add.Tensor, (call(aten.mul.Scalar, (r, 1.0 - momentum)), call(aten.mul.Scalar, (s, momentum))))


def _backward(fg, node: Node, args: list, axes, rank: int, count: int, acc, graph, all_reduce) -> dict:
    call = fg.call_function
    dy, x, w, rm, rv, mean, invstd, _train, eps, mask = args[:10]
    # the CPU kernel takes a reduced-precision input with float32 parameters only if the saved statistics
    # are float32 too (one device's kernel returns them so; the graph may type them as the input)
    param = next((_dtype(graph, node.args[i]) for i in (2, 3) if args[i] is not None), None)
    saved = [_cast(fg, args[i], _dtype(graph, node.args[i]), param) for i in (5, 6)]
    local = call(aten.native_batch_norm_backward.default, (dy, x, w, rm, rv, *saved, True, eps,
                                                           [False, True, True]))
    dotp_l, sum_l = (_cast(fg, call(operator.getitem, (local, i)), _dtype(graph, node.args[5]), acc) for i in (1, 2))
    stats = all_reduce(fg, call(aten.stack.default, ([dotp_l, sum_l],)), axes, ReduceOp.SUM)
    dotp, total = call(operator.getitem, (stats, 0)), call(operator.getitem, (stats, 1))
    mean, invstd, w = (_cast(fg, args[i], _dtype(graph, node.args[i]), acc) for i in (5, 6, 2))
    out = {}
    if node.outputs[0] is not None and mask[0]:
        k = call(aten.div.Scalar, (call(aten.mul.Tensor, (dotp, invstd)), -float(count)))
        scale = invstd if w is None else call(aten.mul.Tensor, (invstd, w))
        shift = call(aten.mul.Tensor, (call(aten.div.Scalar, (total, -float(count))), scale))
        centred = call(aten.sub.Tensor, (x, _channel_view(fg, mean, rank)))
        inner = call(aten.addcmul.default, (dy, centred, _channel_view(fg, k, rank)))
        out[node.outputs[0]] = call(aten.addcmul.default, (_channel_view(fg, shift, rank), inner,
                                                            _channel_view(fg, scale, rank)))
    if len(node.outputs) > 1 and node.outputs[1] is not None and mask[1]:
        out[node.outputs[1]] = dotp
    if len(node.outputs) > 2 and node.outputs[2] is not None and mask[2]:
        out[node.outputs[2]] = total
    return {v: _cast(fg, t, acc, _dtype(graph, v)) for v, t in out.items()}
