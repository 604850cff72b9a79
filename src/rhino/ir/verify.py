"""The IR verifier: an independent check run after every pass.

It checks SSA form and topological order, that no op mutates its inputs, the
training-step signature (one scalar loss; each state input has exactly one
new value of the same type), and that every known op's recorded output shapes
agree with the shapes its annotation implies.
"""
from __future__ import annotations

from .annotation import ShapeError, infer_shapes
from .graph import STATE_ROLES, Graph, Role
from .registry import annotate, call_of, lookup

__all__ = ["VerifyError", "verify", "is_inplace_op"]


class VerifyError(ValueError):
    """The graph breaks an IR invariant."""


# Ops whose schema marks a mutated argument although their names do not say so.
_MUTATING = {"aten._native_batch_norm_legit.default"}
# Overload names of out-variants (they write into an argument).
_OUT_OVERLOADS = {"out", "output", "grad_input", "values", "indices", "dim_max", "dim_min"}


def is_inplace_op(op: str) -> bool:
    """aten naming: ``add_`` mutates its first argument; out-variant overloads write an argument."""
    parts = op.split(".")
    if len(parts) < 3:
        return False
    if op in _MUTATING:
        return True
    name, overload = parts[1], parts[2]
    if name.endswith("__"):
        return name.startswith("__i")
    return (name.endswith("_") or overload in _OUT_OVERLOADS or overload.startswith("out")
            or overload.endswith("_out"))


def verify(graph: Graph, check_shapes: bool = True) -> None:
    problems: list[str] = []
    defined: set[int] = set()
    names: set[str] = set()
    for inp in graph.inputs:
        if inp.name in names:
            problems.append(f"input name {inp.name!r} used twice")
        names.add(inp.name)
        _define(inp.value, f"input {inp.name}", graph, defined, problems)
    for vid in graph.constants:
        _define(vid, f"constant {vid}", graph, defined, problems)
    for node in graph.nodes:
        for ref in node.input_refs():
            if ref.id not in defined:
                problems.append(f"node {node.name} ({node.op}) uses value {ref.id} before it is defined")
        if is_inplace_op(node.op):
            problems.append(f"node {node.name} runs in-place op {node.op}")
        for vid in node.outputs:
            if vid is not None:
                _define(vid, f"node {node.name}", graph, defined, problems)
        if check_shapes and not problems and lookup(node.op) is not None:
            _check_shapes(graph, node, problems)
        if len(problems) > 20:
            break
    _check_signature(graph, defined, problems)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise VerifyError("invalid IR: " + "; ".join(problems[:5]) + more)


def _define(vid: int, what: str, graph: Graph, defined: set[int], problems: list[str]) -> None:
    if vid in defined:
        problems.append(f"{what} redefines value {vid}")
    if vid not in graph.types:
        problems.append(f"{what} defines value {vid} without a type")
    defined.add(vid)


def _check_shapes(graph: Graph, node, problems: list[str]) -> None:
    call = call_of(graph, node)
    try:
        ann = annotate(call)
        if ann is None:
            return
        shapes = infer_shapes(ann, [t.shape for t in call.in_types])
    except (ShapeError, ValueError, TypeError, IndexError, KeyError) as exc:
        problems.append(f"node {node.name} ({node.op}): annotation does not fit its inputs: {exc}")
        return
    if len(shapes) != len(node.outputs):
        problems.append(f"node {node.name} ({node.op}): annotation has {len(shapes)} outputs, node has "
                        f"{len(node.outputs)}")
        return
    for k, (shape, vid) in enumerate(zip(shapes, node.outputs)):
        if vid is None or shape is None:
            continue
        if tuple(graph.types[vid].shape) != tuple(shape):
            problems.append(f"node {node.name} ({node.op}) output {k}: recorded shape "
                            f"{list(graph.types[vid].shape)}, annotation implies {list(shape)}")


def _check_signature(graph: Graph, defined: set[int], problems: list[str]) -> None:
    losses = [o for o in graph.outputs if o.role is Role.LOSS]
    if len(losses) != 1:
        problems.append(f"graph has {len(losses)} loss outputs, expected 1")
    elif losses[0].value not in graph.types:
        problems.append(f"loss refers to undefined value {losses[0].value}")
    elif graph.types[losses[0].value].numel != 1:
        problems.append(f"loss has shape {list(graph.types[losses[0].value].shape)}, expected a scalar")
    state_in = {i.name: i for i in graph.inputs if i.role in STATE_ROLES}
    seen: set[str] = set()
    for out in graph.outputs:
        if out.value not in defined or out.value not in graph.types:
            problems.append(f"output {out.name} refers to undefined value {out.value}")
            continue
        if out.role is Role.LOSS:
            continue
        inp = state_in.get(out.name)
        if inp is None:
            problems.append(f"state output {out.name} has no matching state input")
        elif inp.value in graph.types and graph.types[inp.value] != graph.types[out.value]:
            problems.append(f"state {out.name} changes type from {graph.types[inp.value]} to "
                            f"{graph.types[out.value]}")
        if out.name in seen:
            problems.append(f"state output {out.name} appears twice")
        seen.add(out.name)
    for name in state_in.keys() - seen:
        problems.append(f"state input {name} has no new value among the outputs")
