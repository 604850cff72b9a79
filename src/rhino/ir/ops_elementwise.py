"""Elementwise ops and reductions (registered on import)."""
from __future__ import annotations

from .annotation import Annotation
from .registry import Linear, Lowering, OpCall, OpKind, Values, register
from .rules import NewLetters, elementwise, fixed_from_types, letters, norm_dim, reduce_dims

E = OpKind.ELEMENTWISE

# Unary and binary arithmetic with broadcasting. FLOPs: one per output element
# unless given (transcendentals count as one too: a roofline op is bandwidth bound).
register("""
aten.add.Scalar aten.sub.Scalar aten.rsub.Scalar aten.rsub.Tensor
aten.div.Tensor_mode aten.div.Scalar_mode
aten.pow.Tensor_Scalar aten.pow.Tensor_Tensor aten.pow.Scalar aten.abs.default
aten.exp.default aten.exp2.default aten.expm1.default aten.log.default aten.log1p.default aten.log2.default
aten.sqrt.default aten.rsqrt.default aten.reciprocal.default aten.sin.default aten.cos.default
aten.tanh.default aten.sigmoid.default aten.erf.default aten.sign.default aten.sgn.default aten.floor.default
aten.ceil.default aten.round.default aten.trunc.default aten.relu.default aten.gelu.default
aten.silu.default aten.mish.default aten.elu.default aten.leaky_relu.default aten.hardtanh.default
aten.hardswish.default aten.hardsigmoid.default aten.softplus.default aten.clamp.default aten.clamp.Tensor
aten.clamp_min.default aten.clamp_max.default aten.maximum.default aten.minimum.default
aten.clamp_min.Tensor aten.clamp_max.Tensor aten.xlogy.Tensor aten.xlogy.Scalar_Other aten.xlogy.Scalar_Self
aten.special_xlog1py.default aten.celu.default aten.softshrink.default aten.softshrink_backward.default
aten.hardshrink.default aten.hardshrink_backward.default aten.threshold.default aten.logit.default
aten.logit_backward.default aten.sinc.default aten.atan2.default aten.hypot.default aten.logaddexp.default
aten.logaddexp2.default aten.copysign.Tensor aten.fmax.default aten.fmin.default aten.lgamma.default
aten.digamma.default aten.polygamma.default aten.special_entr.default aten.erfinv.default aten.frac.default
aten.atan.default aten.asin.default aten.acos.default aten.asinh.default aten.atanh.default aten.sinh.default
aten.cosh.default aten.tan.default aten.rrelu_with_noise_backward.default
aten.acosh.default aten.deg2rad.default aten.rad2deg.default aten.erfc.default aten.log10.default aten.angle.default
aten.i0.default aten.special_i0e.default aten.special_i1.default aten.special_i1e.default
aten.special_log_ndtr.default aten.special_ndtri.default aten.special_bessel_j0.default aten.special_bessel_j1.default
aten.mvlgamma.default aten.round.decimals aten.signbit.default aten.isposinf.default aten.isneginf.default
aten.remainder.Scalar aten.remainder.Tensor aten.fmod.Scalar aten.fmod.Tensor aten.floor_divide.default
aten.eq.Scalar aten.eq.Tensor aten.ne.Scalar aten.ne.Tensor aten.lt.Scalar aten.lt.Tensor
aten.le.Scalar aten.le.Tensor aten.gt.Scalar aten.gt.Tensor aten.ge.Scalar aten.ge.Tensor
aten.logical_not.default aten.logical_and.default aten.logical_or.default aten.logical_xor.default
aten.bitwise_not.default aten.bitwise_and.Tensor aten.bitwise_or.Tensor aten.bitwise_xor.Tensor
aten.bitwise_and.Scalar aten.bitwise_or.Scalar
aten.isnan.default aten.isinf.default aten.nan_to_num.default aten.where.self aten.where.ScalarSelf
aten.where.ScalarOther aten.masked_fill.Scalar aten.masked_fill.Tensor aten.lerp.Scalar aten.lerp.Tensor
aten.addcmul.default aten.addcdiv.default
aten.threshold_backward.default aten.gelu_backward.default aten.silu_backward.default
aten.sigmoid_backward.default aten.tanh_backward.default aten.elu_backward.default
aten.leaky_relu_backward.default aten.hardtanh_backward.default aten.hardswish_backward.default
aten.hardsigmoid_backward.default aten.softplus_backward.default aten.mish_backward.default
aten.native_dropout_backward.default aten.complex.default aten.polar.default
aten.ones_like.default aten.zeros_like.default aten.full_like.default aten.zero.default
aten.fill.Scalar aten.fill.Tensor aten.copy.default aten.lift_fresh_copy.default aten.detach.default
""".split(), E, elementwise)
# linear ones: a Partial(sum) input passes through (sharding.rules.partial_inputs)
register("aten.add.Tensor aten.sub.Tensor", E, elementwise, linear=Linear.SUM)
register("aten.neg.default aten.mul.Scalar aten.div.Scalar aten.clone.default aten.alias.default", E, elementwise,
         linear=Linear.ALL)
