"""Single-device execution of a captured step: the state lives outside the graph."""
from __future__ import annotations

import torch

from ..ir.graph import Graph, Role
from .fx import lower

__all__ = ["StepProgram"]


class StepProgram:
    """Runs one training step per call, replacing the state by the graph's new values."""

    def __init__(self, graph: Graph, device: torch.device | str = "cpu") -> None:
        self.graph = graph
        self.device = torch.device(device)
        self.module = lower(graph, self.device)
        self.input_names = [i.name for i in graph.inputs]
        self.state_inputs = [i.name for i in graph.inputs if i.role is not Role.BATCH]
        self.n_batch = sum(1 for i in graph.inputs if i.role is Role.BATCH)
        self.output_names = [o.name for o in graph.outputs]

    def step(self, state: dict[str, torch.Tensor], batch: tuple) -> torch.Tensor:
        """One step: ``state`` is updated in place (its tensors replaced); returns the loss."""
        if len(batch) != self.n_batch:
            raise ValueError(f"the step takes {self.n_batch} batch tensors, got {len(batch)}")
        args = [state[n] for n in self.state_inputs] + list(batch)
        with torch.no_grad():
            outs = self.module(*args)
        loss = outs[0]
        for name, value in zip(self.output_names[1:], outs[1:]):
            state[name] = value
        return loss
