"""Training data: the global batches a run trains on and each rank's share of one.

- A workload file may define ``batches()`` (module level, no arguments): an iterator of global batches,
  each a tuple of tensors shaped like the example batch (wrapping a ``torch.utils.data.DataLoader`` is
  fine). Without it the example batch repeats. Every rank iterates the same global batches (the
  iterator must be deterministic: seed any shuffling) and keeps only its share.
- A rank's share (``rank_batch``): the global batch is cut into ``m`` micro-batches along dim 0
  (micro-batch k = rows [kB/m, (k+1)B/m)); each micro-batch is sharded as the plan shards the batch
  input; the rank's pieces are concatenated in micro-batch order. With m = 1 it is the plain shard.
"""
from __future__ import annotations

from itertools import repeat
from typing import Callable, Iterable, Iterator

import torch

from ..ir.graph import Graph, Role
from ..sharding.plan import ResolvedPlan
from .collectives import shard_tensor

__all__ = ["batch_inputs", "check_batch", "check_microbatch_rows", "rank_batch", "batch_stream", "samples_in"]


def batch_inputs(graph: Graph) -> list:
    """The graph's batch inputs in order (``batch/0``, ``batch/1``, ...)."""
    return [inp for inp in graph.inputs if inp.role is Role.BATCH]


def check_batch(graph: Graph, batch, where: str = "a batch") -> tuple:
    """``batch`` as a tuple of tensors shaped (and typed) like the example batch; else a clear ValueError."""
    if isinstance(batch, torch.Tensor):
        batch = (batch,)
    if not isinstance(batch, (tuple, list)) or not all(isinstance(b, torch.Tensor) for b in batch):
        raise ValueError(f"{where} must be a tuple of tensors like the workload's example batch, "
                         f"got {type(batch).__name__}")
    inputs = batch_inputs(graph)
    if len(batch) != len(inputs):
        raise ValueError(f"{where} has {len(batch)} tensors but the workload's example batch has {len(inputs)}")
    for i, (b, inp) in enumerate(zip(batch, inputs)):
        t = graph.types[inp.value]
        if tuple(b.shape) != tuple(t.shape):
            raise ValueError(f"{where}: tensor {i} has shape {list(b.shape)} but the example batch's has "
                             f"{list(t.shape)}; every batch must have the example batch's shapes")
        if str(b.dtype).removeprefix("torch.") != t.dtype.value:
            raise ValueError(f"{where}: tensor {i} has dtype {str(b.dtype).removeprefix('torch.')} but the "
                             f"example batch's has {t.dtype.value}")
    return tuple(b.detach() for b in batch)


def rank_batch(batch: tuple, rp: ResolvedPlan, rank: int, microbatches: int = 1,
               device: torch.device | str = "cpu") -> tuple:
    """This rank's rows of every micro-batch of the global ``batch``, concatenated in micro-batch order."""
    mesh = rp.plan.mesh
    out = []
    if microbatches > 1:
        check_microbatch_rows(batch, microbatches)
    for b, inp in zip(batch, batch_inputs(rp.graph)):
        sharding = rp.value[inp.value]
        if microbatches == 1:
            out.append(shard_tensor(b, sharding, mesh, rank).to(device))
            continue
        pieces = [shard_tensor(mb, sharding, mesh, rank) for mb in b.chunk(microbatches, 0)]
        out.append(torch.cat(pieces, 0).to(device))
    return tuple(out)


def check_microbatch_rows(batch: tuple, microbatches: int) -> None:
    """ValueError (one sentence) unless ``microbatches`` divides dim 0 of every tensor of ``batch``: micro-batches
    cut every batch tensor along dim 0, so a tensor that is not per-sample (a 0-dim temperature, class
    weights) is named as such rather than as a batch size to change."""
    rows = [b.shape[0] if b.dim() else None for b in batch]
    most = max(set(rows) - {None}, key=rows.count, default=None)
    for i, n in enumerate(rows):
        if n is not None and n % microbatches == 0:
            continue
        if n is not None and n == most:
            raise ValueError(f"the batch of {n} rows does not split into {microbatches} micro-batches; "
                             f"choose microbatches dividing the batch size")
        what = "is a 0-dim tensor" if n is None else f"has {n} rows along dim 0 where the others have {most}"
        raise ValueError(f"batch tensor {i} {what}; microbatches={microbatches} cuts every batch tensor along "
                         f"dim 0 into micro-batches of samples, so each must hold one row per sample (put a "
                         f"sequence-first tensor's samples first, pass per-step constants another way, e.g. as a "
                         f"buffer), or use microbatches=1")


def batch_stream(example: tuple, batches: Callable[[], Iterable] | None) -> Iterator[tuple]:
    """The global batches to train on: ``batches()`` if the workload defines it, else the example forever."""
    if batches is None:
        return repeat(tuple(example))
    it = batches()
    try:
        return iter(it)
    except TypeError:
        raise ValueError(f"batches() must return an iterable of batches, got {type(it).__name__}") from None


def samples_in(batch: tuple) -> int:
    """Samples in a global batch: dim 0 of its first tensor (1 for a scalar)."""
    return int(batch[0].shape[0]) if batch and batch[0].dim() else 1
