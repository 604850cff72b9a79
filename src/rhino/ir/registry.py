"""The op registry: what the IR knows about each op.

Each op declares its dimension semantics as an annotation (see
``annotation.py``): a template string, or for ops whose structure depends on
their arguments (reshape, reductions over given dims, convolutions) a small
function returning one. From it come shape inference, FLOPs and, in later
stages, the sharding rules. Ops not in the registry are *opaque*: executed as
they are, never sharded.

The registration is also the one place for the op's other *facts* (``OpDef`` fields), which the
later stages read with ``lookup(op).<fact>`` instead of keeping tables keyed by op name:
``linear`` (which inputs a Partial(sum) passes through), ``size_args`` (arguments holding global
sizes that the SPMD lowering rewrites to local ones), ``local_op`` (the op a rank calls on its
shard), ``lowering`` (the key of a custom SPMD lowering), ``reduces``/``per_channel`` (the
all-reduces that lowering adds, for the cost model), ``outputs`` (output placements the lowering
makes other than the annotation's), ``family`` (structural roles the planners look for),
``values`` (random or uninitialised results), ``accumulate`` (what the fusion of gradient accumulation
into a matrix product, ``lower.accumulate``, can see through or fuse) and ``input_layout`` (the layout the
kernel assumes of its tensor inputs, as its callers in eager PyTorch guarantee: contiguous, or stride 1 along the
last dimension; a rank's input may be laid out otherwise after a redistribution, so the lowering passes
contiguous copies of the inputs that are not: ``lower.fx.resolve_op``, which treats every opaque op as needing
contiguous inputs) and ``cpu_dtypes`` (the CPU kernel's output dtypes from its tensor inputs' dtypes, where the fake
kernel capture traces with answers otherwise: ``capture.to_ir``, ``lower.rank_graph``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from math import prod
from typing import Any, Callable, Mapping

from .annotation import Annotation, letter_sizes, parse
from .graph import Graph, Node, Ref
from .types import DType, TensorType

__all__ = ["OpKind", "OpDef", "OpCall", "Linear", "SizeRule", "SizeArg", "Lowering", "OutputRule", "Family",
           "Values", "register", "lookup", "is_known", "annotate", "call_signature", "flops_of", "bytes_of",
           "is_random", "draws_rng", "storage_offset_arg", "REGISTRY"]


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


class Linear(str, Enum):
    """Tensor inputs in which the op is linear, so Partial(sum) inputs give a Partial(sum) output."""

    ALL = "all"        # in all of them jointly
    ONE = "one"        # in any one of them, the others fixed
    FIRST = "first"    # in the first only
    SUM = "sum"        # a sum of two tensors: ALL with two tensor operands (x + constant is affine)
    CAST = "cast"      # a dtype cast: ALL unless it casts to a non-float type or narrows (rounds each part)


class SizeRule(str, Enum):
    """How the SPMD lowering rewrites an argument holding a global size (``SizeArg``); "local" sizes are
    those of this rank's shards, of output ``index`` (``OUT_*``) or of the tensor argument ``index``."""

    OUT_SHAPE = "out_shape"        # the local shape of output ``index`` (a list)
    OUT_DIM = "out_dim"            # the local size of dim ``dim`` of output ``index``
    OUT_DIM_LIST = "out_dim_list"  # [that size], when output ``index`` exists
    SPLIT_SIZE = "split_size"      # split.Tensor: output 0's size along the split dim (two outputs or more)
    SPLIT_SIZES = "split_sizes"    # every output's size along the split dim
    IN_DIM = "in_dim"              # the local size of dim ``dim`` of the tensor argument ``index``
    GROUPS = "groups"              # a group count (when not 1) scaled by the local share of argument ``index``'s dim
    SQUEEZED = "squeezed"          # the dims of global size 1 the op removes; later arguments dropped
    OUT_DIM_IN_LIST = "out_dim_in_list"  # element ``dim`` of a size list: local size of that dim of output ``index``


@dataclass(frozen=True)
class SizeArg:
    """Argument ``at`` holds a global size; the lowering rewrites it by ``rule``."""

    at: int
    rule: SizeRule
    index: int = 0
    dim: int = 0


class Lowering(str, Enum):
    """Key of a custom SPMD lowering (``lower/spmd_custom.py``), used when a custom letter is split."""

    EMBEDDING = "embedding"
    EMBEDDING_BACKWARD = "embedding_backward"
    LOG_SOFTMAX = "log_softmax"
    LOG_SOFTMAX_BACKWARD = "log_softmax_backward"
    NLL_LOSS = "nll_loss"                    # also when a mean reduction runs over split dims
    NLL_LOSS_BACKWARD = "nll_loss_backward"
    MSE_LOSS_BACKWARD = "mse_loss_backward"
    CONVOLUTION_BACKWARD = "convolution_backward"
    BATCH_NORM = "batch_norm"                # (input, weight, bias, running_mean, running_var, training, ...)
    BATCH_NORM_NO_STATS = "batch_norm_no_stats"  # (input, weight, bias, training, momentum, eps)
    BATCH_NORM_BACKWARD = "batch_norm_backward"


class OutputRule(str, Enum):
    """Output placements the op's SPMD lowering makes other than the annotation's (``sharding.plan``)."""

    REPLICATED = "replicated"                  # Partial outputs are all-reduced (batch norm statistics)
    REPLICATED_IF_MEAN = "replicated_if_mean"  # so, when argument 3 (reduction) is 1 (mean): nll_loss
    REPLICATED_IF_CUSTOM = "replicated_if_custom"  # so, when the annotation has custom letters


