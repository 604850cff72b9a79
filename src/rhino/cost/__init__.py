"""Cost model (pure Python, never imports torch): device datasheets, clusters, collective times."""
from .cluster import AxisLink, Cluster, LinkKind, axis_links, parse_cluster
from .collectives import StepCost, step_cost, step_seconds, steps_seconds
from .devices import DEVICES, INTER_NODE_LINKS, DeviceSpec, LinkSpec, get_device

__all__ = ["AxisLink", "Cluster", "LinkKind", "axis_links", "parse_cluster", "StepCost", "step_cost",
           "step_seconds", "steps_seconds", "DEVICES", "INTER_NODE_LINKS", "DeviceSpec", "LinkSpec",
           "get_device"]
