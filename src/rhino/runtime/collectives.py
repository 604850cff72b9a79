"""Redistribution steps (``sharding.steps``) executed with ``torch.distributed``.

Layout (``placement.Shard``): a dim sharded with ``blocks`` b over an axis of size n is viewed as
``[b, n, m]``; the rank at coordinate c holds ``[:, c, :]`` flattened back. Gathering is the inverse:
the global dim is the concatenation over blocks of the concatenation over ranks of each rank's
piece of that block.

Collectives, per step (``n`` = axis size; an axis of size 1 needs no communication):
- ``AllReduce``: ``all_reduce`` (sum/max/min; avg = sum, then divided by n).
- ``AllGather``: ``all_gather_single`` into one buffer (emulated: list ``all_gather``), then the
  pieces are interleaved block by block.
- ``ReduceScatter``: the local tensor is cut into its n pieces (each piece = its slices of all blocks),
  stacked, and ``reduce_scatter_single`` leaves piece c on coordinate c (emulated: ``all_reduce``
  then a local slice).
- ``AllToAll`` with different source and destination dims: ``all_to_all_single`` sends rank j its
  destination piece, and the received source pieces are interleaved (emulated, and always when the
  two dims are the same: all-gather along the source dim, then a local slice along the destination).
- ``LocalSlice``, ``LocalScale``, ``ZeroUnlessFirst``: local, no communication.

"Native" collectives are used on the backends in ``NATIVE_BACKENDS``: NCCL, and gloo, whose
``reduce_scatter_single``/``all_to_all_single``/``all_gather_single`` were verified on the pinned
torch 2.13. Any other backend gets the emulations, built from ``all_reduce`` and ``all_gather`` only.
``apply_step(..., native=False)`` forces the emulations (tests run both paths).

Asynchronous form (``start_step``, used by the overlapped programs of ``lower.overlap``): the same
collectives issued with ``async_op=True``; a ``Pending`` holds the work handle and finishes the local
result (interleaving, averaging, layout) in ``wait()``. Several tensors of one all-reduce,
reduce-scatter or all-gather may share one flat buffer (a bucket, as DDP's gradient buckets and
FSDP2's packed reduce-scatter and per-module all-gather): each element still goes to (or is reduced
over) the same ranks, so results equal the per-tensor
ones (bit for bit on 2 ranks, where a sum of two terms has one order; gloo's ring on more ranks may
add an element's terms in another order when its offset in the buffer moves it to another chunk).

Results never alias the input tensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..sharding.mesh import Mesh
from ..sharding.placement import Partial, ReduceOp, Replicate, Shard, Sharding, local_shape
from ..sharding.steps import (AllGather, AllReduce, AllToAll, LocalScale, LocalSlice, ReduceScatter,
                              Step, ZeroUnlessFirst, is_communication)
from ..lower.spmd_ops import Collectives
from .groups import MeshGroups

__all__ = ["NATIVE_BACKENDS", "TORCH_COLLECTIVES", "apply_step", "resolved", "start_step", "Pending", "all_reduce_tensor",
           "shard_tensor", "gather_tensor", "slice_piece", "join_pieces"]

NATIVE_BACKENDS = frozenset({"nccl", "gloo"})

_TORCH_OP = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.SUM,
             ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN}
# torch 2.13 renamed the tensor-buffer collectives; keep the older names as a fallback.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------- local layout

def _piece_len(t: torch.Tensor, dim: int, blocks: int, n: int, what: str) -> int:
    if not 0 <= dim < t.dim():
        raise ValueError(f"{what}: dim {dim} is out of range for a tensor of shape {tuple(t.shape)}")
    if blocks < 1 or t.shape[dim] % (blocks * n):
        raise ValueError(f"{what}: dim {dim} of size {t.shape[dim]} does not split into {blocks} "
                         f"block(s) x {n} pieces")
    return t.shape[dim] // (blocks * n)


def slice_piece(t: torch.Tensor, dim: int, blocks: int, n: int, c: int) -> torch.Tensor:
    """Piece ``c`` of ``n`` of every one of ``blocks`` blocks of ``dim``, concatenated (a copy)."""
    m = _piece_len(t, dim, blocks, n, "slice")
    piece = t.unflatten(dim, (blocks, n, m)).select(dim + 1, c).flatten(dim, dim + 1)
    return piece.clone(memory_format=torch.contiguous_format)


def _pieces_view(t: torch.Tensor, dim: int, blocks: int, n: int, what: str) -> torch.Tensor:
    """``[n, *piece]`` (a view where the layout allows): entry j is ``slice_piece(t, dim, blocks, n, j)``."""
    m = _piece_len(t, dim, blocks, n, what)
    return t.unflatten(dim, (blocks, n, m)).movedim(dim + 1, 0).flatten(dim + 1, dim + 2)


def _stack_pieces(t: torch.Tensor, dim: int, blocks: int, n: int, what: str) -> torch.Tensor:
    """``[n, *piece]``, a fresh contiguous copy: entry j is ``slice_piece(t, dim, blocks, n, j)``."""
    return _pieces_view(t, dim, blocks, n, what).clone(memory_format=torch.contiguous_format)


def join_pieces(stacked: torch.Tensor, dim: int, blocks: int) -> torch.Tensor:
    """Inverse of slicing: ``stacked[j]`` is rank j's piece; interleave them block by block."""
    length = stacked.shape[dim + 1]
    if length % blocks:
        raise ValueError(f"gather: dim {dim} of local size {length} does not split into {blocks} block(s)")
    x = stacked.unflatten(dim + 1, (blocks, length // blocks)).movedim(0, dim + 1)
    return x.flatten(dim, dim + 2).contiguous()


# ----------------------------------------------------------------------------- collectives

def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its lazy conjugation and negation applied (a view of a complex tensor through ``conj``
    carries them as bits; the collectives send the memory, and ``view_as_real`` refuses such a tensor)."""
    return t.resolve_conj().resolve_neg()


def _all_gather(t: torch.Tensor, group, n: int, native: bool) -> torch.Tensor:
    """``[n, *t.shape]``: every member's tensor, in coordinate order."""
    t = t.contiguous()
    if native:
        out = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
        _all_gather_single(out, t.reshape(-1), group=group)
        return out.view(n, *t.shape)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t, group=group)
    return torch.stack(parts)


def _average(t: torch.Tensor, n: int) -> torch.Tensor:
    if not (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"a Partial(avg) tensor must be floating point, got {t.dtype}")
    return t.div_(n)


def _storage_order(t: torch.Tensor) -> list[int]:
    """The permutation of ``t``'s dims under which it is contiguous (a transposed or permuted view of a
    dense tensor); the identity when none makes it so."""
    perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    return perm if t.permute(perm).is_contiguous() else list(range(t.dim()))


def all_reduce_tensor(t: torch.Tensor, op: ReduceOp, group, n: int) -> torch.Tensor:
    """``t`` all-reduced over ``group`` (a new tensor) in the input's layout: a transposed gradient is
    reduced in its storage order and comes back transposed. A contiguous copy would transpose it in
    memory, and element-wise ops downstream would then read one operand across strides (on CPUs
    about 20x slower)."""
    perm = _storage_order(t)
    out = t.permute(perm).clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=_TORCH_OP[op], group=group)
    if op is ReduceOp.AVG:
        _average(out, n)
    return out.permute(sorted(range(len(perm)), key=perm.__getitem__))


