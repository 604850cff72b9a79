"""Building blocks for annotation rules whose structure depends on arguments."""
from __future__ import annotations

from typing import Sequence

from .annotation import Annotation, Dim
from .registry import OpCall

__all__ = ["letters", "norm_dim", "broadcast_shape", "elementwise", "reduce_dims", "fixed_from_types",
           "NewLetters"]


def letters(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def norm_dim(d: int, rank: int) -> int:
    r = max(rank, 1)
    if not -r <= d < r:
        raise ValueError(f"dim {d} out of range for rank {rank}")
    return d % r


class NewLetters:
    """Fresh letters with known sizes (dims that exist only in some tensors)."""

    def __init__(self, prefix: str = "z") -> None:
        self.prefix = prefix
        self.sizes: dict[str, int] = {}

    def __call__(self, size: int) -> str:
        name = f"{self.prefix}{len(self.sizes)}"
        self.sizes[name] = size
        return name


def broadcast_shape(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for s in shapes:
        for i, size in enumerate(s):
            j = rank - len(s) + i
            if size != 1:
                if out[j] not in (1, size):
                    raise ValueError(f"shapes {list(map(list, shapes))} do not broadcast")
                out[j] = size
    return tuple(out)


def elementwise(call: OpCall) -> Annotation:
    """Broadcasting elementwise op: every output has the broadcast shape."""
    shapes = [t.shape for t in call.in_types]
    out = broadcast_shape(shapes) if shapes else ()
    rank = len(out)
    names = letters("e", rank)
    new = NewLetters("b")
    ins = []
    for s in shapes:
        spec: list[Dim] = []
        for i, size in enumerate(s):
            j = rank - len(s) + i
            spec.append((names[j],) if size == out[j] else (new(size),))
        ins.append(tuple(spec))
    sizes = dict(new.sizes)
    if not shapes:  # e.g. a creation op with a shape taken from its output
        out = call.out_types[0].shape
        sizes.update(zip(names := letters("e", len(out)), out))
    outs = tuple(tuple((x,) for x in names[:len(out)]) if t is not None else None for t in call.out_types)
    return Annotation(tuple(ins), outs, sizes=sizes)


def reduce_dims(call: OpCall, dims: Sequence[int] | None, keepdim: bool, kind: str = "sum",
                splittable: bool = True, n_outputs: int = 1, empty_is_all: bool = True) -> Annotation:
    """Reduction of the first tensor input over ``dims`` (None = all dims; so is [] unless
    ``empty_is_all`` is false, as for ``any.dims``, where [] reduces nothing)."""
    rank = call.in_types[0].rank
    if dims:
        red = {norm_dim(d, rank) for d in dims} & set(range(rank))  # a 0-d tensor's dim 0 names no dim
    else:
        red = set(range(rank)) if dims is None or empty_is_all else set()
    names = letters("r", rank)
    new = NewLetters("k")
    out: list[Dim] = []
    for i, x in enumerate(names):
        if i not in red:
            out.append((x,))
        elif keepdim:
            out.append((new(1),))
    marked = frozenset(names[i] for i in red)
    return Annotation(
        (tuple((x,) for x in names),), tuple(tuple(out) for _ in range(n_outputs)),
        reduced=marked if splittable else frozenset(),
        fixed=frozenset() if splittable else marked,
        sizes=new.sizes, reduce_kind=kind)


def fixed_from_types(call: OpCall) -> Annotation:
    """No dim correspondence known: every dim of every tensor is fixed, sizes as recorded."""
    new = NewLetters("f")
    ins = tuple(tuple((new(n),) for n in t.shape) for t in call.in_types)
    outs = tuple(tuple((new(n),) for n in t.shape) if t is not None else None for t in call.out_types)
    return Annotation(ins, outs, fixed=frozenset(new.sizes), sizes=new.sizes)
