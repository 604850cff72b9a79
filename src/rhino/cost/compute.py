"""Compute time of IR ops: a roofline with shape-dependent efficiency (pure Python, no torch).

The model, per op::

    time = max(flops / (peak(dtype) * eff(op, shape)),  bytes / (memory_bandwidth * bw_eff))
           + launch_overhead

- ``flops`` and ``bytes`` come from the op registry (``flops_of``, ``bytes_of``). Views move no
  bytes and do no FLOPs (they only alias). Opaque ops (no registry entry) count 0 FLOPs
  and are memory-bound on their input + output bytes.
- ``peak(dtype)`` is the datasheet peak of ``DeviceSpec.peak_flops``. For MATMUL, CONV and
  ATTENTION the dtype of the first floating input picks the unit: bf16/fp16 tensors use the
  tensor-core rate; fp32 (and fp64, approximated by fp32) uses the "tf32" rate only when
  ``allow_tf32`` is set and the device has one (PyTorch's default for matmul is off), else the
  "fp32" rate. Every other kind (element-wise, reduction, norm, loss, indexing, copies, opaque)
  uses the fp32 vector rate at efficiency 1: such ops are memory-bound in practice, so their
  time is set by the bandwidth term.
- ``eff(op, shape)`` for MATMUL/CONV/ATTENTION saturates with problem size: with
  ``W = flops / 2`` (multiply-adds, i.e. m*n*k for a GEMM, summed over batch),
  ``eff = eff_max(kind) * W / (W + K0)``. Small problems cannot fill the machine (too few tiles
  for the SMs, prologue/epilogue not amortised); a problem of ``K0`` multiply-adds runs at half of
  ``eff_max``. Monotone increasing in every dimension.
- With a measured ``Profile.thin_gemm_d0`` (``rhino profile``), a MATMUL whose smallest dimension is ``d``
  (rows, contraction or columns of one matrix product) runs at a further ``d / (d + d0)``: a product with a
  thin operand (a micro-batch's 32 rows against a 1024 x 1024 weight) re-reads the wide operand for little
  work and runs below a square product of the same FLOPs, which ``K0`` alone cannot say. ``d`` comes from the
  op's shapes (``gemm_min_dim``), or from the caller (``op_time(min_dim=...)``: the pipeline model gives the
  micro-batch's own).
- Views cost nothing on a GPU (no kernel) and the dispatch overhead on a CPU.
- A profile may give measured bytes/s per op kind (``Profile.kind_bandwidth``): ops of that kind
  then take ``bytes / measured`` (e.g. element-wise ops with transcendental math on a CPU).
- ``bound`` says which term set the time: "compute", "memory", or "latency" when the launch
  overhead is larger than both.
- ``graph_compute_time`` sums op times over a graph (serial execution on one device, no overlap
  between ops). With ``local_shapes`` (value id -> per-rank shape) each op's flops and bytes are
  scaled by local/global numel of its largest output: an approximation that is exact for ops
  sharded along a non-contracted dim and for element-wise ops, and ignores that an op's inputs
  may be sharded differently from its output.
- A ``Profile`` (measured on the machine by ``rhino profile``) overrides ``eff_max`` for
  matmul-like ops, the bandwidth efficiency and the launch overhead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..ir.graph import Graph
from ..ir.registry import OpCall, OpKind, bytes_of, call_of, flops_of, lookup
from ..ir.types import DType
from .devices import DeviceSpec, get_device

__all__ = ["OpTime", "Profile", "op_time", "graph_compute_time", "efficiency", "peak_dtype", "gemm_min_dim",
           "EFF_MAX", "K0", "BW_EFFICIENCY", "LAUNCH_OVERHEAD_GPU_S", "LAUNCH_OVERHEAD_CPU_S"]

# -- constants (each with its source) -------------------------------------------------------------

#: Largest fraction of the datasheet peak reached by large problems, per op kind.
EFF_MAX: dict[OpKind, float] = {
    # assumed: large cuBLAS GEMMs in public benchmarks reach roughly 70-90% of the dense
    # tensor-core peak on A100/H100 (e.g. ~230-280 of 312 TFLOP/s fp16 on A100); 0.75 is a
    # conservative middle. Replace with a measured value through Profile.matmul_efficiency.
    OpKind.MATMUL: 0.75,
    # assumed: cuDNN implicit-GEMM convolutions typically run below large GEMMs (im2col
    # layout overheads, small channel counts); 0.6 is assumed, not measured.
    OpKind.CONV: 0.6,
    # Dao, "FlashAttention-2" (arXiv 2307.08691): 50-73% of the A100 theoretical peak in the
    # forward pass, lower in the backward; 0.5 is the low end of that range.
    OpKind.ATTENTION: 0.5,
}

#: Multiply-adds at which a matmul-like op reaches half of ``EFF_MAX`` (2**24 = 256**3).
#: assumed: a 256x256x256 GEMM is a few dozen 128x128 tiles, far fewer than the 108-132 SMs of an
#: A100/H100 can hold, so it runs well below peak; 4096**3 problems run within 0.03% of EFF_MAX.
K0: float = float(2 ** 24)

#: Fraction of datasheet memory bandwidth reached by streaming (memory-bound) kernels.
#: assumed: STREAM-like copy/triad benchmarks reach about 80-90% of the HBM datasheet bandwidth
#: on A100/H100 (and about 80% of DRAM peak on servers); 0.8 is the low end.
BW_EFFICIENCY: float = 0.8

#: Per-op fixed cost on a GPU (kernel launch + scheduling), seconds. assumed: CUDA kernel launch
#: latency is commonly measured at 3-10 us through PyTorch eager; 5 us taken.
LAUNCH_OVERHEAD_GPU_S: float = 5e-6

#: Per-op fixed cost on a CPU (eager-mode dispatch), seconds. assumed: 2 us.
LAUNCH_OVERHEAD_CPU_S: float = 2e-6

_MATMUL_LIKE = (OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION)
_TENSOR_CORE = {DType.bfloat16: "bf16", DType.float16: "fp16"}


@dataclass(frozen=True)
class Profile:
    """Measured overrides of the assumed constants; a field left None keeps the default.

    ``matmul_efficiency`` replaces ``EFF_MAX`` for MATMUL; ``conv_efficiency`` and
    ``attention_efficiency`` replace theirs and, when None, follow ``matmul_efficiency`` scaled
    by the default ratio to the matmul value (so one measured GEMM rate moves all three)."""

    matmul_efficiency: float | None = None
    memory_bandwidth_efficiency: float | None = None
    launch_overhead_s: float | None = None
    conv_efficiency: float | None = None
    attention_efficiency: float | None = None
    k0: float | None = None   # replaces K0 (multiply-adds at half efficiency)
    # measured bytes/s of ops of a kind (OpKind value -> B/s), e.g. element-wise ops with transcendental
    # math on a CPU run below the streaming bandwidth; used instead of the bandwidth roofline for them
    kind_bandwidth: dict | None = field(default=None, hash=False)
    # measured point-to-point messages between local processes (``rhino profile``): pipeline boundaries
    p2p_bandwidth: float | None = None
    p2p_latency_s: float | None = None
    p2p_message_s: float | None = None   # CPU time per message end (posting / completing), not waiting
    # smallest GEMM dimension at which a MATMUL runs at half the rate of a square one of equal work (measured)
    thin_gemm_d0: float | None = None

    def __post_init__(self) -> None:
        for name in ("matmul_efficiency", "memory_bandwidth_efficiency", "conv_efficiency",
                     "attention_efficiency"):
            v = getattr(self, name)
            if v is not None and not 0 < v <= 1:
                raise ValueError(f"Profile.{name} must be in (0, 1], got {v}")
        if self.launch_overhead_s is not None and self.launch_overhead_s < 0:
            raise ValueError(f"Profile.launch_overhead_s must be >= 0, got {self.launch_overhead_s}")
        if self.k0 is not None and self.k0 < 0:
            raise ValueError(f"Profile.k0 must be >= 0, got {self.k0}")
        if self.thin_gemm_d0 is not None and self.thin_gemm_d0 < 0:
            raise ValueError(f"Profile.thin_gemm_d0 must be >= 0, got {self.thin_gemm_d0}")

    def eff_max(self, kind: OpKind) -> float:
        own = {OpKind.MATMUL: self.matmul_efficiency, OpKind.CONV: self.conv_efficiency,
               OpKind.ATTENTION: self.attention_efficiency}.get(kind)
        if own is not None:
            return own
        if self.matmul_efficiency is not None and kind in EFF_MAX:
            return min(1.0, self.matmul_efficiency * EFF_MAX[kind] / EFF_MAX[OpKind.MATMUL])
        return EFF_MAX.get(kind, 1.0)


_DEFAULT_PROFILE = Profile()


@dataclass(frozen=True)
class OpTime:
    """Time of one op (seconds), the FLOPs and bytes it was charged, and what bounded it."""

    seconds: float
    flops: float
    bytes: float
    bound: str  # "compute" | "memory" | "latency"


def is_cpu(device: DeviceSpec) -> bool:
    return device.name.lower().startswith("cpu")


def efficiency(kind: OpKind, flops: float, profile: Profile | None = None, min_dim: float | None = None) -> float:
    """Fraction of peak reached by an op of ``kind`` doing ``flops``; 1 for non-matmul-like kinds. ``min_dim``:
    a MATMUL's smallest dimension (the thin-GEMM factor, when the profile measured ``thin_gemm_d0``)."""
    prof = profile or _DEFAULT_PROFILE
    if kind not in _MATMUL_LIKE:
        return 1.0
    w = max(flops, 0.0) / 2
    k0 = K0 if prof.k0 is None else prof.k0
    eff = prof.eff_max(kind) * (w / (w + k0)) if w > 0 else prof.eff_max(kind) * 1e-9
    if kind is OpKind.MATMUL and prof.thin_gemm_d0 and min_dim:
        eff *= min_dim / (min_dim + prof.thin_gemm_d0)
    return eff


