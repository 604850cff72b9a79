"""Clusters (nodes x devices per node) and how a logical mesh's axes land on them.

Cluster strings (design.md): ``[NODESx]GPUSxTYPE`` (``8xA100-80G``, ``4x8xH100``), ``cpu:N`` (one
node of N cpu devices), or YAML (a ``.yaml``/``.yml`` path or YAML text) with keys ``nodes``
(default 1), ``devices_per_node``, ``device``, and optional ``inter_node`` (a preset name or a
mapping ``{name, bandwidth, latency_s}``), ``nics_per_node``, ``intra_node`` (a mapping overriding
the device's link).

Placement (``axis_links``): physical devices are numbered node-major (rank r sits on node
``r // devices_per_node``) and mesh ranks are row-major (``Mesh.coords``). Each group of an axis of
size n then has k members on each of n/k nodes; per-GPU bandwidths are
  intra-node: the device's NVLink bandwidth per direction;
  inter-node: ``nics_per_node * nic_bandwidth / devices_per_node`` (all GPUs of a node share the
  NICs, since the other groups of the axis communicate at the same time).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Sequence

from ..sharding.mesh import Mesh
from .devices import DeviceSpec, LinkSpec, default_inter_node, get_device, get_link

__all__ = ["Cluster", "make_cluster", "parse_cluster", "cluster_from_dict", "AxisLink", "LinkKind", "axis_links"]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``devices_per_node`` devices; ``inter_node`` bandwidth is per NIC."""

    nodes: int
    devices_per_node: int
    device: DeviceSpec
    inter_node: LinkSpec
    nics_per_node: int

    def __post_init__(self) -> None:
        for key in ("nodes", "devices_per_node", "nics_per_node"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"cluster {key} must be a positive integer, got {v!r}")

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def intra_node(self) -> LinkSpec:
        return self.device.intra_node_link

    @property
    def inter_node_bandwidth_per_device(self) -> float:
        """``nics_per_node * nic_bandwidth / devices_per_node`` (B/s per direction per GPU)."""
        return self.nics_per_node * self.inter_node.bandwidth / self.devices_per_node

    def __str__(self) -> str:
        if self.device.name == "cpu" and self.nodes == 1:
            return f"cpu:{self.devices_per_node}"
        head = f"{self.nodes}x" if self.nodes > 1 else ""
        return f"{head}{self.devices_per_node}x{self.device.name}"


def make_cluster(nodes: int, devices_per_node: int, device: DeviceSpec | str,
                 inter_node: LinkSpec | str | None = None, nics_per_node: int | None = None) -> Cluster:
    """A cluster with the device's default inter-node link and NIC count where not given."""
    dev = get_device(device) if isinstance(device, str) else device
    link, nics = default_inter_node(dev)
    if isinstance(inter_node, str):
        inter_node = get_link(inter_node)
    return Cluster(nodes, devices_per_node, dev, inter_node or link, nics if nics_per_node is None else nics_per_node)


_SHORT = re.compile(r"^(?:(\d+)[xX])?(\d+)[xX](.+)$")
_CPU = re.compile(r"^cpu(?::(\d+))?$", re.IGNORECASE)
_KEYS = ("nodes", "devices_per_node", "device", "inter_node", "nics_per_node", "intra_node")


