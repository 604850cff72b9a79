"""Every rank of a pipelined step in one process: each stage's ranks run their programs in lockstep
(``lower.simulate_spmd.lockstep``, collectives simulated), boundary values are handed over through a
mailbox. The stages advance round-robin, each as far as its messages allow, so a schedule that would
deadlock with blocking receives raises instead; every message is checked against the shape and dtype
its receiver expects (the buffer a real ``irecv`` fills).

A testing aid for the fast tier: ``simulate_pipeline`` runs ``steps`` steps of a plan with stages and
returns what ``runtime.run`` compares (every rank's losses and held state shards).
"""
from __future__ import annotations

import torch

from ..capture import Captured
from ..lower.simulate_spmd import lockstep
from .collectives import shard_tensor
from .pipeline import PipelineStep, Recv, Run, Send
from .rank_step import microbatch_graph

__all__ = ["simulate_pipeline", "PipelineDeadlock"]


class PipelineDeadlock(RuntimeError):
    """No stage can advance: every unfinished rank waits for a message nobody sent."""


def simulate_pipeline(cap: Captured, plan, steps: int = 1, state: dict | None = None,
                      batch: tuple | None = None) -> dict:
    """``steps`` pipelined steps of ``plan``: {"losses": global rank -> loss per step, "local": global rank ->
    its held state shards, "steps": the ``PipelineStep`` of every rank, "messages": messages per step}."""
    m = plan.microbatches
    micro = microbatch_graph(cap, m) if m > 1 else None
    first = PipelineStep(cap.graph, plan, 0, micro_graph=micro)
    ranks = [first] + [PipelineStep(cap.graph, plan, r, micro_graph=micro, spec=first.spec)
                       for r in range(1, plan.world)]
    state = state if state is not None else cap.initial_state()
    batch = tuple(batch if batch is not None else cap.workload.batch)
    inputs = {i.name: i.value for i in first.rp.graph.inputs}
    local = [{n: shard_tensor(state[n], st.rp.value[inputs[n]], plan.mesh, st.local) for n in st.state_names}
             for st in ranks]
    shares = [st.local_batch(batch) for st in ranks]
    losses: dict[int, list[float]] = {r: [] for r in range(plan.world)}
    messages = 0
    for _ in range(steps):
        out, sent = _one_step(ranks, local, shares, plan)
        messages = sent
        last = out[(plan.stages - 1) * plan.mesh.world]
        for r in range(plan.world):
            losses[r].append(last)
    return {"losses": losses, "local": {r: local[r] for r in range(plan.world)}, "steps": ranks,
            "messages": messages}


def _one_step(ranks: list[PipelineStep], local: list[dict], shares: list[tuple], plan) -> tuple[dict, int]:
    W, S = plan.mesh.world, plan.stages
    gens = [st.schedule(local[r], shares[r]) for r, st in enumerate(ranks)]
    acts: list = [None] * len(ranks)
    result: dict[int, float | None] = {}
    done = object()

    def advance(r: int, reply) -> None:
        try:
            acts[r] = gens[r].send(reply)
        except StopIteration as stop:
            acts[r] = done
            result[r] = stop.value

    mailbox: dict[tuple, torch.Tensor] = {}
    in_flight: list[tuple] = []    # (rank, tag, the tensor sent, its value then): a send may read it until the step ends
    sent = 0
    with torch.no_grad():
        for r in range(len(ranks)):
            advance(r, None)
        while any(a is not done for a in acts):
            progressed = False
            for s in range(S):
                group = range(s * W, (s + 1) * W)
                for r in group:
                    while isinstance(acts[r], Send) or (isinstance(acts[r], Recv) and
                                                        (s_key := (acts[r].src, s, r % W, acts[r].tag)) in mailbox):
                        act = acts[r]
                        if isinstance(act, Send):
                            mailbox[(s, act.dst, r % W, act.tag)] = act.tensor.clone()
                            in_flight.append((r, act.tag, act.tensor, mailbox[(s, act.dst, r % W, act.tag)]))
                            sent += 1
                            advance(r, None)
                        else:
                            t = mailbox.pop(s_key)
                            if tuple(t.shape) != act.shape or t.dtype != act.dtype:
                                raise AssertionError(f"stage {s} rank {r} expected {act.shape} {act.dtype} for tag "
                                                     f"{act.tag}, got {tuple(t.shape)} {t.dtype}")
                            advance(r, t)
                        progressed = True
                if all(isinstance(acts[r], Run) for r in group):
                    keys = {acts[r].key for r in group}
                    assert len(keys) == 1, keys
                    _, outs = lockstep([acts[r].program for r in group], [acts[r].args for r in group], plan.mesh)
                    for r, o in zip(group, outs):
                        advance(r, o)
                    progressed = True
            if not progressed:
                waiting = {r: a for r, a in enumerate(acts) if a is not done}
                raise PipelineDeadlock(f"no stage can advance; waiting ranks: {sorted(waiting)}")
    assert not mailbox, sorted(mailbox)
    for r, tag, tensor, then in in_flight:
        if not torch.equal(tensor, then):   # an asynchronous send (dist.isend) would have read either value
            raise AssertionError(f"rank {r} changed the tensor of its send {tag} before the step ended")
    return result, sent
