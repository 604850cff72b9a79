"""The op registry against PyTorch itself.

Oracle: for random small arguments, call the real aten op, record its inputs and
outputs in a one-node IR graph the way the capture does (tensor arguments become
graph inputs referenced by ``Ref``, outputs are typed from the real result), and
check that the shapes the op's annotation infers from the *input* shapes are the
shapes PyTorch returned; the verifier must accept the graph too.
"""
from __future__ import annotations

import sys
from math import prod

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rhino.capture.to_ir import ir_dtype
from rhino.ir.annotation import infer_shapes
from rhino.ir.graph import Graph, GraphOutput, Node, Ref, Role
from rhino.ir.registry import OpKind, annotate, bytes_of, call_of, flops_of, lookup
from rhino.ir.types import Device, DType, Layout, MemoryFormat, TensorType
from rhino.ir.verify import VerifyError, is_inplace_op, verify

# derandomize: calling raw aten kernels on random arguments must give the same run in CI as here
FAST = settings(max_examples=30, deadline=None, derandomize=True)
aten = torch.ops.aten
MAXINT = sys.maxsize  # what a traced ``x[a:]`` passes as ``end``


# -- harness ------------------------------------------------------------------------
def _ttype(t: torch.Tensor) -> TensorType:
    # The IR has no unsigned 64-bit type; CUDA attention returns its philox seed/offset as
    # uint64 (seen here through meta tensors). Only shapes matter to these tests.
    dtype = DType.int64 if t.dtype is torch.uint64 else ir_dtype(t.dtype)
    return TensorType(tuple(t.shape), dtype)


def _to_ir(a, g: Graph):
    if isinstance(a, torch.Tensor):
        return Ref(g.add_input(f"in{len(g.inputs)}", Role.BATCH, _ttype(a)))
    if isinstance(a, (list, tuple)):
        items = [_to_ir(x, g) for x in a]
        return items if isinstance(a, list) else tuple(items)
    if isinstance(a, dict):
        return {k: _to_ir(v, g) for k, v in a.items()}
    if isinstance(a, torch.dtype):
        return ir_dtype(a)
    if isinstance(a, torch.device):
        return Device(a.type)
    if isinstance(a, torch.layout):
        return Layout(str(a).removeprefix("torch."))
    if isinstance(a, torch.memory_format):
        return MemoryFormat(str(a).removeprefix("torch."))
    assert a is None or isinstance(a, (bool, int, float, str)), a
    return a


def _overload(op: str):
    _, name, overload = op.split(".")
    return getattr(getattr(aten, name), overload)


def record(op: str, *args, **kwargs):
    """Run ``op`` for real and record it as a one-node graph: (graph, node, torch result)."""
    assert lookup(op) is not None, f"{op} is not registered"
    result = _overload(op)(*args, **kwargs)
    g = Graph()
    ir_args, ir_kwargs = _to_ir(list(args), g), _to_ir(dict(kwargs), g)
    multi = isinstance(result, (tuple, list))
    vals = list(result) if multi else [result]
    outs = [g.new_value(_ttype(v)) if isinstance(v, torch.Tensor) else None for v in vals]
    node = Node("n1", op, ir_args, ir_kwargs, outs, multi)
    g.nodes.append(node)
    loss = g.add_input("loss", Role.BATCH, TensorType((), DType.float32))
    g.outputs.append(GraphOutput("loss", Role.LOSS, loss))
    return g, node, vals


def check(op: str, *args, unused=(), **kwargs):
    """The oracle: inferred output shapes == PyTorch's output shapes; the verifier agrees.

    ``unused``: outputs whose value the op leaves unspecified (masked out); the
    annotation must leave them out (None)."""
    g, node, vals = record(op, *args, **kwargs)
    call = call_of(g, node)
    ann = annotate(call)
    assert ann is not None, f"{op} has no annotation"
    inferred = infer_shapes(ann, [t.shape for t in call.in_types])
    assert len(inferred) == len(vals), f"{op}: annotation has {len(inferred)} outputs, torch gave {len(vals)}"
    for k, (shape, v) in enumerate(zip(inferred, vals)):
        if k in unused:
            assert shape is None, f"{op} output {k} is unused but annotated {shape}"
        elif isinstance(v, torch.Tensor):
            assert shape == tuple(v.shape), f"{op} output {k}: inferred {shape}, torch gave {tuple(v.shape)}"
    # every letter the annotation marks exists in it
    assert ann.reduced <= set(ann.letters()) | set(ann.sizes)
    if is_inplace_op(op):  # a mutating op is registered for its shapes, but no graph may hold it
        with pytest.raises(VerifyError, match="in-place"):
            verify(g)
    else:
        verify(g)
    return call, ann


# -- strategies ----------------------------------------------------------------------
def shapes(min_rank=0, max_rank=4, lo=1, hi=4):
    return st.lists(st.integers(lo, hi), min_size=min_rank, max_size=max_rank).map(tuple)


def rand(shape, dtype=torch.float32):
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 3, shape, dtype=dtype)
    return torch.randn(shape, dtype=dtype)


@st.composite
def dim_of(draw, rank, extra=0):
    """A dim index for ``rank`` dims (+``extra`` for insertion points), possibly negative."""
    n = max(rank + extra, 1)
    d = draw(st.integers(0, n - 1))
    return d - n if draw(st.booleans()) else d


@st.composite
def broadcast_to(draw, shape):
    """A shape that broadcasts to ``shape``: a suffix with some dims set to 1."""
    k = draw(st.integers(0, len(shape)))
    return tuple(1 if draw(st.booleans()) else n for n in shape[len(shape) - k:])


def _prime_factors(n):
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@st.composite
def factorization(draw, numel):
    """A target shape for view/reshape: the prime factors of numel spread over slots, 1s
    inserted, maybe one -1."""
    factors = _prime_factors(numel) if numel else [0]
    n_slots = draw(st.integers(1 if factors else 0, 5))
    slots = [1] * n_slots
    for f in factors:
        slots[draw(st.integers(0, n_slots - 1))] *= f
    if numel == 0:  # other slots may be anything; -1 would be ambiguous
        return [n if n == 0 else draw(st.integers(1, 3)) for n in slots]
    if slots and draw(st.booleans()):
        slots[draw(st.integers(0, len(slots) - 1))] = -1
    return slots