def _reduce_scatter(t: torch.Tensor, step: ReduceScatter, group, n: int, c: int, native: bool) -> torch.Tensor:
    stacked = _stack_pieces(t, step.dim, step.blocks, n, "reduce-scatter")
    if native:
        out = torch.empty(stacked[0].numel(), dtype=t.dtype, device=t.device)
        _reduce_scatter_single(out, stacked.view(-1), op=_TORCH_OP[step.op], group=group)
        out = out.view(stacked.shape[1:])
    else:
        dist.all_reduce(stacked, op=_TORCH_OP[step.op], group=group)
        out = stacked[c].clone()
    return _average(out, n) if step.op is ReduceOp.AVG else out


def _all_to_all(t: torch.Tensor, step: AllToAll, group, n: int, c: int, native: bool) -> torch.Tensor:
    what = "all-to-all"
    _piece_len(t, step.src_dim, step.src_blocks, 1, what)
    if native and step.src_dim != step.dst_dim:
        send = _stack_pieces(t, step.dst_dim, step.dst_blocks, n, what)   # send[j] goes to rank j
        recv = torch.empty_like(send)                                      # recv[i] came from rank i
        dist.all_to_all_single(recv, send, group=group)
        return join_pieces(recv, step.src_dim, step.src_blocks)
    full = join_pieces(_all_gather(t, group, n, native), step.src_dim, step.src_blocks)
    return slice_piece(full, step.dst_dim, step.dst_blocks, n, c)


