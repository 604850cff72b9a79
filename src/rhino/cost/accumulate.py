"""Cutting a training step into its gradient part and its update part (for gradient accumulation).

A captured step computes the loss and the gradients from the batch (forward and backward), then the
optimizer update from the gradients. With ``m`` micro-batches the first part runs ``m`` times and the
second once, on the accumulated gradients. The cut (pure graph logic, no torch):

- *update seeds*: the optimizer nodes of ``ir.analysis`` (after the loss: they read optimizer state,
  make new state, compute from what those made, or read state and feed only them, as weight decay's
  ``g + wd * p``); the forward nodes that produce new buffer values (BatchNorm running statistics) are
  before the loss and stay in the gradient part, so the buffers are carried from micro-batch to
  micro-batch.
- *update part*: the seeds, everything computed from them, and the nodes they need that do not depend
  on the batch (learning-rate and bias-correction scalars, AdamW's decayed weight), which run once.
- *boundary values*: values the update part reads that depend on the batch: the gradients (and what the
  gradient part computes from them alone, reading no state, before the update proper starts), each a
  storage, not a view (views of them, a transposed weight gradient, are taken in both parts). They are
  accumulated as ``sum_k value_k / m``; weight decay reads the parameter and is an update node, so it
  runs once on the accumulated gradient, as ``optimizer.step()`` after PyTorch's accumulation loop.
- *gradient part*: what the loss, the boundary values and the new buffer values need (buffers updated
  outside the optimizer, e.g. BatchNorm's ``num_batches_tracked + 1``, are updated per micro-batch, as
  in PyTorch's accumulation loop). Nodes that do not depend on the batch may be in both parts (computed
  in each).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.analysis import analyze, batch_dependent
from ..ir.graph import Graph, Role

__all__ = ["StepSplit", "split_step", "SplitError", "accumulation_windows"]


class SplitError(ValueError):
    """The step cannot be cut into a gradient part and an update part: ``reason`` says why; the message adds
    ``advice`` for gradient accumulation (a pipeline gives its own, ``runtime.pipeline``)."""

    def __init__(self, reason: str, advice: str = ""):
        super().__init__(f"{reason}; {advice}" if advice else reason)
        self.reason = reason


@dataclass
class StepSplit:
    grad_nodes: list[str]          # node names in graph order
    update_nodes: list[str]
    boundary: list[int]            # value ids produced by the gradient part and read by the update part
    grad_state_outputs: list[str]  # state outputs (buffers) the gradient part produces, by name
    update_state_outputs: list[str]  # state outputs the update part produces (or passes through)
    update_start: int = -1         # index of the first optimizer node (where the update proper begins)


def split_step(graph: Graph) -> StepSplit:
    """The cut described in the module docstring."""
    nodes = graph.nodes
    a = analyze(graph)
    if a.loss_node is None:
        raise SplitError("the step has no loss node, so it cannot be cut into micro-batches")
    dep = batch_dependent(graph)
    producer = a.producer
    update = set(a.optimizer)
    start = min(update, default=len(nodes))
    for i, node in enumerate(nodes):  # everything computed from an update node
        if i not in update and any(producer.get(r.id) in update for r in node.input_refs()):
            update.add(i)
    boundary: set[int] = set()
    for i in sorted(update, reverse=True):  # batch-free inputs are computed in the update part too
        _pull(nodes, i, update, boundary, dep, producer, a.is_view)
    state_in = {i.value for i in graph.inputs}
    grad_out, upd_out, roots = [], [], set(boundary)
    for o in graph.outputs:
        p = producer.get(o.value)
        if o.role is Role.LOSS:
            roots.add(o.value)
        elif p is not None and p not in update and o.role is Role.BUFFER:
            grad_out.append(o.name)  # updated in the forward (running statistics, counters): per micro-batch
            roots.add(o.value)
        elif p is not None and p not in update and o.value in dep:
            raise SplitError(f"the new value of {o.name} is computed from the batch outside the optimizer "
                             f"update; gradient accumulation cannot run this step")
        elif p is not None and p not in update:
            update.add(p)
            _pull(nodes, p, update, boundary, dep, producer, a.is_view)
            upd_out.append(o.name)
        else:
            assert p is not None or o.value in state_in, o.name
            upd_out.append(o.name)
    grad = _ancestors(nodes, roots, producer)
    clash = [nodes[i].name for i in grad & update
             if not a.is_view[i] and any(v in dep for v in nodes[i].outputs if v is not None)]
    if clash:
        raise SplitError(f"node {clash[0]} is needed by both the gradients and the optimizer update; gradient "
                         f"accumulation cannot cut this step")
    for vid in boundary:
        if a.at_or_before_loss(producer[vid]):   # not a gradient: made in the forward, from the batch
            node = nodes[producer[vid]]
            raise SplitError(f"the optimizer update reads {node.name} ({node.op}), a forward value computed from the "
                             f"batch (a parameter changed in the forward, as nn.Embedding(max_norm=...) renormalises "
                             f"its rows), which micro-batches cannot carry from one to the next", "use microbatches=1")
        if not (graph.types[vid].dtype.is_floating or graph.types[vid].dtype.is_complex):
            raise SplitError(f"the optimizer update reads a {graph.types[vid].dtype.value} value computed from "
                             f"the batch; only floating-point (real or complex) gradients can be accumulated")
    return StepSplit([nodes[i].name for i in sorted(grad)], [nodes[i].name for i in sorted(update)],
                     sorted(boundary, key=lambda v: producer[v]), grad_out, upd_out, start)


def _pull(nodes, i: int, update: set[int], boundary: set[int], dep: set[int], producer: dict, is_view) -> None:
    """Add node ``i``'s batch-free producers and views to ``update`` (recursively); other batch-dependent
    values are boundary values. A view is taken again in the update part, so that no two boundary values
    share a storage: each is accumulated in place, and an accumulator that is a view of another would be
    added into twice (Shampoo's ``G @ G.T`` read a gradient and its transpose)."""
    stack = [i]
    while stack:
        for r in nodes[stack.pop()].input_refs():
            p = producer.get(r.id)
            if p is None or p in update:
                continue
            if r.id in dep and not is_view[p]:
                boundary.add(r.id)
            else:
                update.add(p)
                stack.append(p)


def _ancestors(nodes, roots: set[int], producer: dict) -> set[int]:
    out: set[int] = set()
    stack = [producer[v] for v in roots if v in producer]
    while stack:
        i = stack.pop()
        if i in out:
            continue
        out.add(i)
        stack.extend(producer[r.id] for r in nodes[i].input_refs() if r.id in producer)
    return out


def accumulation_windows(graph: Graph, resolved_plan=None) -> tuple[list[tuple[int, int]], int]:
    """(node index windows of the gradient phase and of the update phase: before and from the first
    optimizer node; bytes of one rank's gradient accumulators: the boundary values at their produced
    sharding, a partial one full-sized), for ``cost.pipeline.accumulation_memory``."""
    split = split_step(graph)
    if resolved_plan is None:
        acc = sum(graph.types[v].nbytes for v in split.boundary)
    else:
        acc = sum(_prod(resolved_plan.local_shape(v)) * graph.types[v].dtype.itemsize for v in split.boundary)
    return [(0, split.update_start), (split.update_start, len(graph.nodes))], acc


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
