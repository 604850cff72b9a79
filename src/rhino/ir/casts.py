"""Dtype casts: ops that convert each element of one tensor and keep its shape.

A cast of a weight (``aten._to_copy`` under ``torch.autocast``, a ``.to(bfloat16)`` in user code, a
``clone``) computes elementwise, so its output may take any sharding of its input: the presets and the
search treat such a chain like a chain of views when deciding where a weight is split (the weight stays
sharded and the cast runs on the shard).
"""
from __future__ import annotations

from .graph import Node
from .types import Layout

__all__ = ["CAST_OPS", "is_cast"]

CAST_OPS = frozenset({"aten._to_copy.default", "aten.clone.default", "prims.convert_element_type.default"})


def is_cast(node: Node) -> bool:
    """Whether ``node`` is a one-tensor elementwise conversion (dtype change or copy) with one output."""
    if node.op not in CAST_OPS or len(node.outputs) != 1 or len(node.input_refs()) != 1:
        return False
    layout = node.kwargs.get("layout")
    return layout is None or (isinstance(layout, Layout) and layout.name == "strided")
