"""Run every rank's program in one process, in lockstep, with collectives simulated (numpy).

A debugging and testing aid: no processes, no torch.distributed. Each value can be assembled from
its shards and compared with the same value computed on one device, which names the first op whose
sharded result is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ir.graph import Graph, Role
from ..sharding import simulate
from ..sharding.plan import ResolvedPlan
from .fx import constant_tensor, convert_arg, resolve_op, runnable_op
from .spmd import lower_rank
from .spmd_ops import redistribute, start, step_from_args, wait

__all__ = ["simulate_ranks", "simulate_training", "first_divergence", "run_single_values", "simulate_peak_bytes",
           "lockstep"]


def _to_np(t: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: such values travel as float32 (exact) and come back rounded once."""
    t = t.detach().cpu().resolve_conj().resolve_neg()
    return (t.float() if t.dtype is torch.bfloat16 else t).numpy()


def _from_np(a, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a)).to(dtype)  # np.array keeps 0-d shapes


def simulate_training(rp: ResolvedPlan, state: dict[str, torch.Tensor], batch: tuple, steps: int,
                      overlap=False) -> dict:
    """``steps`` sharded steps in one process: {"losses" (rank 0's per step), "rank_losses" (each rank's),
    "final" (global state, assembled), "local" (each rank's own state tensors by input name), "held" (rank 0
    bytes), "peaks" (each rank's peak of live tensor bytes in the first step, see ``lockstep``)}."""
    peaks = [0] * rp.plan.mesh.world
    rank_losses: list[list[float]] = [[] for _ in range(rp.plan.mesh.world)]
    envs, progs, losses, local = simulate_ranks(rp, state, batch, steps, return_state=True, peaks=peaks,
                                                rank_losses=rank_losses, overlap=overlap)
    mesh = rp.plan.mesh
    final = {}
    held: dict[str, int] = {}
    for inp in rp.graph.inputs:
        if inp.role is Role.BATCH:
            continue
        locs = [_to_np(local[r][inp.name]) for r in range(mesh.world)]
        final[inp.name] = _from_np(simulate.assemble(locs, rp.value[inp.value], mesh), local[0][inp.name].dtype)
        held[inp.role.value] = held.get(inp.role.value, 0) + locs[0].nbytes
    return {"losses": losses, "rank_losses": rank_losses, "final": final, "local": local, "held": held,
            "peaks": peaks}


def simulate_ranks(rp: ResolvedPlan, state: dict[str, torch.Tensor], batch: tuple, steps: int = 1,
                   return_state: bool = False, peaks: list[int] | None = None,
                   rank_losses: list[list[float]] | None = None, overlap=False):
    """Returns (per-rank env of the last step: fx node name -> tensor, programs, rank 0's per-step losses);
    ``rank_losses`` (one list per rank) receives every rank's loss per step. ``overlap``: run the
    overlapped programs (``lower_rank(..., overlap=...)``; a start computes its bucket at once)."""
    mesh = rp.plan.mesh
    world = mesh.world
    progs = [lower_rank(rp, r, overlap=overlap) for r in range(world)]
    graph = rp.graph
    local = []
    for r in range(world):
        d = {}
        for inp in graph.inputs:
            src = batch[int(inp.name.split("/")[1])] if inp.role is Role.BATCH else state[inp.name]
            d[inp.name] = _from_np(simulate.shard(_to_np(src), rp.value[inp.value], mesh)[r].copy(), src.dtype)
        local.append(d)
    names = [i.name for i in graph.inputs]
    losses = []
    replaced = set(progs[0].output_names[1:])   # handed to the program, as the runtime does: dies at its last use
    state_names = [i.name for i in graph.inputs if i.role is not Role.BATCH and i.name not in replaced]
    for step in range(steps):
        held = [[local[r][n] for n in state_names] for r in range(world)]
        envs, outs = lockstep(progs, [[local[r][n] for n in names] for r in range(world)], mesh,
                               peaks if step == 0 else None, held)
        losses.append(float(outs[0][0]))
        for r in range(world if rank_losses is not None else 0):
            rank_losses[r].append(float(outs[r][0]))
        for r in range(world):
            for name, value in zip(progs[r].output_names[1:], outs[r][1:]):
                local[r][name] = value
    if return_state:
        return envs, progs, losses, local
    return envs, progs, losses


def simulate_peak_bytes(rp: ResolvedPlan, state: dict[str, torch.Tensor], batch: tuple) -> list[int]:
    """Each rank's peak of live tensor bytes during one step, run in lockstep in this process."""
    peaks = [0] * rp.plan.mesh.world
    with torch.no_grad():
        simulate_ranks(rp, state, batch, 1, peaks=peaks)
    return peaks


def _storage_bytes(values) -> int:
    seen: dict[int, int] = {}
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return sum(seen.values())


