"""Views, data movement, creation and indexing ops (registered on import)."""
from __future__ import annotations

from itertools import accumulate
from math import ceil, prod
from operator import mul

from .annotation import Annotation, Dim
from .registry import Accumulate, Family, Linear, OpCall, OpKind, SizeArg, SizeRule, Values, lookup, register
from .types import DType
from .rules import NewLetters, fixed_from_types, letters, norm_dim

V = OpKind.VIEW


def _spec(names: list[str]) -> tuple[Dim, ...]:
    return tuple((x,) for x in names)


def _resolve_size(size: list[int], numel: int) -> list[int]:
    size = list(size)
    if -1 in size:
        known = prod(s for s in size if s != -1)
        size[size.index(-1)] = numel // known if known else 0
    return size


def _refinement(gin: list[int], gout: list[int]) -> tuple | None:
    """The common factors of two groups of dims with the same product, as (factor sizes, each input dim's
    factor indices, each output dim's), or None when there are none: the cuts of both sides (their
    running products) must each divide the next. ``(8, 64) -> (32, 16)`` (an attention's ``(batch, heads x
    head_dim) -> (batch x heads, head_dim)``) is the factors ``8, 4, 16``: ``(a, bc) -> (ab, c)``; ``(6, 4)
    -> (4, 6)`` has none. Dims of size 1 inside a group give none (they have no factor of their own)."""
    if 1 in gin or 1 in gout:
        return None
    cuts = sorted(set(accumulate(gin, mul)) | set(accumulate(gout, mul)))
    sizes, prev = [], 1
    for c in cuts:
        if c % prev:
            return None
        sizes.append(c // prev)
        prev = c

    def dims(group: list[int]) -> list[tuple[int, ...]]:
        out, k = [], 0
        for n in group:
            first, p = k, 1
            while p < n:
                p *= sizes[k]
                k += 1
            out.append(tuple(range(first, k)))
        return out
    return sizes, dims(gin), dims(gout)


def view_rule(call: OpCall) -> Annotation:
    """Reshape: group dims whose products match; a 1-to-many group is a merged dim, a many-to-many group
    is written in the common factors of both sides where they exist (``_refinement``), else kept whole."""
    src = list(call.in_types[0].shape)
    dst = _resolve_size(call.arg(1, "size"), call.in_types[0].numel)
    new = NewLetters("v")
    if 0 in src or 0 in dst:  # empty: products do not tell which dims correspond; keep all whole
        a, b = [new(n) for n in src], [new(n) for n in dst]
        return Annotation((_spec(a),), (_spec(b),), fixed=frozenset(a + b), sizes=new.sizes)
    ins: list[Dim] = []
    outs: list[Dim] = []
    fixed: set[str] = set()
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            ins.append((new(1),)); i += 1; continue
        if j < len(dst) and dst[j] == 1:
            outs.append((new(1),)); j += 1; continue
        if i == len(src) or j == len(dst):
            raise ValueError(f"cannot view {src} as {dst}")
        ii, jj, pi, pj = i + 1, j + 1, src[i], dst[j]
        while pi != pj:
            if pi < pj:
                pi *= src[ii]; ii += 1
            else:
                pj *= dst[jj]; jj += 1
        gin, gout = src[i:ii], dst[j:jj]
        if len(gin) == 1:
            parts = [new(n) for n in gout]
            ins.append(tuple(parts)) if len(parts) > 1 else ins.append((parts[0],))
            outs.extend((p,) for p in parts)
        elif len(gout) == 1:
            parts = [new(n) for n in gin]
            ins.extend((p,) for p in parts)
            outs.append(tuple(parts))
        else:  # many-to-many: the common factors of both sides where they exist, else whole dims
            common = _refinement(gin, gout)
            if common is None:
                a = [new(n) for n in gin]
                b = [new(n) for n in gout]
                ins.extend((x,) for x in a)
                outs.extend((x,) for x in b)
                fixed.update(a + b)
            else:
                names = [new(n) for n in common[0]]
                ins.extend(tuple(names[k] for k in dim) for dim in common[1])
                outs.extend(tuple(names[k] for k in dim) for dim in common[2])
        i, j = ii, jj
    return Annotation((tuple(ins),), (tuple(outs),), fixed=frozenset(fixed), sizes=new.sizes)


_SHAPE_ARG = (SizeArg(1, SizeRule.OUT_SHAPE),)
# a view of a shard may need a copy (the shard is laid out differently from the global tensor): reshape
register("aten.view.default aten._unsafe_view.default", V, view_rule, size_args=_SHAPE_ARG,
         local_op="aten.reshape.default", family=Family.RESHAPE)
register("aten.reshape.default", V, view_rule, size_args=_SHAPE_ARG, family=Family.RESHAPE)


def permute_rule(call: OpCall) -> Annotation:
    rank = call.in_types[0].rank
    names = letters("p", rank)
    order = [norm_dim(d, rank) for d in call.arg(1, "dims")]
    return Annotation((_spec(names),), (_spec([names[d] for d in order]),))


def transpose_rule(call: OpCall) -> Annotation:
    rank = call.in_types[0].rank
    names = letters("p", rank)
    if call.op == "aten.t.default":
        a, b = (0, 1) if rank == 2 else (0, 0)
    else:
        a, b = norm_dim(call.arg(1), rank), norm_dim(call.arg(2), rank)
    out = list(names)
    if rank:  # a 0-d tensor transposes to itself
        out[a], out[b] = out[b], out[a]
    return Annotation((_spec(names),), (_spec(out),))


def expand_rule(call: OpCall) -> Annotation:
    shape = call.in_types[0].shape
    size = list(call.arg(1, "size"))
    new = NewLetters("x")
    lead = len(size) - len(shape)
    ins, outs = [], []
    for k, n in enumerate(size):
        if k < lead:
            outs.append((new(n),))
            continue
        m = shape[k - lead]
        if n in (-1, m):
            x = new(m)
            ins.append((x,)); outs.append((x,))
        else:  # broadcast of a size-1 dim
            ins.append((new(1),)); outs.append((new(n),))
    return Annotation((tuple(ins),), (tuple(outs),), sizes=new.sizes)


def unsqueeze_rule(call: OpCall) -> Annotation:
    rank = call.in_types[0].rank
    names = letters("u", rank)
    d = norm_dim(call.arg(1, "dim"), rank + 1)
    return Annotation((_spec(names),), (_spec(names[:d] + ["one"] + names[d:]),), sizes={"one": 1})


def squeeze_rule(call: OpCall) -> Annotation:
    shape = call.in_types[0].shape
    rank = len(shape)
    dims = call.arg(1, "dim")
    if dims is None:
        drop = {i for i, n in enumerate(shape) if n == 1}
    else:
        dims = [dims] if isinstance(dims, int) else dims
        drop = {norm_dim(d, rank) for d in dims if shape[norm_dim(d, rank)] == 1} if rank else set()
    names = letters("s", rank)
    return Annotation((_spec(names),), (_spec([x for i, x in enumerate(names) if i not in drop]),))


def complex_view_rule(call: OpCall) -> Annotation:
    """``view_as_complex``: ``(..., 2) -> (...)``; ``view_as_real``: ``(...) -> (..., 2)``: the other dims pass
    through, the pair of real and imaginary parts is never split."""
    rank = call.in_types[0].rank
    if call.op == "aten.view_as_complex.default":
        names = letters("z", rank - 1)
        return Annotation((_spec(names + ["pair"]),), (_spec(names),), fixed=frozenset({"pair"}), sizes={"pair": 2})
    names = letters("z", rank)
    return Annotation((_spec(names),), (_spec(names + ["pair"]),), fixed=frozenset({"pair"}), sizes={"pair": 2})


register("aten.view_as_complex.default aten.view_as_real.default", V, complex_view_rule)
register("aten.permute.default", V, permute_rule, family=Family.PERMUTE)
register("aten.transpose.int", V, transpose_rule, family=Family.TRANSPOSE)
register("aten.t.default", V, transpose_rule, family=Family.PERMUTE, accumulate=Accumulate.SEE_THROUGH)
register("aten.expand.default", V, expand_rule, size_args=_SHAPE_ARG)
register("aten.unsqueeze.default", V, unsqueeze_rule)
# locally: squeeze the dims of global size 1 only (a split dim may have size 1 on a rank)
register("aten.squeeze.dim aten.squeeze.dims aten.squeeze.default", V, squeeze_rule,
         size_args=(SizeArg(1, SizeRule.SQUEEZED),), local_op="aten.squeeze.dims")


def _one_dim_changes(call: OpCall, dim: int, out_sizes: list[int]) -> Annotation:
    """The first input keeps all dims but ``dim``, which becomes a fixed dim of each output size."""
    rank = call.in_types[0].rank
    names = letters("c", rank)
    outs = []
    sizes = {}
    for k, n in enumerate(out_sizes):
        o = list(names)
        o[dim] = f"out{k}"
        sizes[f"out{k}"] = n
        outs.append(_spec(o))
    return Annotation((_spec(names),), tuple(outs), fixed=frozenset({names[dim], *sizes}), sizes=sizes)


def slice_rule(call: OpCall) -> Annotation:
    shape = call.in_types[0].shape
    dim = norm_dim(call.arg(1, "dim", 0), len(shape))
    n = shape[dim]
    start, end, step = call.arg(2, "start"), call.arg(3, "end"), call.arg(4, "step", 1) or 1
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else (end + n if end < 0 else end)
    start, end = min(max(start, 0), n), min(max(end, 0), n)
    return _one_dim_changes(call, dim, [max(0, ceil((end - start) / step))])


def select_rule(call: OpCall) -> Annotation:
    rank = call.in_types[0].rank
    dim = norm_dim(call.arg(1, "dim"), rank)
    names = letters("c", rank)
    return Annotation((_spec(names),), (_spec(names[:dim] + names[dim + 1:]),), fixed=frozenset({names[dim]}))


def split_rule(call: OpCall) -> Annotation:
    shape = call.in_types[0].shape
    dim = norm_dim(call.arg(2, "dim", 0), len(shape))
    arg = call.arg(1)
    if isinstance(arg, int):
        n = shape[dim]
        sizes = [min(arg, n - k) for k in range(0, n, arg)] if arg and n else [n]  # empty dim: one empty chunk
    else:
        sizes = list(arg)
    if len(sizes) > 1 and len(set(sizes)) == 1 and sizes[0] > 0:
        return _equal_chunks(call.in_types[0].rank, dim, len(sizes), sizes[0], split=True)
    return _one_dim_changes(call, dim, sizes)


def _equal_chunks(rank: int, dim: int, k: int, chunk: int, split: bool) -> Annotation:
    """k equal chunks along ``dim``: the whole dim is the merged ``(chunks c)``, each chunk is ``c``.

    Splitting ``c`` is a strided shard of the whole dim (``blocks = k``): a fused QKV activation
    split into Q, K and V keeps each rank's heads without any gather."""
    names = letters("c", rank)
    whole = [(x,) for x in names]
    whole[dim] = ("chunks", "c")
    part = [(x,) for x in names]
    part[dim] = ("c",)
    whole_t, part_t = tuple(whole), tuple(part)
    sizes = {"chunks": k, "c": chunk}
    if split:
        return Annotation((whole_t,), tuple(part_t for _ in range(k)), fixed=frozenset({"chunks"}), sizes=sizes)
    return Annotation(tuple(part_t for _ in range(k)), (whole_t,), fixed=frozenset({"chunks"}), sizes=sizes)


def unbind_rule(call: OpCall) -> Annotation:
    rank = call.in_types[0].rank
    dim = norm_dim(call.arg(1, "dim", 0), rank)
    names = letters("c", rank)
    out = _spec(names[:dim] + names[dim + 1:])
    return Annotation((_spec(names),), tuple(out for _ in range(call.in_types[0].shape[dim])),
                      fixed=frozenset({names[dim]}))


def cat_rule(call: OpCall) -> Annotation:
    shapes = [t.shape for t in call.in_types]
    rank = max(len(s) for s in shapes)
    dim = norm_dim(call.arg(1, "dim", 0), rank)
    if len(shapes) > 1 and all(len(s) == rank for s in shapes) and len({s[dim] for s in shapes}) == 1 \
            and shapes[0][dim] > 0:
        return _equal_chunks(rank, dim, len(shapes), shapes[0][dim], split=False)
    names = letters("c", rank)
    ins, sizes = [], {}
    for k, s in enumerate(shapes):
        if len(s) != rank:  # legacy: 1-D empty tensors are skipped by cat
            ins.append(_spec([f"empty{k}"])); sizes[f"empty{k}"] = s[0] if s else 0
            continue
        o = list(names)
        o[dim] = f"in{k}"
        ins.append(_spec(o))
    sizes["cat"] = sum(s[dim] for s in shapes if len(s) == rank)
    out = list(names)
    out[dim] = "cat"
    fixed = {"cat", *(f"in{k}" for k in range(len(shapes))), *(x for x in sizes if x.startswith("empty"))}
    return Annotation(tuple(ins), (_spec(out),), fixed=frozenset(fixed), sizes=sizes)


def stack_rule(call: OpCall) -> Annotation:
    rank = call.in_types[0].rank
    dim = norm_dim(call.arg(1, "dim", 0), rank + 1)
    names = letters("c", rank)
    out = names[:dim] + ["stack"] + names[dim:]
    return Annotation(tuple(_spec(names) for _ in call.in_types), (_spec(out),),
                      fixed=frozenset({"stack"}), sizes={"stack": len(call.in_types)})


D = OpKind.DATA_MOVEMENT
register("aten.slice.Tensor", V, slice_rule)
register("aten.select.int", V, select_rule, family=Family.SELECT)
register("aten.split.Tensor", V, split_rule, size_args=(SizeArg(1, SizeRule.SPLIT_SIZE),), family=Family.SPLIT)
register("aten.split_with_sizes.default", V, split_rule, size_args=(SizeArg(1, SizeRule.SPLIT_SIZES),),
         family=Family.SPLIT)
# the unsafe variants (RNN cells' gate chunks) differ only in autograd's view tracking: the same rule
register("aten.unsafe_split.Tensor", V, split_rule, size_args=(SizeArg(1, SizeRule.SPLIT_SIZE),), family=Family.SPLIT)
register("aten.unsafe_split_with_sizes.default", V, split_rule, size_args=(SizeArg(1, SizeRule.SPLIT_SIZES),),
         family=Family.SPLIT)
register("aten.unbind.int", V, unbind_rule, family=Family.UNBIND)
register("aten.cat.default", D, cat_rule, linear=Linear.ALL, family=Family.CAT)
register("aten.stack.default", D, stack_rule)


def tril_rule(call: OpCall) -> Annotation:
    rank = call.in_types[0].rank
    names = letters("t", rank)
    return Annotation((_spec(names),), (_spec(names),), fixed=frozenset(names[-2:]))


register("aten.tril.default aten.triu.default", OpKind.ELEMENTWISE, tril_rule)


def _creation_shape(call: OpCall) -> tuple[int, ...]:
    op = call.op
    if op.startswith("aten.arange"):
        a = [x for x in call.args]
        start, end, step = (0, a[0], 1) if op == "aten.arange.default" else (a[0], a[1], a[2] if len(a) > 2 else call.kwargs.get("step", 1))
        return (max(0, ceil((end - start) / step)),)
    if op == "aten.scalar_tensor.default":
        return ()
    sizes = lookup(op).size_args     # where the size argument is (``new_zeros(x, size)``, ``randint(lo, hi, size)``)
    return tuple(call.arg(sizes[0].at if sizes else 0, "size"))


def sized_creation_rule(call: OpCall) -> Annotation:
    """A new tensor of a given size: split dims are made at their local size (the lowering rewrites
    the size argument), except ``arange``, whose values are global positions: its dim is fixed."""
    new = NewLetters("n")
    shape = _creation_shape(call)
    ins = tuple(tuple((new(n),) for n in t.shape) for t in call.in_types)
    out = tuple((new(n),) for n in shape)
    fixed = frozenset(d[0] for d in out) if call.op.startswith("aten.arange") else frozenset()
    return Annotation(ins, (out,), sizes=new.sizes, fixed=fixed)


C = OpKind.CREATION
_SIZE_0, _SIZE_1 = (SizeArg(0, SizeRule.OUT_SHAPE),), (SizeArg(1, SizeRule.OUT_SHAPE),)
register("aten.full.default aten.zeros.default aten.ones.default", C, sized_creation_rule, size_args=_SIZE_0)
# an identity: every dim fixed (a rank's share of it is not a smaller identity), so it is made whole everywhere
register("aten.eye.default aten.eye.m", C, fixed_from_types)
# evenly spaced points: each value depends on its global index (affine_grid's backward makes its base grid so)
register("aten.linspace.default aten.logspace.default", C, fixed_from_types)
register("aten.empty.memory_format", C, sized_creation_rule, size_args=_SIZE_0, values=Values.UNINITIALIZED)
register("aten.rand.default aten.randn.default", C, sized_creation_rule, size_args=_SIZE_0, values=Values.NOISE)
register("aten.randint.default", C, sized_creation_rule, size_args=_SIZE_1, values=Values.NOISE)
register("aten.randint.low aten.normal.float_float", C, sized_creation_rule,
         size_args=(SizeArg(2, SizeRule.OUT_SHAPE),), values=Values.NOISE)
register("aten.arange.default aten.arange.start aten.arange.start_step aten.scalar_tensor.default", C,
         sized_creation_rule)
register("aten.new_zeros.default aten.new_ones.default aten.new_full.default", C, sized_creation_rule,
         size_args=_SIZE_1)
#: ``new_zeros(x, size)`` and its kin read only ``x``'s dtype and device, which the IR knows: capture records them
#: as the plain creation op (``capture.to_ir``), so that no sharding rule asks for ``x`` in any layout (data
#: parallelism all-gathered a gradient only for ``new_zeros`` to read its dtype). Op -> (the plain op, how many
#: arguments after ``x`` it keeps; ``new_empty_strided``'s strides only say how uninitialised values are laid out)
WITHOUT_INPUT = {"aten.new_zeros.default": ("aten.zeros.default", 1), "aten.new_ones.default": ("aten.ones.default", 1),
                 "aten.new_full.default": ("aten.full.default", 2),
                 "aten.new_empty.default": ("aten.empty.memory_format", 1),
                 "aten.new_empty_strided.default": ("aten.empty.memory_format", 1)}
register("aten.new_empty.default", C, sized_creation_rule, size_args=_SIZE_1, values=Values.UNINITIALIZED)

# Indexing: shapes depend on index values or on structure the notation cannot
# say; their dims are fixed (replicated) until a custom sharding rule exists.
I = OpKind.INDEX


def gather_rule(call: OpCall) -> Annotation:
    rank = call.in_types[0].rank
    dim = norm_dim(call.arg(1, "dim"), rank)
    x, idx = call.in_types[0].shape, call.in_types[1].shape
    if len(idx) != rank or any(idx[k] != x[k] for k in range(rank) if k != dim):
        return fixed_from_types(call)
    names = letters("g", rank)
    i = list(names)
    i[dim] = "idx"
    return Annotation((_spec(names), _spec(i)), (_spec(i),), fixed=frozenset({names[dim], "idx"}))


def scatter_rule(call: OpCall) -> Annotation:
    """scatter/scatter_add/scatter_reduce(self, dim, index, src|value): output like self."""
    rank = call.in_types[0].rank
    dim = norm_dim(call.arg(1, "dim"), rank)
    shapes = [t.shape for t in call.in_types]
    if any(len(s) != rank or any(s[k] != shapes[0][k] for k in range(rank) if k != dim) for s in shapes[1:]):
        return fixed_from_types(call)
    names = letters("g", rank)
    i = list(names)
    i[dim] = "idx"
    src = list(names)  # src may be longer than index along dim (only its first entries are used)
    src[dim] = "src"
    ins = (_spec(names), _spec(i)) + ((_spec(src),) if len(shapes) > 2 else ())
    return Annotation(ins, (_spec(names),), fixed=frozenset({names[dim], "idx", "src"}))


def topk_rule(call: OpCall) -> Annotation:
    rank = call.in_types[0].rank
    dim = norm_dim(call.arg(2, "dim", -1), rank)
    return _one_dim_changes(call, dim, [call.arg(1, "k")] * 2)


def index_select_rule(call: OpCall) -> Annotation:
    rank = call.in_types[0].rank
    dim = norm_dim(call.arg(1, "dim"), rank)
    names = letters("g", rank)
    out = list(names)
    out[dim] = "idx"
    scalar = call.in_types[1].rank == 0  # a 0-d index selects one entry
    return Annotation((_spec(names), () if scalar else (("idx",),)), (_spec(out),),
                      fixed=frozenset({names[dim], "idx"}), sizes={"idx": 1} if scalar else {})


register("aten.gather.default", I, gather_rule)
register("aten.scatter.src aten.scatter.value aten.scatter_add.default aten.scatter_reduce.two",
         I, scatter_rule)
register("aten.topk.default", I, topk_rule)
register("aten.index_select.default", I, index_select_rule)
def index_put_rule(call: OpCall) -> Annotation:
    """``x[mask] = v`` with one boolean mask shaped like ``x`` and a 0-dim ``v``, not accumulated (a masked fill
    written as indexing: Rprop, ``t[t < 0] = 0``): element-wise; any other indexing: every dim fixed."""
    ts = call.in_types
    indices = call.arg(1, "indices")
    if (len(ts) == 3 and isinstance(indices, (list, tuple)) and len(indices) == 1 and ts[1].dtype is DType.bool
            and ts[1].shape == ts[0].shape and ts[2].rank == 0 and not call.arg(3, "accumulate", False)):
        names = letters("e", ts[0].rank)
        return Annotation((_spec(names), _spec(names), ()), (_spec(names),))
    return fixed_from_types(call)


register("aten.index_put.default aten._unsafe_index_put.default", I, index_put_rule)
register("aten.masked_scatter.default aten.masked_scatter_backward.default aten.as_strided.default "
         "aten.as_strided_scatter.default", I, fixed_from_types)
# nn.Embedding(max_norm=...): the rows its indices look up rescaled to the norm, in a whole weight
register("aten.embedding_renorm.default", I, fixed_from_types)


def index_fill_rule(call: OpCall) -> Annotation:
    """``index_fill(x, dim, index, value)``: the rows ``index`` of ``dim`` set to ``value`` (a number or a 0-d
    tensor); ``dim`` and the index are fixed, every other dim passes through."""
    x = call.in_types[0].shape
    d = norm_dim(call.arg(1, "dim"), len(x))
    xs = list(_spec(letters("k", len(x))))
    xs[d] = ("xd",)
    ins = [tuple(xs), (("ix",),)] + [()] * (len(call.in_types) - 2)
    return Annotation(tuple(ins), (tuple(xs),), fixed=frozenset({"xd", "ix"}))


register("aten.index_fill.int_Tensor aten.index_fill.int_Scalar", I, index_fill_rule)


def diagonal_rule(call: OpCall) -> Annotation:
    """``diagonal(x, offset, dim1, dim2)`` (x's other dims in order, then the diagonal) and ``diagonal_scatter(x,
    src, offset, dim1, dim2)`` (src, shaped like that diagonal, written into a copy of x): the planes ``dim1,
    dim2`` and the diagonal are fixed, every other dim passes through (each matrix of a batch on its own)."""
    x = call.in_types[0]
    scatter = call.op.startswith("aten.diagonal_scatter")
    first = 3 if scatter else 2
    d1 = norm_dim(call.arg(first, "dim1", 0), x.rank)
    d2 = norm_dim(call.arg(first + 1, "dim2", 1), x.rank)
    new = NewLetters("f")
    batch = iter(letters("e", x.rank - 2))
    full = tuple((new(n),) if i in (d1, d2) else (next(batch),) for i, n in enumerate(x.shape))
    diag = _spec(letters("e", x.rank - 2)) + ((new(call.in_types[1].shape[-1] if scatter
                                                   else call.out_types[0].shape[-1]),),)
    if scatter:
        return Annotation((full, diag), (full,), fixed=frozenset(new.sizes), sizes=new.sizes)
    return Annotation((full,), (diag,), fixed=frozenset(new.sizes), sizes=new.sizes)


register("aten.diagonal.default aten.diagonal_scatter.default", I, diagonal_rule)


def diagonal_planes_rule(call: OpCall) -> Annotation:
    """``diag_embed(x, offset, dim1, dim2)`` (x's last dim becomes the diagonal of the output's planes
    ``dim1, dim2``) and ``diagonal_backward(grad, sizes, offset, dim1, dim2)`` (grad's last dim, the diagonal,
    written back into the planes ``dim1, dim2`` of a zero tensor of ``sizes``): the diagonal and the planes are
    fixed, every other dim passes through in order (a batch of matrices is built independently)."""
    x, out = call.in_types[0], call.out_types[0]
    embed = call.op.startswith("aten.diag_embed")
    d1 = norm_dim(call.arg(2 if embed else 3, "dim1", -2 if embed else 0), out.rank)
    d2 = norm_dim(call.arg(3 if embed else 4, "dim2", -1 if embed else 1), out.rank)
    new = NewLetters("f")
    batch = letters("e", x.rank - 1)
    ins = _spec(batch + [new(x.shape[-1])])
    rest = iter(batch)
    outs = tuple((new(n),) if i in (d1, d2) else (next(rest),) for i, n in enumerate(out.shape))
    return Annotation((ins,), (outs,), fixed=frozenset(new.sizes), sizes=new.sizes)


register("aten.diag_embed.default", I, diagonal_planes_rule)
register("aten.diagonal_backward.default", I, diagonal_planes_rule, size_args=(SizeArg(1, SizeRule.OUT_SHAPE),))


# Ops that move data along some dims and leave the others alone: the untouched dims pass through
# (a batch split stays split), the touched ones are fixed.
def _touching(call: OpCall, dims, out_index: int | None = 0) -> Annotation:
    """The first input and output ``out_index`` (None: no output shaped like it) share every dim but
    ``dims``, which are fixed (sized separately in input and output)."""
    shape = call.in_types[0].shape
    rank = len(shape)
    touched = {norm_dim(d, rank) for d in dims}
    names = letters("k", rank)
    new = NewLetters("z")
    ins = tuple((new(n),) if i in touched else (x,) for i, (x, n) in enumerate(zip(names, shape)))
    outs = []
    for t in call.out_types:
        if t is None or t.rank != rank:
            outs.append(None if t is None else tuple((new(n),) for n in t.shape))
            continue
        outs.append(tuple((new(n),) if i in touched else (x,) for i, (x, n) in enumerate(zip(names, t.shape))))
    return Annotation((ins,) + tuple(tuple((new(n),) for n in t.shape) for t in call.in_types[1:]), tuple(outs),
                      fixed=frozenset(new.sizes), sizes=new.sizes)


def roll_rule(call: OpCall) -> Annotation:
    dims = call.arg(2, "dims") or []
    return _touching(call, dims) if dims else fixed_from_types(call)  # no dims: a roll of the flattened tensor


def flip_rule(call: OpCall) -> Annotation:
    return _touching(call, call.arg(1, "dims"))


def pad_rule(call: OpCall) -> Annotation:
    """constant_pad_nd(x, pad): pad names the last len(pad) / 2 dims (last dim first)."""
    rank = call.in_types[0].rank
    return _touching(call, range(rank - len(call.arg(1, "pad")) // 2, rank))


def repeat_rule(call: OpCall) -> Annotation:
    """repeat(x, repeats): dims repeated once pass through; new leading dims and repeated ones are fixed."""
    shape = call.in_types[0].shape
    reps = list(call.arg(1, "repeats"))
    lead = len(reps) - len(shape)
    names = letters("k", len(shape))
    new = NewLetters("z")
    ins = tuple((x,) if reps[lead + i] == 1 else (new(n),) for i, (x, n) in enumerate(zip(names, shape)))
    out = tuple((new(n),) for n in call.out_types[0].shape[:lead]) + tuple(
        (x,) if reps[lead + i] == 1 else (new(n * reps[lead + i]),) for i, (x, n) in enumerate(zip(names, shape)))
    return Annotation((ins,), (out,), fixed=frozenset(new.sizes), sizes=new.sizes)


def one_hot_rule(call: OpCall) -> Annotation:
    """one_hot(indices [*], classes) -> [* classes]: the index dims pass through."""
    rank = call.in_types[0].rank
    names = _spec(letters("k", rank))
    classes = call.out_types[0].shape[-1]
    return Annotation((names,), (names + (("cls",),),), fixed=frozenset({"cls"}), sizes={"cls": classes})


def scatter_into_rule(call: OpCall) -> Annotation:
    """slice_scatter / select_scatter (x, src, dim, ...) -> like x; index_add (x, dim, index, src):
    x and src share every dim but ``dim``."""
    x = call.in_types[0].shape
    dim_index = 1 if call.op == "aten.index_add.default" else 2
    d = norm_dim(call.arg(dim_index, "dim", 0), len(x))
    names = letters("k", len(x))
    xs = list(_spec(names))
    xs[d] = ("xd",)
    src = list(_spec(names))
    if call.op == "aten.select_scatter.default":
        del src[d]
    else:
        src[d] = ("sd",)
    sizes = {"sd": call.in_types[-1].shape[d]} if call.op != "aten.select_scatter.default" else {}
    ins = [tuple(xs), tuple(src)]
    if call.op == "aten.index_add.default":
        ins = [tuple(xs), (("ix",),), tuple(src)]
    return Annotation(tuple(ins), (tuple(xs),), fixed=frozenset({"xd", "sd", "ix"}), sizes=sizes)


def backward_into_rule(call: OpCall) -> Annotation:
    """slice_backward / select_backward (grad, input_sizes, dim, ...) -> zeros of input_sizes with grad
    written in: every dim but ``dim`` passes through."""
    size = list(call.arg(1, "input_sizes"))
    d = norm_dim(call.arg(2, "dim"), len(size))
    names = letters("k", len(size))
    out = list(_spec(names))
    out[d] = ("od",)
    g = list(_spec(names))
    if call.op == "aten.select_backward.default":
        del g[d]
    else:
        g[d] = ("gd",)
    sizes = {"od": size[d]}
    if call.op == "aten.slice_backward.default":
        sizes["gd"] = call.in_types[0].shape[d]
    return Annotation((tuple(g),), (tuple(out),), fixed=frozenset({"od", "gd"}), sizes=sizes)


def unfold_rule(call: OpCall) -> Annotation:
    """unfold(x, dim, size, step) -> x with ``dim`` replaced by the window count, plus a window dim."""
    x = call.in_types[0].shape
    d = norm_dim(call.arg(1, "dimension"), len(x))
    out = call.out_types[0].shape
    names = letters("k", len(x))
    ins = list(_spec(names))
    ins[d] = ("ud",)
    outs = list(_spec(names))
    outs[d] = ("wins",)
    return Annotation((tuple(ins),), (tuple(outs) + (("win",),),), fixed=frozenset({"ud", "wins", "win"}),
                      sizes={"wins": out[d], "win": out[-1]})


def index_rule(call: OpCall) -> Annotation:
    """index / _unsafe_index (x, [idx or None per leading dim]): with the indexed dims adjacent, the
    dims indexed by None pass through and the indexed block becomes the broadcast index shape (fixed);
    otherwise (torch moves the block to the front) every dim is fixed."""
    indices = call.arg(1, "indices")
    pos = [i for i, a in enumerate(indices) if a is not None]
    masks = any(call._types[a.id].dtype in (DType.bool, DType.uint8) for a in indices if a is not None)
    if masks or not pos or pos != list(range(pos[0], pos[-1] + 1)):
        return fixed_from_types(call)
    x = call.in_types[0].shape
    out = call.out_types[0].shape
    names = letters("k", len(x))
    new = NewLetters("z")
    block = len(out) - (len(x) - len(pos))
    bnames = [new(n) for n in out[pos[0]:pos[0] + block]]
    xs = tuple((new(n),) if i in pos else (x_,) for i, (x_, n) in enumerate(zip(names, x)))
    ins = [xs]
    for a in indices:
        if a is not None:
            t = call._types[a.id].shape
            ins.append(tuple((bnames[block - len(t) + i],) if n == out[pos[0] + block - len(t) + i] else (new(n),)
                             for i, n in enumerate(t)))
    outs = tuple((x_,) for x_ in names[:pos[0]]) + tuple((b,) for b in bnames) + tuple(
        (x_,) for x_ in names[pos[-1] + 1:])
    return Annotation(tuple(ins), (outs,), fixed=frozenset(new.sizes), sizes=new.sizes)


register("aten.roll.default", I, roll_rule)
register("aten.flip.default", I, flip_rule)
register("aten.constant_pad_nd.default", I, pad_rule)
register("aten.repeat.default", I, repeat_rule)
register("aten.one_hot.default", I, one_hot_rule)
register("aten.slice_scatter.default aten.select_scatter.default aten.index_add.default", I, scatter_into_rule)
register("aten.slice_backward.default aten.select_backward.default", I, backward_into_rule,
         size_args=(SizeArg(1, SizeRule.OUT_SHAPE),))
register("aten.unfold.default", I, unfold_rule)
register("aten.index.Tensor aten._unsafe_index.Tensor", I, index_rule)