def parse_cluster(text: str) -> Cluster:
    """``"8xA100-80G"``, ``"4x8xH100"``, ``"cpu:4"``, a YAML path, or YAML text -> Cluster."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("cluster must be a string such as 8xA100-80G, 4x8xH100, cpu:4, or a YAML file")
    t = text.strip()
    if t.lower().endswith((".yaml", ".yml")) and "\n" not in t:
        if not os.path.isfile(t):
            raise ValueError(f"cluster file {t!r} does not exist; give an existing YAML file or a string like 8xA100-80G")
        with open(t, encoding="utf-8") as f:
            return cluster_from_dict(_load_yaml(f.read(), t), t)
    if "\n" in t or t.startswith("{") or re.search(r"\bdevices_per_node\s*:", t):
        return cluster_from_dict(_load_yaml(t, "cluster YAML"), "cluster YAML")
    m = _CPU.match(t)
    if m:
        n = int(m.group(1) or 1)
        if n < 1:
            raise ValueError(f"cluster {t!r} needs at least one cpu device, e.g. cpu:4")
        return make_cluster(1, n, "cpu")
    m = _SHORT.match(t)
    if not m:
        raise ValueError(f"cluster {t!r} is not of the form [NODESx]GPUSxTYPE; write e.g. 8xA100-80G, "
                         f"4x8xH100 or cpu:4")
    nodes, per_node, name = int(m.group(1) or 1), int(m.group(2)), m.group(3)
    if nodes < 1 or per_node < 1:
        raise ValueError(f"cluster {t!r} needs positive node and device counts, e.g. 2x8xA100-80G")
    return make_cluster(nodes, per_node, get_device(name, f"cluster {t!r}"))


def _load_yaml(text: str, where: str) -> Any:
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - yaml ships with transformers
        raise ValueError(f"{where}: reading a YAML cluster needs PyYAML; pip install pyyaml or use a "
                         f"string like 8xA100-80G") from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{where} is not valid YAML: {str(e).splitlines()[0]}") from e


def _link(value: Any, key: str, where: str) -> LinkSpec:
    if isinstance(value, str):
        return get_link(value)
    if isinstance(value, dict) and "bandwidth" in value:
        try:
            return LinkSpec(str(value.get("name", key)), float(value["bandwidth"]),
                            float(value.get("latency_s", 10e-6)), str(value.get("source", f"given in {where}")))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {key} needs a numeric bandwidth (B/s) and latency_s (s): {e}") from e
    raise ValueError(f"{where}: {key} must be a link name or a mapping with bandwidth (B/s) and latency_s")


def cluster_from_dict(d: Any, where: str = "cluster YAML") -> Cluster:
    """Cluster from the YAML mapping (keys listed in the module docstring)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a mapping with keys nodes, devices_per_node, device, ...")
    unknown = sorted(set(d) - set(_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; allowed: {', '.join(_KEYS)}")
    for key in ("devices_per_node", "device"):
        if key not in d:
            raise ValueError(f"{where} is missing {key!r}; e.g. devices_per_node: 8, device: A100-80G")
    if not isinstance(d["device"], str):
        raise ValueError(f"{where}: device must be a name such as A100-80G")
    dev = get_device(d["device"], where)
    if "intra_node" in d:
        dev = replace(dev, intra_node_link=_link(d["intra_node"], "intra_node", where))
    inter = _link(d["inter_node"], "inter_node", where) if "inter_node" in d else None
    return make_cluster(d.get("nodes", 1), d["devices_per_node"], dev, inter, d.get("nics_per_node"))


class LinkKind(str, Enum):
    LOCAL = "local"                # axis of size 1: no communication
    INTRA = "intra-node"           # every group inside one node
    INTER = "inter-node"           # one device per node
    HIERARCHICAL = "hierarchical"  # k devices per node on n/k nodes, 1 < k < n
    MIXED = "mixed"                # uneven spread over nodes: flat ring at the slower link


@dataclass(frozen=True)
class AxisLink:
    """How one mesh axis of size ``size = intra_size * inter_size`` communicates: an intra-node
    phase among ``intra_size`` devices at ``intra_bandwidth``/``intra_latency`` and an inter-node
    phase among ``inter_size`` nodes at ``inter_bandwidth``/``inter_latency`` (B/s per direction
    per GPU; s). INTRA has inter_size 1, INTER and MIXED have intra_size 1."""

    name: str
    size: int
    kind: LinkKind
    intra_size: int
    inter_size: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float


def axis_links(cluster: Cluster, mesh: Mesh) -> list[AxisLink]:
    """One AxisLink per mesh axis (see the module docstring for the placement rule)."""
    if mesh.world != cluster.world:
        raise ValueError(f"mesh {mesh} has {mesh.world} devices but cluster {cluster} has {cluster.world}; "
                         f"pick a mesh whose sizes multiply to {cluster.world}")
    dpn = cluster.devices_per_node
    ib, il = cluster.intra_node.bandwidth, cluster.intra_node.latency_s
    eb, el = cluster.inter_node_bandwidth_per_device, cluster.inter_node.latency_s
    out = []
    for a, name in enumerate(mesh.names):
        n = mesh.sizes[a]
        shapes = {_spread(g, dpn) for g in mesh.groups(a)}
        if n == 1:
            kind, k = LinkKind.LOCAL, 1
        elif len(shapes) == 1 and (shape := shapes.pop())[0] > 0:
            k = shape[0]
            kind = LinkKind.INTRA if k == n else LinkKind.INTER if k == 1 else LinkKind.HIERARCHICAL
        else:
            kind, k = LinkKind.MIXED, 1
        if kind is LinkKind.MIXED:
            out.append(AxisLink(name, n, kind, 1, n, ib, il, min(eb, ib), max(el, il)))
        else:
            out.append(AxisLink(name, n, kind, k, n // k, ib, il, eb, el))
    return out


def _spread(group: Sequence[int], dpn: int) -> tuple[int, int]:
    """(members per node, nodes) when even, else (0, 0)."""
    per: dict[int, int] = {}
    for r in group:
        per[r // dpn] = per.get(r // dpn, 0) + 1
    counts = set(per.values())
    return (counts.pop(), len(per)) if len(counts) == 1 else (0, 0)