def gemm_min_dim(call: OpCall) -> int | None:
    """The smallest of a matrix product's rows, contraction and columns (per matrix of a batched product): the
    last two inputs of rank >= 2 are ``A [..., m, k]`` and ``B [..., k, n]``; None for other shapes."""
    mats = [t for t in call.in_types if t is not None and getattr(t, "shape", None) is not None and len(t.shape) >= 2]
    if len(mats) < 2:
        return None
    a, b = mats[-2].shape, mats[-1].shape
    return int(min(a[-2], a[-1], b[-1]))


def _float_dtype(call: OpCall) -> DType | None:
    for t in list(call.in_types) + [t for t in call.out_types if t is not None]:
        if t.dtype.is_floating:
            return t.dtype
    return None


def peak_dtype(call: OpCall, device: DeviceSpec, *, allow_tf32: bool = False) -> str:
    """The ``peak_flops`` key whose rate ``call`` runs at on ``device`` (see module docstring)."""
    opdef = lookup(call.op)
    kind = opdef.kind if opdef is not None else OpKind.OPAQUE
    if kind not in _MATMUL_LIKE:
        return "fp32"
    dt = _float_dtype(call)
    if dt in _TENSOR_CORE:
        key = _TENSOR_CORE[dt]
        if key in device.peak_flops:
            return key
        # no unit for this dtype (bf16 on V100): the other 16-bit tensor-core rate would be
        # optimistic; fall back to the fp32 rate.
        return "fp32"
    if allow_tf32 and "tf32" in device.peak_flops and not is_cpu(device):
        return "tf32"
    return "fp32"


