"""``rhino profile``: micro-benchmarks of this machine for the cost model (see cost/machine_profile.py).

Every timing is the median of repeated runs after a warm-up, each run repeated until it lasts at
least ``min_seconds``. Fits are least squares on the medians.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..cost.machine_profile import MachineProfile
from ..sharding.placement import ReduceOp
from .collectives import all_reduce_tensor
from .launch import launch

__all__ = ["alpha_beta", "measure_profile", "time_call", "fit_line"]

_MATMUL_SIZES = (64, 128, 192, 256, 384, 512, 768, 1024)
_ALLREDUCE_BYTES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)


def time_call(fn: Callable[[], object], min_seconds: float = 0.02, repeats: int = 5) -> float:
    """Median seconds of one call of ``fn``."""
    fn()
    n, t = 1, 0.0
    while True:  # calls per timing so that one timing lasts min_seconds
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
        if t >= min_seconds or n >= 1 << 16:
            break
        n *= 2
    samples = [t / n]
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys = slope * xs + intercept."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """(seconds per byte, latency) of ``times = latency + sizes * per_byte`` by least squares. Where timing noise
    on the large messages makes the fitted latency zero or negative, the latency is the smallest message's time
    less its bytes' share, or that whole time where that is not positive either (every message pays it, so it is
    at most the smallest message's time): a measured link always has a positive latency."""
    slope, intercept = fit_line(sizes, times)
    if intercept > 0:
        return slope, intercept
    i = min(range(len(sizes)), key=sizes.__getitem__)
    rest = times[i] - max(slope, 0.0) * sizes[i]
    return slope, rest if rest > 0 else times[i]


def _overhead() -> float:
    """One aten op on one-element tensors, called as the lowered programs call ops."""
    a, b = torch.ones(1), torch.ones(1)
    add = torch.ops.aten.add.Tensor
    return time_call(lambda: add(a, b))


def _matmul(overhead: float, progress) -> tuple[float, float]:
    ws, ts = [], []
    for n in _MATMUL_SIZES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        ts.append(time_call(lambda: torch.mm(a, b)) - overhead)
        ws.append(float(n) ** 3)
        progress(f"  matmul {n}x{n}x{n}: {2 * ws[-1] / max(ts[-1], 1e-12) / 1e9:.1f} GFLOP/s")
    # seconds per FLOP, t / 2W = 1 / P + (k0 / P) / W, is linear in 1 / W: a fit of relative errors (a fit of t
    # itself is set by the largest sizes, and their timing noise alone moved k0 by millions of multiply-adds)
    per_flop = [t / (2.0 * w) for w, t in zip(ws, ts)]
    slope, intercept = fit_line([1.0 / w for w in ws], per_flop)
    if intercept <= 0:       # noise larger than the saturation: the fastest size's rate, no saturation term
        return 1.0 / min(per_flop), 0.0
    flops = 1.0 / intercept
    return flops, max(0.0, slope * flops)


_THIN_ROWS = (8, 16, 32, 64, 128)


def _thin_matmul(overhead: float, flops: float, k0: float) -> float:
    """``d0`` of ``Profile.thin_gemm_d0``: GEMMs with one small dimension ``r`` (``r x 1024 @ 1024 x 1024``, as a
    micro-batch's forward and input-gradient GEMMs, and ``1024 x r @ r x 1024``, as its weight gradient) run at
    ``r / (r + d0)`` of the square-GEMM rate of the same work; least squares of ``rate_sq / rate - 1 = d0 / r``."""
    xs, ys = [], []
    for r in _THIN_ROWS:
        for a, b in ((torch.randn(r, 1024), torch.randn(1024, 1024)), (torch.randn(1024, r), torch.randn(r, 1024))):
            t = max(time_call(lambda: torch.mm(a, b)) - overhead, 1e-12)
            w = float(r) * 1024 * 1024
            square = flops * w / (w + k0)
            xs.append(1.0 / r)
            ys.append(square / (2 * w / t) - 1.0)
    return max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))


def _bandwidth() -> float:
    n = 1 << 23
    a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
    t = time_call(lambda: torch.add(a, b, out=out), min_seconds=0.05)
    return 3 * n * 4 / t


