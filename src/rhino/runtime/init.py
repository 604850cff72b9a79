"""Sharded initialisation: each rank builds only its own shards of the training state.

``local_state(cap, rp, rank, source)`` returns, for every non-batch graph input (parameters, frozen
parameters, buffers, optimizer state), this rank's local tensor under the plan, equal to
``shard_tensor(cap.initial_state()[name], ...)`` bitwise, without ever building the whole state:

- parameters and buffers are materialised one full tensor at a time (``source``: the ``Deferred``
  of ``capture.deferred.load_deferred``, which replays that tensor's construction alone; ``None``
  when the workload holds real tensors), sliced, and the full tensor dropped;
- optimizer state that torch creates lazily (moments, step counters, Adagrad sums) is created
  directly at the local shape, from the graph input's type; state an optimizer's own traced step makes
  at its first step (``capture.optim_traced``) is computed from the materialised parameters and sliced; state the optimizer already holds
  (a workload that stepped before returning) is materialised and sliced like a parameter.

``build_rank_state(workload, plan, rank)`` does the whole per-rank set-up for a trainer or a test:
load deferred, capture, resolve the plan (a ``ShardingPlan`` or a strategy string), local state and
local example batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capture import Captured, capture, default_dtype
from ..capture.deferred import Deferred, load_deferred
from ..capture.optim import SCALAR_KEYS, lazy_value, state_name
from ..ir.graph import Role
from ..sharding.mesh import Mesh
from ..sharding.placement import Partial, ReduceOp, Replicate, Sharding, local_shape
from ..sharding.plan import ResolvedPlan, ShardingPlan, resolve
from ..sharding.presets import parse_strategy, preset_plan
from .collectives import shard_tensor

__all__ = ["RankState", "build_rank_state", "example_batch", "local_batch", "local_state", "return_freed_memory"]

# glibc mallopt(3) parameter number of M_MMAP_THRESHOLD (malloc.h), and the value set: allocations of at
# least 64 KiB (about a 128x128 fp32 tensor) get their own mapping, unmapped when freed.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 1024


def _tensor_of(cap: Captured, name: str) -> torch.Tensor:
    model = cap.workload.model
    params = dict(model.named_parameters())
    return params[name] if name in params else dict(model.named_buffers())[name]


def _value(t: torch.Tensor, source: Deferred | None) -> torch.Tensor:
    if t.device.type == "meta":
        if source is None:
            raise ValueError("the workload's tensors are on the meta device; pass the Deferred that "
                             "load_deferred returned as source")
        return source.materialize(t)
    return t.detach().clone()


def _local_constant(value: float, shape, dtype: torch.dtype, sharding: Sharding, mesh: Mesh, rank: int,
                    device) -> torch.Tensor:
    """This rank's piece of a tensor filled with ``value`` (``shard_tensor``'s rule: a Partial(sum) piece
    off coordinate 0 holds zeros)."""
    coords = mesh.coords(rank)
    zero = any(isinstance(p, Partial) and p.op is ReduceOp.SUM and coords[a] != 0 for a, p in enumerate(sharding))
    local = local_shape(shape, sharding, mesh)
    return torch.full(local, 0.0 if zero else value, dtype=dtype, device=device)


def local_state(cap: Captured, rp: ResolvedPlan, rank: int, source: Deferred | None = None,
                device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """This rank's shard of every non-batch graph input, by graph-input name (see the module docstring).
    At most one full parameter or buffer (plus what its construction reads) exists at a time."""
    mesh = rp.plan.mesh
    device = torch.device(device or "cpu")
    updates = {state_name(u.name, k): (u, k) for u in cap.updates for k in u.state_keys}
    params = dict(cap.workload.model.named_parameters())
    opt_state = cap.workload.optimizer.state
    out: dict[str, torch.Tensor] = {}
    rates = cap.schedule_values
    for inp in cap.graph.inputs:
        if inp.role is Role.BATCH:
            continue
        sharding = rp.value[inp.value]
        if inp.name in cap.scheduled:          # a scheduled learning rate: the trainer sets it before each step
            out[inp.name] = torch.tensor(rates[inp.name], dtype=torch.float64, device=device)
            continue
        if inp.role is Role.OPT_STATE:
            u, key = updates[inp.name]
            held = opt_state.get(params[u.name], {})
            if key not in held and u.init is None:
                out[inp.name] = _lazy_state(cap, inp, u, key, held, sharding, mesh, rank, device)
                continue
            if key == "started":    # a traced step()'s first-step branch (capture.optim_traced)
                full = torch.tensor(lazy_value(u, key, held))
            elif key not in held:   # made by the optimizer's own first step, from the parameters' values
                full = u.init.value(u.name, key, lambda n: _value(_tensor_of(cap, n), source))
            elif isinstance(held[key], torch.Tensor):
                full = _value(held[key], source)
            else:
                full = torch.tensor(held[key])
            if key in SCALAR_KEYS:     # 0-dim state in the captured step's dtype (float32 step counters)
                full = full.to(getattr(torch, cap.graph.types[inp.value].dtype.value))
        else:
            full = _value(_tensor_of(cap, inp.name), source)
        whole = all(isinstance(p, Replicate) for p in sharding)   # kept as materialised: no second copy
        out[inp.name] = (full if whole else shard_tensor(full, sharding, mesh, rank)).to(device)
        del full
    return out


def _lazy_state(cap: Captured, inp, u, key: str, held: dict, sharding, mesh, rank, device) -> torch.Tensor:
    """State torch creates at the first step, as ``capture.optim.initial_state`` gives it, at local shape."""
    t = cap.graph.types[inp.value]
    dtype = getattr(torch, t.dtype.value)
    return _local_constant(lazy_value(u, key, held), t.shape, dtype, sharding, mesh, rank, device)


def example_batch(source: Deferred | None, cap_or_workload=None) -> tuple[torch.Tensor, ...]:
    """The workload's example batch with real values (the whole global batch: batches are small)."""
    workload = getattr(cap_or_workload, "workload", cap_or_workload)
    if workload is None:
        workload = source.workload
    return tuple(_value(b, source) for b in workload.batch)


