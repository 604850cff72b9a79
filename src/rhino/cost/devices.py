"""Device and link datasheets: the numbers the cost model prices compute and communication with.

Units: FLOP/s (dense, no structured sparsity), bytes, bytes per second. Datasheet "GB" and "TB/s"
are decimal (1 GB = 1e9 B), which for memory capacity is slightly conservative (a "80 GB" part
holds 80 GiB). Link ``bandwidth`` is one direction, per GPU (or per NIC for inter-node presets;
``Cluster`` turns it into a per-GPU share). Every constant carries its source in ``source``.

Latencies are not on datasheets: they are assumed constants (marked "assumed" in ``source``),
meant to be replaced by ``rhino profile`` measurements.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LinkSpec", "DeviceSpec", "DEVICES", "INTER_NODE_LINKS", "DTYPES", "get_device", "get_link",
           "default_inter_node"]

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")

G, T = 1e9, 1e12

# Assumed latencies (per message / per ring hop), not datasheet numbers.
NVLINK_LATENCY_S = 5e-6       # assumed: typical NCCL small-message step over NVLink
IB_LATENCY_S = 10e-6          # assumed: typical NCCL small-message step over InfiniBand
CPU_LATENCY_S = 20e-6         # assumed: gloo over shared memory / loopback
ETHERNET_LATENCY_S = 50e-6    # assumed: TCP over 10 GbE


@dataclass(frozen=True)
class LinkSpec:
    """A link: ``bandwidth`` in B/s per direction (per GPU, or per NIC for inter-node presets),
    ``latency_s`` the per-message start-up cost (alpha in the alpha-beta model)."""

    name: str
    bandwidth: float
    latency_s: float
    source: str

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.latency_s >= 0):
            raise ValueError(f"link {self.name!r} needs a positive bandwidth and a non-negative latency, "
                             f"got {self.bandwidth} B/s and {self.latency_s} s")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: peak dense FLOP/s per dtype (only the dtypes it has), memory capacity
    (bytes) and bandwidth (B/s), and the intra-node link each device has to its node peers."""

    name: str
    peak_flops: dict[str, float] = field(hash=False)
    memory_bytes: float
    memory_bandwidth: float
    intra_node_link: LinkSpec
    source: str

    def __post_init__(self) -> None:
        unknown = set(self.peak_flops) - set(DTYPES)
        if unknown:
            raise ValueError(f"device {self.name!r} has unknown dtypes {sorted(unknown)}; use {DTYPES}")
        if not all(v > 0 for v in self.peak_flops.values()) or self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"device {self.name!r} needs positive FLOP/s, memory size and memory bandwidth")

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype``; ValueError if the device has no such unit."""
        if dtype not in self.peak_flops:
            raise ValueError(f"device {self.name} has no {dtype} peak; it has {sorted(self.peak_flops)}")
        return self.peak_flops[dtype]


_V100_DS = "NVIDIA Tesla V100 datasheet (SXM2): https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"
_A100_DS = "NVIDIA A100 Tensor Core GPU datasheet (SXM4): https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100_DS = "NVIDIA H100 Tensor Core GPU datasheet (SXM5): https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200_DS = "NVIDIA H200 Tensor Core GPU datasheet (SXM): https://www.nvidia.com/en-us/data-center/h200/"

NVLINK2 = LinkSpec("NVLink2", 150 * G, NVLINK_LATENCY_S,
                   f"{_V100_DS}: NVLink 300 GB/s total = 150 GB/s per direction; latency assumed 5 us")
NVLINK3 = LinkSpec("NVLink3", 300 * G, NVLINK_LATENCY_S,
                   f"{_A100_DS}: NVLink 600 GB/s total bidirectional = 300 GB/s per direction; latency assumed 5 us")
NVLINK4 = LinkSpec("NVLink4", 450 * G, NVLINK_LATENCY_S,
                   f"{_H100_DS}: NVLink 900 GB/s total = 450 GB/s per direction; latency assumed 5 us")
CPU_LINK = LinkSpec("cpu-shm", 5 * G, CPU_LATENCY_S,
                    "assumed; measure with rhino profile: 5 GB/s gloo shared-memory copy, 20 us latency")

_H100_FLOPS = {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T, "fp8": 1979 * T}

DEVICES: dict[str, DeviceSpec] = {d.name: d for d in [
    DeviceSpec("V100-32G", {"fp32": 15.7 * T, "fp16": 125 * T}, 32 * G, 900 * G, NVLINK2,
               f"{_V100_DS}: 15.7 TFLOP/s fp32, 125 TFLOP/s fp16 tensor, 32 GB HBM2, 900 GB/s"),
    DeviceSpec("A100-40G", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
               40 * G, 1555 * G, NVLINK3,
               f"{_A100_DS}: 19.5 TFLOP/s fp32, 156 tf32, 312 bf16/fp16 (dense), 40 GB HBM2, 1555 GB/s"),
    DeviceSpec("A100-80G", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
               80 * G, 2039 * G, NVLINK3,
               f"{_A100_DS}: 19.5 TFLOP/s fp32, 156 tf32, 312 bf16/fp16 (dense), 80 GB HBM2e, 2039 GB/s"),
    DeviceSpec("H100-80G", dict(_H100_FLOPS), 80 * G, 3.35 * T, NVLINK4,
               f"{_H100_DS}: 67 TFLOP/s fp32, 494.5 tf32, 989.5 bf16/fp16, 1979 fp8 (dense, i.e. half the "
               "with-sparsity figures), 80 GB HBM3, 3.35 TB/s"),
    DeviceSpec("H200-141G", dict(_H100_FLOPS), 141 * G, 4.8 * T, NVLINK4,
               f"{_H200_DS}: same compute as H100 SXM (67 fp32, 494.5 tf32, 989.5 bf16/fp16, 1979 fp8 dense), "
               "141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s"),
    DeviceSpec("cpu", {"fp32": 50 * G, "bf16": 25 * G, "fp16": 25 * G}, 16 * G, 20 * G, CPU_LINK,
               "assumed; measure with rhino profile: 50 GFLOP/s fp32, 25 GFLOP/s bf16/fp16, 16 GB, 20 GB/s"),
]}

# Aliases (upper-case keys) -> preset name. "A100" is deliberately absent: it is ambiguous.
ALIASES = {"V100": "V100-32G", "H100": "H100-80G", "H100-SXM": "H100-80G", "H200": "H200-141G",
           "CPU": "cpu", **{k.upper(): k for k in DEVICES}}
_AMBIGUOUS = {"A100": "A100-40G or A100-80G"}

_DGX_NICS = "DGX A100/H100 user guide: 8 single-port ConnectX NICs"
INTER_NODE_LINKS: dict[str, LinkSpec] = {l.name: l for l in [
    LinkSpec("IB-EDR", 100 / 8 * G, IB_LATENCY_S,
             "InfiniBand EDR 100 Gb/s per NIC = 12.5 GB/s per direction (DGX-1 V100 system architecture "
             "whitepaper: 4 EDR NICs); latency assumed 10 us"),
    LinkSpec("IB-HDR", 200 / 8 * G, IB_LATENCY_S,
             f"InfiniBand HDR 200 Gb/s per NIC = 25 GB/s per direction ({_DGX_NICS}, ConnectX-6); "
             "latency assumed 10 us"),
    LinkSpec("IB-NDR", 400 / 8 * G, IB_LATENCY_S,
             f"InfiniBand NDR 400 Gb/s per NIC = 50 GB/s per direction ({_DGX_NICS}, ConnectX-7); "
             "latency assumed 10 us"),
    LinkSpec("ethernet-10G", 10 / 8 * G, ETHERNET_LATENCY_S,
             "assumed; measure with rhino profile: 10 GbE = 1.25 GB/s, 50 us latency"),
]}

# device -> (inter-node link, NICs per node) when a cluster does not say.
_DEFAULT_INTER = {"V100-32G": ("IB-EDR", 4), "A100-40G": ("IB-HDR", 8), "A100-80G": ("IB-HDR", 8),
                  "H100-80G": ("IB-NDR", 8), "H200-141G": ("IB-NDR", 8), "cpu": ("ethernet-10G", 1)}


def get_device(name: str, context: str = "") -> DeviceSpec:
    """The preset for ``name`` (case-insensitive; aliases such as "H100" accepted)."""
    key = name.strip().upper()
    where = f"{context} has " if context else ""
    if key in _AMBIGUOUS:
        raise ValueError(f"{where}ambiguous device {name!r}; write {_AMBIGUOUS[key]}")
    if key not in ALIASES:
        raise ValueError(f"{where}unknown device {name!r}; known: {', '.join(sorted(DEVICES))} "
                         f"(aliases: {', '.join(sorted(k for k in ALIASES if k not in {d.upper() for d in DEVICES}))})")
    return DEVICES[ALIASES[key]]


def get_link(name: str) -> LinkSpec:
    """The inter-node link preset ``name`` (case-insensitive)."""
    for k, v in INTER_NODE_LINKS.items():
        if k.upper() == name.strip().upper():
            return v
    raise ValueError(f"unknown inter-node link {name!r}; known: {', '.join(INTER_NODE_LINKS)}")


def default_inter_node(device: DeviceSpec) -> tuple[LinkSpec, int]:
    """(inter-node link, NICs per node) assumed for ``device`` when a cluster does not say."""
    link, nics = _DEFAULT_INTER.get(device.name, ("IB-HDR", 8))
    return INTER_NODE_LINKS[link], nics