def _kind_bandwidth() -> dict[str, float]:
    """Bytes read + written per second by typical ops of the non-GEMM kinds, on tensors of 4M floats
    (the median over a few ops of each kind: their time is set by memory traffic and, on CPUs, by the
    math per element)."""
    x, y = torch.randn(4096, 1024), torch.randn(4096, 1024)
    w, b = torch.ones(1024), torch.zeros(1024)
    nbytes = x.numel() * 4
    aten = torch.ops.aten
    ops = {
        "elementwise": [(lambda: aten.gelu.default(x), 2), (lambda: aten.mul.Tensor(x, y), 3),
                        (lambda: aten.exp.default(x), 2), (lambda: aten.add.Tensor(x, y), 3)],
        "norm": [(lambda: aten.native_layer_norm.default(x, [1024], w, b, 1e-5), 2)],
        "reduction": [(lambda: aten.sum.dim_IntList(x, [0]), 1), (lambda: aten.amax.default(x, [1]), 1)],
    }
    return {kind: statistics.median(k * nbytes / time_call(fn) for fn, k in fns) for kind, fns in ops.items()}


def _conv_rate() -> float:
    x, w = torch.randn(8, 64, 56, 56), torch.randn(64, 64, 3, 3)
    t = time_call(lambda: F.conv2d(x, w, padding=1))
    return 2 * 8 * 64 * 56 * 56 * 64 * 9 / t


def _attention_rate() -> float:
    q, k, v = (torch.randn(4, 8, 256, 64) for _ in range(3))
    t = time_call(lambda: F.scaled_dot_product_attention(q, k, v))
    return 4 * 4 * 8 * 256 * 256 * 64 / t


