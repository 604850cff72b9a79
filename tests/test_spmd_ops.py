"""``lower.spmd_ops``: a per-rank program's communication runs on the collectives it was given
(``set_context(..., collectives)``), so ``lower/`` needs nothing from ``runtime/``."""
from __future__ import annotations

import pytest
import torch

from rhino.lower import spmd_ops
from rhino.lower.spmd_ops import Collectives, redistribute, set_context, start, step_args, step_from_args, wait
from rhino.sharding.mesh import Mesh
from rhino.sharding.placement import ReduceOp
from rhino.sharding.steps import (AllGather, AllReduce, AllToAll, LocalScale, LocalSlice, ReduceScatter,
                                  ZeroUnlessFirst)


class _Done:
    def __init__(self, values):
        self.values = values

    def wait(self):
        return self.values


def test_step_args_round_trip():
    for step in (AllReduce(0, ReduceOp.SUM), ReduceScatter(1, ReduceOp.MAX, 0, 2), AllGather(0, 1, 3),
                 AllToAll(1, 0, 1, 1, 2), LocalSlice(0, 1, 2), LocalScale(1, 0.5), ZeroUnlessFirst(0)):
        assert step_from_args(*step_args(step)) == step


def test_redistribute_and_start_call_the_injected_collectives(monkeypatch):
    calls = []

    def apply(x, step, mesh, rank, groups, native=None):
        calls.append(("apply", step, rank, groups, native))
        return x * 2

    def begin(xs, step, mesh, rank, groups, native=None):
        calls.append(("start", step, rank, groups, native))
        return _Done([x + 1 for x in xs])

    monkeypatch.setattr(spmd_ops, "_CTX", {})
    x = torch.ones(2)
    with pytest.raises(RuntimeError, match="set_context"):
        redistribute(x, "AllReduce", 0, "sum")
    mesh = Mesh(("dp",), (2,))
    set_context(mesh, 1, "groups", Collectives(apply=apply, start=begin))
    assert torch.equal(redistribute(x, "AllGather", 0, 0, 1), 2 * x)
    out = wait(start([x, x], "AllReduce", 0, "sum"))
    assert [torch.equal(o, x + 1) for o in out] == [True, True]
    assert calls == [("apply", AllGather(0, 0, 1), 1, "groups", None),
                     ("start", AllReduce(0, ReduceOp.SUM), 1, "groups", None)]