def op_time(call: OpCall, device: DeviceSpec | str, *, allow_tf32: bool = False,
            profile: Profile | None = None, scale: float = 1.0, min_dim: float | None = None) -> OpTime:
    """Roofline time of one op on one device. ``scale`` multiplies its FLOPs and bytes (the
    fraction of the op a rank executes; see ``graph_compute_time``); ``min_dim``: a MATMUL's smallest
    dimension as it runs (default: ``gemm_min_dim`` of its shapes; used with ``Profile.thin_gemm_d0``)."""
    dev = get_device(device) if isinstance(device, str) else device
    prof = profile or _DEFAULT_PROFILE
    opdef = lookup(call.op)
    kind = opdef.kind if opdef is not None else OpKind.OPAQUE
    overhead = prof.launch_overhead_s if prof.launch_overhead_s is not None else \
        (LAUNCH_OVERHEAD_CPU_S if is_cpu(dev) else LAUNCH_OVERHEAD_GPU_S)
    if kind is OpKind.VIEW:  # no kernel; on a CPU the dispatch itself is the time
        return OpTime(overhead if is_cpu(dev) else 0.0, 0.0, 0.0, "latency")
    flops = flops_of(call) * scale
    nbytes = bytes_of(call) * scale
    peak = dev.flops(peak_dtype(call, dev, allow_tf32=allow_tf32))
    if kind is OpKind.MATMUL and prof.thin_gemm_d0 and min_dim is None:
        min_dim = gemm_min_dim(call)
    t_compute = flops / (peak * efficiency(kind, flops, prof, min_dim)) if flops > 0 else 0.0
    bw_eff = prof.memory_bandwidth_efficiency if prof.memory_bandwidth_efficiency is not None else BW_EFFICIENCY
    measured = (prof.kind_bandwidth or {}).get(kind.value)
    if measured:
        t_compute = 0.0 if kind not in _MATMUL_LIKE else t_compute
        t_memory = nbytes / measured if nbytes > 0 else 0.0
    else:
        t_memory = nbytes / (dev.memory_bandwidth * bw_eff) if nbytes > 0 else 0.0
    if overhead >= max(t_compute, t_memory):
        bound = "latency"
    else:
        bound = "compute" if t_compute >= t_memory else "memory"
    return OpTime(max(t_compute, t_memory) + overhead, flops, nbytes, bound)


