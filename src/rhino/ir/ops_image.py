"""Image and signal ops on ``(batch, channels, *spatial)`` tensors: resampling, reflection and replication
padding, ``unfold`` / ``fold``, affine grids and grid sampling (registered on import). The batch and channel dims
pass through and may be split; the spatial dims are fixed (each output pixel reads a neighbourhood of input
pixels)."""
from __future__ import annotations

from .annotation import Annotation, parse
from .registry import OpCall, OpKind, SizeArg, SizeRule, register
from .rules import NewLetters, letters

_SPATIAL = {"1d": 1, "2d": 2, "3d": 3}


def _spatial(op: str) -> int:
    """Spatial dims of ``op`` from its name (``upsample_bilinear2d_backward`` -> 2)."""
    return next(n for tag, n in _SPATIAL.items() if tag in op.split(".")[1])


def _lead_fixed(shape: tuple[int, ...], n_sp: int, lead: list[str], new: NewLetters) -> tuple:
    """``shape`` as the shared leading letters and fresh (fixed) spatial letters."""
    return tuple((x,) for x in lead) + tuple((new(n),) for n in shape[len(shape) - n_sp:])


def spatial_rule(call: OpCall) -> Annotation:
    """One tensor in, one out (``upsample_*``, ``reflection_pad*``, ``replication_pad*`` and the resampling
    backwards, whose input is the gradient): the leading dims shared, the spatial dims fixed."""
    x, out = call.in_types[0].shape, call.out_types[0].shape
    n_sp = _spatial(call.op)
    lead, new = letters("l", len(x) - n_sp), NewLetters("s")
    ins = _lead_fixed(x, n_sp, lead, new)
    outs = _lead_fixed(out, n_sp, lead, new)
    return Annotation((ins,), (outs,), fixed=frozenset(new.sizes), sizes=new.sizes)


def pad_backward_rule(call: OpCall) -> Annotation:
    """``reflection_pad*_backward`` / ``replication_pad*_backward(grad_out, x, padding)`` -> grad_x like x."""
    g, x = call.in_types[0].shape, call.in_types[1].shape
    n_sp = _spatial(call.op)
    lead, new = letters("l", len(x) - n_sp), NewLetters("s")
    xs = _lead_fixed(x, n_sp, lead, new)
    return Annotation((_lead_fixed(g, n_sp, lead, new), xs), (xs,), fixed=frozenset(new.sizes), sizes=new.sizes)


