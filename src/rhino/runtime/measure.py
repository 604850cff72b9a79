"""Measuring a real step: live tensor bytes while an fx program runs, and step times."""
from __future__ import annotations

import torch
import torch.fx

__all__ = ["LiveBytesMeter"]


class LiveBytesMeter(torch.fx.Interpreter):
    """Runs an fx program node by node (fx frees each value after its last use) and records the peak
    bytes of distinct tensor storages live while a node runs: the interpreter's live values, the
    node's result and the ``held`` tensors (state kept outside the program). This is what the cost
    model's ``estimate_memory`` predicts (it ignores allocator rounding and caching)."""

    def __init__(self, gm: torch.fx.GraphModule, held=()) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.held = list(held)
        self.peak = 0
        self.peak_node = ""

    def run_node(self, n):
        result = super().run_node(n)
        storages: dict[int, int] = {}
        # an input nothing reads is dropped at once (the boxed programs of ``lower.overlap.release_inputs``)
        stack = [v for k, v in self.env.items() if k.users or k.op != "placeholder"] + [result] + self.held
        while stack:
            v = stack.pop()
            if isinstance(v, torch.Tensor):
                s = v.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
            elif isinstance(v, (list, tuple)):
                stack.extend(v)
        live = sum(storages.values())
        if live > self.peak:
            self.peak, self.peak_node = live, n.name
        return result