def apply_step(tensor: torch.Tensor, step: Step, mesh: Mesh, rank: int, groups: MeshGroups,
               *, native: bool | None = None) -> torch.Tensor:
    """This rank's local tensor after ``step`` (collective for communication steps: every rank of the
    step's axis group must call it). ``native=None`` picks by backend (see module docstring)."""
    if not 0 <= step.axis < mesh.ndim:
        raise ValueError(f"step {step} names axis {step.axis} but mesh {mesh} has {mesh.ndim} axes")
    if groups.mesh != mesh or groups.rank != rank:
        raise ValueError(f"groups were built for mesh {groups.mesh} on rank {groups.rank}, "
                         f"not mesh {mesh} on rank {rank}")
    n, c = mesh.sizes[step.axis], mesh.coords(rank)[step.axis]
    if isinstance(step, LocalScale):
        return tensor * step.factor
    if isinstance(step, ZeroUnlessFirst):
        return tensor.clone() if c == 0 else torch.zeros_like(tensor)
    if isinstance(step, LocalSlice):
        return slice_piece(tensor, step.dim, step.blocks, n, c)
    if not isinstance(step, (AllReduce, AllGather, ReduceScatter, AllToAll)):
        raise ValueError(f"unknown redistribution step {step!r}")
    tensor = resolved(tensor)
    if n == 1:                                  # a one-rank axis: every step is the identity
        return _single_rank(tensor, step)
    group = groups.group(rank, step.axis)
    if native is None:
        native = dist.get_backend(group) in NATIVE_BACKENDS
    if isinstance(step, AllReduce):
        return all_reduce_tensor(tensor, step.op, group, n)
    if isinstance(step, AllGather):
        _piece_len(tensor, step.dim, step.blocks, 1, "all-gather")
        return join_pieces(_all_gather(tensor, group, n, native), step.dim, step.blocks)
    if isinstance(step, ReduceScatter):
        return _reduce_scatter(tensor, step, group, n, c, native)
    return _all_to_all(tensor, step, group, n, c, native)


def _single_rank(tensor: torch.Tensor, step: Step) -> torch.Tensor:
    """A communication step on an axis of size 1 (still checking that its dims are valid)."""
    if isinstance(step, AllGather):
        _piece_len(tensor, step.dim, step.blocks, 1, "all-gather")
    elif isinstance(step, ReduceScatter):
        _piece_len(tensor, step.dim, step.blocks, 1, "reduce-scatter")
    elif isinstance(step, AllToAll):
        _piece_len(tensor, step.src_dim, step.src_blocks, 1, "all-to-all")
        _piece_len(tensor, step.dst_dim, step.dst_blocks, 1, "all-to-all")
    return tensor.clone()


# ----------------------------------------------------------------------------- whole tensors

def _check_sharding(shape: tuple[int, ...], sharding: Sharding, mesh: Mesh) -> None:
    if len(sharding) != mesh.ndim:
        raise ValueError(f"sharding has {len(sharding)} placements but mesh {mesh} has {mesh.ndim} axes")
    for p in sharding:
        if not isinstance(p, (Replicate, Shard, Partial)):
            raise ValueError(f"unknown placement {p!r}")
    local_shape(shape, sharding, mesh)          # raises ValueError when a dim does not divide


def shard_tensor(global_tensor: torch.Tensor, sharding: Sharding, mesh: Mesh, rank: int) -> torch.Tensor:
    """The local tensor of ``rank`` (no communication). Partial(sum): coordinate 0 holds the value and
    the others zeros; Partial(avg|max|min): every coordinate holds the value."""
    _check_sharding(tuple(global_tensor.shape), sharding, mesh)
    coords = mesh.coords(rank)
    t = global_tensor
    for axis, p in enumerate(sharding):
        if isinstance(p, Shard):
            t = slice_piece(t, p.dim, p.blocks, mesh.sizes[axis], coords[axis])
        elif isinstance(p, Partial) and p.op is ReduceOp.SUM and coords[axis] != 0:
            t = torch.zeros_like(t)
    return t.clone() if t is global_tensor else t


