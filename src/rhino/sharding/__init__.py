"""Sharding: placements, rules derived from op annotations, redistribution (pure Python)."""
from .mesh import Mesh
from .placement import Partial, Placement, ReduceOp, Replicate, Shard, Sharding, local_shape

__all__ = ["Mesh", "Partial", "Placement", "ReduceOp", "Replicate", "Shard", "Sharding", "local_shape"]
