"""Einsum-like dimension annotations and the shape inference they imply.

An annotation names every dim of every tensor input and output with letters:
the same letter is the same dim. A letter absent from an output is reduced
away for that output: marked ``+`` it is summed (splitting it gives a
``Partial(sum)``), otherwise it may not be split for that output. ``^`` marks
a dim that must never be split. ``(a b)`` is a merged dim (the product of
``a`` and ``b``, ``a`` major). ``*`` expands to however many leading dims the
tensor has beyond the explicit ones. Examples::

    "m k+, k+ n -> m n"                   matmul
    "* d^, d^, d^ -> * d^"                layer norm
    "(a b) c -> a (b c)"                  reshape
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Mapping, Sequence

__all__ = ["Dim", "Annotation", "parse", "ShapeError", "infer_shapes", "letter_sizes"]

Dim = tuple[str, ...]  # one letter, or several for a merged dim (major first)


class ShapeError(ValueError):
    """Shapes that contradict an op's annotation."""


@dataclass(frozen=True)
class Annotation:
    inputs: tuple[tuple[Dim, ...], ...]
    outputs: tuple[tuple[Dim, ...] | None, ...]
    reduced: frozenset[str] = frozenset()   # letters summed away ("+")
    fixed: frozenset[str] = frozenset()     # letters that may not be split ("^")
    sizes: Mapping[str, int] = field(default_factory=dict)  # sizes not visible in inputs
    reduce_kind: str = "sum"                # what a split reduced letter gives: sum|max|min
    # Inputs added to the result (addmm's bias): when a split reduced letter makes the output
    # Partial, these must be Partial too (not replicated, or they would be added n times).
    additive: frozenset[int] = frozenset()
    # Letters whose split the plain op cannot compute locally: the SPMD lowering has a custom
    # rule for them (a vocabulary-parallel embedding masks indices outside its rows, a softmax
    # over a split dim all-reduces its max and sum, ...).
    custom: frozenset[str] = frozenset()

    def letters(self) -> list[str]:
        seen: dict[str, None] = {}
        for spec in (*self.inputs, *(o for o in self.outputs if o is not None)):
            for dim in spec:
                for letter in dim:
                    seen.setdefault(letter)
        return list(seen)

    def __str__(self) -> str:
        def dim(d: Dim) -> str:
            text = " ".join(d)
            text = f"({text})" if len(d) > 1 else text
            mark = "".join("+" if x in self.reduced else "^" if x in self.fixed else "" for x in d[:1]) if len(d) == 1 else ""
            return text + mark

        ins = ", ".join(" ".join(dim(d) for d in spec) for spec in self.inputs)
        outs = ", ".join("-" if spec is None else " ".join(dim(d) for d in spec) for spec in self.outputs)
        return f"{ins} -> {outs}"


def _parse_spec(text: str, reduced: set, fixed: set) -> list:
    dims: list = []
    tokens = text.replace("(", " ( ").replace(")", " ) ").split()
    group: list[str] | None = None
    for tok in tokens:
        if tok == "(":
            group = []
            continue
        if tok == ")":
            if not group:
                raise ValueError(f"empty merged dim in {text!r}")
            dims.append(tuple(group))
            group = None
            continue
        name = tok.rstrip("+^")
        if "+" in tok[len(name):]:
            reduced.add(name)
        if "^" in tok[len(name):]:
            fixed.add(name)
        if group is not None:
            group.append(name)
        else:
            dims.append("*" if name == "*" else (name,))
    if group is not None:
        raise ValueError(f"unclosed '(' in {text!r}")
    return dims


