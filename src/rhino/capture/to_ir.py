"""Convert a traced aten-level ``torch.fx`` graph into the IR."""
from __future__ import annotations

import operator

import torch
import torch.fx
from torch.utils._pytree import tree_leaves

from ..ir.graph import Graph, GraphOutput, Node, Ref, Role
from ..ir.ops_shape import WITHOUT_INPUT
from ..ir.registry import lookup
from ..ir.types import Device, DType, Layout, MemoryFormat, TensorType

__all__ = ["fx_to_ir", "fx_arg", "ir_dtype", "torch_dtype"]

_DTYPES = {getattr(torch, d.value): d for d in DType}


def ir_dtype(dt: torch.dtype) -> DType:
    try:
        return _DTYPES[dt]
    except KeyError:
        raise ValueError(f"dtype {dt} is not supported by the IR") from None


def torch_dtype(dt: DType) -> torch.dtype:
    return getattr(torch, dt.value)


def _ttype(val) -> TensorType:
    return TensorType(tuple(int(s) for s in val.shape), ir_dtype(val.dtype))


def _cpu_types(op: str, args, kwargs, types: list[TensorType | None]) -> list[TensorType | None]:
    """The output types the CPU kernel gives where the fake kernel's differ (the registry's ``cpu_dtypes``)."""
    fix = getattr(lookup(op), "cpu_dtypes", None)
    if fix is None:
        return types
    ins = [ir_dtype(a.meta["val"].dtype) for a in tree_leaves((args, kwargs))
           if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    dtypes = fix(ins, [t.dtype if t is not None else None for t in types])
    return [t if t is None or d is None else TensorType(t.shape, d) for t, d in zip(types, dtypes)]


def fx_to_ir(gm: torch.fx.GraphModule, in_roles: list[tuple[str, Role]],
             out_roles: list[tuple[str, Role]]) -> tuple[Graph, list[str]]:
    """Build the IR graph; returns it with the names of opaque (unregistered) ops."""
    g = Graph()
    env: dict[torch.fx.Node, object] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(in_roles):
        raise AssertionError(f"{len(placeholders)} placeholders for {len(in_roles)} inputs")
    for node, (name, role) in zip(placeholders, in_roles):
        env[node] = Ref(g.add_input(name, role, _ttype(node.meta["val"])))
    opaque: list[str] = []
    counter = 0
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            vid = g.new_value(_ttype(value))
            g.constants[vid] = value.detach().cpu().reshape(-1).tolist()
            env[node] = Ref(vid)
        elif node.op == "call_function" and node.target is operator.getitem:
            env[node] = env[node.args[0]][node.args[1]]
        elif node.op == "call_function":
            if not isinstance(node.target, torch._ops.OpOverload):
                raise AssertionError(f"unexpected non-aten call {node.target} in the traced graph")
            op, args, kwargs = _creation_without_input(node)
            val = node.meta.get("val")
            _fix_default_dtype(node, kwargs, val)
            multi = isinstance(val, (tuple, list))
            vals = list(val) if multi else [val]
            types = _cpu_types(op, args, kwargs, [_ttype(v) if isinstance(v, torch.Tensor) else None for v in vals])
            outs = [g.new_value(t) if t is not None else None for t in types]
            counter += 1
            g.nodes.append(Node(f"n{counter}_{node.name}", op, fx_arg(args, env), fx_arg(kwargs, env), outs, multi))
            if lookup(op) is None:
                opaque.append(op)
            env[node] = [Ref(v) if v is not None else None for v in outs] if multi else Ref(outs[0])
        elif node.op == "output":
            results = node.args[0]
            if len(results) != len(out_roles):
                raise AssertionError(f"{len(results)} outputs for {len(out_roles)} roles")
            for res, (name, role) in zip(results, out_roles):
                g.outputs.append(GraphOutput(name, role, env[res].id))
    return g, opaque


def _creation_without_input(node: torch.fx.Node) -> tuple[str, tuple, dict]:
    """The op, args and kwargs a call node is recorded with (``ir.ops_shape.WITHOUT_INPUT``'s rewrite: the
    input's dtype and device filled in; else as traced)."""
    op = str(node.target)
    plain, kept = WITHOUT_INPUT.get(op, (None, 0))
    src = node.args[0].meta.get("val") if plain and isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(src, torch.Tensor):
        return op, node.args, dict(node.kwargs)
    kwargs = dict(node.kwargs)
    if kwargs.get("dtype") is None:
        kwargs["dtype"] = src.dtype
    if kwargs.get("device") is None:
        kwargs["device"] = src.device
    return plain, tuple(node.args[1:1 + kept]), kwargs


def _fix_default_dtype(node: torch.fx.Node, kwargs: dict, val) -> None:
    """A creation op traced without ``dtype`` (``torch.zeros(n, m)``) made the default dtype of the trace; a rank
    process has its own default (float32 where the step was captured in float64), so the dtype is written in."""
    if kwargs.get("dtype") is not None or not isinstance(val, torch.Tensor):
        return
    schema = getattr(node.target, "_schema", None)
    if schema is None or not any(a.name == "dtype" and a.kwarg_only for a in schema.arguments):
        return
    if not any(isinstance(a, torch.fx.Node) for a in tree_leaves((node.args, node.kwargs))):
        kwargs["dtype"] = val.dtype


def fx_arg(a, env):
    """A torch.fx argument as an IR argument: fx nodes become the value ``env`` holds for them (a ``Ref``)."""
    if isinstance(a, torch.fx.Node):
        ref = env[a]
        if isinstance(ref, list):
            raise AssertionError(f"multi-output node {a} used directly")
        return ref
    if isinstance(a, (list, tuple)):
        items = [fx_arg(x, env) for x in a]
        return items if isinstance(a, list) else tuple(items)
    if isinstance(a, dict):
        return {k: fx_arg(v, env) for k, v in a.items()}
    if isinstance(a, torch.dtype):
        return ir_dtype(a)
    if isinstance(a, torch.device):
        return Device(a.type)
    if isinstance(a, torch.layout):
        return Layout(str(a).removeprefix("torch."))
    if isinstance(a, torch.memory_format):
        return MemoryFormat(str(a).removeprefix("torch."))
    if a is None or isinstance(a, (bool, int, float, complex, str)):
        return a
    raise ValueError(f"unsupported op argument {a!r} of type {type(a).__name__}")