class Family(str, Enum):
    """Structural roles that planners and reports look for in a graph."""

    RESHAPE = "reshape"        # same elements, new shape (argument 1)
    TRANSPOSE = "transpose"    # swaps the dims given as arguments 1 and 2
    PERMUTE = "permute"        # reorders dims (permute, t)
    SPLIT = "split"            # into chunks along a dim (arguments 1: sizes, 2: dim)
    CAT = "cat"                # concatenation along a dim
    EMBEDDING = "embedding"    # a lookup of rows of the table in argument 0
    SELECT = "select"          # one index (argument 2) along a dim (argument 1), which it removes
    UNBIND = "unbind"          # every index along a dim (argument 1), one output each


class Accumulate(str, Enum):
    """The op's part in fusing ``acc.add_(g)`` into the product that makes ``g`` (``lower.accumulate``)."""

    MATMUL = "matmul"          # its product can be added into the accumulator (mm -> addmm_)
    SEE_THROUGH = "see_through"  # a transpose view between the product and the addition (t)


class InputLayout(str, Enum):
    """What a kernel assumes of its tensor inputs' layout (the ``input_layout`` fact)."""

    CONTIGUOUS = "contiguous"      # row-major contiguous
    INNER = "inner"                # stride 1 along the last dimension (leading dimensions in any order)


class Values(str, Enum):
    """What the op's output values are."""

    COMPUTED = "computed"      # a function of the inputs
    RANDOM = "random"          # drawn from the RNG with parameters from the inputs (dropout, bernoulli)
    NOISE = "noise"            # drawn from the RNG independent of input values (rand, randn, *_like)
    UNINITIALIZED = "uninitialized"  # unspecified (empty)


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
    """An op's registry entry: its annotation rule, FLOPs and facts (module docstring)."""

    name: str
    kind: OpKind
    rule: str | Rule | None
    flops: FlopFn | int | None = None  # int: FLOPs per output element; None: derived from kind
    reduce_kind: str = "sum"
    linear: Linear | None = None
    size_args: tuple[SizeArg, ...] = ()
    local_op: str | None = None        # the op a rank calls on local shards instead (a view -> reshape)
    lowering: Lowering | None = None
    reduces: int = 0                   # all-reduces its custom lowering adds when a custom letter is split
    per_channel: bool = False          # ... each of two values per channel (else one value per row)
    outputs: OutputRule | None = None
    family: Family | None = None
    values: Values = Values.COMPUTED
    accumulate: Accumulate | None = None
    input_layout: InputLayout | None = None
    cpu_dtypes: Callable[[list[DType], list[DType | None]], list[DType | None]] | None = None


REGISTRY: dict[str, OpDef] = {}


def register(names: str | list[str], kind: OpKind, rule: str | Rule | None,
             flops: FlopFn | int | None = None, reduce_kind: str = "sum", **facts: Any) -> None:
    """Register ops; ``names`` are ``aten.<op>.<overload>`` strings (a list or space separated);
    ``facts``: ``OpDef`` fields (module docstring)."""
    for name in (names.split() if isinstance(names, str) else names):
        if name in REGISTRY:
            raise ValueError(f"op {name} registered twice")
        REGISTRY[name] = OpDef(name, kind, rule, flops, reduce_kind, **facts)


def lookup(op: str) -> OpDef | None:
    _load_tables()
    return REGISTRY.get(op)


def is_known(op: str) -> bool:
    return lookup(op) is not None


def is_random(op: str) -> bool:
    """Whether ``op`` draws random numbers (running it twice gives different values); opaque ops are
    never rerun or sharded, so only registered ops are asked."""
    opdef = lookup(op)
    return opdef is not None and opdef.values in (Values.RANDOM, Values.NOISE)


# ops drawing from the generator's stream, by name (registered or not); ``draws_rng``
_RNG_NAME = re.compile(r"(^|\.)(_?native_dropout|dropout|bernoulli|rand|randn|randint|randperm|rand_like|randn_like|"
                       r"randint_like|normal|uniform|multinomial|exponential|geometric|cauchy|log_normal|random|"
                       r"poisson|binomial|_standard_gamma|_sample_dirichlet|"
                       r"rrelu_with_noise_functional)"
                       r"(_|\.|$)")


def draws_rng(op: str) -> bool:
    """Whether ``op`` (``aten.<name>.<overload>``, registered or not) draws from the random generator's
    stream, so that reordering two such ops changes the numbers each gets: its name after the namespace
    matches a sampling op's (dropout, bernoulli, rand*, normal, uniform, multinomial, ...; in-place
    ``_`` forms included). A rule on names, not the ``values`` fact of ``is_random``, because the memory
    planner must keep the order of unregistered (opaque) sampling ops too."""
    return _RNG_NAME.search(op.split(".", 1)[-1]) is not None


# ops whose storage offset argument counts from the start of their first argument's storage (registered or
# not): its position among the args; ``storage_offset_arg``
_STORAGE_OFFSET_ARG = {"aten.as_strided.default": 3, "aten.as_strided_copy.default": 3,
                       "aten.as_strided_scatter.default": 4}


def storage_offset_arg(op: str) -> int | None:
    """The position of ``op``'s ``storage_offset`` argument where it counts from the start of the first
    argument's storage (``as_strided`` and its copy; ``as_strided_scatter``, which clones its input with the
    input's offset), else None. An executor that places tensors inside a larger storage moves it."""
    return _STORAGE_OFFSET_ARG.get(op)


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
        from . import ops_elementwise, ops_image, ops_linalg, ops_nn, ops_shape  # noqa: F401  (they register on import)