register("aten.mul.Tensor", E, elementwise, linear=Linear.ONE)
register("aten._conj.default aten.conj_physical.default", E, elementwise, linear=Linear.ALL)  # complex conjugate
register("aten.div.Tensor", E, elementwise, linear=Linear.FIRST)
register("aten._to_copy.default", E, elementwise, linear=Linear.CAST)
# values not computed from the inputs
register("aten.native_dropout.default aten.bernoulli.p aten.bernoulli.default", E, elementwise, values=Values.RANDOM)
# the functional forms of the in-place draws (``x.normal_(m, s)``, ``torch.normal(mean_t, s)``, ``torch.poisson``)
register("aten.normal.Tensor_float aten.normal.float_Tensor aten.normal.Tensor_Tensor aten.poisson.default "
         "aten.binomial.default", E, elementwise, values=Values.RANDOM)
register("aten.rand_like.default aten.randn_like.default aten.randint_like.default aten.randint_like.low_dtype "
         "aten.uniform.default aten.normal_functional.default aten.exponential.default aten.geometric.default "
         "aten.cauchy.default aten.log_normal.default aten.random.default aten.random.to", E,
         elementwise, values=Values.NOISE)
register("aten.empty_like.default", E, elementwise, values=Values.UNINITIALIZED)


def _dims_keep(dims_index: int, keep_index: int, kind: str = "sum", splittable: bool = True,
               n_outputs: int = 1, empty_is_all: bool = True, default_dim: int | None = None):
    """``default_dim``: the dim when the call gives none (``kthvalue``'s -1; None: every dim)."""
    def rule(call: OpCall) -> Annotation:
        dims = call.arg(dims_index, "dim", default_dim)
        if isinstance(dims, int):
            dims = [dims]
        return reduce_dims(call, dims, bool(call.arg(keep_index, "keepdim", False)), kind, splittable, n_outputs,
                           empty_is_all)
    return rule


def _all(kind: str = "sum", splittable: bool = True):
    return lambda call: reduce_dims(call, None, False, kind, splittable)


R = OpKind.REDUCTION
register("aten.sum.default", R, _all(), linear=Linear.ALL)
register("aten.sum.dim_IntList", R, _dims_keep(1, 2), linear=Linear.ALL)
register("aten.mean.default", R, _all("avg"), linear=Linear.ALL)
register("aten.mean.dim", R, _dims_keep(1, 2, "avg"), linear=Linear.ALL)
register("aten.amax.default", R, _dims_keep(1, 2, "max"))
register("aten.amin.default", R, _dims_keep(1, 2, "min"))
register("aten.max.default", R, _all("max"))
register("aten.min.default", R, _all("min"))
register("aten.any.default aten.all.default aten.prod.default aten.norm.Scalar", R, _all(splittable=False))
register("aten.trace.default", R, fixed_from_types)   # the diagonal's sum: both dims fixed
register("aten.any.dim aten.all.dim aten.argmax.default aten.argmin.default aten.logsumexp.default",
         R, _dims_keep(1, 2, splittable=False))
