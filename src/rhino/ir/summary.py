"""A short summary of a graph: ops by kind, FLOPs, bytes of each kind of state."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .graph import Graph, Role
from .registry import OpKind, call_of, flops_of, lookup

__all__ = ["Summary", "summarize"]


@dataclass
class Summary:
    nodes: int
    ops_by_kind: dict[str, int]
    flops: int
    param_bytes: int
    buffer_bytes: int
    opt_state_bytes: int
    batch_bytes: int
    params: int
    opaque_ops: list[str]


def summarize(graph: Graph) -> Summary:
    kinds: Counter[str] = Counter()
    flops = 0
    opaque = set()
    for node in graph.nodes:
        opdef = lookup(node.op)
        kinds[(opdef.kind if opdef else OpKind.OPAQUE).value] += 1
        if opdef is None:
            opaque.add(node.op)
        else:
            flops += flops_of(call_of(graph, node))

    def nbytes(*roles: Role) -> int:
        return sum(graph.types[i.value].nbytes for i in graph.inputs_by_role(*roles))

    return Summary(
        nodes=len(graph.nodes), ops_by_kind=dict(kinds.most_common()), flops=flops,
        param_bytes=nbytes(Role.PARAM, Role.FROZEN), buffer_bytes=nbytes(Role.BUFFER),
        opt_state_bytes=nbytes(Role.OPT_STATE), batch_bytes=nbytes(Role.BATCH),
        params=sum(graph.types[i.value].numel for i in graph.inputs_by_role(Role.PARAM, Role.FROZEN)),
        opaque_ops=sorted(opaque),
    )
