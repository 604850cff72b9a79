"""Sharding rules derived from op annotations.

A node's *strategy* names, for each mesh axis, the annotation letter split along that axis (or
``None``: the node runs replicated on that axis). From the annotation alone follow the placement
each input must have and the placement of each output:

- an input (output) holding the letter in one of its dims is ``Shard(dim, blocks)`` on that axis,
  where ``blocks`` is the product of the local sizes of the letters before it in a merged dim
  (so a split minor part of a merged dim is a strided shard);
- an input without the letter is ``Replicate``;
- an output without the letter is ``Partial(reduce_kind)`` if the letter is reduced (``+``),
  and the strategy is illegal otherwise;
- a fixed letter (``^``) may not be split, and split letters must divide evenly.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

from ..ir.annotation import Annotation, Dim, letter_sizes
from ..ir.registry import Linear, lookup
from .mesh import Mesh
from .placement import Partial, ReduceOp, Replicate, Shard, Sharding
from .vocab import PASS, EntryKind, parse_entry, split_letter

__all__ = ["Strategy", "StrategyError", "shardings_for", "candidate_letters", "PASS",
           "partial_inputs"]

Strategy = tuple  # tuple[str | None, ...], one entry per mesh axis

# Strategy entries (split letters, strided splits ``x/k``, partial passthrough ``PASS``): ``vocab``.


def partial_inputs(op: str, kind_is_view: bool, n_inputs: int, args: Sequence,
                   kwargs: dict | None = None, in_dtype=None) -> list[list[int]]:
    """The sets of input positions that may be Partial together under a passthrough strategy, from the
    op's ``linear`` fact (``ir.registry.Linear``); a view of one input is linear in it (``in_dtype``: the
    first input's dtype, which tells a narrowing cast)."""
    opdef = lookup(op)
    linear = opdef.linear if opdef is not None else None
    if linear is Linear.SUM and n_inputs != 2:
        return []  # x + constant is not linear in x
    dtype = (kwargs or {}).get("dtype")
    if linear is Linear.CAST and dtype is not None:
        if not getattr(dtype, "is_floating", False):
            return []  # a cast to an integer or bool type truncates: not linear
        if in_dtype is not None and dtype.itemsize < in_dtype.itemsize:
            # a narrowing cast rounds each part, not the sum (float64 partial sums cast to float32, as a
            # float32 RMSNorm in a float64 model, differed by 7e-9): reduce first
            return []
    mode = Linear.ALL if (kind_is_view and n_inputs == 1) or linear in (Linear.SUM, Linear.CAST) else linear
    if mode is Linear.ALL:
        return [list(range(n_inputs))]
    if mode is Linear.ONE:
        return [[k] for k in range(n_inputs)]
    if mode is Linear.FIRST:
        return [[0]]
    return []


class StrategyError(ValueError):
    """A strategy that the annotation does not allow."""


@dataclass(frozen=True)
class NodeShardings:
    inputs: tuple[Sharding, ...]
    outputs: tuple[Sharding | None, ...]


def candidate_letters(ann: Annotation, sizes: dict[str, int], axis_size: int) -> list[str]:
    """Letters that may be split on an axis of ``axis_size``: not fixed, evenly divisible."""
    out = []
    for x in ann.letters():
        if x in ann.fixed or sizes.get(x, 0) % axis_size or sizes.get(x, 0) == 0:
            continue
        if all(x in spec_letters(o) or x in ann.reduced for o in ann.outputs if o is not None):
            out.append(x)
    return out


def spec_letters(spec: Sequence[Dim]) -> set[str]:
    return {x for d in spec for x in d}


def _placement(spec: Sequence[Dim], letter: str, local: dict[str, int], extra_blocks: int = 1) -> Shard | None:
    for i, dim in enumerate(spec):
        if letter in dim:
            k = dim.index(letter)
            return Shard(i, prod(local[x] for x in dim[:k]) * extra_blocks)
    return None


def shardings_for(ann: Annotation, shapes: Sequence[Sequence[int]], strategy: Strategy, mesh: Mesh) -> NodeShardings:
    """Input and output shardings implied by ``strategy`` (one letter or None per mesh axis)."""
    if len(strategy) != mesh.ndim:
        raise StrategyError(f"strategy {strategy} has {len(strategy)} entries for a {mesh.ndim}-axis mesh")
    sizes = letter_sizes(ann, shapes)
    local = dict(sizes)
    ins: list[list] = [[] for _ in ann.inputs]
    outs: list[list | None] = [[] if o is not None else None for o in ann.outputs]
    reduce_op = ReduceOp(ann.reduce_kind)
    for axis, letter in enumerate(strategy):
        n = mesh.sizes[axis]
        entry = parse_entry(letter)
        if entry.kind in (EntryKind.PASS_ALL, EntryKind.PASS_ONE):
            marked = set(range(len(ins))) if entry.input is None else {entry.input}
            for k, p in enumerate(ins):
                p.append(Partial(ReduceOp.SUM) if k in marked else Replicate())
            for p in outs:
                if p is not None:
                    p.append(Partial(ReduceOp.SUM))
            continue
        if letter is None or n == 1:
            for p in ins:
                p.append(Replicate())
            for p in outs:
                if p is not None:
                    p.append(Replicate())
            continue
        letter, extra = split_letter(letter)
        if letter in ann.fixed:
            raise StrategyError(f"letter {letter!r} may not be split")
        if letter not in sizes:
            raise StrategyError(f"letter {letter!r} is not in the annotation")
        if local[letter] % (n * extra):
            raise StrategyError(f"letter {letter!r} of local size {local[letter]} does not divide by {n * extra}")
        makes_partial = letter in ann.reduced and any(
            o is not None and letter not in spec_letters(o) for o in ann.outputs)
        for k, (spec, p) in enumerate(zip(ann.inputs, ins)):
            pl = _placement(spec, letter, local, extra)
            if pl is None and makes_partial and k in ann.additive:
                pl = Partial(reduce_op)
            p.append(pl or Replicate())
        for spec, p in zip(ann.outputs, outs):
            if p is None:
                continue
            pl = _placement(spec, letter, local, extra)
            if pl is None:
                if letter not in ann.reduced:
                    raise StrategyError(f"letter {letter!r} is absent from an output and not reducible")
                pl = Partial(reduce_op)
            p.append(pl)
        local[letter] //= n
    return NodeShardings(tuple(tuple(p) for p in ins), tuple(tuple(p) if p is not None else None for p in outs))


