"""Neural-network ops: matmuls, convolutions, attention, norms, losses, embeddings, pooling."""
from __future__ import annotations

from math import prod
from typing import Mapping

from .annotation import Annotation, Dim, parse
from .graph import Ref
from .types import DType
from .registry import (Accumulate, Family, InputLayout, Linear, Lowering, OpCall, OpKind, OutputRule, SizeArg,
                       SizeRule, register)
from .rules import NewLetters, elementwise, letters, norm_dim

M = OpKind.MATMUL
register("aten.mm.default", M, "m k+, k+ n -> m n", linear=Linear.ONE, accumulate=Accumulate.MATMUL)
register("aten.bmm.default", M, "b m k+, b k+ n -> b m n", linear=Linear.ONE)
register("aten.dot.default aten.vdot.default", M, "k+, k+ -> ")
register("aten.mv.default", M, "m k+, k+ -> m")


def _addmm(template: str):
    """``bias + product``: the product's annotation ``template`` over the other inputs, the bias broadcast to
    its output (added once: Partial with it where a split contraction makes the output Partial)."""
    def rule(call: OpCall) -> Annotation:
        mm = parse(template, call.ranks[1:])
        out = mm.outputs[0]
        bias = call.in_types[0].shape
        new = NewLetters("bias")
        spec = tuple(out[len(out) - len(bias) + i] if n != 1 or out_is_one(call, len(out) - len(bias) + i)
                     else (new(1),) for i, n in enumerate(bias))
        return Annotation((spec,) + mm.inputs, mm.outputs, reduced=mm.reduced, sizes=new.sizes,
                          additive=frozenset({0}))
    return rule


def out_is_one(call: OpCall, i: int) -> bool:
    return call.out_types[0].shape[i] == 1


def _addmm_flops(call: OpCall, ann: Annotation, sizes: Mapping[str, int]) -> int:
    return 2 * prod(sizes[x] for x in ann.letters() if not x.startswith("bias")) + call.out_types[0].numel


register("aten.addmm.default", M, _addmm("m k+, k+ n -> m n"), flops=_addmm_flops)
register("aten.baddbmm.default", M, _addmm("b m k+, b k+ n -> b m n"), flops=_addmm_flops)
register("aten.addbmm.default", M, _addmm("b+ m k+, b+ k+ n -> m n"), flops=_addmm_flops)
register("aten.addmv.default", M, _addmm("m k+, k+ -> m"), flops=_addmm_flops)
register("aten.addr.default", M, _addmm("m, n -> m n"), flops=_addmm_flops)


def trilinear_rule(call: OpCall) -> Annotation:
    """``_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim)`` (nn.Bilinear, forward and backward): each
    input unsqueezed at its ``expand`` dims to one rank, the three multiplied and summed over ``sumdim``, which
    the output drops. An einsum: a dim an input lacks broadcasts it, a summed dim is reduced (the product is
    linear in each input, so a split summed dim gives partial sums)."""
    total = call.in_types[0].rank + len(call.arg(3, "expand1"))
    sumdim = {norm_dim(d, total) for d in call.arg(6, "sumdim")}
    names = letters("t", total)
    new = NewLetters("u")
    sizes = [1] * total
    ins = []
    for j, t in enumerate(call.in_types[:3]):
        expand = {norm_dim(d, total) for d in call.arg(3 + j, f"expand{j + 1}")}
        kept = [i for i in range(total) if i not in expand]
        for i, n in zip(kept, t.shape):
            sizes[i] = max(sizes[i], n)
        ins.append(kept)
    specs = tuple(tuple((names[i],) if sizes[i] == n else (new(n),) for i, n in zip(kept, t.shape))
                  for kept, t in zip(ins, call.in_types))
    present = {x for spec in specs for d in spec for x in d}
    out = tuple((names[i],) if names[i] in present else (new(1),) for i in range(total) if i not in sumdim)
    return Annotation(specs, (out,), reduced=frozenset(names[i] for i in sumdim),
                      fixed=frozenset(new.sizes), sizes=new.sizes)


register("aten._trilinear.default", M, trilinear_rule)   # flops: a matmul's, 2 x the product of every letter


# -- convolution -------------------------------------------------------------
def _conv_out(size: int, k: int, s: int, p: int, d: int, transposed: bool, op: int) -> int:
    if transposed:
        return (size - 1) * s - 2 * p + d * (k - 1) + op + 1
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _expand(v, n: int) -> list[int]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def _conv_sizes(x: tuple, w: tuple, stride, padding, dilation, transposed, out_pad, groups):
    n_sp = len(x) - 2
    k = w[2:]
    st, pa, di = _expand(stride, n_sp), _expand(padding, n_sp), _expand(dilation, n_sp)
    op = _expand(out_pad, n_sp) if transposed else [0] * n_sp
    spatial = [_conv_out(x[2 + i], k[i], st[i], pa[i], di[i], transposed, op[i]) for i in range(n_sp)]
    out_ch = w[1] * groups if transposed else w[0]
    return out_ch, spatial