# -- elementwise -----------------------------------------------------------------------
UNARY = ["aten.exp.default", "aten.relu.default", "aten.gelu.default", "aten.sigmoid.default",
         "aten.tanh.default", "aten.neg.default", "aten.abs.default", "aten.rsqrt.default",
         "aten.clone.default", "aten.silu.default", "aten.sign.default", "aten.logical_not.default",
         "aten.isnan.default", "aten.zeros_like.default", "aten.ones_like.default", "aten.detach.default",
         "aten.alias.default", "aten.lift_fresh_copy.default", "aten.randn_like.default", "aten.ceil.default",
         "aten.cos.default", "aten.sin.default", "aten.erf.default", "aten.exp2.default", "aten.expm1.default",
         "aten.floor.default", "aten.round.default", "aten.trunc.default", "aten.hardsigmoid.default",
         "aten.hardswish.default", "aten.isinf.default", "aten.log.default", "aten.log1p.default",
         "aten.log2.default", "aten.sqrt.default", "aten.reciprocal.default", "aten.mish.default",
         "aten.softplus.default", "aten.elu.default", "aten.nan_to_num.default", "aten.empty_like.default",
         "aten.rand_like.default", "aten.bernoulli.default", "aten.bitwise_not.default"]
INTEGER_OPS = {"aten.bitwise_not.default", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
               "aten.bitwise_xor.Tensor", "aten.bitwise_and.Scalar", "aten.bitwise_or.Scalar"}
BINARY = ["aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.maximum.default",
          "aten.minimum.default", "aten.pow.Tensor_Tensor", "aten.eq.Tensor", "aten.lt.Tensor",
          "aten.ge.Tensor", "aten.remainder.Tensor", "aten.rsub.Tensor", "aten.logical_and.default",
          "aten.bitwise_xor.Tensor", "aten.fmod.Tensor", "aten.floor_divide.default", "aten.gt.Tensor",
          "aten.le.Tensor", "aten.ne.Tensor", "aten.logical_or.default", "aten.logical_xor.default",
          "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor"]
BACKWARD = ["aten.gelu_backward.default", "aten.silu_backward.default", "aten.sigmoid_backward.default",
            "aten.tanh_backward.default", "aten.hardswish_backward.default", "aten.mish_backward.default",
            "aten.hardsigmoid_backward.default"]


@FAST
@given(op=st.sampled_from(UNARY), shape=shapes(lo=0))
def test_unary(op, shape):
    x = rand(shape, torch.int64 if op in INTEGER_OPS else torch.float32)
    check(op, torch.rand(shape) if op == "aten.bernoulli.default" else x)  # bernoulli: probabilities


@FAST
@given(op=st.sampled_from(BINARY), out=shapes(lo=0), data=st.data())
def test_binary_broadcast(op, out, data):
    a, b = data.draw(broadcast_to(out)), data.draw(broadcast_to(out))
    if data.draw(st.booleans()):  # at least one of them has the full shape
        a = out
    dtype = torch.int64 if op in INTEGER_OPS else torch.float32
    check(op, rand(a, dtype), rand(b, dtype))
    if op == "aten.div.Tensor":
        check("aten.div.Tensor_mode", rand(a), rand(b), rounding_mode="floor")


@FAST
@given(op=st.sampled_from(BACKWARD), shape=shapes())
def test_activation_backward(op, shape):
    check(op, rand(shape), rand(shape))
    x = rand(shape)
    check("aten.elu_backward.default", rand(shape), 1.0, 1.0, 1.0, False, x)
    check("aten.hardtanh_backward.default", rand(shape), x, -1.0, 1.0)
    check("aten.leaky_relu_backward.default", rand(shape), x, 0.01, False)
    check("aten.softplus_backward.default", rand(shape), x, 1.0, 20.0)


@FAST
@given(op=st.sampled_from(["aten.add.Scalar", "aten.mul.Scalar", "aten.div.Scalar", "aten.pow.Tensor_Scalar",
                           "aten.rsub.Scalar", "aten.eq.Scalar", "aten.gt.Scalar", "aten.fmod.Scalar",
                           "aten.clamp_min.default", "aten.clamp_max.default", "aten.leaky_relu.default",
                           "aten.fill.Scalar", "aten.full_like.default", "aten.sub.Scalar", "aten.ge.Scalar",
                           "aten.le.Scalar", "aten.lt.Scalar", "aten.ne.Scalar", "aten.remainder.Scalar",
                           "aten.bitwise_and.Scalar", "aten.bitwise_or.Scalar"]),
       shape=shapes())
def test_tensor_scalar(op, shape):
    if op in INTEGER_OPS:
        check(op, rand(shape, torch.int64), 6)
    else:
        check(op, rand(shape), 2.0)
    check("aten.div.Scalar_mode", rand(shape), 2.0, rounding_mode="trunc")


@FAST
@given(out=shapes(lo=0), data=st.data())
def test_ternary_broadcast(out, data):
    s = [data.draw(broadcast_to(out)) for _ in range(3)]
    s[data.draw(st.integers(0, 2))] = out
    check("aten.where.self", rand(s[0], torch.bool), rand(s[1]), rand(s[2]))
    check("aten.addcmul.default", rand(s[0]), rand(s[1]), rand(s[2]), value=0.5)
    check("aten.addcdiv.default", rand(s[0]), rand(s[1]), rand(s[2]).abs() + 1)
    check("aten.clamp.Tensor", rand(s[0]), rand(s[1]), rand(s[2]))
    check("aten.lerp.Tensor", rand(s[0]), rand(s[1]), rand(s[2]))
    check("aten.where.ScalarSelf", rand(s[0], torch.bool), 1.0, rand(s[2]))
    check("aten.where.ScalarOther", rand(s[0], torch.bool), rand(s[1]), 0.0)
    check("aten.lerp.Scalar", rand(s[0]), rand(s[1]), 0.5)