def _allreduce_rank(ctx, sizes: tuple[int, ...]) -> list[float]:
    """Median seconds per all-reduce at each size, as the runtime performs a gradient's (a copy, the
    all-reduce, the division by the group size: ``collectives.all_reduce_tensor``). Every rank makes the
    same number of calls (a count chosen per size, not adaptively), else the collectives would not
    match up."""
    out = []
    group = dist.group.WORLD
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        calls = max(2, min(50, (4 << 20) // nbytes))
        for _ in range(2):
            all_reduce_tensor(x, ReduceOp.AVG, group, ctx.world_size)
        samples = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                all_reduce_tensor(x, ReduceOp.AVG, group, ctx.world_size)
            samples.append((time.perf_counter() - t0) / calls)
        out.append(statistics.median(samples))
    return out


_P2P_BYTES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)


def _p2p_rank(ctx, sizes: tuple[int, ...]) -> list[float]:
    """Rank 0 and 1: median one-way seconds of a point-to-point message at each size (half a ping-pong,
    each message an ``isend`` and an ``irecv(...).wait()`` as ``runtime.pipeline`` sends boundary values);
    the other ranks wait."""
    out = []
    for nbytes in sizes:
        x, y = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        calls = max(4, min(50, (2 << 20) // nbytes))
        samples = []
        for rep in range(6):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls if ctx.rank < 2 else 0):
                if ctx.rank == 0:
                    dist.isend(x, 1).wait()
                    dist.irecv(y, 1).wait()
                else:
                    dist.irecv(y, 0).wait()
                    dist.isend(x, 0).wait()
            if rep:   # the first is a warm-up
                samples.append((time.perf_counter() - t0) / calls / 2)
        out.append(statistics.median(samples))
    return out


def _p2p_post_rank(ctx, nbytes: int = 4 << 10, reps: int = 20) -> float:
    """Rank 0: median CPU-side seconds of one message at each end, as ``runtime.pipeline`` handles one:
    posting an ``isend`` plus completing an ``irecv(...).wait()`` whose message was sent before (no waiting
    for the sender); the time the device spends on a message besides its programs."""
    x, y = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    samples = []
    for _ in range(reps):
        work = dist.isend(x, 0) if ctx.rank == 1 else None
        dist.barrier()                       # the message has been posted
        t0 = time.perf_counter()
        if ctx.rank == 0:
            dist.irecv(y, 1).wait()
            work = dist.isend(x, 1)
        t1 = time.perf_counter()
        if ctx.rank == 1:
            dist.irecv(y, 0).wait()
        if work is not None:
            work.wait()
        samples.append(t1 - t0)
    return statistics.median(samples)


def _compute(progress: Callable[[str], None], sync: Callable[[], None]) -> tuple:
    """(overhead, matmul FLOP/s, k0, bandwidth, conv eff., attention eff., kind bandwidths, thin-GEMM d0); ``sync``
    runs between the micro-benchmarks so that concurrent ranks measure the same thing at the same time."""
    with torch.no_grad():
        progress(f"profiling with {torch.get_num_threads()} thread(s)")
        overhead = _overhead()
        progress(f"  op overhead: {overhead * 1e6:.2f} us")
        sync()
        flops, k0 = _matmul(overhead, progress)
        progress(f"  matmul fit: {flops / 1e9:.1f} GFLOP/s asymptotic, half efficiency at {k0:.3g} multiply-adds")
        sync()
        thin = _thin_matmul(overhead, flops, k0)
        progress(f"  thin matmuls: half the rate at a smallest dimension of {thin:.1f}")
        sync()
        bw = _bandwidth()
        progress(f"  memory bandwidth: {bw / 1e9:.2f} GB/s")
        sync()
        conv, attn = _conv_rate() / flops, _attention_rate() / flops
        progress(f"  conv {conv:.2f} and attention {attn:.2f} of the matmul rate")
        sync()
        kinds = _kind_bandwidth()
        progress("  " + ", ".join(f"{k} ops {v / 1e9:.2f} GB/s" for k, v in kinds.items()))
    return overhead, flops, k0, bw, conv, attn, kinds, thin


def _rank_profile(ctx, threads: int | None) -> tuple:
    """One rank of a concurrent profile: the compute numbers (all ranks at once), then all-reduces."""
    if threads is not None:
        torch.set_num_threads(threads)
    compute = _compute(lambda m: None, dist.barrier)
    dist.barrier()
    return (torch.get_num_threads(), compute, _allreduce_rank(ctx, _ALLREDUCE_BYTES), _p2p_rank(ctx, _P2P_BYTES),
            _p2p_post_rank(ctx))


def _slowest(per_rank: list[tuple]) -> tuple:
    """Per number, the slowest rank's (a SPMD step waits for the slowest rank at every collective)."""
    over = max(r[0] for r in per_rank)
    flops, k0 = min((r[1], r[2]) for r in per_rank)
    bw = min(r[3] for r in per_rank)
    conv, attn = min(r[4] for r in per_rank), min(r[5] for r in per_rank)
    kinds = {k: min(r[6][k] for r in per_rank) for k in per_rank[0][6]}
    return over, flops, k0, bw, conv, attn, kinds, max(r[7] for r in per_rank)


def measure_profile(threads: int | None = None, nproc: int = 2, progress: Callable[[str], None] = lambda m: None
                    ) -> MachineProfile:
    """Measure what one device of a ``cpu:nproc`` run sees. ``nproc`` = 1: this process with ``threads``
    torch threads (default: torch's current setting). ``nproc`` > 1: ``nproc`` local gloo processes
    with ``threads`` each (default: cores // nproc, as ``rhino run``) run every compute micro-benchmark
    at the same time, so that shared memory bandwidth and caches are contended as in a real run (the
    slowest rank's numbers are kept), then the all-reduce benchmark."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    if nproc > 1:
        progress(f"profiling {nproc} concurrent processes" + (f" with {threads} thread(s) each" if threads else ""))
        results = launch(_rank_profile, nproc, threads, timeout_s=600.0)
        used = results[0][0]
        overhead, flops, k0, bw, conv, attn, kinds, thin = _slowest([r[1] for r in results])
        progress(f"  slowest rank: op overhead {overhead * 1e6:.2f} us, matmul {flops / 1e9:.1f} GFLOP/s, "
                 f"memory {bw / 1e9:.2f} GB/s, " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in kinds.items()))
        worst = [max(ts) for ts in zip(*(r[2] for r in results))]
        slope, intercept = alpha_beta([float(s) for s in _ALLREDUCE_BYTES], worst)
        link_bw = 2 * (nproc - 1) / nproc / slope
        link_lat = intercept / (2 * (nproc - 1))
        progress(f"  all-reduce over {nproc} processes: {link_bw / 1e9:.2f} GB/s, {link_lat * 1e6:.1f} us")
        p_slope, p2p_lat = alpha_beta([float(s) for s in _P2P_BYTES], results[0][3])
        p2p_bw = 1.0 / max(p_slope, 1e-15)
        post = results[0][4] / 2
        progress(f"  point-to-point: {p2p_bw / 1e9:.2f} GB/s, {p2p_lat * 1e6:.1f} us; {post * 1e6:.1f} us per message "
                 f"end")
        return MachineProfile(f"cpu ({used} threads per process, {nproc} processes)", used, flops, k0, bw,
                              overhead, conv, attn, link_bw, link_lat, nproc, kinds, p2p_bw, p2p_lat, post, thin)
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        overhead, flops, k0, bw, conv, attn, kinds, thin = _compute(progress, lambda: None)
        return MachineProfile(f"cpu ({torch.get_num_threads()} threads)", torch.get_num_threads(), flops, k0, bw,
                              overhead, conv, attn, None, None, None, kinds, thin_gemm_d0=thin)
    finally:
        torch.set_num_threads(old)
