"""IR -> ``torch.fx.GraphModule``: one call per IR node, state passed in and out."""
from __future__ import annotations

import operator
import re
from typing import Callable

import torch
import torch.fx

from ..ir.graph import Graph, Ref
from ..ir.registry import Family, InputLayout, lookup
from ..ir.types import Device, DType, Layout, MemoryFormat

__all__ = ["lower", "resolve_op", "OnContiguous", "overload_of", "runnable_op", "convert_arg", "add_constants",
           "emit_node", "py_name"]


def resolve_op(op: str) -> Callable:
    """An IR op name (``aten.mm.default``) -> what a rank calls for it: its torch overload
    (``torch.ops.aten.mm.default``), or an ``OnContiguous`` of it when the op has the ``input_layout`` fact or is
    opaque (an unknown kernel may read its inputs as laid out in eager PyTorch, where its callers make them
    contiguous: ``_weight_norm_interface_backward`` does)."""
    if op in _WRAPPED:
        return _WRAPPED[op]
    ns, name, overload = op.split(".")
    try:
        fn = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except AttributeError:
        raise ValueError(f"op {op} does not exist in this PyTorch build") from None
    d = lookup(op)
    if d is None or d.input_layout is not None:
        fn = _WRAPPED[op] = OnContiguous(fn, InputLayout.CONTIGUOUS if d is None else d.input_layout)
    return fn


_WRAPPED: dict[str, Callable] = {}


class OnContiguous:
    """``op`` called on contiguous copies of the tensor arguments not laid out as ``layout`` asks; other
    attributes (``_schema``, ``is_view``) are the op's."""

    def __init__(self, op: torch._ops.OpOverload, layout: InputLayout):
        self.op, self.layout = op, layout
        self.__name__ = py_name(f"{op.__name__}_on_contiguous")
        self._outs = {a.name for a in op._schema.arguments if a.is_out}   # written into: passed as they are

    def __call__(self, *args, **kwargs):
        return self.op(*self._laid_out(args), **{k: v if k in self._outs else self._laid_out(v)
                                                 for k, v in kwargs.items()})

    def __getattr__(self, name: str):
        if name in ("op", "layout", "_outs"):     # (not set yet: a copy being made)
            raise AttributeError(name)
        return getattr(self.op, name)

    def _laid_out(self, a):
        if isinstance(a, torch.Tensor):
            inner = a.dim() == 0 or a.stride(-1) == 1 or a.shape[-1] == 1
            keep = inner if self.layout is InputLayout.INNER else a.is_contiguous()
            return a if keep else a.contiguous()
        if isinstance(a, (list, tuple)):
            return type(a)(self._laid_out(x) for x in a)
        if isinstance(a, dict):
            return {k: self._laid_out(v) for k, v in a.items()}
        return a


def overload_of(target) -> torch._ops.OpOverload:
    """The torch overload an fx call target runs (itself, or the op inside an ``OnContiguous``)."""
    return target.op if isinstance(target, OnContiguous) else target


def runnable_op(op: str) -> str:
    """The op to call for an IR node's ``op`` on whole tensors: a reshape for a view that may fail on a layout
    (the ``local_op`` of the RESHAPE family, which takes the same arguments). Capture's fake kernels may give
    an output strides the real kernel does not (``softplus_backward`` on CPU keeps a transposed gradient's
    layout, its fake kernel is contiguous), so a traced ``view`` can fail on the real tensor; a reshape is the
    same view where one exists and a copy otherwise. (Other ``local_op``s take local arguments: not here.)"""
    d = lookup(op)
    return d.local_op if d is not None and d.local_op and d.family is Family.RESHAPE else op


def py_name(name: str) -> str:
    """``name`` as a Python identifier (what the emitted code calls the value)."""
    safe = re.sub(r"\W", "_", name)
    return safe if not safe[:1].isdigit() else "_" + safe


def convert_arg(a, ref, device: torch.device):
    """IR argument -> torch argument; ``ref(Ref)`` gives what a tensor reference becomes."""
    if isinstance(a, Ref):
        return ref(a)
    if isinstance(a, list):
        return [convert_arg(x, ref, device) for x in a]
    if isinstance(a, tuple):
        return tuple(convert_arg(x, ref, device) for x in a)
    if isinstance(a, dict):
        return {k: convert_arg(v, ref, device) for k, v in a.items()}
    if isinstance(a, DType):
        return getattr(torch, a.value)
    if isinstance(a, Device):
        return device
    if isinstance(a, (Layout, MemoryFormat)):
        return getattr(torch, a.name)
    return a


def constant_tensor(graph: Graph, vid: int, device: torch.device | str = "cpu") -> torch.Tensor:
    t = graph.types[vid]
    return torch.tensor(graph.constants[vid], dtype=getattr(torch, t.dtype.value), device=device).reshape(t.shape)


def add_constants(graph: Graph, root: torch.nn.Module, fg: torch.fx.Graph, env: dict, device) -> None:
    """Register the graph's constant tensors as buffers of ``root`` and read them with get_attr."""
    for vid in graph.constants:
        name = f"_const{vid}"
        root.register_buffer(name, constant_tensor(graph, vid, device))
        env[vid] = fg.get_attr(name)


def emit_node(fg: torch.fx.Graph, node, op: str, args, kwargs, env: dict) -> None:
    """Call ``op`` for an IR node and bind its outputs (through getitem for tuple results) in ``env``."""
    call = fg.call_function(resolve_op(op), tuple(args), kwargs)
    call.name = py_name(node.name)
    if node.multi:
        for i, vid in enumerate(node.outputs):
            if vid is not None:
                env[vid] = fg.call_function(operator.getitem, (call, i))
    elif node.outputs and node.outputs[0] is not None:   # (an op returning nothing: a check)
        env[node.outputs[0]] = call


def lower(graph: Graph, device: torch.device | str = "cpu") -> torch.fx.GraphModule:
    """A GraphModule taking the graph inputs in order and returning the outputs in order.

    Device arguments recorded at capture are replaced by ``device``.
    """
    device = torch.device(device)
    root = torch.nn.Module()
    fg = torch.fx.Graph()
    env: dict[int, torch.fx.Node] = {}
    for inp in graph.inputs:
        env[inp.value] = fg.placeholder(py_name(inp.name))
    add_constants(graph, root, fg, env, device)
    for node in graph.nodes:
        conv = lambda a: convert_arg(a, lambda r: env[r.id], device)  # noqa: E731
        emit_node(fg, node, runnable_op(node.op), conv(node.args), conv(node.kwargs), env)
    fg.output([env[o.value] for o in graph.outputs])
    return torch.fx.GraphModule(root, fg)