@FAST
@given(shape=shapes(), data=st.data())
def test_elementwise_misc(shape, data):
    x = rand(shape)
    mask_shape = data.draw(broadcast_to(shape))
    check("aten.masked_fill.Scalar", x, rand(mask_shape, torch.bool), 0.0)
    check("aten.masked_fill.Tensor", x, rand(mask_shape, torch.bool), torch.tensor(1.0))
    check("aten.copy.default", x, rand(data.draw(broadcast_to(shape))))
    check("aten._to_copy.default", x, dtype=torch.float16)
    check("aten.native_dropout.default", x, 0.5, True)
    check("aten.native_dropout_backward.default", x, rand(shape, torch.bool), 2.0)
    check("aten.threshold_backward.default", x, rand(shape), 0.0)
    check("aten.bernoulli.p", x, 0.5)
    check("aten.hardtanh.default", x, -1.0, 1.0)
    check("aten.clamp.default", x, -1.0, 1.0)
    check("aten.fill.Tensor", x, torch.tensor(3.0))
    check("aten.pow.Scalar", 2.0, x)


# -- reductions -------------------------------------------------------------------------
@st.composite
def reduce_args(draw, min_rank=0):
    shape = draw(shapes(min_rank=min_rank))
    rank = len(shape)
    idx = draw(st.lists(st.integers(0, max(rank, 1) - 1), unique=True, max_size=rank)) if rank else \
        draw(st.sampled_from([[], [0]]))
    dims = [d - max(rank, 1) if draw(st.booleans()) else d for d in idx]
    return shape, dims, draw(st.booleans())


@FAST
@given(args=reduce_args())
def test_reductions_over_dims(args):
    shape, dims, keep = args
    x = rand(shape)
    check("aten.sum.dim_IntList", x, dims, keep)
    check("aten.mean.dim", x, dims, keep)
    check("aten.amax.default", x, dims, keep)
    check("aten.amin.default", x, dims, keep)
    if dims:  # torch itself fails on logsumexp over dim=[]
        check("aten.logsumexp.default", x, dims, keep)
    check("aten.any.dims", rand(shape, torch.bool), dims, keep)
    check("aten.var.correction", x, dims, correction=0, keepdim=keep)
    check("aten.std.correction", x, dims, correction=0, keepdim=keep)
    check("aten.var_mean.correction", x, dims, correction=0, keepdim=keep)
    check("aten.linalg_vector_norm.default", x, 2, dims, keep)


@FAST
@given(shape=shapes(), keep=st.booleans())
def test_reductions_over_all(shape, keep):
    x = rand(shape)
    for op in ["aten.sum.default", "aten.mean.default", "aten.max.default", "aten.min.default",
               "aten.prod.default"]:
        check(op, x)
    check("aten.any.default", rand(shape, torch.bool))
    check("aten.all.default", rand(shape, torch.bool))
    check("aten.sum.dim_IntList", x, None, keep)
    check("aten.argmax.default", x, None, keep)
    check("aten.var.correction", x, None, correction=1, keepdim=keep)
    check("aten.linalg_vector_norm.default", x, 2, None, keep)


@FAST
@given(shape=shapes(min_rank=1), keep=st.booleans(), data=st.data())
def test_reductions_over_one_dim(shape, keep, data):
    d = data.draw(dim_of(len(shape)))
    x = rand(shape)
    check("aten.max.dim", x, d, keep)
    check("aten.min.dim", x, d, keep)
    check("aten.argmax.default", x, d, keep)
    check("aten.argmin.default", x, d, keep)
    check("aten.any.dim", rand(shape, torch.bool), d, keep)
    check("aten.all.dim", rand(shape, torch.bool), d, keep)


@FAST
@given(shape=shapes(lo=0), data=st.data())
def test_along_one_dim(shape, data):
    d = data.draw(dim_of(len(shape)))
    x = rand(shape)
    check("aten._softmax.default", x, d, False)
    check("aten._log_softmax.default", x, d, False)
    check("aten._softmax_backward_data.default", rand(shape), torch.softmax(x, d), d, torch.float32)
    check("aten._log_softmax_backward_data.default", rand(shape), torch.log_softmax(x, d), d, torch.float32)
    check("aten.cumsum.default", x, d)
    check("aten.cumprod.default", x, d)
    check("aten.logcumsumexp.default", x, d)
    check("aten.sort.default", x, d, data.draw(st.booleans()))
    check("aten.sort.stable", x, stable=True, dim=d)
    check("aten.sort.stable", x, stable=None)


@pytest.mark.parametrize("op, args", [
    ("aten._softmax.default", (-1, False)), ("aten.sum.dim_IntList", ([-1], True)),
    ("aten.amax.default", ([0], False)),
])
def test_reduction_marks(op, args):
    """Splittable reductions mark the reduced letters '+'; softmax fixes its dim instead."""
    _, ann = check(op, rand((3, 4)), *args)
    if op == "aten._softmax.default":
        assert ann.reduced == frozenset() and "e1" in ann.fixed
    else:
        assert len(ann.reduced) == 1
    if op == "aten.amax.default":
        assert ann.reduce_kind == "max"


# -- views and data movement -----------------------------------------------------------------
@FAST
@given(shape=shapes(max_rank=5, lo=0), data=st.data())
def test_view_reshape(shape, data):
    target = data.draw(factorization(prod(shape)))
    x = rand(shape)
    for op in ["aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"]:
        check(op, x, target)


@pytest.mark.parametrize("src, dst", [
    ((6,), [2, 3]), ((2, 3), [6]), ((2, 3), [3, 2]), ((4, 6), [2, 12]), ((2, 1, 3), [6]), ((6,), [2, 1, 3]),
    ((), [1, 1]), ((1, 1), []), ((2, 3, 4), [-1]), ((2, 3, 4), [6, -1]), ((1,), [-1]), ((12, 1), [1, 3, 4]),
    ((0, 3), [3, 0]), ((0, 0), [0]), ((2, 0), [-1]), ((0,), [0, 5, 1]), ((4, 0, 2), [4, 0]),
])
def test_view_cases(src, dst):
    check("aten.view.default", rand(src), dst)


@FAST
@given(shape=shapes(max_rank=5, lo=0), data=st.data())
def test_permute(shape, data):
    rank = len(shape)
    perm = data.draw(st.permutations(range(rank)))
    perm = [p - rank if data.draw(st.booleans()) else p for p in perm]
    check("aten.permute.default", rand(shape), perm)


@FAST
@given(shape=shapes(lo=0), data=st.data())
def test_transpose(shape, data):
    a, b = data.draw(dim_of(len(shape))), data.draw(dim_of(len(shape)))
    check("aten.transpose.int", rand(shape), a, b)