register("aten.any.dims", R, _dims_keep(1, 2, splittable=False, empty_is_all=False))  # dim=[] reduces nothing
register("aten.max.dim aten.min.dim", R, _dims_keep(1, 2, splittable=False, n_outputs=2))
register("aten.var.correction aten.std.correction", R, _dims_keep(1, 3, splittable=False))
register("aten.var_mean.correction", R, _dims_keep(1, 3, splittable=False, n_outputs=2))
register("aten.linalg_vector_norm.default aten.norm.ScalarOpt_dim", R, _dims_keep(2, 3, splittable=False))
register("aten.prod.dim_int", R, _dims_keep(1, 2, splittable=False))
register("aten.median.dim", R, _dims_keep(1, 2, splittable=False, n_outputs=2))
register("aten.kthvalue.default", R, _dims_keep(2, 3, splittable=False, n_outputs=2, default_dim=-1))
# F.rrelu: its functional form returns the noise it drew (training) beside the result
register("aten.rrelu_with_noise_functional.default", E, elementwise, values=Values.RANDOM)


def _along_dim(dim_index: int, default: int | None = None):
    """Ops that scan or normalise along one dim: that dim is fixed, the rest pass through."""
    def rule(call: OpCall) -> Annotation:
        ann = elementwise(call)
        rank = len(ann.outputs[0]) if ann.outputs and ann.outputs[0] is not None else call.in_types[0].rank
        d = norm_dim(call.arg(dim_index, "dim", default), rank)
        return Annotation(ann.inputs, ann.outputs, fixed=frozenset({f"e{d}"}), sizes=ann.sizes)
    return rule


def _log_softmax_rule(dim_index: int):
    """log-softmax (and its backward) along a dim that may be split: the custom lowering all-reduces
    the row max and the sum of exponentials (a vocabulary-parallel cross-entropy)."""
    def rule(call: OpCall) -> Annotation:
        ann = _along_dim(dim_index)(call)
        return Annotation(ann.inputs, ann.outputs, sizes=ann.sizes, custom=ann.fixed)
    return rule


# _safe_softmax: softmax whose fully masked rows give 0 (scaled_dot_product_attention's math path)
register("aten._softmax.default aten._safe_softmax.default aten.cumsum.default aten.cumprod.default "
         "aten.logcumsumexp.default", OpKind.NORM, _along_dim(1), flops=5)
# over a split class dim: all-reduced row max and sum of exp (forward), row sum of the gradient (backward)
register("aten._log_softmax.default", OpKind.NORM, _log_softmax_rule(1), flops=5, lowering=Lowering.LOG_SOFTMAX,
         reduces=2)
register("aten._softmax_backward_data.default", OpKind.NORM, _along_dim(2), flops=5)
register("aten._log_softmax_backward_data.default", OpKind.NORM, _log_softmax_rule(2), flops=5,
         lowering=Lowering.LOG_SOFTMAX_BACKWARD, reduces=1)
register("aten.sort.default aten.sort.stable", OpKind.INDEX, _along_dim(1, -1))
register("aten.cummax.default aten.cummin.default", OpKind.INDEX, _along_dim(1))


def _fft_rule(call: OpCall) -> Annotation:
    """``_fft_r2c / _fft_c2r / _fft_c2c(x, dim, ...)``: the transformed dims are fixed (a dim whose size the
    transform changes, the one-sided half spectrum, is a new fixed letter), every other dim passes through
    (a batch of images or channels is transformed independently)."""
    x = call.in_types[0]
    dims = {norm_dim(d, x.rank) for d in call.arg(1, "dim")}
    out = call.out_types[0].shape
    names = letters("e", x.rank)
    new = NewLetters("f")
    outs = tuple((names[i],) if out[i] == x.shape[i] else (new(out[i]),) for i in range(x.rank))
    fixed = frozenset({names[d] for d in dims} | {o[0] for o in outs if o[0] not in names})
    return Annotation((tuple((n,) for n in names),), (outs,), fixed=fixed, sizes=new.sizes)


register("aten._fft_r2c.default aten._fft_c2r.default aten._fft_c2c.default", OpKind.ELEMENTWISE, _fft_rule)


# nn.PReLU: the weight is viewed to broadcast over the channel dim before the kernel; the backward returns
# both gradients at the broadcast shape (the weight's is summed down after it)
register("aten._prelu_kernel.default", E, elementwise, flops=2)
register("aten._prelu_kernel_backward.default", E, elementwise, flops=4)