def gather_tensor(local: torch.Tensor, sharding: Sharding, mesh: Mesh, rank: int, groups: MeshGroups,
                  *, native: bool | None = None) -> torch.Tensor:
    """The full global tensor on every rank (collective): undo the axes last to first, all-gathering
    shards and all-reducing partials."""
    if len(sharding) != mesh.ndim:
        raise ValueError(f"sharding has {len(sharding)} placements but mesh {mesh} has {mesh.ndim} axes")
    t = local
    for axis in reversed(range(mesh.ndim)):
        p = sharding[axis]
        if isinstance(p, Shard):
            t = apply_step(t, AllGather(axis, p.dim, p.blocks), mesh, rank, groups, native=native)
        elif isinstance(p, Partial):
            t = apply_step(t, AllReduce(axis, p.op), mesh, rank, groups, native=native)
        elif not isinstance(p, Replicate):
            raise ValueError(f"unknown placement {p!r}")
    return t.clone() if t is local else t


# ----------------------------------------------------------------------------- asynchronous, bucketed

# Each tensor of a bucket starts at a multiple of this many bytes in the flat buffer: the alignment of
# PyTorch's CPU allocator (c10 ``gAlignment`` = 64), so a bucket member is laid out as a fresh tensor
# would be and vectorised kernels downstream see the same alignment as after a per-tensor collective.
BUCKET_ALIGN_BYTES = 64


class Pending:
    """An issued collective: ``wait()`` blocks on its work handle (None when it already completed)
    and returns this rank's results, one per input tensor, as the blocking ``apply_step`` would."""

    def __init__(self, work, finish) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> list[torch.Tensor]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        finish, self._finish = self._finish, None
        assert finish is not None, "a collective was waited on twice"
        return finish()