@pytest.mark.parametrize("shape", [(), (3,), (2, 3)])
def test_t(shape):
    check("aten.t.default", rand(shape))


@FAST
@given(shape=shapes(lo=0), data=st.data())
def test_expand(shape, data):
    lead = data.draw(shapes(max_rank=2))
    size = list(lead) + [data.draw(st.sampled_from([-1, n])) if n != 1 else data.draw(st.sampled_from([-1, 1, 3]))
                         for n in shape]
    check("aten.expand.default", rand(shape), size)


@FAST
@given(shape=shapes(lo=1, hi=3), data=st.data())
def test_squeeze_unsqueeze(shape, data):
    rank = len(shape)
    x = rand(shape)
    check("aten.unsqueeze.default", x, data.draw(dim_of(rank, extra=1)))
    check("aten.squeeze.default", x)
    check("aten.squeeze.dim", x, data.draw(dim_of(rank)))
    dims = data.draw(st.lists(st.integers(0, max(rank, 1) - 1), unique=True, max_size=rank))
    check("aten.squeeze.dims", x, dims)


@st.composite
def slice_bound(draw, n):
    return draw(st.one_of(st.none(), st.integers(-n - 3, n + 3), st.just(MAXINT), st.just(-MAXINT)))


@FAST
@given(shape=shapes(min_rank=1, lo=0, hi=6), data=st.data())
def test_slice(shape, data):
    d = data.draw(dim_of(len(shape)))
    n = shape[d]
    start, end = data.draw(slice_bound(n)), data.draw(slice_bound(n))
    step = data.draw(st.integers(1, 4))
    check("aten.slice.Tensor", rand(shape), d, start, end, step)
    check("aten.slice.Tensor", rand(shape), d, start, end)


@pytest.mark.parametrize("args", [(), (0,), (0, 1), (0, None, 2), (0, -2, MAXINT), (0, 3, 1, 2), (0, 5, 2)])
def test_slice_defaults(args):
    check("aten.slice.Tensor", rand((5, 2)), *args)


@FAST
@given(shape=shapes(min_rank=1, lo=0), data=st.data())
def test_select_unbind(shape, data):
    d = data.draw(dim_of(len(shape)))
    if shape[d]:
        i = data.draw(st.integers(-shape[d], shape[d] - 1))
        check("aten.select.int", rand(shape), d, i)
    check("aten.unbind.int", rand(shape), d)


@FAST
@given(shape=shapes(min_rank=1, lo=0, hi=7), data=st.data())
def test_split(shape, data):
    d = data.draw(dim_of(len(shape)))
    n = shape[d]
    check("aten.split.Tensor", rand(shape), data.draw(st.integers(1, n + 2)), d)
    if n == 0:
        check("aten.split.Tensor", rand(shape), 0, d)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=3)))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    check("aten.split_with_sizes.default", rand(shape), sizes, d)


@FAST
@given(shape=shapes(min_rank=1, lo=0), n=st.integers(1, 4), data=st.data())
def test_cat_stack(shape, n, data):
    d = data.draw(dim_of(len(shape)))
    parts = []
    for _ in range(n):
        s = list(shape)
        s[d] = data.draw(st.integers(0, 3))
        parts.append(rand(tuple(s)))
    check("aten.cat.default", parts, d)
    if d in (0, -len(shape)):
        check("aten.cat.default", parts)
    check("aten.stack.default", [rand(shape) for _ in range(n)], data.draw(dim_of(len(shape), extra=1)))


def test_cat_skips_legacy_empty():
    check("aten.cat.default", [rand((2, 3)), torch.empty(0), rand((1, 3))])


@FAST
@given(shape=shapes(min_rank=2), diagonal=st.integers(-2, 2))
def test_tril_triu(shape, diagonal):
    check("aten.tril.default", rand(shape), diagonal)
    check("aten.triu.default", rand(shape), diagonal)


# -- creation ----------------------------------------------------------------------------
@FAST
@given(size=shapes(lo=0), data=st.data())
def test_sized_creation(size, data):
    size = list(size)
    check("aten.full.default", size, 1.5, dtype=torch.float32, device=torch.device("cpu"))
    check("aten.zeros.default", size, dtype=torch.float32)
    check("aten.ones.default", size, layout=torch.strided)
    check("aten.empty.memory_format", size, memory_format=torch.contiguous_format)
    check("aten.rand.default", size)
    check("aten.randn.default", size)
    x = rand(data.draw(shapes()))
    check("aten.new_zeros.default", x, size)
    check("aten.new_ones.default", x, size)
    check("aten.new_empty.default", x, size)
    check("aten.new_full.default", x, size, 2.0)
    check("aten.scalar_tensor.default", 3.0)


@FAST
@given(a=st.integers(-6, 6), b=st.integers(-6, 6), step=st.integers(1, 3), neg=st.booleans(), fl=st.booleans())
def test_arange(a, b, step, neg, fl):
    start, end = sorted((a, b))
    if neg:
        start, end, step = end, start, -step
    if fl:
        start, end, step = start * 0.5, end * 0.5, step * 0.7  # signs kept: a valid range
    check("aten.arange.start_step", start, end, step)
    check("aten.arange.start", min(start, end), max(start, end))
    check("aten.arange.default", abs(end))


# -- indexing -----------------------------------------------------------------------------
@FAST
@given(shape=shapes(min_rank=1), data=st.data())
def test_gather_scatter(shape, data):
    rank = len(shape)
    d = data.draw(dim_of(rank))
    dd = d % rank
    # index: at most the input's size off the dim, any size along it
    idx_shape = tuple(data.draw(st.integers(1, 4)) if k == dd else data.draw(st.integers(1, n))
                      for k, n in enumerate(shape))
    index = torch.randint(0, shape[dd], idx_shape)
    x = rand(shape)
    check("aten.gather.default", x, d, index)
    # scatter: index at most self off the dim, at most src everywhere
    idx_shape = tuple(data.draw(st.integers(1, n)) for n in shape)
    index = torch.randint(0, shape[dd], idx_shape)
    src_shape = tuple(m + data.draw(st.integers(0, 2)) for m in idx_shape)
    src = rand(src_shape)
    check("aten.scatter.src", x, d, index, src)
    check("aten.scatter.value", x, d, index, 1.0)
    check("aten.scatter_add.default", x, d, index, src)
    check("aten.scatter_reduce.two", x, d, index, src, "amax", include_self=False)


