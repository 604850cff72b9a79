"""Sample calls of every registered op, for the exhaustive rule check (tests/test_rule_exhaustive.py).

Shapes use dims of 2, 4 and 8 so that splits over 2 and 2 x 2 ranks (and strided ``x/2`` splits)
are possible; floating point tensors are float64; index tensors hold valid indices (unique where the
op's result would otherwise depend on the write order).
"""
from __future__ import annotations

import torch

F = torch.float64
aten = torch.ops.aten

#: Ops with no CPU kernel: the exhaustive check cannot run them here. Their annotation is
#: ``sdpa_rule``, the same as the CPU kernel ``_scaled_dot_product_flash_attention_for_cpu``, which is checked.
_CUDA_ONLY = "CUDA-only kernel (rule: sdpa_rule, checked on the CPU variant)"
NO_CPU_KERNEL = {
    "aten._scaled_dot_product_flash_attention.default": _CUDA_ONLY,
    "aten._scaled_dot_product_efficient_attention.default": _CUDA_ONLY,
}

UNARY = """neg abs exp exp2 expm1 sin cos tanh sigmoid erf sign sgn floor ceil round trunc relu gelu silu mish elu
leaky_relu hardtanh hardswish hardsigmoid softplus clone _to_copy lift_fresh_copy alias detach isnan isinf
nan_to_num ones_like zeros_like empty_like rand_like randn_like celu softshrink hardshrink sinc lgamma frac atan
asinh sinh cosh tan deg2rad rad2deg erfc i0 special_i0e special_i1 special_i1e special_log_ndtr angle
special_bessel_j0 special_bessel_j1 signbit isposinf isneginf""".split()
#: defined on (0, 1) (inverse trigonometric and hyperbolic functions, logit, erfinv)
UNIT = "logit asin acos atanh erfinv special_ndtri".split()
POSITIVE = "log log1p log2 log10 sqrt rsqrt reciprocal".split()
BINARY = """add.Tensor sub.Tensor rsub.Tensor mul.Tensor div.Tensor pow.Tensor_Tensor maximum.default minimum.default
remainder.Tensor fmod.Tensor floor_divide.default eq.Tensor ne.Tensor lt.Tensor le.Tensor gt.Tensor
ge.Tensor copy.default atan2.default hypot.default logaddexp.default logaddexp2.default copysign.Tensor
fmax.default fmin.default complex.default polar.default""".split()
SCALAR = """add.Scalar sub.Scalar rsub.Scalar mul.Scalar div.Scalar pow.Tensor_Scalar remainder.Scalar fmod.Scalar
eq.Scalar ne.Scalar lt.Scalar le.Scalar gt.Scalar ge.Scalar clamp_min.default clamp_max.default
full_like.default fill.Scalar""".split()
BACKWARD = """gelu_backward silu_backward hardswish_backward hardsigmoid_backward mish_backward""".split()


def r(*shape):
    return torch.randn(shape, dtype=F)


def pos(*shape):
    return torch.rand(*shape, dtype=F) + 0.5


def ints(hi, *shape):
    return torch.randint(0, hi, shape)


def mask(*shape):
    return torch.rand(*shape) > 0.5


def perm_index(shape, dim):
    """Indices along ``dim`` that are a permutation in every slice (unique writes)."""
    return torch.argsort(torch.rand(*shape), dim=dim)


