"""A measured machine profile (``rhino profile --out profile.json``) and how the estimate uses it.

The profile holds absolute numbers measured on the local machine by micro-benchmarks
(``rhino.runtime.profile``), each fitted the same way for every workload:

- ``matmul_flops``: the asymptotic FLOP/s of fp32 GEMMs and ``k0`` the multiply-adds at which a GEMM
  reaches half of it: a least-squares fit of ``t = 2 (W + k0) / matmul_flops + overhead`` over square
  GEMMs of several sizes (W multiply-adds), fitted on relative errors (seconds per FLOP against 1 / W);
- ``thin_gemm_d0``: GEMMs with one small dimension ``d`` (a micro-batch's rows) run at ``d / (d + d0)`` of the
  rate of a square GEMM of the same work: least squares over ``r x 1024 @ 1024 x 1024`` and ``1024 x r @ r x 1024``
  GEMMs, ``r`` = 8 .. 128 (``Profile.thin_gemm_d0``);
- ``conv_efficiency`` / ``attention_efficiency``: the measured FLOP/s of a convolution and of
  scaled-dot-product attention over ``matmul_flops``;
- ``memory_bandwidth``: bytes read + written per second by a large element-wise add;
- ``launch_overhead_s``: the time of an op on a one-element tensor (dispatch cost);
- ``kind_bandwidth``: bytes/s achieved by typical element-wise, norm and reduction ops (on a CPU their
  math per element, e.g. ``erf`` in GELU, keeps them below the streaming bandwidth);
- ``link_bandwidth`` / ``link_latency_s``: alpha-beta fit of all-reduce times over the local
  process group (gloo on CPU) at several sizes, using the ring formula of ``collectives.py``; each
  all-reduce is timed as the runtime performs a gradient's (copy, all-reduce, divide); where noise on the large
  sizes makes the fitted latency non-positive, the smallest size's time less its bytes' share
  (``runtime.profile.alpha_beta``).
- ``p2p_bandwidth`` / ``p2p_latency_s``: alpha-beta fit of one-way point-to-point message times between
  two processes (half a ping-pong, each message an ``isend`` and an ``irecv(...).wait()`` as
  ``runtime.pipeline`` sends boundary values); the pipeline model prices stage boundaries with it;
  ``p2p_message_s``: the CPU time one end of a message takes besides waiting (half of posting an ``isend``
  plus completing the ``irecv`` of a message already sent), charged to the device per message it sends or
  receives.

Profiled for ``N`` > 1 processes, every process runs the compute micro-benchmarks at the same time and
the slowest one's numbers are kept: what one rank of a ``cpu:N`` run sees, with memory bandwidth
and caches shared.

``apply`` turns it into the device the cost model prices: the measured numbers replace the datasheet
ones (with efficiencies 1: they are achieved rates, not peaks).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .cluster import Cluster
from .compute import Profile
from .devices import LinkSpec

__all__ = ["MachineProfile", "load_profile", "PROFILE_FORMAT"]

PROFILE_FORMAT = 1


@dataclass(frozen=True)
class MachineProfile:
    device: str                  # what was measured, e.g. "cpu (2 threads)"
    threads: int
    matmul_flops: float
    k0: float
    memory_bandwidth: float
    launch_overhead_s: float
    conv_efficiency: float | None = None
    attention_efficiency: float | None = None
    link_bandwidth: float | None = None
    link_latency_s: float | None = None
    link_ranks: int | None = None
    kind_bandwidth: dict | None = field(default=None, hash=False, compare=False)
    p2p_bandwidth: float | None = None
    p2p_latency_s: float | None = None
    p2p_message_s: float | None = None
    thin_gemm_d0: float | None = None

    def __post_init__(self) -> None:
        for key in ("matmul_flops", "memory_bandwidth"):
            if not getattr(self, key) > 0:
                raise ValueError(f"profile {key} must be positive, got {getattr(self, key)}")

    def to_json(self) -> str:
        return json.dumps({"format": PROFILE_FORMAT, **asdict(self)}, indent=1)

    def cost_profile(self) -> Profile:
        clamp = (lambda v: None if v is None else min(1.0, max(1e-3, v)))
        return Profile(matmul_efficiency=1.0, memory_bandwidth_efficiency=1.0,
                       launch_overhead_s=self.launch_overhead_s, conv_efficiency=clamp(self.conv_efficiency),
                       attention_efficiency=clamp(self.attention_efficiency), k0=self.k0,
                       kind_bandwidth=dict(self.kind_bandwidth) if self.kind_bandwidth else None,
                       p2p_bandwidth=self.p2p_bandwidth, p2p_latency_s=self.p2p_latency_s,
                       p2p_message_s=self.p2p_message_s, thin_gemm_d0=self.thin_gemm_d0)

    def apply(self, cluster: Cluster) -> tuple[Cluster, Profile]:
        """The cluster with its device's numbers replaced by the measured ones, and the cost profile."""
        dev = cluster.device
        peaks = {k: self.matmul_flops for k in dev.peak_flops}
        link = dev.intra_node_link
        if self.link_bandwidth and self.link_latency_s is not None:
            link = LinkSpec(f"measured ({self.link_ranks} ranks)", self.link_bandwidth, self.link_latency_s,
                            "rhino profile: all-reduce alpha-beta fit")
        measured = replace(dev, peak_flops=peaks, memory_bandwidth=self.memory_bandwidth, intra_node_link=link,
                           source=f"rhino profile on {self.device}")
        return replace(cluster, device=measured), self.cost_profile()


def load_profile(path: str | Path) -> MachineProfile:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"profile {str(path)!r} does not exist; make one with `rhino profile --out {path}`")
    if path.is_dir():
        raise ValueError(f"profile {str(path)!r} is a directory; give the JSON file `rhino profile --out` wrote")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
        raise ValueError(f"profile {str(path)!r} has format {d.get('format') if isinstance(d, dict) else None!r}; "
                         f"expected {PROFILE_FORMAT}: make it again with `rhino profile`")
    d.pop("format")
    known = set(MachineProfile.__dataclass_fields__)
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"profile {str(path)!r} has unknown keys {sorted(unknown)}")
    try:
        return MachineProfile(**d)
    except TypeError as exc:
        raise ValueError(f"profile {str(path)!r} is incomplete: {exc}") from None