def _flat_layout(tensors: list[torch.Tensor], sizes: list[int]) -> tuple[list[int], int]:
    """Offsets (elements) of each member in a flat buffer, each aligned to ``BUCKET_ALIGN_BYTES``."""
    align = max(1, BUCKET_ALIGN_BYTES // tensors[0].element_size())
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // align) * align
    return offsets, at


def _start_all_reduce(tensors: list[torch.Tensor], op: ReduceOp, group, n: int) -> Pending:
    """One ``all_reduce`` over a flat buffer holding every tensor in its storage order (see
    ``all_reduce_tensor``); each result is a view of the buffer in its input's layout."""
    perms = [_storage_order(t) for t in tensors]
    moved = [t.permute(p) for t, p in zip(tensors, perms)]
    if len(tensors) == 1:
        flat = moved[0].clone(memory_format=torch.contiguous_format)
        views = [flat]
    else:
        offsets, total = _flat_layout(tensors, [t.numel() for t in tensors])
        flat = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
        views = [flat[o:o + m.numel()].view(m.shape) for o, m in zip(offsets, moved)]
        for v, m in zip(views, moved):
            v.copy_(m)
    work = dist.all_reduce(flat, op=_TORCH_OP[op], group=group, async_op=True)

    def finish():
        if op is ReduceOp.AVG:
            _average(flat, n)
        return [v.permute(sorted(range(len(p)), key=p.__getitem__)) for v, p in zip(views, perms)]
    return Pending(work, finish)


def _start_reduce_scatter(tensors: list[torch.Tensor], step: ReduceScatter, group, n: int) -> Pending:
    """One ``reduce_scatter_single`` over ``[n, sum of pieces]``: row j holds every tensor's piece j
    (as FSDP2 packs its reduce-scatter), so row c, split back, is this rank's piece of each tensor."""
    if len(tensors) == 1:                    # sent as it is when its pieces are already laid out in order
        send = _pieces_view(tensors[0], step.dim, step.blocks, n, "reduce-scatter")
        if not send.is_contiguous():
            send = send.clone(memory_format=torch.contiguous_format)
        shapes, offsets = [tuple(send.shape[1:])], [0]
        send = send.view(n, -1)
    else:
        views = [_pieces_view(t, step.dim, step.blocks, n, "reduce-scatter") for t in tensors]
        shapes = [tuple(v.shape[1:]) for v in views]
        offsets, total = _flat_layout(tensors, [v[0].numel() for v in views])
        send = torch.empty(n, total, dtype=tensors[0].dtype, device=tensors[0].device)
        for v, o in zip(views, offsets):
            send[:, o:o + v[0].numel()].view(v.shape).copy_(v)
        del views
    out = torch.empty(send.shape[1], dtype=send.dtype, device=send.device)
    work = _reduce_scatter_single(out, send.reshape(-1), op=_TORCH_OP[step.op], group=group, async_op=True)

    def finish():
        if step.op is ReduceOp.AVG:
            _average(out, n)
        return [out[o:o + _numel(s)].view(s) for s, o in zip(shapes, offsets)]
    return Pending(work, finish)


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _start_all_gather(tensors: list[torch.Tensor], step: AllGather, group, n: int) -> Pending:
    """One ``all_gather_single``: every member's local tensor packed in one flat buffer (as FSDP2 packs a
    module's shards), received as ``[n, buffer]``; each result is its member's pieces interleaved
    (``join_pieces``: a view of the received buffer for a lone tensor gathered along dim 0, else a
    copy, so the flat buffer dies once every result is made)."""
    for t in tensors:
        _piece_len(t, step.dim, step.blocks, 1, "all-gather")
    if len(tensors) == 1:
        send, offsets = tensors[0].contiguous().reshape(-1), [0]
    else:
        offsets, total = _flat_layout(tensors, [t.numel() for t in tensors])
        send = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
        for t, o in zip(tensors, offsets):
            send[o:o + t.numel()].view(t.shape).copy_(t)
    out = torch.empty(n * send.numel(), dtype=send.dtype, device=send.device)
    work = _all_gather_single(out, send, group=group, async_op=True)
    shapes = [tuple(t.shape) for t in tensors]

    def finish():
        rows = out.view(n, -1)
        return [join_pieces(rows[:, o:o + _numel(s)].view(n, *s), step.dim, step.blocks)
                for s, o in zip(shapes, offsets)]
    return Pending(work, finish)


def _start_all_to_all(t: torch.Tensor, step: AllToAll, group, n: int) -> Pending:
    _piece_len(t, step.src_dim, step.src_blocks, 1, "all-to-all")
    send = _stack_pieces(t, step.dst_dim, step.dst_blocks, n, "all-to-all")
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return Pending(work, lambda: [join_pieces(recv, step.src_dim, step.src_blocks)])


def start_step(tensors: list[torch.Tensor], step: Step, mesh: Mesh, rank: int, groups: MeshGroups,
               *, native: bool | None = None) -> Pending:
    """Issue ``step`` on every tensor of ``tensors`` without waiting (``async_op=True``): several
    tensors of one all-reduce, reduce-scatter or all-gather travel in one flat buffer (a bucket). Results equal
    ``apply_step`` on each tensor: the reduction of an element is the same sum over the same ranks.
    Steps with no native asynchronous form here (local steps, axes of size 1, the emulated
    collectives, an all-to-all within one dim) run at once and return a completed ``Pending``."""
    if not tensors:
        raise ValueError("start_step needs at least one tensor")
    tensors = [resolved(t) for t in tensors]
    n = mesh.sizes[step.axis] if 0 <= step.axis < mesh.ndim else 0
    group = groups.group(rank, step.axis) if n > 1 and is_communication(step) else None
    if native is None and group is not None:
        native = dist.get_backend(group) in NATIVE_BACKENDS
    if group is not None and native:
        if isinstance(step, AllReduce):
            return _start_all_reduce(tensors, step.op, group, n)
        if isinstance(step, ReduceScatter):
            return _start_reduce_scatter(tensors, step, group, n)
        if isinstance(step, AllGather):
            return _start_all_gather(tensors, step, group, n)
        if isinstance(step, AllToAll) and len(tensors) == 1 and step.src_dim != step.dst_dim:
            return _start_all_to_all(tensors[0], step, group, n)
    done = [apply_step(t, step, mesh, rank, groups, native=native) for t in tensors]
    return Pending(None, lambda: done)


# what a per-rank program's ``redistribute`` / ``start`` run on (``lower.spmd_ops.set_context``)
TORCH_COLLECTIVES = Collectives(apply=apply_step, start=start_step)
