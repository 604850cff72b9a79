"""The op registry: what the IR knows about each op.

Each op declares its dimension semantics as an annotation (see
``annotation.py``): a template string, or for ops whose structure depends on
their arguments (reshape, reductions over given dims, convolutions) a small
function returning one. From it come shape inference, FLOPs and, in later
stages, the sharding rules. Ops not in the registry are *opaque*: executed as
they are, never sharded.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from math import prod
from typing import Any, Callable, Mapping

from .annotation import Annotation, letter_sizes, parse
from .graph import Graph, Node, Ref
from .types import TensorType

__all__ = ["OpKind", "OpDef", "OpCall", "register", "lookup", "is_known", "annotate", "call_signature", "flops_of",
           "bytes_of", "is_random", "REGISTRY"]


class OpKind(str, Enum):
    MATMUL = "matmul"
    CONV = "conv"
    ATTENTION = "attention"
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    NORM = "norm"
    VIEW = "view"             # aliasing or layout-only: no bytes moved, no FLOPs
    DATA_MOVEMENT = "data_movement"  # copies, cat, slicing into new storage
    INDEX = "index"           # gather/scatter/embedding/top-k
    CREATION = "creation"     # new tensors from attributes only
    LOSS = "loss"
    RANDOM = "random"
    OPAQUE = "opaque"


@dataclass
class OpCall:
    """An op call with its tensor types resolved, as rules and FLOP counters see it."""

    op: str
    args: list
    kwargs: dict
    in_types: list[TensorType]          # tensor inputs in flattened argument order
    out_types: list[TensorType | None]

    def arg(self, index: int, name: str | None = None, default: Any = None) -> Any:
        if index < len(self.args):
            return self.args[index]
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return default

    @property
    def ranks(self) -> list[int]:
        return [t.rank for t in self.in_types]

    def shape_of(self, index: int) -> tuple[int, ...]:
        """Shape of the tensor argument at positional ``index``."""
        ref = self.args[index]
        assert isinstance(ref, Ref), f"argument {index} of {self.op} is not a tensor"
        return self._types[ref.id].shape

    _types: Mapping[int, TensorType] = None  # type: ignore[assignment]


Rule = Callable[[OpCall], Annotation]
FlopFn = Callable[[OpCall, Annotation, Mapping[str, int]], int]


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: OpKind
    rule: str | Rule | None
    flops: FlopFn | int | None = None  # int: FLOPs per output element; None: derived from kind
    reduce_kind: str = "sum"


REGISTRY: dict[str, OpDef] = {}


def register(names: str | list[str], kind: OpKind, rule: str | Rule | None,
             flops: FlopFn | int | None = None, reduce_kind: str = "sum") -> None:
    """Register ops; ``names`` are ``aten.<op>.<overload>`` strings (a list or space separated)."""
    for name in (names.split() if isinstance(names, str) else names):
        if name in REGISTRY:
            raise ValueError(f"op {name} registered twice")
        REGISTRY[name] = OpDef(name, kind, rule, flops, reduce_kind)


def lookup(op: str) -> OpDef | None:
    _load_tables()
    return REGISTRY.get(op)


def is_known(op: str) -> bool:
    return lookup(op) is not None


# aten ops that draw from the RNG (their kinds say what their shapes do: elementwise, creation)
_RANDOM_NAMES = frozenset({"rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm",
                           "bernoulli", "native_dropout", "normal", "uniform", "multinomial", "poisson",
                           "exponential", "geometric", "cauchy", "log_normal"})


def is_random(op: str) -> bool:
    """Whether ``op`` draws random numbers (running it twice gives different values)."""
    parts = op.split(".")
    return len(parts) >= 2 and parts[0] == "aten" and parts[1].rstrip("_") in _RANDOM_NAMES


def call_of(graph: Graph, node: Node) -> OpCall:
    ins = [graph.types[r.id] for r in node.input_refs()]
    outs = [graph.types[v] if v is not None else None for v in node.outputs]
    call = OpCall(node.op, node.args, node.kwargs, ins, outs)
    call._types = graph.types
    return call


def call_signature(graph: Graph, node: Node) -> tuple:
    """A hashable key equal for two nodes that make the same call (op, constant arguments, tensor
    types): their annotation, FLOPs and sharding rules are the same. Tensor arguments are keyed by
    type, not identity."""
    def key(a: Any) -> Any:
        if isinstance(a, Ref):
            t = graph.types[a.id]
            return ("#", t.shape, t.dtype)
        if isinstance(a, (list, tuple)):
            return tuple(key(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, key(v)) for k, v in sorted(a.items()))
        return a if isinstance(a, (int, float, str, bool, type(None))) else repr(a)
    outs = tuple(None if v is None else (graph.types[v].shape, graph.types[v].dtype) for v in node.outputs)
    return (node.op, key(node.args), key(node.kwargs), outs)


def annotate(call: OpCall) -> Annotation | None:
    """The op's annotation for this call, or None for opaque ops."""
    opdef = lookup(call.op)
    if opdef is None or opdef.rule is None:
        return None
    if isinstance(opdef.rule, str):
        return parse(opdef.rule, call.ranks, reduce_kind=opdef.reduce_kind)
    return opdef.rule(call)


def flops_of(call: OpCall) -> int:
    """Floating point operations of one call (a multiply-add counts 2)."""
    opdef = lookup(call.op)
    if opdef is None:
        return 0
    if callable(opdef.flops):
        ann = annotate(call)
        sizes = letter_sizes(ann, [t.shape for t in call.in_types]) if ann else {}
        return int(opdef.flops(call, ann, sizes))
    out_numel = sum(t.numel for t in call.out_types if t is not None)
    if isinstance(opdef.flops, int):
        return opdef.flops * out_numel
    if opdef.kind is OpKind.MATMUL:
        ann = annotate(call)
        sizes = letter_sizes(ann, [t.shape for t in call.in_types])
        return 2 * prod(sizes[x] for x in ann.letters())
    if opdef.kind in (OpKind.REDUCTION, OpKind.NORM, OpKind.LOSS):
        return sum(t.numel for t in call.in_types)
    if opdef.kind is OpKind.ELEMENTWISE:
        return out_numel
    return 0


def bytes_of(call: OpCall) -> int:
    """Bytes an op reads and writes (0 for views, which only alias)."""
    opdef = lookup(call.op)
    if opdef is not None and opdef.kind is OpKind.VIEW:
        return 0
    return sum(t.nbytes for t in call.in_types) + sum(t.nbytes for t in call.out_types if t is not None)


_LOADED = False


def _load_tables() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        from . import ops_elementwise, ops_nn, ops_shape  # noqa: F401  (they register on import)