def samples() -> list[tuple[str, tuple, dict]]:
    """(op, args, kwargs) for every op the check covers (several calls for some ops)."""
    torch.manual_seed(0)
    out: list[tuple[str, tuple, dict]] = []

    def add(op, *args, **kwargs):
        out.append((op if op.count(".") == 2 else f"aten.{op}", args, kwargs))

    x, y = r(4, 8), r(4, 8)
    for name in UNARY:
        add(f"{name}.default", x)
    for name in POSITIVE:
        add(f"{name}.default", pos(4, 8))
    for name in UNIT:
        add(f"{name}.default", torch.rand(4, 8, dtype=F) * 0.8 + 0.1)
    add("digamma.default", pos(4, 8))
    add("polygamma.default", 1, pos(4, 8))
    add("special_entr.default", pos(4, 8))
    add("threshold.default", x, 0.1, -1.0)
    add("softshrink_backward.default", y, x, 0.5)
    add("hardshrink_backward.default", y, x, 0.5)
    add("logit_backward.default", y, torch.rand(4, 8, dtype=F) * 0.8 + 0.1, None)
    noise = torch.rand(4, 8, dtype=F) * 0.2 + 0.1
    add("rrelu_with_noise_backward.default", y, x, noise, 0.1, 0.3, True, False)
    add("rrelu_with_noise_functional.default", x, noise, 0.1, 0.3, False)   # training draws: not comparable
    for name in BINARY:
        if name.startswith("pow"):
            add(name, pos(4, 8), y)
            add(name, pos(4, 8), r(8))
            continue
        add(name, x, y)
        add(name, x, r(8))  # broadcast
    add("div.Tensor_mode", x, y, rounding_mode="floor")
    for name in SCALAR:
        add(name, pos(4, 8) if name.startswith("pow") else x, 1.5)
    add("div.Scalar_mode", x, 1.5, rounding_mode="floor")
    add("pow.Scalar", 2.0, x)
    add("clamp.default", x, -0.5, 0.5)
    add("clamp.Tensor", x, r(8), r(4, 8) + 1)
    add("fill.Tensor", x, torch.tensor(2.0, dtype=F))
    add("_to_copy.default", x, dtype=torch.float32)
    add("_to_copy.default", x * 4, dtype=torch.int64)  # truncation: not linear
    add("bernoulli.p", x, 0.0)
    add("bernoulli.default", ints(2, 4, 8).to(F))
    add("native_dropout.default", x, 0.0, True)
    # parameters from the inputs, at values that make the draw certain (std 0, rate 0, probability 0 or 1)
    add("normal.Tensor_float", x, 0.0)
    add("normal.float_Tensor", 1.5, x.abs() * 0)
    add("normal.Tensor_Tensor", x, r(8).abs() * 0)
    add("poisson.default", x.abs() * 0)
    add("binomial.default", ints(5, 4, 8).to(F), ints(2, 4, 8).to(F))
    # values independent of the inputs' values (shapes only)
    add("randint_like.default", x, 5)
    add("randint_like.low_dtype", x, 2, 5)
    add("uniform.default", x, -0.5, 0.5)
    add("normal_functional.default", x, 0.0, 0.1)
    add("exponential.default", x, 2.0)
    add("geometric.default", x, 0.5)
    add("cauchy.default", x)
    add("log_normal.default", x)
    add("random.default", x)
    add("random.to", x, 10)
    add("native_dropout_backward.default", x, mask(4, 8), 2.0)
    m, mi = mask(4, 8), ints(8, 4, 8)
    add("logical_not.default", m)
    add("bitwise_not.default", mi)
    for name in ("logical_and.default", "logical_or.default", "logical_xor.default"):
        add(name, m, mask(4, 8))
    for name in ("bitwise_and.Tensor", "bitwise_or.Tensor", "bitwise_xor.Tensor"):
        add(name, mi, ints(8, 4, 8))
    add("bitwise_and.Scalar", mi, 3)
    add("bitwise_or.Scalar", mi, 3)
    add("where.self", m, x, r(8))
    add("where.ScalarSelf", m, 1.0, x)
    add("where.ScalarOther", m, x, 1.0)
    add("masked_fill.Scalar", x, m, 0.5)
    add("masked_fill.Tensor", x, mask(8), torch.tensor(1.5, dtype=F))
    add("lerp.Scalar", x, y, 0.3)
    add("lerp.Tensor", x, y, r(8))
    add("addcmul.default", x, y, r(8), value=0.5)
    add("addcdiv.default", x, y, pos(4, 8), value=0.5)
    for name in BACKWARD:
        add(f"{name}.default", y, x)
    add("threshold_backward.default", y, x, 0.0)
    add("sigmoid_backward.default", y, torch.sigmoid(x))
    add("tanh_backward.default", y, torch.tanh(x))
    add("elu_backward.default", y, 1.0, 1.0, 1.0, False, x)
    add("leaky_relu_backward.default", y, x, 0.01, False)
    add("hardtanh_backward.default", y, x, -1.0, 1.0)
    add("softplus_backward.default", y, x, 1.0, 20.0)
    add("tril.default", r(2, 4, 8), 0)
    add("triu.default", r(2, 4, 8), 1)

    # reductions
    x3, b3 = r(4, 2, 8), mask(4, 2, 8)
    add("sum.default", x3)
    add("sum.dim_IntList", x3, [1, 2])
    add("sum.dim_IntList", x3, [0], True)
    add("sum.dim_IntList", x3, [])
    add("sum.dim_IntList", b3, [2])  # a count: bool in, int64 partial sums out
    add("sum.default", ints(8, 4, 8))
    add("mean.dim", x3, [-1, -3], True, dtype=F)
    add("var.correction", x3, None, correction=0)
    add("mean.default", x3)
    add("mean.dim", x3, [0, 2])
    add("mean.dim", x3, [2], True)
    add("amax.default", x3, [2])
    add("amin.default", x3, [0], True)
    add("max.default", x3)
    add("min.default", x3)
    add("prod.default", pos(2, 4))
    add("any.default", b3)
    add("all.default", b3)
    add("any.dim", b3, 2)
    add("all.dim", b3, 0, True)
    add("any.dims", b3, [0, 2])
    add("argmax.default", x3, 2)
    add("argmin.default", x3, 0, True)
    add("logsumexp.default", x3, [2])
    add("max.dim", x3, 2)
    add("min.dim", x3, 0, True)
    add("var.correction", x3, [2], correction=1)
    add("std.correction", x3, [0, 2], correction=0, keepdim=True)
    add("var_mean.correction", x3, [2], correction=1)
    add("linalg_vector_norm.default", x3, 2, [2])
    add("norm.ScalarOpt_dim", x3, 2, [2])
    add("norm.Scalar", x3, 3)
    add("trace.default", x)
    add("prod.dim_int", x3, 2)
    ls, buf = aten.log_sigmoid_forward.default(x)
    add("log_sigmoid_forward.default", x)
    add("log_sigmoid_backward.default", y, x, buf)
    add("glu.default", r(4, 2, 8), -1)
    add("glu.default", r(4, 4, 8), 1)
    add("glu_backward.default", r(4, 2, 8), r(4, 4, 8), 1)
    # bias + product forms beside addmm: a vector product, an outer product, a sum of batched products
    add("addmv.default", r(4), r(4, 8), r(8))
    add("addmv.default", r(1), r(4, 8), r(8), beta=0.5, alpha=2.0)
    add("addr.default", r(4, 8), r(4), r(8))
    add("addr.default", r(8), r(4), r(8), alpha=0.5)
    add("addbmm.default", r(4, 8), r(2, 4, 8), r(2, 8, 8))
    add("addbmm.default", r(8), r(4, 4, 2), r(4, 2, 8), beta=2.0)
    # nn.PReLU: a weight viewed to broadcast over the channels
    xp, wp = r(4, 2, 8), pos(2, 1) * 0.25
    add("_prelu_kernel.default", xp, wp)
    add("_prelu_kernel_backward.default", r(4, 2, 8), xp, wp)
    add("_prelu_kernel_backward.default", r(4, 8), x, pos(8) * 0.25)
    # pixel and channel shuffles
    add("pixel_shuffle.default", r(2, 16, 2, 4), 2)
    add("pixel_unshuffle.default", r(2, 2, 4, 8), 2)
    add("channel_shuffle.default", r(2, 8, 4), 2)
    add("native_channel_shuffle.default", r(2, 8, 2, 2), 4)
    # batched linear algebra on well-conditioned matrices: the batch dims free, the matrix dims fixed
    sq2, sq4 = r(4, 2, 2), r(2, 4, 4)
    sq2 = sq2 @ sq2.transpose(1, 2) + 2 * torch.eye(2, dtype=F)
    spd = sq4 @ sq4.transpose(1, 2) + 4 * torch.eye(4, dtype=F)
    chol = torch.linalg.cholesky(spd)
    add("linalg_inv_ex.default", sq2)
    add("_linalg_check_errors.default", torch.zeros(4, dtype=torch.int32), "linalg.inv", is_matrix=False)
    add("_linalg_solve_ex.default", spd, r(2, 4, 2))
    add("linalg_cholesky_ex.default", spd)
    add("cholesky_solve.default", r(2, 4, 2), chol)
    add("linalg_solve_triangular.default", chol, r(2, 4, 2), upper=False)
    add("_linalg_det.default", sq2)
    add("_linalg_slogdet.default", spd)
    add("_linalg_eigh.default", spd)
    lu, piv, _ = aten.linalg_lu_factor_ex.default(spd)
    add("linalg_lu_factor_ex.default", spd)
    add("linalg_lu_solve.default", lu, piv, r(2, 4, 2))
    add("linalg_matrix_exp.default", r(4, 2, 2) * 0.3)
    add("linalg_qr.default", r(2, 8, 4))
    a1, a2 = r(2, 4, 8), r(2, 8, 8)
    add("_cdist_forward.default", a1, a2, 2.0, None)
    add("_cdist_forward.default", r(4, 8), r(8, 8), 1.0, None)
    add("_cdist_backward.default", r(2, 4, 8), a1, a2, 2.0, aten._cdist_forward.default(a1, a2, 2.0, None))
    add("prod.dim_int", x3, 0, True)
    add("median.dim", x3, 2)
    add("kthvalue.default", x3, 2, 1, True)
    add("kthvalue.default", x3, 2)   # dim -1 by default
    add("acosh.default", x.abs() + 1)
    add("mvlgamma.default", x.abs() + 2, 2)
    add("round.decimals", x, decimals=2)
    add("cummax.default", x3, 2)
    add("cummin.default", x3, 0)
    add("norm.ScalarOpt_dim", x3, 1, [0, 2], True)
    # element-wise with a tensor bound or a logarithm of the second operand (kl_div, binary entropies)
    add("clamp_min.Tensor", x, r(8))
    add("clamp_max.Tensor", x, r(4, 8))
    add("xlogy.Tensor", x, pos(4, 8))
    add("xlogy.Tensor", x, pos(8))
    add("xlogy.Scalar_Other", x, 1.5)
    add("xlogy.Scalar_Self", 1.5, pos(4, 8))
    add("special_xlog1py.default", x, pos(4, 8))
    # spectral transforms (a Fourier neural operator): the transformed dims fixed, the rest pass through
    add("_fft_r2c.default", x3, [2], 0, True)
    add("_fft_r2c.default", r(2, 4, 8, 4), [2, 3], 2, False)
    add("_fft_c2c.default", torch.randn(4, 2, 8, dtype=torch.complex128), [2], 1, True)
    add("_fft_c2c.default", torch.randn(2, 4, 4, 8, dtype=torch.complex128), [2, 3], 0, False)
    add("_fft_c2r.default", torch.randn(4, 2, 5, dtype=torch.complex128), [2], 2, 8)
    add("_fft_c2r.default", torch.randn(2, 4, 8, 3, dtype=torch.complex128), [2, 3], 0, 4)

    # pooling
    x4, x5, x1 = r(2, 4, 8, 8), r(2, 4, 4, 4, 4), r(2, 4, 8)
    add("max_pool2d_with_indices.default", x4, [2, 2], [2, 2])
    add("max_pool3d_with_indices.default", x5, [2, 2, 2], [2, 2, 2])
    add("avg_pool2d.default", x4, [2, 2], [2, 2])
    add("avg_pool3d.default", x5, [2, 2, 2], [2, 2, 2])
    add("max_pool1d.default", x1, [2], [2])
    add("_adaptive_avg_pool2d.default", x4, [2, 2])
    add("_adaptive_avg_pool3d.default", x5, [2, 2, 2])
    add("adaptive_max_pool2d.default", x4, [2, 2])
    o, idx = aten.max_pool2d_with_indices.default(x4, [2, 2], [2, 2])
    add("max_pool2d_with_indices_backward.default", r(*o.shape), x4, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
    o, idx = aten.max_pool3d_with_indices.default(x5, [2, 2, 2], [2, 2, 2])
    add("max_pool3d_with_indices_backward.default", r(*o.shape), x5, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1],
        False, idx)
    add("avg_pool2d_backward.default", r(2, 4, 4, 4), x4, [2, 2], [2, 2], [0, 0], False, True, None)
    add("avg_pool3d_backward.default", r(2, 4, 2, 2, 2), x5, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, True, None)
    add("_adaptive_avg_pool2d_backward.default", r(2, 4, 2, 2), x4)
    add("_adaptive_avg_pool3d_backward.default", r(2, 4, 2, 2, 2), x5)
    o, idx = aten.adaptive_max_pool2d.default(x4, [2, 2])
    add("adaptive_max_pool2d_backward.default", r(*o.shape), x4, idx)

    # resampling, reflection and replication padding, unfold / fold (ir/ops_image.py)
    shapes = {1: (2, 4, 8), 2: (2, 4, 4, 4), 3: (2, 2, 2, 4, 4)}
    for name, n, extra in [("upsample_nearest1d", 1, ()), ("upsample_nearest2d", 2, ()), ("upsample_nearest3d", 3, ()),
                           ("_upsample_nearest_exact1d", 1, ()), ("_upsample_nearest_exact2d", 2, ()),
                           ("_upsample_nearest_exact3d", 3, ()), ("upsample_linear1d", 1, (False,)),
                           ("upsample_bilinear2d", 2, (True,)), ("upsample_bicubic2d", 2, (False,)),
                           ("upsample_trilinear3d", 3, (False,))]:
        xi = r(*shapes[n])
        size = [2 * d for d in xi.shape[-n:]]
        add(f"{name}.default", xi, size, *extra)
        add(f"{name}_backward.default", r(*xi.shape[:-n], *size), size, list(xi.shape), *extra)
    for kind in ("reflection", "replication"):
        for n, pad in ((1, [2, 1]), (2, [1, 2, 2, 1]), (3, [1, 1, 2, 1, 1, 1])):
            xi = r(*shapes[n])
            padded = getattr(aten, f"{kind}_pad{n}d").default(xi, pad)
            add(f"{kind}_pad{n}d.default", xi, pad)
            add(f"{kind}_pad{n}d_backward.default", r(*padded.shape), xi, pad)
    add("im2col.default", x4, [2, 2], [1, 1], [0, 0], [2, 2])
    for n, mode, pad, corners in ((2, 0, 0, False), (2, 1, 1, True), (2, 2, 2, False), (3, 0, 1, True)):
        xi, grid = r(*shapes[n]), torch.rand(2, *([2] * (n - 1)), 4, n, dtype=F) * 2.2 - 1.1
        add(f"grid_sampler_{n}d.default", xi, grid, mode, pad, corners)
        sampled = getattr(aten, f"grid_sampler_{n}d").default(xi, grid, mode, pad, corners)
        for wanted in ([True, True], [False, True]):
            add(f"grid_sampler_{n}d_backward.default", r(*sampled.shape), xi, grid, mode, pad, corners, wanted)
    add("col2im.default", r(2, 16, 16), [8, 8], [2, 2], [1, 1], [0, 0], [2, 2])
    bounds = torch.tensor([-0.5, 0.0, 0.5], dtype=F)
    for right in (False, True):
        add("bucketize.Tensor", r(4, 8), bounds, right=right)
        add("searchsorted.Tensor", bounds, r(4, 8), right=right)
        add("searchsorted.Tensor", torch.sort(r(4, 6), -1).values, r(4, 8), right=right)
    add("zero.default", r(4, 8))
    for theta, size in ((r(4, 2, 3), [4, 3, 5, 6]), (r(4, 3, 4), [4, 2, 3, 4, 5])):
        for corners in (False, True):
            add("affine_grid_generator.default", theta, size, corners)
            add("affine_grid_generator_backward.default", r(4, *size[2:], len(size) - 2), size, corners)

    # along one dim, norms
    for name in ("cumsum", "cumprod", "logcumsumexp"):
        add(f"{name}.default", x3, 2)
        add(f"{name}.default", x3, 0)
    add("_softmax.default", x3, 2, False)
    for v, g, d in ((r(4, 2, 2), r(4, 1, 1), 0), (r(4, 8), r(1, 8), 1)):
        add("_weight_norm_interface.default", v, g, d)
        norms = aten._weight_norm_interface.default(v, g, d)[1]
        add("_weight_norm_interface_backward.default", r(*v.shape), v, g, norms, d)
    masked = x3.clone()
    masked[1, 0] = float("-inf")     # a fully masked row: _safe_softmax gives 0 there, _softmax NaN
    add("_safe_softmax.default", masked, 2)
    add("_safe_softmax.default", x3, 0)
    add("_log_softmax.default", x3, 2, False)
    add("_log_softmax.default", x3, 0, False)
    add("_softmax_backward_data.default", r(4, 2, 8), torch.softmax(x3, 2), 2, F)
    add("_log_softmax_backward_data.default", r(4, 2, 8), torch.log_softmax(x3, 2), 2, F)
    add("_log_softmax_backward_data.default", r(4, 2, 8), torch.log_softmax(x3, 0), 0, F)
    w, b = r(8), r(8)
    add("native_layer_norm.default", x3, [8], w, b, 1e-5)
    add("native_layer_norm.default", x3, [2, 8], None, None, 1e-5)
    _, mean, rstd = aten.native_layer_norm.default(x3, [8], w, b, 1e-5)
    add("native_layer_norm_backward.default", r(4, 2, 8), x3, [8], mean, rstd, w, b, [True, True, True])
    xg, wg, bg = r(4, 4, 2, 2), r(4), r(4)
    add("native_group_norm.default", xg, wg, bg, 4, 4, 4, 2, 1e-5)
    _, mean, rstd = aten.native_group_norm.default(xg, wg, bg, 4, 4, 4, 2, 1e-5)
    add("native_group_norm_backward.default", r(4, 4, 2, 2), xg, mean, rstd, wg, 4, 4, 4, 2, [True, True, True])

    # batch norm (training mode over a split batch: SyncBatchNorm statistics)
    xb, cb = r(4, 4, 2, 2), 4
    wb, bb, rm, rv = r(cb), r(cb), r(cb), pos(cb)
    for training in (True, False):
        add("_native_batch_norm_legit_functional.default", xb, wb, bb, rm, rv, training, 0.1, 1e-5)
        add("_native_batch_norm_legit.default", xb, wb, bb, rm.clone(), rv.clone(), training, 0.1, 1e-5)
        add("native_batch_norm.default", xb, wb, bb, rm.clone(), rv.clone(), training, 0.1, 1e-5)
    add("_native_batch_norm_legit.no_stats", xb, wb, bb, True, 0.1, 1e-5)
    add("_native_batch_norm_legit_functional.default", r(4, 4), None, None, rm, rv, True, 0.1, 1e-5)
    add("_native_batch_norm_legit_no_training.default", xb, wb, bb, rm, rv, 0.1, 1e-5)
    _, sm, si = aten.native_batch_norm.default(xb, wb, bb, rm.clone(), rv.clone(), True, 0.1, 1e-5)
    add("native_batch_norm_backward.default", r(4, 4, 2, 2), xb, wb, rm, rv, sm, si, True, 1e-5, [True, True, True])
    add("native_batch_norm_backward.default", r(4, 4, 2, 2), xb, wb, rm, rv, None, None, False, 1e-5,
        [True, True, True])

    # indexing
    add("sort.default", x3, 2)
    add("sort.default", x3, 0, True)
    add("sort.stable", x3, stable=True, dim=2)
    add("topk.default", x3, 2, 2)
    add("topk.default", x3, 2, 0)
    emb, tok = r(8, 4), ints(8, 4, 2)
    add("embedding.default", emb, tok)
    add("embedding_dense_backward.default", r(4, 2, 4), tok, 8, -1, False)
    add("embedding_dense_backward.default", r(4, 2, 4), tok, 8, 3, False)
    add("embedding_dense_backward.default", r(4, 2, 4), tok, 8, -1, True)  # scaled by global counts
    add("gather.default", x, 1, ints(8, 4, 8))
    add("gather.default", x, 0, ints(4, 2, 8))
    pi = perm_index((4, 8), 1)
    add("scatter.src", x, 1, pi, y)
    add("scatter.value", x, 1, pi, 2.0)
    add("scatter_add.default", x, 1, ints(8, 4, 8), y)
    add("scatter_reduce.two", x, 1, pi, y, "sum")
    add("index_select.default", x, 1, ints(8, 4))
    add("index_select.default", x, 0, ints(4, 2))
    rows = torch.randperm(4)[:2]
    add("index.Tensor", x, [rows])
    add("index.Tensor", x, [None, ints(8, 4)])
    add("index.Tensor", x3, [ints(4, 2, 1), None, ints(8, 4)])  # indexed dims apart: the block goes first
    add("index.Tensor", x, [mask(4)])
    add("_unsafe_index.Tensor", x4, [None, None, ints(8, 16, 1), ints(8, 16)])  # nearest upsampling
    add("_unsafe_index.Tensor", x, [rows])
    add("index_put.default", x, [rows], r(2, 8))
    add("index_put.default", x, [rows], r(2, 8), True)
    add("index_put.default", x, [m], r())          # x[mask] = v: a masked fill
    add("index_put.default", x, [m], r(), True)    # accumulated: fixed
    add("_unsafe_index_put.default", x, [rows], r(2, 8))
    add("index_add.default", x, 0, ints(4, 6), r(6, 8))
    add("masked_scatter.default", x, m, r(4, 8))
    add("masked_scatter_backward.default", r(4, 8), m, [4, 8])
    add("embedding_renorm.default", r(10, 4), ints(10, 6), 1.0, 2.0)
    add("one_hot.default", ints(8, 4, 2), 8)
    add("repeat.default", x, [2, 1])
    add("roll.default", x, [1], [1])
    add("roll.default", x, [1])
    add("repeat.default", x, [2, 1, 2])
    add("flip.default", x, [1])
    add("constant_pad_nd.default", x, [1, 1])
    add("constant_pad_nd.default", x4, [1, 1, 0, 2], 0.5)
    add("diagonal.default", r(4, 4, 2))
    add("diagonal.default", r(2, 4, 8), 1, 1, 2)
    add("diagonal.default", r(8, 4, 4, 2), -1, 2, 1)
    add("diagonal_scatter.default", r(2, 4, 8), r(2, 4), 1, 1, 2)
    add("diagonal_scatter.default", r(4, 4, 8), r(8, 4))
    add("index_fill.int_Scalar", r(4, 8), 1, torch.tensor([0, 3, 5]), -1.5)
    add("index_fill.int_Tensor", r(2, 4, 8), 1, torch.tensor([2, 0]), torch.tensor(2.5, dtype=F))
    add("as_strided_scatter.default", r(4, 8), r(4, 2), [4, 2], [8, 2], 1)
    add("diag_embed.default", r(4, 2))
    add("diag_embed.default", r(2, 4, 2), 1, 0, 2)
    add("diag_embed.default", r(4, 2, 2), -2, 3, 1)
    add("diagonal_backward.default", r(2, 4), [4, 4, 2], 0, 0, 1)
    add("diagonal_backward.default", r(4, 4, 2), [4, 2, 4, 4], -2, 3, 1)
    add("as_strided.default", x, [4, 4], [8, 1])
    add("unfold.default", x, 1, 2, 2)
    add("slice_scatter.default", x, r(4, 4), 1, 0, 4)
    add("select_scatter.default", x, r(4), 1, 0)
    add("select_backward.default", r(4), [4, 8], 1, 0)
    add("select_backward.default", r(4, 8), [4, 2, 8], 1, 1)
    add("slice_backward.default", r(4, 4), [4, 8], 1, 0, 4, 1)
    add("slice_backward.default", r(2, 8), [4, 8], 0, 1, 4, 2)

    # matmuls, convolutions, attention
    add("mm.default", x, r(8, 4))
    add("bmm.default", r(2, 4, 8), r(2, 8, 4))
    add("dot.default", r(8), r(8))
    add("vdot.default", r(8), r(8))
    # nn.Bilinear's forward and its three backwards (expand1, expand2, expand3, sumdim)
    add("_trilinear.default", r(4, 2), r(8, 2, 4), r(4, 4), [1, 3], [0], [1, 2], [2, 3])
    add("_trilinear.default", r(4, 8), r(8, 2, 4), r(4, 4), [2, 3], [0], [1, 2], [1, 3])
    add("_trilinear.default", r(4, 2), r(4, 8), r(4, 4), [1, 3], [2, 3], [1, 2], [0])
    add("_trilinear.default", r(2, 4, 2), r(8, 2, 4), r(2, 4, 4), [2, 4], [0, 1], [2, 3], [2, 3])
    add("mv.default", x, r(8))
    add("addmm.default", r(4), x, r(8, 4))
    add("addmm.default", r(4, 4), x, r(8, 4), beta=0.5, alpha=2.0)
    add("baddbmm.default", r(2, 4, 4), r(2, 4, 8), r(2, 8, 4))
    xc, wc = r(2, 4, 4, 4), r(4, 4, 3, 3)
    add("convolution.default", xc, wc, r(4), [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    add("convolution.default", xc, r(4, 2, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 2)
    add("convolution.default", xc, r(4, 2, 2, 2), r(2), [2, 2], [0, 0], [1, 1], True, [0, 0], 1)
    add("convolution.default", r(2, 4, 8), r(8, 4, 3), r(8), [2], [1], [1], False, [0], 1)
    add("convolution.default", xc, r(4, 4, 3, 3), None, [2, 2], [1, 1], [1, 1], True, [1, 1], 1)
    add("convolution_backward.default", r(2, 4, 4, 4), xc, wc, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
        [True, True, True])
    add("convolution_backward.default", r(2, 4, 4, 4), xc, r(4, 2, 3, 3), None, [1, 1], [1, 1], [1, 1], False,
        [0, 0], 2, [True, True, False])
    q, k, v = r(2, 4, 4, 2), r(2, 4, 8, 2), r(2, 4, 8, 2)
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    add(f"{sdpa}.default", q, k, v, 0.0, False)
    add(f"{sdpa}.default", q, k, v, 0.0, False, attn_mask=r(4, 8))
    add(f"{sdpa}.default", q, r(2, 4, 4, 2), r(2, 4, 4, 2), 0.0, True, scale=0.3)
    add(f"{sdpa}.default", q, r(2, 2, 8, 2), r(2, 2, 8, 2), 0.0, False)  # grouped-query
    out_, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, False)
    add(f"{sdpa}_backward.default", r(2, 4, 4, 2), q, k, v, out_, lse, 0.0, False)

    # losses
    logp, tgt = torch.log_softmax(r(4, 8), 1), ints(8, 4)
    wt = pos(8)
    for red in (0, 1, 2):
        add("nll_loss_forward.default", logp, tgt, None, red, -100)
        add("nll_loss_forward.default", logp, tgt, wt, red, 1)
        o, total = aten.nll_loss_forward.default(logp, tgt, wt, red, 1)
        add("nll_loss_backward.default", r(*o.shape), logp, tgt, wt, red, 1, total)
        lp2, t2 = torch.log_softmax(r(2, 4, 2, 2), 1), ints(4, 2, 2, 2)
        add("nll_loss2d_forward.default", lp2, t2, None, red, -100)
        o, total = aten.nll_loss2d_forward.default(lp2, t2, None, red, -100)
        add("nll_loss2d_backward.default", r(*o.shape), lp2, t2, None, red, -100, total)
        add("mse_loss.default", x3, r(4, 2, 8), red)
        o = aten.mse_loss.default(x3, r(4, 2, 8), red)
        add("mse_loss_backward.default", r(*o.shape), x3, r(4, 2, 8), red)
        add("soft_margin_loss.default", x3, torch.sign(r(4, 2, 8)), red)
        o = aten.soft_margin_loss.default(x3, torch.sign(r(4, 2, 8)), red)
        add("soft_margin_loss_backward.default", r(*o.shape), x3, torch.sign(r(4, 2, 8)), red)
        pb = torch.rand(4, 2, 8, dtype=F) * 0.8 + 0.1
        add("binary_cross_entropy.default", pb, torch.rand(4, 2, 8, dtype=F), None, red)
        add("binary_cross_entropy.default", pb, torch.rand(4, 2, 8, dtype=F), pos(2, 8), red)
        o = aten.binary_cross_entropy.default(pb, torch.rand(4, 2, 8, dtype=F), None, red)
        add("binary_cross_entropy_backward.default", r(*o.shape), pb, torch.rand(4, 2, 8, dtype=F), None, red)
        add("binary_cross_entropy_backward.default", r(*o.shape), pb, torch.rand(4, 2, 8, dtype=F), pos(8), red)
        tb = torch.rand(4, 2, 8, dtype=F)
        add("binary_cross_entropy_with_logits.default", x3, tb, None, None, red)
        add("binary_cross_entropy_with_logits.default", x3, tb, pos(2, 8), pos(8), red)
        for loss, arg in (("smooth_l1_loss", 0.5), ("huber_loss", 0.7)):
            add(f"{loss}.default", x3, r(4, 2, 8), red, arg)
            lo = getattr(aten, loss).default(x3, r(4, 2, 8), red, arg)
            add(f"{loss}_backward.default", r(*lo.shape), x3, r(4, 2, 8), red, arg)

    add("nll_loss_forward.default", logp[0], tgt[0], wt, 1, -100)  # one row, no batch dim
    o, total = aten.nll_loss_forward.default(logp[0], tgt[0], wt, 1, -100)
    add("nll_loss_backward.default", r(), logp[0], tgt[0], wt, 1, -100, total)

    # views and data movement
    add("view.default", x3, [8, 8])
    add("view.default", x3, [4, 2, 2, 4])
    add("view.default", r(8, 8), [2, 4, 8])
    add("_unsafe_view.default", x3, [4, 16])
    # many-to-many groups in their common factors: (a, bc) -> (ab, c) (attention heads), and back
    add("view.default", r(4, 2, 8), [4, 4, 4])
    add("view.default", r(4, 4, 4), [4, 2, 8])
    add("_unsafe_view.default", r(8, 4), [4, 8])
    # complex numbers (rotary embeddings written with them): pairs of reals <-> complex, the conjugate
    add("view_as_complex.default", r(4, 8, 2))
    add("view_as_real.default", torch.randn(4, 8, dtype=torch.complex128))
    add("_conj.default", torch.randn(4, 8, dtype=torch.complex128))
    add("conj_physical.default", torch.randn(4, 8, dtype=torch.complex128))
    add("reshape.default", x3, [2, 4, 8])
    add("permute.default", x3, [2, 0, 1])
    add("transpose.int", x3, 0, 2)
    add("t.default", x)
    add("expand.default", r(4, 1), [4, 8])
    add("expand.default", r(8), [2, 4, 8])
    add("unsqueeze.default", x, 1)
    add("squeeze.dim", r(4, 1, 8), 1)
    add("squeeze.dims", r(4, 1, 8), [1])
    add("squeeze.default", r(4, 1, 8))
    add("slice.Tensor", x, 1, 0, 4)
    add("slice.Tensor", x, 0, 1, 4, 2)
    add("select.int", x3, 1, 1)
    add("split.Tensor", x, 4, 1)
    add("split.Tensor", x, 3, 1)
    add("split_with_sizes.default", x, [3, 5], 1)
    add("unsafe_split.Tensor", x, 4, 1)
    add("unsafe_split_with_sizes.default", x, [3, 5], 1)
    add("unbind.int", x3, 1)
    add("cat.default", [x, y], 1)
    add("cat.default", [x, r(4, 4)], 1)
    add("stack.default", [x, y], 0)

    # creation
    add("full.default", [4, 8], 2.0, dtype=F)
    add("zeros.default", [4, 8], dtype=F)
    add("eye.default", 4, dtype=F)
    add("eye.m", 4, 8, dtype=F)
    add("linspace.default", -1, 1, 6, dtype=F)
    add("logspace.default", -1, 1, 6, 2.0, dtype=F)
    add("ones.default", [4, 8], dtype=F)
    add("empty.memory_format", [4, 8], dtype=F)
    add("rand.default", [4, 8], dtype=F)
    add("randn.default", [4, 8], dtype=F)
    add("randint.default", 5, [4, 8], dtype=F)
    add("randint.low", 2, 5, [4, 8], dtype=F)
    add("normal.float_float", 0.0, 1.0, [4, 8], dtype=F)
    add("arange.default", 8)
    add("arange.start", 2, 10)
    add("arange.start_step", 0, 16, 2)
    add("scalar_tensor.default", 2.0, dtype=F)
    add("new_zeros.default", x, [4, 8])
    add("new_ones.default", x, [4, 8])
    add("new_empty.default", x, [4, 8])
    add("new_full.default", x, [4, 8], 2.0)
    return out