def local_batch(cap: Captured, rp: ResolvedPlan, rank: int, batch: tuple,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, ...]:
    """This rank's shard of a global batch, per the plan's batch-input placements."""
    device = torch.device(device or "cpu")
    inputs = [i for i in cap.graph.inputs if i.role is Role.BATCH]
    if len(inputs) != len(batch):
        raise ValueError(f"the batch has {len(batch)} tensors but the captured step takes {len(inputs)}")
    return tuple(shard_tensor(b, rp.value[i.value], rp.plan.mesh, rank).to(device) for i, b in zip(inputs, batch))


def return_freed_memory() -> bool:
    """Make freed tensor memory go back to the OS at once (glibc only; False elsewhere).

    glibc raises its mmap threshold to the size of the largest block freed so far (up to 32 MiB,
    mallopt(3), DEFAULT_MMAP_THRESHOLD_MAX), after which tensors below it come from the heap, which
    fragments and rarely shrinks: a rank's RSS then grows past its live bytes from step to step (a
    wide MLP under tp=4 on 4 ranks, tests/test_large_model.py: peak 2.11-2.29 GiB per rank after step 2
    without this, 1.86 GiB with it).
    Setting ``M_MMAP_THRESHOLD`` fixes the threshold (it disables the adjustment), so every tensor of
    64 KiB or more is its own mapping. Call once per rank process, before building state."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


@dataclass
class RankState:
    """What one rank needs to run a plan: the captured step, the resolved plan, its state and batch."""

    cap: Captured
    rp: ResolvedPlan
    state: dict[str, torch.Tensor]
    batch: tuple[torch.Tensor, ...]
    source: Deferred


def build_rank_state(workload, plan: ShardingPlan | str, rank: int, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> RankState:
    """Deferred load of ``workload`` (``FILE[:FUNC]`` or a function), capture, the plan (a ``ShardingPlan``
    or a strategy string such as ``"dp=2,zero=3"``), then this rank's state and example-batch shards."""
    with default_dtype(dtype):
        w, source = load_deferred(workload, dtype)
        cap = capture(w)
        if isinstance(plan, str):
            plan = preset_plan(cap.graph, parse_strategy(plan))
    rp = resolve(cap.graph, plan)
    state = local_state(cap, rp, rank, source, device)
    batch = local_batch(cap, rp, rank, example_batch(source, cap), device)
    return RankState(cap, rp, state, batch, source)