def im2col_rule(call: OpCall) -> Annotation:
    """``im2col(x [n c h w], kernel, dilation, padding, stride)`` -> ``[n, c * kh * kw, blocks]`` (``F.unfold``):
    channel-major, so a split of the channels is a split of the output's dim 1 (``(c k)``)."""
    n, c, h, w = call.in_types[0].shape
    _, ck, blocks = call.out_types[0].shape
    sizes = {"n": n, "c": c, "h": h, "w": w, "k": ck // c, "b": blocks}
    return Annotation(((("n",), ("c",), ("h",), ("w",)),), ((("n",), ("c", "k"), ("b",)),),
                      fixed=frozenset("hwkb"), sizes=sizes)


def col2im_rule(call: OpCall) -> Annotation:
    """``col2im(cols [n, c * kh * kw, blocks], output_size, kernel, ...)`` -> ``[n c h w]`` (``F.fold``)."""
    n, ck, blocks = call.in_types[0].shape
    _, c, h, w = call.out_types[0].shape
    sizes = {"n": n, "c": c, "h": h, "w": w, "k": ck // c, "b": blocks}
    return Annotation(((("n",), ("c", "k"), ("b",)),), ((("n",), ("c",), ("h",), ("w",)),),
                      fixed=frozenset("hwkb"), sizes=sizes)


_RESAMPLE = ["upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
             "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
             "upsample_bicubic2d", "upsample_trilinear3d"]
_PADS = [f"{kind}_pad{n}d" for kind in ("reflection", "replication") for n in (1, 2, 3)]
M = OpKind.DATA_MOVEMENT
register([f"aten.{op}.default" for op in _RESAMPLE + _PADS], M, spatial_rule)
# the backward's ``input_size`` names the whole input: a rank's is its gradient's local shape
register([f"aten.{op}_backward.default" for op in _RESAMPLE], M, spatial_rule,
         size_args=(SizeArg(2, SizeRule.OUT_SHAPE),))
register([f"aten.{op}_backward.default" for op in _PADS], M, pad_backward_rule)
register("aten.im2col.default", M, im2col_rule)
register("aten.col2im.default", M, col2im_rule)


def _shuffle_rule(call: OpCall) -> Annotation:
    """pixel_shuffle(x, r): ``* (c r s) h w -> * c (h r) (w s)``; pixel_unshuffle(x, r), the inverse;
    channel_shuffle(x, g): ``n (g k) * -> n (k g) *``. The factors the op takes as an argument (``r``, ``g``) are
    fixed (a rank's local op is called with the same factor); the others split, as strided shards inside a
    merged dim."""
    op, k = call.op, int(call.args[1])
    x = call.in_types[0]
    if op.startswith("aten.pixel_shuffle"):
        return parse("* (c r^ s^) h w -> * c (h r) (w s)", [x.rank], sizes={"r": k, "s": k})
    if op.startswith("aten.pixel_unshuffle"):
        return parse("* c (h r^) (w s^) -> * (c r s) h w", [x.rank], sizes={"r": k, "s": k})
    rest = " ".join(f"d{i}" for i in range(x.rank - 2))
    return parse(f"n (g^ k) {rest} -> n (k g) {rest}", [x.rank], sizes={"g": k})


register("aten.pixel_shuffle.default aten.pixel_unshuffle.default aten.channel_shuffle.default "
         "aten.native_channel_shuffle.default", OpKind.DATA_MOVEMENT, _shuffle_rule)


def _grid_specs(call: OpCall, x_at: int) -> tuple:
    """(input, grid, output) letters of ``grid_sampler_{2,3}d``: ``n c *spatial``, ``n *out 2|3`` and
    ``n c *out``; the sampled spatial dims and the grid's coordinates are fixed (any output pixel may read any
    input pixel), the batch, the channels and the output's spatial dims (the grid's) pass through."""
    x, grid = call.in_types[x_at], call.in_types[x_at + 1]
    n_sp = x.rank - 2
    new = NewLetters("s")
    sp, out = [new(n) for n in x.shape[2:]], letters("o", n_sp)
    xs = (("n",), ("c",)) + tuple((h,) for h in sp)
    gs = (("n",),) + tuple((o,) for o in out) + ((new(grid.shape[-1]),),)
    return xs, gs, (("n",), ("c",)) + tuple((o,) for o in out), new


def grid_sampler_rule(call: OpCall) -> Annotation:
    """``grid_sampler_2d / 3d(input, grid, mode, padding_mode, align_corners)``: ``_grid_specs``."""
    xs, gs, outs, new = _grid_specs(call, 0)
    return Annotation((xs, gs), (outs,), fixed=frozenset(new.sizes), sizes=new.sizes)


def grid_sampler_backward_rule(call: OpCall) -> Annotation:
    """``grid_sampler_2d_backward(grad_out, input, grid, ..., output_mask)`` -> (grad_input, grad_grid): the
    grid's gradient sums over the channels (a split of them makes it partial)."""
    xs, gs, outs, new = _grid_specs(call, 1)
    mask = call.arg(6, "output_mask", (True, True))
    res = tuple(o if t is not None and m else None for o, t, m in zip((xs, gs), call.out_types, mask))
    return Annotation((outs, xs, gs), res, reduced=frozenset({"c"}), fixed=frozenset(new.sizes), sizes=new.sizes)


register("aten.grid_sampler_2d.default aten.grid_sampler_3d.default", M, grid_sampler_rule)
register("aten.grid_sampler_2d_backward.default aten.grid_sampler_3d_backward.default", M,
         grid_sampler_backward_rule)


def affine_grid_rule(call: OpCall) -> Annotation:
    """``affine_grid_generator(theta [n, d, d + 1], size [n, c, *spatial], align_corners)`` -> ``[n, *spatial, d]``
    and its backward ``(grad [n, *spatial, d], size, align_corners)`` -> ``[n, d, d + 1]``: the batch passes through
    (the size's first element becomes the rank's batch, ``SizeRule.OUT_DIM_IN_LIST``); the other dims are fixed."""
    new = NewLetters("s")

    def spec(shape: tuple[int, ...]) -> tuple:
        return (("n",),) + tuple((new(k),) for k in shape[1:])

    return Annotation((spec(call.in_types[0].shape),), (spec(call.out_types[0].shape),), fixed=frozenset(new.sizes),
                      sizes=new.sizes)


register("aten.affine_grid_generator.default aten.affine_grid_generator_backward.default", M, affine_grid_rule,
         size_args=(SizeArg(1, SizeRule.OUT_DIM_IN_LIST),))
