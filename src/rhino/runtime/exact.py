"""Exactness checks without processes: every rank of a plan run in lockstep in this process.

``simulate_plan`` runs a captured workload under a plan with the per-rank programs the runtime runs
(collectives simulated in numpy, see ``lower.simulate_spmd``) and compares every rank's losses and
state shards with single-device PyTorch (``runtime.compare``). Build the workload in float64
(``capture.default_dtype(torch.float64)`` or ``load_workload(spec, dtype=torch.float64)``) so that the
comparison runs at 1e-9, where a wrong sharding rule cannot hide in rounding noise.
"""
from __future__ import annotations

import time

import torch

from ..capture import Captured, default_dtype
from ..lower.simulate_spmd import simulate_training
from ..lower.spmd import lower_rank
from ..sharding.plan import ShardingPlan, resolve
from .compare import Tolerance, state_dtype
from .run import RunResult, bytes_by_role, check_executable, compare_results

__all__ = ["simulate_plan"]


def simulate_plan(cap: Captured, plan: ShardingPlan, steps: int = 2,
                  tol: Tolerance | None = None) -> tuple[RunResult, dict]:
    """(the comparison, ``simulate_training``'s result: losses, local state, peaks per rank)."""
    start = time.perf_counter()
    check_executable(plan)
    rp = resolve(cap.graph, plan)
    state = cap.initial_state()
    with default_dtype(torch.float64 if state_dtype(cap) is torch.float64 else None):
        res = simulate_training(rp, state, tuple(cap.workload.batch), steps)
    results = {r: {"losses": res["rank_losses"][r], "local": res["local"][r],
                   "held": bytes_by_role(cap.graph, {k: v for k, v in res["local"][r].items() if k in state})}
               for r in range(plan.mesh.world)}
    return compare_results(cap, rp, lower_rank(rp, 0), results, steps, start, tol), res
