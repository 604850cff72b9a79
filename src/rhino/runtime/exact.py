"""Exactness checks without processes: every rank of a plan run in lockstep in this process.

``simulate_plan`` runs a captured workload under a plan with the per-rank programs the runtime runs
(each rank's ``RankStep``, its collectives simulated in numpy, see ``lower.simulate_spmd``) and compares
every rank's losses and state shards with single-device PyTorch (``runtime.compare``; with micro-batches,
PyTorch's accumulation loop). Build the workload in float64 (``capture.default_dtype(torch.float64)``
or ``load_workload(spec, dtype=torch.float64)``) so that the comparison runs at 1e-9, where a wrong
sharding rule cannot hide in rounding noise.
"""
from __future__ import annotations

import time

import torch

from ..capture import Captured, default_dtype
from ..capture.schedule import planned_rates, set_rates
from ..ir.graph import Role
from ..lower.simulate_spmd import lockstep
from ..sharding.plan import ShardingPlan, resolve
from .collectives import shard_tensor
from .compare import Tolerance, state_dtype
from .rank_step import RankStep, microbatch_graph
from .run import RunResult, bytes_by_role, compare_results

__all__ = ["simulate_plan", "simulate_rank_steps"]


def simulate_plan(cap: Captured, plan: ShardingPlan, steps: int = 2,
                  tol: Tolerance | None = None, overlap: bool = False) -> tuple[RunResult, dict]:
    """``overlap``: the ranks run the overlapped programs (``RankStep(..., overlap=True)``) instead of the
    blocking ones. Returns (the comparison, {"losses" (rank 0's), "rank_losses", "local" (each rank's state by input name),
    "held" (rank 0's state bytes by role), "peaks" (each rank's peak live bytes in the first step)})."""
    start = time.perf_counter()
    rp = resolve(cap.graph, plan)
    micro = microbatch_graph(cap, plan.microbatches) if plan.microbatches > 1 else None
    world = plan.mesh.world
    rank_steps = [RankStep(cap.graph, plan, r, overlap=overlap, micro_graph=micro) for r in range(world)]
    full = cap.initial_state()
    state = [{i.name: shard_tensor(full[i.name], rp.value[i.value], plan.mesh, r).clone()
              for i in cap.graph.inputs if i.role is not Role.BATCH} for r in range(world)]
    batch = tuple(b.detach() for b in cap.workload.batch)
    with default_dtype(torch.float64 if state_dtype(cap) is torch.float64 else None):
        res = simulate_rank_steps(rank_steps, state, [batch] * steps, planned_rates(cap, steps))
    res["held"] = bytes_by_role(cap.graph, state[0])
    results = {r: {"losses": res["rank_losses"][r], "local": state[r],
                   "held": bytes_by_role(cap.graph, state[r])} for r in range(world)}
    return compare_results(cap, rp, rank_steps[0].step_communication(), results, steps, start, tol), res


def simulate_rank_steps(rank_steps: list[RankStep], states: list[dict], batches: list[tuple],
                        rates: list | None = None) -> dict:
    """Train every rank's ``RankStep`` in lockstep on the global ``batches`` (one per step; ``rates``: each
    step's scheduled learning rates, ``capture.schedule``); ``states`` (each rank's local state) are updated
    in place. Returns {"losses", "rank_losses", "local", "peaks"}: peaks are each rank's live bytes in the
    first step, counted as ``RankStep.run_measured`` counts them."""
    world = len(rank_steps)
    mesh = rank_steps[0].plan.mesh
    rank_losses: list[list[float]] = [[] for _ in range(world)]
    peaks = [0] * world
    for step, batch in enumerate(batches):
        for st in states:
            set_rates(st, rates[step] if rates else None)
        locs = [rs.local_batch(batch) for rs in rank_steps]
        gens = [rs.schedule(states[r], locs[r], release=True) for r, rs in enumerate(rank_steps)]
        outs: list = [None] * world
        with torch.no_grad():
            while True:
                phase, done = _advance(gens, outs)
                if done is not None:
                    break
                held = [rank_steps[r].held(*phase[r], states[r], locs[r]) for r in range(world)]
                phase_peaks = [0] * world if step == 0 else None
                _, outs = lockstep([p for p, _ in phase], [a for _, a in phase], mesh, phase_peaks, held)
                del phase, held
                if phase_peaks is not None:
                    peaks = [max(a, b) for a, b in zip(peaks, phase_peaks)]
        for r in range(world):
            rank_losses[r].append(done[r])
    return {"losses": rank_losses[0], "rank_losses": rank_losses, "local": states, "peaks": peaks}


def _advance(gens, outs) -> tuple[list, list | None]:
    """Send each rank's outputs to its schedule: (every rank's next (program, args), None), or when the
    schedules end (they end together), (None, every rank's loss)."""
    phase, done = [], []
    for g, o in zip(gens, outs):
        try:
            phase.append(g.send(o))
        except StopIteration as stop:
            done.append(stop.value)
    assert not (phase and done), "the ranks' schedules ran different numbers of programs"
    return (None, done) if done else (phase, None)