def conv_rule(call: OpCall) -> Annotation:
    """convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups).

    Spatial dims are fixed (no halo exchange). With groups > 1 the channel dims are (g cg) and (g og):
    only the group letter ``g`` may be split (each rank convolves whole groups; the lowering passes its
    local group count), so a depthwise convolution splits along channels.
    Weight layout: [O, C/g, k...] (transposed: [C, O/g, k...]).
    """
    x, w = call.shape_of(0), call.shape_of(1)
    has_bias = isinstance(call.args[2], Ref)
    transposed, groups = bool(call.args[6]), call.args[8]
    out_ch, spatial = _conv_sizes(x, w, *call.args[3:6], transposed, call.args[7], groups)
    n_sp = len(x) - 2
    sp_in, ks, sp_out = letters("h", n_sp), letters("kk", n_sp), letters("ho", n_sp)
    sizes = dict(zip(sp_out, spatial))
    if groups == 1:
        c, o = "c", "o"
        wspec = [(c,), (o,)] if transposed else [(o,), (c,)]
        fixed = set(sp_in + ks + sp_out)
    else:  # grouped: whole groups per rank
        c, o = ("g", "cg"), ("g", "og")
        wspec = [c, ("og",)] if transposed else [o, ("cg",)]
        fixed = set(sp_in + ks + sp_out + ["cg", "og"])
        sizes.update(g=groups, cg=x[1] // groups, og=out_ch // groups)
    ins = [((("n",), c) + tuple((s,) for s in sp_in)), tuple(_dim(d) for d in wspec) + tuple((k,) for k in ks)]
    if has_bias:
        ins.append((_dim(o),))
    out = (("n",), _dim(o)) + tuple((s,) for s in sp_out)
    return Annotation(tuple(ins), (out,), reduced=frozenset({"c"} if groups == 1 else {"cg"}),
                      fixed=frozenset(fixed), sizes=sizes, additive=frozenset({2} if has_bias else set()))


def _dim(d) -> tuple:
    """A dim spec from a letter or a tuple of letters (a merged dim)."""
    return d if isinstance(d, tuple) else (d,)


def _conv_flops(call: OpCall, ann: Annotation, sizes: Mapping[str, int]) -> int:
    w = call.shape_of(1)
    out = call.out_types[0].shape
    transposed = bool(call.args[6])
    per_out = prod(w[1:]) if not transposed else w[0] // call.args[8] * prod(w[2:])
    if transposed:  # FLOPs of the equivalent direct conv on the input side
        x = call.shape_of(0)
        return 2 * x[0] * prod(x[2:]) * x[1] * prod(w[1:])
    return 2 * out[0] * out[1] * prod(out[2:]) * per_out


def conv_backward_rule(call: OpCall) -> Annotation:
    """convolution_backward(grad_out, input, weight, bias_sizes, stride, padding, dilation,
    transposed, output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)."""
    x = call.shape_of(1)
    groups, transposed = call.args[9], bool(call.args[7])
    n_sp = len(x) - 2
    sp_in, ks, sp_out = letters("h", n_sp), letters("kk", n_sp), letters("ho", n_sp)
    fixed = set(sp_in + ks + sp_out)
    sizes = {}
    if groups == 1:
        c, o = ("c",), ("o",)
        wspec = (c, o) if transposed else (o, c)
        reduced = {"n", "o", "c"}
    else:  # whole groups per rank (see conv_rule)
        w = call.shape_of(2)
        out_ch = w[1] * groups if transposed else w[0]
        c, o = ("g", "cg"), ("g", "og")
        wspec = (c, ("og",)) if transposed else (o, ("cg",))
        fixed |= {"cg", "og"}
        reduced = {"n", "cg", "og"}
        sizes = {"g": groups, "cg": x[1] // groups, "og": out_ch // groups}
    wspec = wspec + tuple((k,) for k in ks)
    go_spec = (("n",), o) + tuple((s,) for s in sp_out)
    x_spec = (("n",), c) + tuple((s,) for s in sp_in)
    outs = [x_spec, wspec, (o,)]
    # an output the mask leaves out is unspecified (CPU may return a stray tensor for it)
    outs = tuple(o if t is not None and m else None for o, t, m in zip(outs, call.out_types, call.args[10]))
    # split input channels: every rank computes the whole bias gradient; the custom lowering keeps it
    # on one coordinate so that it is an exact partial sum (a group split gives each rank its own groups')
    custom = frozenset({"c"}) if groups == 1 and outs[2] is not None else frozenset()
    return Annotation((go_spec, x_spec, wspec), outs, reduced=frozenset(reduced), fixed=frozenset(fixed),
                      sizes=sizes, custom=custom)


def _conv_backward_flops(call: OpCall, ann: Annotation, sizes: Mapping[str, int]) -> int:
    go, w = call.shape_of(0), call.shape_of(2)
    transposed = bool(call.args[7])
    fwd = 2 * go[0] * go[1] * prod(go[2:]) * prod(w[1:]) if not transposed else \
        2 * call.shape_of(1)[0] * prod(call.shape_of(1)[2:]) * call.shape_of(1)[1] * prod(w[1:])
    return fwd * sum(1 for t, m in zip(call.out_types[:2], call.args[10]) if t is not None and m)


register("aten.convolution.default", OpKind.CONV, conv_rule, flops=_conv_flops,
         size_args=(SizeArg(8, SizeRule.GROUPS, index=0, dim=1),))
register("aten.convolution_backward.default", OpKind.CONV, conv_backward_rule, flops=_conv_backward_flops,
         size_args=(SizeArg(3, SizeRule.OUT_DIM_LIST, index=2), SizeArg(9, SizeRule.GROUPS, index=1, dim=1)),
         lowering=Lowering.CONVOLUTION_BACKWARD)


# -- attention -----------------------------------------------------------------
def _heads(call: OpCall, q_index: int) -> tuple[Dim, Dim]:
    """Head dims of (query, key/value). Equal head counts share the letter ``h``. Grouped-query
    attention (query heads = kv heads x g, query head j reading kv head j // g) is ``(hk g)`` for
    the query and ``hk`` for keys and values: splitting ``hk`` keeps groups whole, splitting ``g``
    gives each rank part of every group with all kv heads."""
    hq, hkv = call.shape_of(q_index)[1], call.shape_of(q_index + 1)[1]
    return (("h",), ("h",)) if hq == hkv else (("hk", "g"), ("hk",))


def _mask_spec(call: OpCall, new: NewLetters, qh: Dim) -> tuple[Dim, ...] | None:
    mask = call.kwargs.get("attn_mask")
    if mask is None and "efficient" in call.op and len(call.args) > 3:
        mask = call.args[3]  # the efficient kernel takes its bias positionally
    if not isinstance(mask, Ref):
        return None
    shape = call._types[mask.id].shape
    full = [("b",), qh, ("s",), ("t",)][4 - len(shape):]
    return tuple(x if n != 1 else (new(1),) for x, n in zip(full, shape))


def sdpa_rule(call: OpCall) -> Annotation:
    """Fused attention (b h s d query, b h t d key, b h t e value) -> (b h s e out, b h s logsumexp).

    Sequence and head-size dims are fixed: softmax needs whole rows, causal masks need offsets.
    """
    new = NewLetters("m")
    qh, kh = _heads(call, 0)
    q = (("b",), qh, ("s",), ("d",))
    k = (("b",), kh, ("t",), ("d",))
    v = (("b",), kh, ("t",), ("e",))
    ins = [q, k, v]
    mask = _mask_spec(call, new, qh)
    if mask is not None:
        ins.append(mask)
    outs = []
    for t in call.out_types:
        if t is None:
            outs.append(None)
        elif t.rank == 4:
            outs.append((("b",), qh, ("s",), ("e",)))
        elif t.rank == 3 and "efficient" in call.op:  # logsumexp rows padded to 32, or none at all
            s = call.shape_of(0)[2]
            outs.append((("b",), qh, (new(-(-s // 32) * 32 if call.arg(4, "compute_log_sumexp") else 0),)))
        elif t.rank == 3:
            outs.append((("b",), qh, ("s",)))
        else:
            outs.append(tuple((new(n),) for n in t.shape))
    return Annotation(tuple(ins), tuple(outs), fixed=frozenset({"s", "t", "d"} | set(new.sizes)),
                      sizes=new.sizes)


def sdpa_backward_rule(call: OpCall) -> Annotation:
    """(grad_out, q, k, v, out, logsumexp, ...) -> (grad_q, grad_k, grad_v); with grouped-query
    attention the key/value gradients sum over each group (``g`` is reduced)."""
    new = NewLetters("m")
    qh, kh = _heads(call, 1)
    q = (("b",), qh, ("s",), ("d",))
    k = (("b",), kh, ("t",), ("d",))
    v = (("b",), kh, ("t",), ("e",))
    o = (("b",), qh, ("s",), ("e",))
    lse = (("b",), qh, ("s",))
    ins = [o, q, k, v, o, lse]
    mask = _mask_spec(call, new, qh)
    if mask is not None:
        ins.append(mask)
    return Annotation(tuple(ins), (q, k, v), reduced=frozenset({"g"}) if len(qh) > 1 else frozenset(),
                      fixed=frozenset({"s", "t", "d"} | set(new.sizes)), sizes=new.sizes)


def _attn_flops(factor: int):
    def flops(call: OpCall, ann: Annotation, sizes: Mapping[str, int]) -> int:
        b, h, s, d = call.shape_of(0 if factor == 4 else 1)
        t = call.shape_of(1 if factor == 4 else 2)[2]
        return factor * b * h * s * t * d
    return flops


A = OpKind.ATTENTION
# input_layout (registry docstring): PyTorch 2.13's CPU flash attention reads an input whose last dimension is not
# stride 1 as if it were, the layer norm and group norm backward any non-contiguous input (wrong values, no error;
# tests/test_opfacts.py lays out every sampled op's inputs otherwise); group norm and nll_loss2d_backward refuse one
register("aten._scaled_dot_product_flash_attention_for_cpu.default", A, sdpa_rule, flops=_attn_flops(4),
         input_layout=InputLayout.INNER)
register("aten._scaled_dot_product_flash_attention.default "
         "aten._scaled_dot_product_efficient_attention.default", A, sdpa_rule, flops=_attn_flops(4))
# Backward: recompute scores + 4 matmuls (dV, dP, dQ, dK) = 5 matmuls of 2*b*h*s*t*d.
register("aten._scaled_dot_product_flash_attention_for_cpu_backward.default", A, sdpa_backward_rule,
         flops=_attn_flops(10), input_layout=InputLayout.INNER)


# -- normalization ---------------------------------------------------------------
N = OpKind.NORM


def layer_norm_rule(call: OpCall) -> Annotation:
    """native_layer_norm(x, normalized_shape, weight?, bias?, eps) -> (y, mean, rstd)."""
    rank, k = call.in_types[0].rank, len(call.args[1])
    lead, norm = letters("l", rank - k), letters("nd", k)
    x = tuple((a,) for a in lead + norm)
    stat = tuple((a,) for a in lead) + tuple((f"one{i}",) for i in range(k))
    ins = [x] + [tuple((a,) for a in norm) for a in call.args[2:4] if isinstance(a, Ref)]
    return Annotation(tuple(ins), (x, stat, stat), fixed=frozenset(norm), sizes={f"one{i}": 1 for i in range(k)})


def layer_norm_backward_rule(call: OpCall) -> Annotation:
    """native_layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight?, bias?, mask)."""
    rank, k = call.in_types[0].rank, len(call.args[2])
    lead, norm = letters("l", rank - k), letters("nd", k)
    x = tuple((a,) for a in lead + norm)
    stat = tuple((a,) for a in lead) + tuple((f"one{i}",) for i in range(k))
    w = tuple((a,) for a in norm)
    ins = [x, x, stat, stat] + [w for a in call.args[5:7] if isinstance(a, Ref)]
    outs = tuple(s if t is not None else None for s, t in zip((x, w, w), call.out_types))
    return Annotation(tuple(ins), outs, reduced=frozenset(lead), fixed=frozenset(norm),
                      sizes={f"one{i}": 1 for i in range(k)})


# Batch norm in training mode with its batch (and spatial) dims split has SyncBatchNorm semantics: the
# custom lowering (lower/spmd_bn.py) all-reduces per-channel statistics, so every rank normalises with
# the global mean and variance and holds the global save_mean/save_invstd and running statistics.
_BN_EVAL = "aten._native_batch_norm_legit_no_training.default"


def bn_training(call: OpCall) -> bool:
    """Whether a batch norm forward normalises with batch statistics (else with running ones)."""
    if call.op == _BN_EVAL:
        return False
    return bool(call.args[3 if call.op.endswith(".no_stats") else 5])


def _bn_mutates(call: OpCall) -> bool:
    """Variants that update running statistics in place (functionalization removes them from captured
    graphs); they keep the batch unsplit."""
    if call.op == "aten._native_batch_norm_legit.default":
        return True
    return call.op == "aten.native_batch_norm.default" and bool(call.args[5]) and isinstance(call.args[3], Ref)


def batch_norm_rule(call: OpCall) -> Annotation:
    """Batch norm forward variants: input [n c *]; per-channel tensors [c]; statistics over n and *.

    n and the spatial dims are summed away for the statistics outputs (``+``); in training mode their
    split is custom (all-reduced statistics, replicated statistics outputs, ``sharding.plan``)."""
    rank = call.in_types[0].rank
    sp = letters("h", rank - 2)
    x = (("n",), ("c",)) + tuple((a,) for a in sp)
    ins = [x] + [(("c",),)] * (len(call.in_types) - 1)
    outs = tuple(None if t is None else x if t.rank == rank else (("c",),) if t.shape == (call.in_types[0].shape[1],)
                 else tuple((f"z{i}",) for i in range(t.rank)) for t in call.out_types)
    sizes = {f"z{i}": n for t in call.out_types if t is not None and t.rank != rank
             and t.shape != (call.in_types[0].shape[1],) for i, n in enumerate(t.shape)}
    batch = frozenset({"n", *sp})
    if _bn_mutates(call):
        return Annotation(tuple(ins), outs, fixed=batch | set(sizes), sizes=sizes)
    return Annotation(tuple(ins), outs, reduced=batch, fixed=frozenset(sizes), sizes=sizes,
                      custom=batch if bn_training(call) else frozenset())


def batch_norm_backward_rule(call: OpCall) -> Annotation:
    """native_batch_norm_backward(dy, x, weight?, running_mean?, running_var?, save_mean?, save_invstd?,
    train, eps, mask). Weight and bias gradients sum over n and *; in training the input gradient
    needs their global values (custom: one all-reduce, the weight and bias gradients come out
    replicated)."""
    rank = call.in_types[0].rank
    sp = letters("h", rank - 2)
    x = (("n",), ("c",)) + tuple((a,) for a in sp)
    chan = call.in_types[0].shape[1]
    new = NewLetters("z")
    ins = [x, x] + [(("c",),) if t.shape == (chan,) else tuple((new(n),) for n in t.shape) for t in call.in_types[2:]]
    outs = tuple(s if t is not None else None for s, t in zip((x, (("c",),), (("c",),)), call.out_types))
    batch = frozenset({"n", *sp})
    return Annotation(tuple(ins), outs, reduced=batch, fixed=frozenset(new.sizes), sizes=new.sizes,
                      custom=batch if call.args[7] else frozenset())


def group_norm_rule(call: OpCall) -> Annotation:
    """native_group_norm(x, weight?, bias?, N, C, HxW, group, eps) -> (y, mean [N,G], rstd [N,G])."""
    rank = call.in_types[0].rank
    sp = letters("h", rank - 2)
    x = (("n",), ("c",)) + tuple((a,) for a in sp)
    ins = [x] + [(("c",),)] * (len(call.in_types) - 1)
    stat = (("n",), ("g",))
    return Annotation(tuple(ins), (x, stat, stat), fixed=frozenset({"c", "g", *sp}), sizes={"g": call.args[6]})


def group_norm_backward_rule(call: OpCall) -> Annotation:
    """native_group_norm_backward(dy, x, mean, rstd, weight?, N, C, HxW, group, mask)."""
    rank = call.in_types[0].rank
    sp = letters("h", rank - 2)
    x = (("n",), ("c",)) + tuple((a,) for a in sp)
    stat = (("n",), ("g",))
    ins = [x, x, stat, stat] + ([(("c",),)] if len(call.in_types) > 4 else [])
    outs = tuple(s if t is not None else None for s, t in zip((x, (("c",),), (("c",),)), call.out_types))
    return Annotation(tuple(ins), outs, reduced=frozenset({"n"}), fixed=frozenset({"c", "g", *sp}))


def weight_norm_rule(call: OpCall) -> Annotation:
    """``_weight_norm_interface(v, g, dim)`` -> (w, norms) and its backward ``(grad_w, v, g, norms, dim)`` ->
    (grad_v, grad_g): ``w = v * g / norm(v)``, the norm over every dim but ``dim``; ``dim`` passes through (a split
    of a Linear's output rows), the others are fixed (a norm over a split would need their sum)."""
    backward = call.op.startswith("aten._weight_norm_interface_backward")
    v = call.in_types[1 if backward else 0]
    d = norm_dim(call.arg(4 if backward else 2, "dim", 0), v.rank)
    new = NewLetters("f")
    vs = tuple(("k",) if i == d else (new(n),) for i, n in enumerate(v.shape))
    gs = tuple(("k",) if i == d else (new(1),) for i in range(v.rank))
    ins = (vs, vs, gs, gs) if backward else (vs, gs)
    return Annotation(ins, (vs, gs), fixed=frozenset(new.sizes), sizes=new.sizes)


# the backward kernel reads a transposed gradient as if it were contiguous (tests/test_opfacts.py)
register("aten._weight_norm_interface.default aten._weight_norm_interface_backward.default", N, weight_norm_rule,
         flops=6, input_layout=InputLayout.CONTIGUOUS)
def layer_norm_cpu_dtypes(ins: list[DType], outs: list[DType | None]) -> list[DType | None]:
    """The CPU ``native_layer_norm`` of a bf16/fp16 input with float32 weight or bias (a LayerNorm under CPU
    autocast) keeps its mean and rstd in float32 ("mixed type"); the fake kernel gives them the input's dtype."""
    if ins[0] in (DType.bfloat16, DType.float16) and DType.float32 in ins[1:]:
        return [outs[0], DType.float32, DType.float32]
    return outs


register("aten.native_layer_norm.default", N, layer_norm_rule, flops=8, cpu_dtypes=layer_norm_cpu_dtypes)
register("aten.native_layer_norm_backward.default", N, layer_norm_backward_rule, flops=10,
         input_layout=InputLayout.CONTIGUOUS)
# batch norm in training over a split batch: one all-reduce of [2, C] statistics (lower/spmd_bn.py)
register("aten._native_batch_norm_legit_functional.default aten.native_batch_norm.default", N, batch_norm_rule,
         flops=8, lowering=Lowering.BATCH_NORM, reduces=1, per_channel=True, outputs=OutputRule.REPLICATED)
register("aten._native_batch_norm_legit.no_stats", N, batch_norm_rule, flops=8, lowering=Lowering.BATCH_NORM_NO_STATS,
         reduces=1, per_channel=True, outputs=OutputRule.REPLICATED)
register("aten._native_batch_norm_legit_no_training.default", N, batch_norm_rule, flops=8,
         outputs=OutputRule.REPLICATED)
register("aten._native_batch_norm_legit.default", N, batch_norm_rule, flops=8)
register("aten.native_batch_norm_backward.default", N, batch_norm_backward_rule, flops=10,
         lowering=Lowering.BATCH_NORM_BACKWARD, reduces=1, per_channel=True, outputs=OutputRule.REPLICATED_IF_CUSTOM)
register("aten.native_group_norm.default", N, group_norm_rule, flops=8, size_args=(SizeArg(3, SizeRule.IN_DIM),),
         input_layout=InputLayout.CONTIGUOUS)     # its kernel refuses a non-contiguous input
register("aten.native_group_norm_backward.default", N, group_norm_backward_rule, flops=10,
         size_args=(SizeArg(5, SizeRule.IN_DIM, index=1),), input_layout=InputLayout.CONTIGUOUS)


# -- embeddings and losses ---------------------------------------------------------
I = OpKind.INDEX
def embedding_rule(call: OpCall) -> Annotation:
    """embedding(weight [v d], indices [*]) -> [* d]. Splitting the vocabulary ``v`` gives a partial
    sum (each rank looks up the rows it holds, zeros elsewhere): a custom lowering masks indices."""
    ann = parse("v+ d, * -> * d", call.ranks)
    return Annotation(ann.inputs, ann.outputs, reduced=ann.reduced, custom=frozenset({"v"}))


def embedding_backward_rule(call: OpCall) -> Annotation:
    """embedding_dense_backward(grad [*, d], indices [*], num_weights, padding_idx, scale); a split
    vocabulary keeps the gradient rows of each rank's slice (custom lowering); with ``scale_grad_by_freq``
    the counts of each index are global, so the index dims and the vocabulary stay whole."""
    if call.arg(4, "scale_grad_by_freq", False):  # scaled by global index counts: only ``d`` may split
        ann = parse("*^ d, *^ -> v^ d", call.ranks, sizes={"v": call.args[2]})
        return Annotation(ann.inputs, ann.outputs, fixed=ann.fixed, sizes=ann.sizes)
    ann = parse("*+ d, *+ -> v d", call.ranks, sizes={"v": call.args[2]})
    return Annotation(ann.inputs, ann.outputs, reduced=ann.reduced, sizes=ann.sizes, custom=frozenset({"v"}))


register("aten.embedding.default", I, embedding_rule, lowering=Lowering.EMBEDDING, family=Family.EMBEDDING)


register("aten.embedding_dense_backward.default", I, embedding_backward_rule, lowering=Lowering.EMBEDDING_BACKWARD,
         size_args=(SizeArg(2, SizeRule.OUT_DIM),))


def nll_rule(call: OpCall) -> Annotation:
    """nll_loss_forward / nll_loss2d_forward(x [N,C,*], target [N,*], weight?, reduction, ignore_index)."""
    x = call.in_types[0].shape
    rank = len(x)
    if rank == 1:
        xs, ts = (("c",),), ()
    else:
        sp = tuple((a,) for a in letters("h", rank - 2))
        xs, ts = (("n",), ("c",)) + sp, (("n",),) + sp
    ins = [xs, ts] + ([(("c",),)] if len(call.in_types) > 2 else [])
    reduction = call.args[3]
    out = ts if reduction == 0 else ()
    # Batch rows and classes may be split: the losses of split rows or classes are partial sums;
    # classes need the custom lowering (targets outside a rank's classes are ignored there), and a
    # mean over split rows becomes an all-reduced sum divided by the all-reduced total weight.
    return Annotation(tuple(ins), (out, ()), reduced=frozenset({"c", "n"} if rank > 1 else {"c"}),
                      fixed=frozenset(a[0] for a in xs[2:]), custom=frozenset({"c"}))


def nll_backward_rule(call: OpCall) -> Annotation:
    """nll_loss_backward(grad, x, target, weight?, reduction, ignore_index, total_weight) -> grad_x."""
    x = call.in_types[1].shape
    rank = len(x)
    if rank == 1:
        xs, ts = (("c",),), ()
    else:
        sp = tuple((a,) for a in letters("h", rank - 2))
        xs, ts = (("n",), ("c",)) + sp, (("n",),) + sp
    red = call.args[4]
    ins = [ts if red == 0 else (), xs, ts] + ([(("c",),)] if len(call.in_types) > 4 else []) + [()]
    return Annotation(tuple(ins), (xs,), fixed=frozenset(a[0] for a in xs[2:]), custom=frozenset({"c"}))


L = OpKind.LOSS
# a mean over split rows or classes: all-reduced target sum and total weight
register("aten.nll_loss_forward.default aten.nll_loss2d_forward.default", L, nll_rule, lowering=Lowering.NLL_LOSS,
         reduces=2, outputs=OutputRule.REPLICATED_IF_MEAN)
register("aten.nll_loss_backward.default", L, nll_backward_rule, lowering=Lowering.NLL_LOSS_BACKWARD)
register("aten.nll_loss2d_backward.default", L, nll_backward_rule, lowering=Lowering.NLL_LOSS_BACKWARD,
         input_layout=InputLayout.CONTIGUOUS)


def reduced_loss_rule(reduction_index: int):
    """An element-wise loss with a ``reduction`` argument at ``reduction_index`` (mse_loss(x, target,
    reduction): 2; binary_cross_entropy(p, target, weight, reduction): 3; the with-logits form, whose weight and
    pos_weight broadcast like any operand: 4): element-wise for none; a split dim gives a partial sum (sum) or a
    partial average (mean: the local means of equal shards average to the global mean)."""
    def rule(call: OpCall) -> Annotation:
        ann = elementwise(call)
        reduction = call.arg(reduction_index, "reduction", 1)
        if reduction == 0:
            return ann
        reduced = frozenset(x for d in ann.outputs[0] for x in d) if ann.outputs[0] else frozenset()
        return Annotation(ann.inputs, ((),), reduced=reduced, sizes=ann.sizes,
                          reduce_kind="avg" if reduction == 1 else "sum")
    return rule


mse_rule = reduced_loss_rule(2)


#: the position of the reduction argument of a mean-reducible loss's backward (``Lowering.MSE_LOSS_BACKWARD``)
LOSS_BACKWARD_REDUCTION = {"aten.binary_cross_entropy_backward.default": 4}


def mse_backward_rule(call: OpCall) -> Annotation:
    """mse_loss_backward(grad, x, target, reduction) -> grad_x like x. With ``reduction=mean`` the
    gradient is scaled by 1 / (global element count): a split dim needs the custom lowering."""
    ann = _like_input(call, 1)
    if call.arg(LOSS_BACKWARD_REDUCTION.get(call.op, 3), "reduction", 1) != 1:
        return ann
    return Annotation(ann.inputs, ann.outputs, sizes=ann.sizes, custom=frozenset(ann.letters()))


def log_sigmoid_rule(call: OpCall) -> Annotation:
    """log_sigmoid_forward(x) -> (out, buffer): element-wise; the buffer is x's shape on CPU and empty on CUDA
    (then never split)."""
    ann = elementwise(call)
    buf = call.out_types[1]
    if buf is None or buf.shape == call.in_types[0].shape:
        return ann
    new = NewLetters("z")
    spec = tuple((new(n),) for n in buf.shape)
    return Annotation(ann.inputs, (ann.outputs[0], spec), fixed=frozenset(x for d in spec for x in d),
                      sizes={**ann.sizes, **new.sizes})


def glu_rule(call: OpCall) -> Annotation:
    """glu(x, dim) halves ``dim`` (fixed: each output row pairs the two halves); glu_backward(grad, x, dim)
    gives x's shape. Every other dim passes through."""
    backward = call.op.startswith("aten.glu_backward")
    x = call.in_types[1 if backward else 0]
    d = call.arg(2 if backward else 1, "dim", -1) % x.rank
    names = letters("e", x.rank)
    new = NewLetters("h")
    half = tuple((new(x.shape[i] // 2),) if i == d else (names[i],) for i in range(x.rank))
    whole = tuple((n,) for n in names)
    fixed = frozenset({names[d], half[d][0]})
    ins, out = ((half, whole), whole) if backward else ((whole,), half)
    return Annotation(ins, (out,), fixed=fixed, sizes=new.sizes)


def cdist_rule(call: OpCall) -> Annotation:
    """_cdist_forward(x1 [*, P, M], x2 [*, R, M], p, mode) -> [*, P, R]: rows of either side split, the
    feature dim M fixed (a p-norm over it). _cdist_backward(grad, x1, x2, p, dist) -> grad of x1: a sum over
    x2's rows R (split: a partial sum)."""
    if call.op.startswith("aten._cdist_backward"):
        return parse("* p r, * p m^, * r+ m^, * p r -> * p m", call.ranks)
    return parse("* p m^, * r m^ -> * p r", call.ranks)


register("aten.binary_cross_entropy_with_logits.default", L, reduced_loss_rule(4), flops=6)
register("aten.binary_cross_entropy.default", L, reduced_loss_rule(3), flops=4)
register("aten.binary_cross_entropy_backward.default", L, mse_backward_rule, flops=4,
         lowering=Lowering.MSE_LOSS_BACKWARD)
register("aten.log_sigmoid_forward.default", OpKind.ELEMENTWISE, log_sigmoid_rule, flops=3)
register("aten.log_sigmoid_backward.default", OpKind.ELEMENTWISE, lambda call: _like_input(call, 1), flops=3)
register("aten.glu.default aten.glu_backward.default", OpKind.ELEMENTWISE, glu_rule, flops=3)
# (not MATMUL: no Megatron split of its own; ~3 FLOPs per (row, row, feature): difference, power, sum)
register("aten._cdist_forward.default aten._cdist_backward.default", OpKind.INDEX, cdist_rule,
         flops=lambda call, ann, sizes: 3 * prod(sizes.values()))
# smooth L1 and Huber losses: (x, target, reduction, beta / delta), elementwise terms reduced like mse's
register("aten.mse_loss.default aten.smooth_l1_loss.default aten.huber_loss.default aten.soft_margin_loss.default",
         L, mse_rule, flops=3)
register("aten.mse_loss_backward.default aten.smooth_l1_loss_backward.default aten.huber_loss_backward.default "
         "aten.soft_margin_loss_backward.default", L,
         mse_backward_rule, flops=3, lowering=Lowering.MSE_LOSS_BACKWARD)


def _like_input(call: OpCall, index: int) -> Annotation:
    """Output shaped like tensor input ``index``; other inputs broadcast to it or are scalars."""
    ref = call.in_types[index]
    names = letters("e", ref.rank)
    new = NewLetters("b")
    ins = []
    for t in call.in_types:
        ins.append(tuple((names[ref.rank - t.rank + i],) if n == ref.shape[ref.rank - t.rank + i] else (new(n),)
                         for i, n in enumerate(t.shape)) if t.rank <= ref.rank else tuple((new(n),) for n in t.shape))
    return Annotation(tuple(ins), (tuple((x,) for x in names),), sizes=new.sizes)


# -- pooling ---------------------------------------------------------------------------
P = OpKind.REDUCTION


def _pool_out(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    num = size + 2 * p - d * (k - 1) - 1
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_spatial(op: str) -> int:
    """Spatial dims pooled by ``op``, from its name (``max_pool2d...`` -> 2). Not from the kernel
    argument: aten accepts one value for all spatial dims."""
    return int(op.split("pool")[1][0])


def pool_rule(call: OpCall) -> Annotation:
    """max_pool*_with_indices / avg_pool*(x [n c *sp], kernel, stride, padding[, dilation], ceil_mode...)."""
    x = call.in_types[0].shape
    n_sp = _pool_spatial(call.op)
    lead = letters("l", len(x) - n_sp)
    kernel = _expand(call.args[1], n_sp)
    stride = _expand(call.arg(2, "stride") or kernel, n_sp)
    padding = _expand(call.arg(3, "padding", 0), n_sp)
    is_max = "max_pool" in call.op
    dilation = _expand(call.arg(4, "dilation", 1), n_sp) if is_max else [1] * n_sp
    ceil_mode = bool(call.arg(5 if is_max else 4, "ceil_mode", False))
    sp_in, sp_out = letters("h", n_sp), letters("ho", n_sp)
    sizes = {o: _pool_out(x[len(lead) + i], kernel[i], stride[i], padding[i], dilation[i], ceil_mode)
             for i, o in enumerate(sp_out)}
    xs = tuple((a,) for a in lead + sp_in)
    out = tuple((a,) for a in lead + sp_out)
    return Annotation((xs,), tuple(out for _ in call.out_types), fixed=frozenset(sp_in + sp_out), sizes=sizes)


def adaptive_pool_rule(call: OpCall) -> Annotation:
    x = call.in_types[0].shape
    size = list(call.args[1])
    lead = letters("l", len(x) - len(size))
    sp_in, sp_out = letters("h", len(size)), letters("ho", len(size))
    xs = tuple((a,) for a in lead + sp_in)
    out = tuple((a,) for a in lead + sp_out)
    return Annotation((xs,), tuple(out for _ in call.out_types), fixed=frozenset(sp_in + sp_out),
                      sizes=dict(zip(sp_out, size)))


def pool_backward_rule(call: OpCall) -> Annotation:
    """Pooling backward (grad_out, x, ...[, indices]) -> grad_x shaped like x."""
    x = call.in_types[1].shape
    n_sp = _pool_spatial(call.op)
    lead = letters("l", len(x) - n_sp)
    sp_in, sp_out = letters("h", n_sp), letters("ho", n_sp)
    xs = tuple((a,) for a in lead + sp_in)
    gs = tuple((a,) for a in lead + sp_out)
    ins = [gs, xs] + [gs] * (len(call.in_types) - 2)
    return Annotation(tuple(ins), (xs,), fixed=frozenset(sp_in + sp_out))


register("aten.max_pool2d_with_indices.default aten.max_pool3d_with_indices.default "
         "aten.avg_pool2d.default aten.avg_pool3d.default aten.max_pool1d.default", P, pool_rule)
register("aten._adaptive_avg_pool2d.default aten._adaptive_avg_pool3d.default "
         "aten.adaptive_max_pool2d.default", P, adaptive_pool_rule)
register("aten.max_pool2d_with_indices_backward.default aten.max_pool3d_with_indices_backward.default "
         "aten.avg_pool2d_backward.default aten.avg_pool3d_backward.default "
         "aten._adaptive_avg_pool2d_backward.default aten._adaptive_avg_pool3d_backward.default "
         "aten.adaptive_max_pool2d_backward.default", P, pool_backward_rule)


def search_rule(sequence_first: bool):
    """bucketize(x [*], boundaries [b]) -> [*] and searchsorted(sorted [b] or [* b], x [*] or [* k]) -> x's shape:
    each element of ``x`` is looked up on its own (its dims split), the sorted values whole."""
    def rule(call: OpCall) -> Annotation:
        if not sequence_first:
            spec = "*, b^ -> *"
        else:
            spec = "b^, * -> *" if call.in_types[0].rank == 1 else "* b^, * k -> * k"
        ann = parse(spec, call.ranks)
        return Annotation(ann.inputs, ann.outputs, fixed=ann.fixed)
    return rule


register("aten.bucketize.Tensor", OpKind.INDEX, search_rule(False))
register("aten.searchsorted.Tensor", OpKind.INDEX, search_rule(True))
