"""Every rank of a parallel plan in its planned arena (``lower.rank_graph`` + ``lower.arena``).

``rank_arena`` makes one rank's ``ArenaProgram`` from its rank graph and the plan of its problem
(``memory.step_report.RankMemoryReport``); in a real run its communication nodes call ``spmd_ops``'
collectives, blocking, in program order. ``lockstep_arenas`` runs one step of every rank in this process,
each rank in its own planned order: each rank runs until its next communication node, and when every rank
has reached one (the same step: the collective-order constraint of ``rank_graph.rank_problem`` makes the
ranks' communication sequences equal), the step is computed on all ranks' inputs at once with the numpy
simulation of ``sharding.simulate``. ``compare_arena_ranks`` checks a plan's arenas against the plain rank
programs (``simulate_spmd.simulate_ranks``) on every rank.
"""
from __future__ import annotations

import numpy as np
import torch

from ..ir.graph import Role
from ..memory.step_report import RankMemoryReport
from ..sharding import simulate
from ..sharding.plan import ResolvedPlan
from .arena import ArenaProgram, compare_pairs
from .rank_graph import RankMemory
from .simulate_spmd import simulate_ranks
from .spmd_ops import step_from_args

__all__ = ["rank_arena", "lockstep_arenas", "local_inputs", "simulate_arenas", "compare_arena_ranks"]


def rank_arena(rm: RankMemory, report: RankMemoryReport, device: torch.device | str = "cpu", debug: bool = False,
               communicate=None) -> ArenaProgram:
    """Rank ``rm.rank``'s arena program under the plan ``report`` made for its problem."""
    plan = report.of_rank(rm.rank).plan
    return ArenaProgram(rm.graph, rm.problem, rm.mapping, plan.order, plan.offsets, plan.height, device,
                        debug=debug, communicate=communicate)


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return (t.float() if t.dtype is torch.bfloat16 else t).numpy()


def lockstep_arenas(arenas: list[ArenaProgram], states: list[dict], batches: list[tuple], mesh) -> list[torch.Tensor]:
    """One step of every rank (``states[r]`` updated as ``ArenaProgram.step`` does); returns each rank's loss."""
    world = len(arenas)
    gens = [a.steps(states[r], batches[r]) for r, a in enumerate(arenas)]
    sends: list = [None] * world
    with torch.no_grad():
        while True:
            reqs, losses = [], []
            for g, s in zip(gens, sends):
                try:
                    reqs.append(g.send(s))
                except StopIteration as stop:
                    losses.append(stop.value)
            if losses:
                assert not reqs, "the ranks' arena programs ran different numbers of communication steps"
                return losses
            kind, axis, params = reqs[0][1:]
            assert all(r[1:] == (kind, axis, params) for r in reqs), \
                f"the ranks reached different communication steps: {[r[1:] for r in reqs]}"
            ys = simulate.apply_step([_np(r[0]) for r in reqs], step_from_args(kind, axis, *params), mesh)
            sends = [torch.from_numpy(np.array(y)).to(r[0].dtype) for y, r in zip(ys, reqs)]


def local_inputs(rp: ResolvedPlan, state: dict, batch: tuple) -> list[tuple[dict, tuple]]:
    """Each rank's shard of the state and of the batch (``sharding.simulate.shard``, as ``simulate_ranks``)."""
    mesh, graph = rp.plan.mesh, rp.graph
    out = []
    for r in range(mesh.world):
        st, bt = {}, []
        for inp in graph.inputs:
            src = batch[int(inp.name.split("/")[1])] if inp.role is Role.BATCH else state[inp.name]
            local = torch.from_numpy(np.array(simulate.shard(_np(src), rp.value[inp.value], mesh)[r])).to(src.dtype)
            if inp.role is Role.BATCH:
                bt.append(local)
            else:
                st[inp.name] = local
        out.append((st, tuple(bt)))
    return out


def simulate_arenas(rp: ResolvedPlan, memories: list[RankMemory], report: RankMemoryReport, state: dict,
                    batch: tuple, steps: int = 1, debug: bool = True) -> dict:
    """``steps`` steps of every rank in its arena, in lockstep: {"rank_losses", "local" (each rank's state),
    "arena_bytes" (each rank's arena)}."""
    arenas = [rank_arena(rm, report, debug=debug) for rm in memories]
    inputs = local_inputs(rp, state, batch)
    states = [st for st, _ in inputs]
    rank_losses: list[list[float]] = [[] for _ in arenas]
    for _ in range(steps):
        for r, loss in enumerate(lockstep_arenas(arenas, states, [b for _, b in inputs], rp.plan.mesh)):
            rank_losses[r].append(float(loss))
    return {"rank_losses": rank_losses, "local": states, "arena_bytes": [a.stats.arena_bytes for a in arenas]}


def compare_arena_ranks(rp: ResolvedPlan, memories: list[RankMemory], report: RankMemoryReport, state: dict,
                        batch: tuple, rtol: float, atol: float, steps: int = 1) -> dict:
    """Every rank in its planned arena (debug guards on) against the plain blocking rank programs, both in
    lockstep on the same shards: whether every rank's losses and state tensors agree (``allclose`` at
    ``rtol``/``atol``, and bitwise), the largest difference, and each rank's arena bytes against its plan."""
    arena = simulate_arenas(rp, memories, report, state, batch, steps)
    plain_losses: list[list[float]] = [[] for _ in memories]
    with torch.no_grad():
        _, _, _, plain = simulate_ranks(rp, state, batch, steps, return_state=True, rank_losses=plain_losses)
    pairs = []
    for r in range(len(memories)):
        pairs.append((torch.tensor(plain_losses[r]), torch.tensor(arena["rank_losses"][r])))
        pairs += [(plain[r][k], arena["local"][r][k]) for k in arena["local"][r]]
    max_diff, equal, bitwise = compare_pairs(pairs, rtol, atol)
    heights = [report.of_rank(rm.rank).plan.height for rm in memories]
    return {"equal": equal, "bitwise": bitwise, "max_abs_diff": max_diff, "steps": steps,
            "arena_bytes": arena["arena_bytes"], "plan_bytes": heights,
            "arena_equals_plan": arena["arena_bytes"] == heights}
