"""The module a state input belongs to, from its name: the unit in which ZeRO-3 parameters are
gathered (one collective per module, as FSDP2 gathers one ``fully_shard`` unit at a time).

State inputs are named by their PyTorch ``state_dict`` key (``blocks.3.attn.qkv.weight``; optimizer
state ``opt/<parameter name>/<slot>``, ``capture.optim``). The *block* of a name is its prefix up to
and including its first numeric component (``blocks.3``): the element of an ``nn.ModuleList`` or
``nn.Sequential``, the unit users wrap with ``fully_shard`` (torchtitan wraps each transformer block
and the root); in a ``Sequential`` of single layers that is one layer (``enc1.0`` for
``enc1.0.weight``: its weight and bias), which keeps the gathered bytes small where the model has
no repeated blocks. A name with no such component belongs to the root, ``""``.
"""
from __future__ import annotations

from .graph import STATE_ROLES, Graph

__all__ = ["ROOT", "parameter_name", "block_of", "value_blocks"]

ROOT = ""


def parameter_name(name: str) -> str:
    """The parameter a state input belongs to: ``opt/<p>/<slot>`` -> ``<p>``; other names as they are."""
    if name.startswith("opt/") and name.count("/") >= 2:
        return name[len("opt/"):name.rindex("/")]
    return name


def block_of(name: str) -> str:
    """``"blocks.3"`` for ``"blocks.3.attn.qkv.weight"`` (and its optimizer state), ``"enc1.0"`` for
    ``"enc1.0.weight"``; ``ROOT`` when no module component of the name is a number."""
    parts = parameter_name(name).split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ROOT


def value_blocks(graph: Graph) -> dict[int, str]:
    """The block of each value that a node reads together with a state input (a gradient, read by its
    parameter's update): the block of the state inputs of the first such node. FSDP2 reduce-scatters
    the gradients of one module together, so the runtime and the cost model bucket them by this."""
    state = {i.value: block_of(i.name) for i in graph.inputs if i.role in STATE_ROLES}
    out: dict[int, str] = {}
    for node in graph.nodes:
        refs = [r.id for r in node.input_refs()]
        blocks = [state[v] for v in refs if v in state]
        if blocks:
            for v in refs:
                if v not in state:
                    out.setdefault(v, blocks[0])
    return out