@FAST
@given(shape=shapes(min_rank=1, hi=5), data=st.data())
def test_topk_index_select(shape, data):
    d = data.draw(dim_of(len(shape)))
    n = shape[d]
    check("aten.topk.default", rand(shape), data.draw(st.integers(0, n)), d,
          data.draw(st.booleans()), data.draw(st.booleans()))
    check("aten.topk.default", rand(shape), 1)
    check("aten.index_select.default", rand(shape), d, torch.randint(0, n, (data.draw(st.integers(0, 5)),)))
    check("aten.index_select.default", rand(shape), d, torch.tensor(n - 1))
    idx = torch.randint(0, shape[0], data.draw(shapes(max_rank=2)))
    check("aten.index.Tensor", rand(shape), [idx])


@FAST
@given(shape=shapes(min_rank=2, max_rank=3, lo=2), data=st.data())
def test_ops_without_dim_correspondence(shape, data):
    """Indexing and data-movement ops (annotated from their recorded types, or with only the dims they
    leave alone passing through): the rule must fit."""
    x, n = rand(shape), shape[0]
    idx = torch.randint(0, n, data.draw(shapes(max_rank=2)))
    check("aten.index.Tensor", x, [None, torch.randint(0, shape[1], (3,))])
    check("aten._unsafe_index.Tensor", x, [idx])
    flat = torch.randint(0, n, (3,))
    check("aten.index_put.default", x, [flat], rand((3,) + shape[1:]), True)
    check("aten._unsafe_index_put.default", x, [flat], rand(shape[1:]))
    check("aten.index_add.default", x, 0, flat, rand((3,) + shape[1:]))
    check("aten.masked_scatter.default", x, rand(shape[1:], torch.bool), rand(shape))
    check("aten.one_hot.default", idx, n)
    check("aten.repeat.default", x, [2] * len(shape) + [1])
    check("aten.roll.default", x, [1, -1], [0, -1])
    check("aten.flip.default", x, [0, -1])
    check("aten.constant_pad_nd.default", x, [1, 0, 0, 2], 0.0)
    check("aten.diagonal.default", x, data.draw(st.integers(-1, 1)), 0, 1)
    check("aten.as_strided.default", x, [2, 2], [1, 2])
    check("aten.unfold.default", x, -1, 2, 1)
    check("aten.slice_scatter.default", x, rand((1,) + shape[1:]), 0, 0, 1, 1)
    check("aten.select_scatter.default", x, rand(shape[1:]), 0, -1)
    check("aten.select_backward.default", rand(shape[1:]), list(shape), 0, 1)
    check("aten.slice_backward.default", rand((1,) + shape[1:]), list(shape), 0, 1, 2, 1)


@FAST
@given(v=st.integers(1, 6), d=st.integers(1, 4), idx=shapes(max_rank=3), pad=st.integers(-1, 5))
def test_embedding(v, d, idx, pad):
    weight, indices = rand((v, d)), torch.randint(0, v, idx)
    call, ann = check("aten.embedding.default", weight, indices)
    # a split vocabulary gives a partial sum, computed by the custom SPMD lowering
    assert "v" in ann.reduced and "v" in ann.custom and "v" not in ann.fixed
    check("aten.embedding.default", weight, indices, min(pad, v - 1))
    check("aten.embedding_dense_backward.default", rand(idx + (d,)), indices, v, min(pad, v - 1), False)


# -- matmuls ------------------------------------------------------------------------------
@FAST
@given(m=st.integers(1, 5), k=st.integers(1, 5), n=st.integers(1, 5), b=st.integers(1, 3), data=st.data())
def test_matmul(m, k, n, b, data):
    call, _ = check("aten.mm.default", rand((m, k)), rand((k, n)))
    assert flops_of(call) == 2 * m * k * n
    assert bytes_of(call) == 4 * (m * k + k * n + m * n)
    call, _ = check("aten.bmm.default", rand((b, m, k)), rand((b, k, n)))
    assert flops_of(call) == 2 * b * m * k * n
    call, _ = check("aten.mv.default", rand((m, k)), rand((k,)))
    assert flops_of(call) == 2 * m * k
    call, _ = check("aten.dot.default", rand((k,)), rand((k,)))
    assert flops_of(call) == 2 * k
    bias = data.draw(broadcast_to((m, n)))
    call, ann = check("aten.addmm.default", rand(bias), rand((m, k)), rand((k, n)), beta=0.5, alpha=2.0)
    assert flops_of(call) == 2 * m * k * n + m * n
    assert ann.reduced == {"k"}
    bias = data.draw(broadcast_to((b, m, n)))
    call, _ = check("aten.baddbmm.default", rand(bias), rand((b, m, k)), rand((b, k, n)))
    assert flops_of(call) == 2 * b * m * k * n + b * m * n


def test_matmul_shape_mismatch_fails_verify():
    from rhino.ir.verify import VerifyError
    g, node, _ = record("aten.mm.default", rand((2, 3)), rand((3, 4)))
    g.types[g.inputs[1].value] = TensorType((5, 4), DType.float32)  # k: 3 vs 5
    with pytest.raises(VerifyError, match="annotation does not fit"):
        verify(g)


# -- convolution --------------------------------------------------------------------------
@st.composite
def conv_args(draw):
    n_sp = draw(st.integers(1, 3))
    g = draw(st.integers(1, 3))
    cg, og = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    n = draw(st.integers(1, 2))
    transposed = draw(st.booleans())
    k = [draw(st.integers(1, 3)) for _ in range(n_sp)]
    s = [draw(st.integers(1, 3)) for _ in range(n_sp)]
    d = [draw(st.integers(1, 2)) for _ in range(n_sp)]
    p = [draw(st.integers(0, 2)) for _ in range(n_sp)]
    if transposed:
        op = [draw(st.integers(0, max(si, di) - 1)) for si, di in zip(s, d)]
        sizes = [draw(st.integers(1, 4)) for _ in range(n_sp)]
        out = [(x - 1) * si - 2 * pi + di * (ki - 1) + oi + 1 for x, si, pi, di, ki, oi in zip(sizes, s, p, d, k, op)]
        assume(all(o >= 1 for o in out))
        x_shape = (n, g * cg, *sizes)
        w_shape = (g * cg, og, *k)
    else:
        op = [0] * n_sp
        sizes = [max(1, di * (ki - 1) + 1 - 2 * pi) + draw(st.integers(0, 3)) for ki, pi, di in zip(k, p, d)]
        x_shape = (n, g * cg, *sizes)
        w_shape = (g * og, cg, *k)
    out_ch = og * g
    # aten accepts one value for all spatial dims
    def maybe_one(v):
        return v[:1] if len(set(v)) == 1 and draw(st.booleans()) else v
    return dict(x=x_shape, w=w_shape, bias=draw(st.booleans()), stride=maybe_one(s), padding=maybe_one(p),
                dilation=maybe_one(d), transposed=transposed, output_padding=maybe_one(op), groups=g,
                out_ch=out_ch)