def _local_scale(call: OpCall, outputs: list[int | None],
                 local_shapes: Mapping[int, tuple[int, ...]] | None) -> float:
    """local/global numel of the op's largest output, 1 when it has no local shape."""
    if not local_shapes:
        return 1.0
    best = None
    for vid, t in zip(outputs, call.out_types):
        if vid is not None and t is not None and (best is None or t.numel > best[1].numel):
            best = (vid, t)
    if best is None or best[0] not in local_shapes or best[1].numel == 0:
        return 1.0
    local = 1
    for d in local_shapes[best[0]]:
        local *= int(d)
    return local / best[1].numel


def graph_compute_time(graph: Graph, device: DeviceSpec | str,
                       local_shapes: Mapping[int, tuple[int, ...]] | None = None, *,
                       allow_tf32: bool = False, profile: Profile | None = None
                       ) -> tuple[float, dict[str, float]]:
    """Total compute seconds of ``graph`` run op after op on one device, and the seconds per op
    kind (``OpKind`` value; "opaque" for ops without a registry entry)."""
    dev = get_device(device) if isinstance(device, str) else device
    total = 0.0
    per_kind: dict[str, float] = {}
    for node in graph.nodes:
        call = call_of(graph, node)
        opdef = lookup(node.op)
        kind = opdef.kind.value if opdef is not None else OpKind.OPAQUE.value
        t = op_time(call, dev, allow_tf32=allow_tf32, profile=profile,
                    scale=_local_scale(call, node.outputs, local_shapes)).seconds
        total += t
        per_kind[kind] = per_kind.get(kind, 0.0) + t
    return total, per_kind
