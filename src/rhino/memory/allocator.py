"""A simulation of PyTorch's CUDA caching allocator (the "PyTorch" baseline of the memory planner).

Source of the rules: pytorch/pytorch ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``:
``round_size``, ``get_pool``, ``get_allocation_size``, ``get_free_block``, ``should_split``,
``alloc_found_block``, ``free_block``/``try_merge_blocks``), default configuration (no
``max_split_size``, no ``roundup_power2_divisions``, no expandable segments), one stream, and a device
with unlimited memory (so segments are never released back with ``cudaFree``). Written from the rules,
not from the code:

- A request of ``n`` bytes is rounded up to a multiple of ``K_MIN_BLOCK_SIZE`` (512, at least 512).
- Requests up to ``K_SMALL_SIZE`` (1 MiB) use the small pool, larger ones the large pool.
- The allocator takes the smallest free block of the request's pool that fits (ties: lowest address).
- With none, it reserves a new segment (``cudaMalloc``): ``K_SMALL_BUFFER`` (2 MiB) for small requests,
  ``K_LARGE_BUFFER`` (20 MiB) for requests below ``K_MIN_LARGE_ALLOC`` (10 MiB), otherwise the request
  rounded up to ``K_ROUND_LARGE`` (2 MiB).
- The block is split when the remainder is at least 512 bytes (small pool) or more than 1 MiB (large
  pool): the request takes the low end, the remainder stays free above it.
- A freed block merges with its free neighbours in the same segment.

Peak *reserved* is the most bytes held in segments (what ``torch.cuda.max_memory_reserved`` reports);
peak *allocated* the most bytes in allocated blocks (``max_memory_allocated``, block sizes after
rounding and unsplit remainders).
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from .problem import MemProblem, TensorKind

__all__ = [
    "AllocatorStats",
    "CachingAllocator",
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "simulate_allocator",
]

MiB = 1 << 20
K_MIN_BLOCK_SIZE = 512  # all sizes are rounded to at least 512 bytes (CUDACachingAllocator.cpp)
K_SMALL_SIZE = 1 * MiB  # largest "small" allocation
K_SMALL_BUFFER = 2 * MiB  # small allocations are packed in 2 MiB segments
K_LARGE_BUFFER = 20 * MiB  # allocations between 1 and 10 MiB may use a 20 MiB segment
K_MIN_LARGE_ALLOC = 10 * MiB  # from here on a segment is the rounded request
K_ROUND_LARGE = 2 * MiB  # large segments are rounded up to 2 MiB


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    segment: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.addr)


@dataclass(frozen=True)
class AllocatorStats:
    """Result of replaying an order through the allocator simulation."""

    peak_reserved: int  # most bytes in segments
    peak_allocated: int  # most bytes in allocated blocks
    peak_requested: int  # most bytes requested by live tensors (unrounded)
    segments: int  # number of segments reserved

    @property
    def fragmentation(self) -> float:
        """``1 - peak_requested / peak_reserved`` (0 when nothing was reserved)."""
        return 0.0 if self.peak_reserved == 0 else 1.0 - self.peak_requested / self.peak_reserved


class CachingAllocator:
    """The caching allocator's bookkeeping: ``malloc(size) -> handle``, ``free(handle)``.

    Addresses are virtual: each segment gets a fresh range, so block addresses order blocks within a
    segment (and across segments by reservation time).
    """

    def __init__(self) -> None:
        self._pools: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # small? -> sorted (size, addr)
        self._free_by_key: dict[tuple[int, int], _Block] = {}
        self._live: dict[int, tuple[_Block | None, int]] = {}  # handle -> (block, requested bytes)
        self._next_handle = 0
        self._next_addr = 0
        self.segments: list[int] = []  # sizes
        self.reserved = 0
        self.allocated = 0
        self.requested = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self.peak_requested = 0

    @staticmethod
    def round_size(size: int) -> int:
        """Request rounded up to a multiple of 512 (at least 512)."""
        if size < K_MIN_BLOCK_SIZE:
            return K_MIN_BLOCK_SIZE
        return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)

    @staticmethod
    def allocation_size(rounded: int) -> int:
        """Size of the segment reserved for a request that no free block fits."""
        if rounded <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if rounded < K_MIN_LARGE_ALLOC:
            return K_LARGE_BUFFER
        return K_ROUND_LARGE * ((rounded + K_ROUND_LARGE - 1) // K_ROUND_LARGE)

    @staticmethod
    def _should_split(block: _Block, rounded: int) -> bool:
        remaining = block.size - rounded
        return remaining >= K_MIN_BLOCK_SIZE if block.small else remaining > K_SMALL_SIZE

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._pools[block.small], block.key())
        self._free_by_key[block.key()] = block

    def _remove_free(self, block: _Block) -> None:
        pool = self._pools[block.small]
        i = bisect.bisect_left(pool, block.key())
        assert pool[i] == block.key()
        pool.pop(i)
        del self._free_by_key[block.key()]

    def malloc(self, size: int) -> int:
        """Allocate ``size`` bytes; returns a handle for :meth:`free`. Zero bytes allocate nothing."""
        if size < 0:
            raise ValueError(f"cannot allocate {size} bytes")
        handle = self._next_handle
        self._next_handle += 1
        if size == 0:
            self._live[handle] = (None, 0)
            return handle
        rounded = self.round_size(size)
        small = rounded <= K_SMALL_SIZE
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (rounded, -1))
        if i < len(pool):
            block = self._free_by_key[pool[i]]
            self._remove_free(block)
        else:
            seg = self.allocation_size(rounded)
            block = _Block(self._next_addr, seg, len(self.segments), small)
            self._next_addr += seg
            self.segments.append(seg)
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        if self._should_split(block, rounded):
            rest = _Block(block.addr + rounded, block.size - rounded, block.segment, small,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = rounded
            self._insert_free(rest)
        block.allocated = True
        self._live[handle] = (block, size)
        self.allocated += block.size
        self.requested += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        return handle

    def free(self, handle: int) -> None:
        """Return a block to its pool, merging it with free neighbours in its segment."""
        block, size = self._live.pop(handle)
        if block is None:
            return
        self.allocated -= block.size
        self.requested -= size
        block.allocated = False
        for nb in (block.prev, block.next):
            if nb is None or nb.allocated:
                continue
            self._remove_free(nb)
            if nb is block.prev:
                block.addr = nb.addr
                block.prev = nb.prev
                if nb.prev is not None:
                    nb.prev.next = block
            else:
                block.next = nb.next
                if nb.next is not None:
                    nb.next.prev = block
            block.size += nb.size
        self._insert_free(block)

    def stats(self) -> AllocatorStats:
        """Peaks so far."""
        return AllocatorStats(self.peak_reserved, self.peak_allocated, self.peak_requested, len(self.segments))


def simulate_allocator(problem: MemProblem, order: Iterable[int] | None = None) -> AllocatorStats:
    """Replay ``order`` (default: program order) through :class:`CachingAllocator`.

    Events follow the lifetime rule of ``problem.py``, as eager PyTorch would: graph inputs are
    allocated first (in tensor-id order); each op allocates its outputs in the order it lists them,
    then every tensor whose last reader just ran (and every output nobody reads) is freed, in the order
    the op lists them (inputs first, then outputs). OUTPUT tensors and inputs marked ``also_output``
    are never freed.
    """
    order = problem.op_ids() if order is None else list(order)
    alloc = CachingAllocator()
    remaining = {tid: 0 for tid in problem.tensors}
    for o in order:
        for tid in dict.fromkeys(problem.op(o).inputs):
            remaining[tid] += 1
    keep = {tid for tid, t in problem.tensors.items()
            if t.kind is TensorKind.OUTPUT or (t.kind is TensorKind.INPUT and t.also_output)}
    handles: dict[int, int] = {}
    for tid in sorted(problem.tensors):
        t = problem.tensors[tid]
        if t.kind is TensorKind.INPUT:
            handles[tid] = alloc.malloc(t.size)
    for s, o in enumerate(order):
        op = problem.op(o)
        for tid in op.outputs:
            handles[tid] = alloc.malloc(problem.tensors[tid].size)
        dead: list[int] = []
        for tid in dict.fromkeys(op.inputs):
            remaining[tid] -= 1
            if remaining[tid] == 0:
                dead.append(tid)
        dead.extend(tid for tid in op.outputs if remaining[tid] == 0)
        if s == 0:
            dead.extend(tid for tid in sorted(problem.tensors)
                        if problem.tensors[tid].kind is TensorKind.INPUT and remaining[tid] == 0
                        and tid not in op.inputs)
        for tid in dead:
            if tid not in keep and tid in handles:
                alloc.free(handles.pop(tid))
    return alloc.stats()