def _conv_closed_form_flops(x, w, out, transposed, groups):
    if transposed:  # the direct conv it is the gradient of: each input element meets O/g * k weights
        return 2 * x[0] * prod(x[2:]) * x[1] * (w[1]) * prod(w[2:])
    return 2 * out[0] * out[1] * prod(out[2:]) * (x[1] // groups) * prod(w[2:])


@FAST
@given(a=conv_args())
def test_convolution(a):
    x, w = rand(a["x"]), rand(a["w"])
    bias = rand((a["out_ch"],)) if a["bias"] else None
    conv = (a["stride"], a["padding"], a["dilation"], a["transposed"], a["output_padding"], a["groups"])
    call, ann = check("aten.convolution.default", x, w, bias, *conv)
    out = call.out_types[0].shape
    assert out[1] == a["out_ch"]
    assert flops_of(call) == _conv_closed_form_flops(a["x"], a["w"], out, a["transposed"], a["groups"])
    # plain convs sum over input channels; grouped ones over a group's input channels, which stay whole
    # (only the group letter may be split)
    assert ann.reduced == ({"c"} if a["groups"] == 1 else {"cg"})
    if a["groups"] > 1:
        assert {"cg", "og"} <= ann.fixed and "g" not in ann.fixed
    mask = [True, True, a["bias"]]
    grad = rand(out)
    call, _ = check("aten.convolution_backward.default", grad, x, w, [a["out_ch"]] if a["bias"] else None,
                    *conv, mask)
    fwd = _conv_closed_form_flops(a["x"], a["w"], out, a["transposed"], a["groups"])
    assert flops_of(call) == 2 * fwd


@FAST
@given(a=conv_args(), mask=st.lists(st.booleans(), min_size=3, max_size=3))
def test_convolution_backward_mask(a, mask):
    x, w = rand(a["x"]), rand(a["w"])
    conv = (a["stride"], a["padding"], a["dilation"], a["transposed"], a["output_padding"], a["groups"])
    out = aten.convolution.default(x, w, None, *conv)
    call, _ = check("aten.convolution_backward.default", rand(out.shape), x, w, [a["out_ch"]], *conv, mask,
                    unused=[k for k in range(3) if not mask[k]])
    fwd = _conv_closed_form_flops(a["x"], a["w"], out.shape, a["transposed"], a["groups"])
    assert flops_of(call) == fwd * (mask[0] + mask[1])


# -- pooling ------------------------------------------------------------------------------
@st.composite
def pool_args(draw, n_sp=2, dilation=True):
    k = [draw(st.integers(1, 3)) for _ in range(n_sp)]
    s = [draw(st.integers(1, 3)) for _ in range(n_sp)]
    p = [draw(st.integers(0, ki // 2)) for ki in k]
    d = [draw(st.integers(1, 2)) if dilation else 1 for _ in range(n_sp)]
    sizes = [max(1, di * (ki - 1) + 1 - 2 * pi) + draw(st.integers(0, 4)) for ki, pi, di in zip(k, p, d)]
    lead = draw(st.sampled_from([(2,), (1, 3), (2, 2)]))  # unbatched [c, *sp] or [n, c, *sp]

    def maybe_one(v):
        return v[:1] if len(set(v)) == 1 and draw(st.booleans()) else v
    stride = draw(st.sampled_from([maybe_one(s), []]))
    return (*lead, *sizes), maybe_one(k), stride, maybe_one(p), maybe_one(d), draw(st.booleans())


@FAST
@given(a=pool_args())
def test_max_pool2d(a):
    shape, k, s, p, d, ceil_mode = a
    x = rand(shape)
    call, ann = check("aten.max_pool2d_with_indices.default", x, k, s, p, d, ceil_mode)
    assert len(set(ann.fixed) & {letter for dim in ann.inputs[0][-2:] for letter in dim}) == 2
    out, idx = aten.max_pool2d_with_indices.default(x, k, s, p, d, ceil_mode)
    check("aten.max_pool2d_with_indices_backward.default", rand(out.shape), x, k, s or k, p, d, ceil_mode, idx)


@FAST
@given(a=pool_args(dilation=False), count_include_pad=st.booleans())
def test_avg_pool2d(a, count_include_pad):
    shape, k, s, p, _, ceil_mode = a
    x = rand(shape)
    check("aten.avg_pool2d.default", x, k, s, p, ceil_mode, count_include_pad)
    if all(n >= kk for n, kk in zip(shape[-2:], k * 2 if len(k) == 1 else k)):
        check("aten.avg_pool2d.default", x, k)
    out = aten.avg_pool2d.default(x, k, s, p, ceil_mode, count_include_pad)
    check("aten.avg_pool2d_backward.default", rand(out.shape), x, k, s, p, ceil_mode, count_include_pad, None)


# Fixed cases: random arguments once aborted the process inside torch's CPU max_pool3d backward.
@pytest.mark.parametrize("a", [
    ((2, 3, 5, 6, 4), [2], [2], [0], [1], False),
    ((1, 2, 7, 5, 6), [3, 2, 2], [2, 1, 2], [1, 0, 1], [1, 1, 1], True),
    ((3, 4, 4, 4), [2, 2, 1], [], [0], [1], False),
    ((2, 1, 6, 6, 6), [3], [2], [1], [2], True),
])
def test_pool3d(a):
    shape, k, s, p, d, ceil_mode = a
    x = rand(shape)
    check("aten.max_pool3d_with_indices.default", x, k, s, p, d, ceil_mode)
    out, idx = aten.max_pool3d_with_indices.default(x, k, s, p, d, ceil_mode)
    check("aten.max_pool3d_with_indices_backward.default", rand(out.shape), x, k, s or k, p, d, ceil_mode, idx)
    if all(n >= kk for n, kk in zip(shape[-3:], k * 3 if len(k) == 1 else k)):
        check("aten.avg_pool3d.default", x, k, s, p, ceil_mode)
        out = aten.avg_pool3d.default(x, k, s, p, ceil_mode)
        check("aten.avg_pool3d_backward.default", rand(out.shape), x, k, s or k, p, ceil_mode, True, None)
    check("aten._adaptive_avg_pool3d.default", x, [1, 2, 1])
    check("aten._adaptive_avg_pool3d_backward.default", rand(shape[:-3] + (1, 2, 1)), x)


@FAST
@given(a=pool_args(n_sp=1))
def test_max_pool1d(a):
    shape, k, s, p, d, ceil_mode = a
    check("aten.max_pool1d.default", rand(shape), k, s, p, d, ceil_mode)


@FAST
@given(lead=st.sampled_from([(1,), (2, 3)]), hw=shapes(2, 2, 1, 6), out=shapes(2, 2, 1, 4))
def test_adaptive_pool(lead, hw, out):
    x = rand(lead + hw)
    check("aten._adaptive_avg_pool2d.default", x, list(out))
    check("aten.adaptive_max_pool2d.default", x, list(out))
    y = aten._adaptive_avg_pool2d.default(x, list(out))
    check("aten._adaptive_avg_pool2d_backward.default", rand(y.shape), x)
    y, idx = aten.adaptive_max_pool2d.default(x, list(out))
    check("aten.adaptive_max_pool2d_backward.default", rand(y.shape), x, idx)


@pytest.mark.parametrize("op", ["aten.max_pool2d_with_indices_backward.default", "aten.avg_pool2d_backward.default"])
def test_pool_backward_fixes_spatial_dims(op):
    """Even where pooling keeps a spatial size (here W), both spatial dims are fixed."""
    x = rand((2, 3, 6, 4))
    if op.startswith("aten.max"):
        out, idx = aten.max_pool2d_with_indices.default(x, [2, 1], [2, 1])
        args = (rand(out.shape), x, [2, 1], [2, 1], [0, 0], [1, 1], False, idx)
    else:
        out = aten.avg_pool2d.default(x, [2, 1], [2, 1])
        args = (rand(out.shape), x, [2, 1], [2, 1], [0, 0], False, True, None)
    _, ann = check(op, *args)
    spatial = {letter for dim in ann.inputs[1][2:] for letter in dim}
    assert spatial <= ann.fixed
    lead = {letter for dim in ann.inputs[1][:2] for letter in dim}
    assert not lead & ann.fixed


# -- normalization -------------------------------------------------------------------------
@FAST
@given(shape=shapes(min_rank=1), data=st.data())
def test_layer_norm(shape, data):
    k = data.draw(st.integers(1, len(shape)))
    ns = list(shape[len(shape) - k:])
    affine = data.draw(st.booleans())
    w = rand(tuple(ns)) if affine else None
    b = rand(tuple(ns)) if affine and data.draw(st.booleans()) else None
    x = rand(shape)
    _, ann = check("aten.native_layer_norm.default", x, ns, w, b, 1e-5)
    assert ann.fixed == {f"nd{i}" for i in range(k)}
    y, mean, rstd = aten.native_layer_norm.default(x, ns, w, b, 1e-5)
    mask = [data.draw(st.booleans()), w is not None and data.draw(st.booleans()),
            b is not None and data.draw(st.booleans())]
    check("aten.native_layer_norm_backward.default", rand(shape), x, ns, mean, rstd, w, b, mask,
          unused=[k for k in range(3) if not mask[k]])


@st.composite
def bn_input(draw):
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    sp = draw(shapes(max_rank=3))
    return (n, c, *sp)


@FAST
@given(shape=bn_input(), affine=st.booleans(), training=st.booleans())
def test_batch_norm(shape, affine, training):
    c = shape[1]
    x = rand(shape)
    w, b = (rand((c,)), rand((c,))) if affine else (None, None)
    rm, rv = rand((c,)), rand((c,)).abs()
    check("aten._native_batch_norm_legit_functional.default", x, w, b, rm, rv, training, 0.1, 1e-5)
    check("aten._native_batch_norm_legit.default", x, w, b, rm.clone(), rv.clone(), training, 0.1, 1e-5)
    check("aten._native_batch_norm_legit.no_stats", x, w, b, True, 0.1, 1e-5)
    check("aten._native_batch_norm_legit_no_training.default", x, w, b, rm, rv, 0.1, 1e-5)
    check("aten.native_batch_norm.default", x, w, b, rm.clone(), rv.clone(), training, 0.1, 1e-5)
    y, mean, invstd = aten.native_batch_norm.default(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5)
    check("aten.native_batch_norm_backward.default", rand(shape), x, w, rm, rv, mean, invstd, True, 1e-5,
          [True, affine, affine])
    check("aten.native_batch_norm_backward.default", rand(shape), x, w, rm, rv, None, None, False, 1e-5,
          [True, affine, affine])


@FAST
@given(n=st.integers(1, 3), g=st.integers(1, 3), cg=st.integers(1, 2), sp=shapes(max_rank=2),
       affine=st.booleans(), mask=st.lists(st.booleans(), min_size=3, max_size=3))
def test_group_norm(n, g, cg, sp, affine, mask):
    mask = [mask[0], mask[1] and affine, mask[2] and affine]
    c = g * cg
    x = rand((n, c, *sp))
    w, b = (rand((c,)), rand((c,))) if affine else (None, None)
    hw = prod(sp)
    check("aten.native_group_norm.default", x, w, b, n, c, hw, g, 1e-5)
    y, mean, rstd = aten.native_group_norm.default(x, w, b, n, c, hw, g, 1e-5)
    check("aten.native_group_norm_backward.default", rand(x.shape), x, mean, rstd, w, n, c, hw, g, mask,
          unused=[k for k in range(3) if not mask[k]])


# -- losses -------------------------------------------------------------------------------
@FAST
@given(n=st.integers(1, 4), c=st.integers(1, 5), batched=st.booleans(), weighted=st.booleans(),
       reduction=st.integers(0, 2), ignore=st.integers(-100, 2))
def test_nll_loss(n, c, batched, weighted, reduction, ignore):
    x = torch.log_softmax(rand((n, c) if batched else (c,)), -1)
    target = torch.randint(0, c, (n,) if batched else ())
    weight = rand((c,)).abs() if weighted else None
    check("aten.nll_loss_forward.default", x, target, weight, reduction, ignore)
    out, total = aten.nll_loss_forward.default(x, target, weight, reduction, ignore)
    check("aten.nll_loss_backward.default", rand(out.shape), x, target, weight, reduction, ignore, total)


@FAST
@given(n=st.integers(1, 3), c=st.integers(1, 4), hw=shapes(2, 2), weighted=st.booleans(),
       reduction=st.integers(0, 2))
def test_nll_loss2d(n, c, hw, weighted, reduction):
    x = rand((n, c, *hw))
    target = torch.randint(0, c, (n, *hw))
    weight = rand((c,)).abs() if weighted else None
    check("aten.nll_loss2d_forward.default", x, target, weight, reduction, -100)
    out, total = aten.nll_loss2d_forward.default(x, target, weight, reduction, -100)
    check("aten.nll_loss2d_backward.default", rand(out.shape), x, target, weight, reduction, -100, total)


@FAST
@given(shape=shapes(), reduction=st.integers(0, 2))
def test_mse_loss(shape, reduction):
    x, y = rand(shape), rand(shape)
    check("aten.mse_loss.default", x, y, reduction)
    out = aten.mse_loss.default(x, y, reduction)
    check("aten.mse_loss_backward.default", rand(out.shape), x, y, reduction)


# -- attention ----------------------------------------------------------------------------
@st.composite
def attn_shapes(draw, mask_ranks=(2, 3, 4)):
    b, h, s, t, d = (draw(st.integers(1, 3)) for _ in range(5))
    mask = None
    if draw(st.booleans()):
        full = (b, h, s, t)
        mask = tuple(1 if draw(st.booleans()) else n for n in full[4 - draw(st.sampled_from(mask_ranks)):])
    return (b, h, s, d), (b, h, t, d), (b, h, t, d), mask


@FAST
@given(a=attn_shapes(mask_ranks=(2, 4)), causal=st.booleans(), scale=st.sampled_from([None, 0.5]))
def test_sdpa_cpu(a, causal, scale):
    qs, ks, vs, ms = a
    q, k, v = rand(qs), rand(ks), rand(vs)
    kw = {"scale": scale}
    if ms is not None:
        kw["attn_mask"] = rand(ms)
    call, _ = check("aten._scaled_dot_product_flash_attention_for_cpu.default", q, k, v, 0.0, causal, **kw)
    b, h, s, d = qs
    assert flops_of(call) == 4 * b * h * s * ks[2] * d
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, causal, **kw)
    call, _ = check("aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
                    rand(out.shape), q, k, v, out, lse, 0.0, causal, **kw)
    assert flops_of(call) == 10 * b * h * s * ks[2] * d


def _meta(shape):
    return torch.empty(shape, device="meta")


@FAST
@given(a=attn_shapes(), causal=st.booleans(), lse=st.booleans())
def test_sdpa_cuda_variants_on_meta(a, causal, lse):
    """The CUDA kernels' shapes, from their meta implementations."""
    qs, ks, vs, ms = a
    q, k, v = _meta(qs), _meta(ks), _meta(vs)
    check("aten._scaled_dot_product_flash_attention.default", q, k, v, 0.0, causal)
    bias = _meta(ms) if ms is not None else None
    check("aten._scaled_dot_product_efficient_attention.default", q, k, v, bias, lse, 0.0, causal)


# -- flops and bytes ------------------------------------------------------------------------
def test_views_move_no_bytes():
    x = rand((2, 3, 4))
    for op, args in [("aten.view.default", ([6, 4],)), ("aten.permute.default", ([2, 0, 1],)),
                     ("aten.transpose.int", (0, 1)), ("aten.slice.Tensor", (1, 0, 2)),
                     ("aten.expand.default", ([5, 2, 3, 4],)), ("aten.unsqueeze.default", (0,)),
                     ("aten.select.int", (0, 1)), ("aten.split.Tensor", (1, 1))]:
        call, _ = check(op, x, *args)
        assert lookup(op).kind is OpKind.VIEW
        assert bytes_of(call) == 0 and flops_of(call) == 0


def test_bytes_and_flops_of_elementwise_and_reductions():
    x, y = rand((2, 3)), rand((3,))
    call, _ = check("aten.add.Tensor", x, y)
    assert bytes_of(call) == 4 * (6 + 3 + 6)
    assert flops_of(call) == 6
    call, _ = check("aten.sum.dim_IntList", x, [1])
    assert flops_of(call) == 6
    assert bytes_of(call) == 4 * (6 + 2)
    call, _ = check("aten._softmax.default", x, -1, False)
    assert flops_of(call) == 5 * 6
    call, _ = check("aten.cat.default", [x, x], 0)
    assert bytes_of(call) == 4 * (6 + 6 + 12) and flops_of(call) == 0
    call, _ = check("aten._to_copy.default", x, dtype=torch.float16)
    assert bytes_of(call) == 4 * 6 + 2 * 6


def test_unknown_op_is_opaque():
    from rhino.ir.registry import OpCall
    call = OpCall("aten.not_an_op.default", [], {}, [TensorType((2,), DType.float32)],
                  [TensorType((2,), DType.float32)])
    assert annotate(call) is None
    assert flops_of(call) == 0
    assert bytes_of(call) == 16


def test_registry_names_are_real_aten_overloads():
    from rhino.ir.registry import REGISTRY
    lookup("aten.mm.default")  # loads the tables
    missing = []
    for name in REGISTRY:
        try:
            _overload(name)
        except (AttributeError, RuntimeError):
            missing.append(name)
    assert not missing, f"registered names that are not aten overloads: {missing}"


def test_register_twice_is_an_error():
    from rhino.ir.registry import register
    with pytest.raises(ValueError, match="twice"):
        register("aten.mm.default", OpKind.MATMUL, "m k+, k+ n -> m n")