def parse(template: str, ranks: Sequence[int], sizes: Mapping[str, int] | None = None,
          reduce_kind: str = "sum") -> Annotation:
    """Parse ``template`` for inputs of the given ranks, expanding ``*``.

    Every ``*`` stands for the same dims (named ``_0``, ``_1``, ...); their
    count is taken from the first input that has a ``*``.
    """
    lhs, _, rhs = template.partition("->")
    reduced: set[str] = set()
    fixed: set[str] = set()
    in_specs = [_parse_spec(s, reduced, fixed) for s in lhs.split(",")] if lhs.strip() else []
    out_specs = [_parse_spec(s, reduced, fixed) for s in rhs.split(",")]
    if len(in_specs) != len(ranks):
        raise ShapeError(f"annotation {template!r} has {len(in_specs)} inputs, op has {len(ranks)} tensors")
    n_star = None
    for spec, rank in zip(in_specs, ranks):
        if "*" in spec:
            n_star = rank - (len(spec) - 1)
            break
    star_letters = tuple(f"_{i}" for i in range(n_star or 0))
    star_fixed = "*" in fixed
    star_reduced = "*" in reduced
    if star_fixed:
        fixed.update(star_letters)
    if star_reduced:
        reduced.update(star_letters)
    fixed.discard("*")
    reduced.discard("*")

    def expand(spec: list) -> tuple[Dim, ...]:
        out: list[Dim] = []
        for d in spec:
            if d == "*":
                if n_star is None or n_star < 0:
                    raise ShapeError(f"cannot expand '*' in {template!r} for ranks {list(ranks)}")
                out.extend((x,) for x in star_letters)
            else:
                out.append(d)
        return tuple(out)

    return Annotation(
        inputs=tuple(expand(s) for s in in_specs),
        outputs=tuple(expand(s) for s in out_specs),
        reduced=frozenset(reduced), fixed=frozenset(fixed),
        sizes=dict(sizes or {}), reduce_kind=reduce_kind,
    )


def letter_sizes(ann: Annotation, shapes: Sequence[Sequence[int]]) -> dict[str, int]:
    """Bind every letter to a size from the input shapes (and ``ann.sizes``)."""
    sizes: dict[str, int] = dict(ann.sizes)
    pending: list[tuple[Dim, int]] = []
    if len(shapes) != len(ann.inputs):
        raise ShapeError(f"{len(shapes)} input shapes for an annotation with {len(ann.inputs)} inputs")
    for spec, shape in zip(ann.inputs, shapes):
        if len(spec) != len(shape):
            raise ShapeError(f"input of rank {len(shape)} annotated with {len(spec)} dims")
        for dim, size in zip(spec, shape):
            if len(dim) == 1:
                _bind(sizes, dim[0], size)
            else:
                pending.append((dim, size))
    while pending:  # a part sized by one merged dim may size another: repeat until no progress
        rest: list[tuple[Dim, int]] = []
        for dim, size in pending:
            unknown = [x for x in dim if x not in sizes]
            known = prod(sizes[x] for x in dim if x in sizes)
            if len(unknown) == 1 and known and size % known == 0:
                sizes[unknown[0]] = size // known
            elif len(unknown) > 1:
                rest.append((dim, size))
            elif unknown:
                raise ShapeError(f"cannot size the parts of merged dim {dim}")
            elif known != size:
                raise ShapeError(f"merged dim {dim} has size {size}, parts give {known}")
        if len(rest) == len(pending):
            raise ShapeError(f"cannot size the parts of merged dim {rest[0][0]}")
        pending = rest
    return sizes


def _bind(sizes: dict[str, int], letter: str, size: int) -> None:
    if sizes.setdefault(letter, size) != size:
        raise ShapeError(f"dim {letter!r} is {sizes[letter]} in one place and {size} in another")


def infer_shapes(ann: Annotation, shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...] | None]:
    """Output shapes implied by the annotation and the input shapes."""
    sizes = letter_sizes(ann, shapes)
    out: list[tuple[int, ...] | None] = []
    for spec in ann.outputs:
        if spec is None:
            out.append(None)
            continue
        try:
            out.append(tuple(prod(sizes[x] for x in dim) for dim in spec))
        except KeyError as exc:
            raise ShapeError(f"output dim {exc.args[0]!r} has no size") from None
    return out