def lockstep(progs, inputs, mesh, peaks: list[int] | None = None, held=None):
    """Run all ranks node by node. With ``peaks`` (one int per rank), record each rank's peak bytes of
    distinct storages alive while a node runs: values still needed later, the node's result and
    ``held[r]`` (what ``runtime.measure.LiveBytesMeter`` counts in a real run)."""
    world = len(progs)
    nodes = [list(p.module.graph.nodes) for p in progs]
    envs = [dict() for _ in range(world)]
    outs = None
    if peaks is not None:
        order = {n.name: k for k, n in enumerate(nodes[0])}
        # as fx.Interpreter(garbage_collect_values=True): a value goes after its last user; one with no
        # user is never freed, but an input nothing reads is dropped at once (``runtime.measure``)
        last = {n.name: max([order[u.name] for u in n.users],
                            default=order[n.name] if n.op == "placeholder" else len(order)) for n in nodes[0]}
        alive = [dict() for _ in range(world)]
    for i, n0 in enumerate(nodes[0]):
        if peaks is not None and i > 0:
            for r in range(world):
                name = nodes[r][i - 1].name
                alive[r][name] = envs[r].get(name)
                for k in [k for k in alive[r] if last[k] < i]:
                    del alive[r][k]

        if n0.op == "placeholder":
            for r in range(world):
                envs[r][nodes[r][i].name] = inputs[r][len([n for n in nodes[0][:i] if n.op == "placeholder"])]
        elif n0.op == "get_attr":
            for r in range(world):
                envs[r][nodes[r][i].name] = getattr(progs[r].module, nodes[r][i].target)
        elif n0.op == "call_function" and n0.target is start:   # overlapped program: a bucket, at once
            step = step_from_args(*n0.args[1:])
            results = [[] for _ in range(world)]
            for k, x0 in enumerate(n0.args[0]):
                dtype = envs[0][x0.name].dtype
                ys = simulate.apply_step([_to_np(envs[r][nodes[r][i].args[0][k].name]) for r in range(world)],
                                         step, mesh)
                for r in range(world):
                    results[r].append(_from_np(ys[r], dtype))
            for r in range(world):
                envs[r][nodes[r][i].name] = results[r]
        elif n0.op == "call_function" and n0.target is wait:
            for r in range(world):
                envs[r][nodes[r][i].name] = envs[r][nodes[r][i].args[0].name]
        elif n0.op == "call_function" and n0.target is redistribute:
            dtype = envs[0][nodes[0][i].args[0].name].dtype
            xs = [_to_np(envs[r][nodes[r][i].args[0].name]) for r in range(world)]
            step = step_from_args(*n0.args[1:])
            ys = simulate.apply_step(xs, step, mesh)
            for r in range(world):
                envs[r][nodes[r][i].name] = _from_np(ys[r], dtype)
        elif n0.op == "call_function":
            for r in range(world):
                n = nodes[r][i]
                args = torch.fx.node.map_arg(n.args, lambda a: envs[r][a.name])
                kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: envs[r][a.name])
                envs[r][n.name] = n.target(*args, **kwargs)
        elif n0.op == "output":
            outs = [torch.fx.node.map_arg(nodes[r][i].args[0], lambda a: envs[r][a.name]) for r in range(world)]
        if peaks is not None and n0.op != "output":
            for r in range(world):
                live = _storage_bytes(list(alive[r].values()) + [envs[r][nodes[r][i].name]] + list(held[r]))
                peaks[r] = max(peaks[r], live)
    return envs, outs


def run_single_values(graph: Graph, state: dict, batch: tuple) -> dict[int, torch.Tensor]:
    """Every IR value of one step on one device."""
    vals: dict[int, torch.Tensor] = {}
    for inp in graph.inputs:
        vals[inp.value] = batch[int(inp.name.split("/")[1])] if inp.role is Role.BATCH else state[inp.name]
    for vid in graph.constants:
        vals[vid] = constant_tensor(graph, vid)
    cpu = torch.device("cpu")

    def conv(a):
        return convert_arg(a, lambda r: vals[r.id], cpu)

    with torch.no_grad():
        for node in graph.nodes:
            out = resolve_op(runnable_op(node.op))(*conv(node.args), **conv(node.kwargs))
            if node.multi:
                for k, vid in enumerate(node.outputs):
                    if vid is not None:
                        vals[vid] = out[k]
            else:
                vals[node.outputs[0]] = out
    return vals


@dataclass
class Divergence:
    node: str
    op: str
    value: int
    sharding: str
    max_abs_diff: float


def first_divergence(rp: ResolvedPlan, state: dict, batch: tuple, rtol=1e-4, atol=1e-5) -> Divergence | None:
    """The first node whose assembled sharded output differs from one device (one step)."""
    single = run_single_values(rp.graph, state, batch)
    envs, progs, _ = simulate_ranks(rp, state, batch, 1)
    mesh = rp.plan.mesh
    for node in rp.graph.nodes:
        for vid in node.outputs:
            if vid is None or vid not in progs[0].value_nodes:
                continue
            name = progs[0].value_nodes[vid]
            locs = [_to_np(envs[r][progs[r].value_nodes[vid]]) for r in range(mesh.world)]
            try:
                got = simulate.assemble(locs, rp.value[vid], mesh)
            except (ValueError, AssertionError) as exc:
                return Divergence(node.name, node.op, vid, f"{rp.value[vid]} (inconsistent: {exc})", float("inf"))
            want = _to_np(single[vid])
            if got.shape != want.shape or not np.allclose(got.astype(np.float64), want.astype(np.float64),
                                                          rtol=rtol, atol=atol):
                diff = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max()) \
                    if got.shape == want.shape else float("inf")
                return Divergence(node.name, node.op, vid, str(rp.value[vid]), diff)
            del name
    return None
