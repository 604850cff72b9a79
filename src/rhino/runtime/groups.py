"""Process groups of a device mesh: one group per rank list of ``mesh.groups(axis)``, every axis.

``build_groups`` is collective: every rank of the default process group must call it with the same
mesh, because ``dist.new_group`` must be called by all ranks, for every group, in the same order.
A group spanning the whole world reuses the default group instead of creating a new one.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ..sharding.mesh import Mesh

__all__ = ["MeshGroups", "build_groups", "build_stage_groups"]


class MeshGroups:
    """Lookup of the process group that ``rank`` uses to communicate along a mesh axis."""

    def __init__(self, mesh: Mesh, rank: int, by_axis: list[list[tuple[tuple[int, ...], object]]]) -> None:
        self.mesh = mesh
        self.rank = rank                        # the rank of this process
        self._by_axis = by_axis                 # axis -> [(ranks, group)] in mesh.groups order
        self._index = [{r: i for i, (ranks, _) in enumerate(groups) for r in ranks} for groups in by_axis]

    def _entry(self, rank: int, axis: int | str) -> tuple[tuple[int, ...], object]:
        if isinstance(axis, str) and axis not in self.mesh.names:
            raise ValueError(f"mesh {self.mesh} has no axis {axis!r}")
        a = self.mesh.axis(axis)
        if not 0 <= a < self.mesh.ndim:
            raise ValueError(f"mesh {self.mesh} has no axis {axis!r}")
        if not 0 <= rank < self.mesh.world:
            raise ValueError(f"rank {rank} is not in mesh {self.mesh} of {self.mesh.world} ranks")
        return self._by_axis[a][self._index[a][rank]]

    def group(self, rank: int, axis: int | str):
        """The group of ``rank`` along ``axis`` (usable for collectives only by its members)."""
        return self._entry(rank, axis)[1]

    def ranks(self, rank: int, axis: int | str) -> tuple[int, ...]:
        """The global ranks of that group, in order of their coordinate on ``axis``."""
        return self._entry(rank, axis)[0]


def build_groups(mesh: Mesh, timeout_s: float | None = None) -> MeshGroups:
    """Create the groups of every mesh axis (collective: all ranks call it with the same mesh)."""
    if not dist.is_initialized():
        raise ValueError("build_groups needs an initialized process group: call it inside launch() "
                         "or after init_from_env()")
    world = dist.get_world_size()
    if mesh.world != world:
        raise ValueError(f"mesh {mesh} has {mesh.world} ranks but the process group has {world}; "
                         f"choose a mesh whose sizes multiply to {world}")
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    by_axis = []
    for axis in range(mesh.ndim):
        groups = []
        for ranks in mesh.groups(axis):
            if len(ranks) == world:
                group = dist.group.WORLD
            else:
                group = dist.new_group(ranks, timeout=timeout)
            groups.append((tuple(ranks), group))
        by_axis.append(groups)
    return MeshGroups(mesh, dist.get_rank(), by_axis)


def build_stage_groups(mesh: Mesh, stages: int, timeout_s: float | None = None) -> MeshGroups:
    """The groups of this rank's pipeline stage: the job is ``stages`` copies of ``mesh`` (stage-major
    ranks, ``runtime.pipeline``); every stage's groups are created on every rank (collective, same
    order), and the returned lookup has the stage's mesh, this rank's local rank and local rank tuples."""
    if not dist.is_initialized():
        raise ValueError("build_stage_groups needs an initialized process group: call it inside launch() "
                         "or after init_from_env()")
    world, W = dist.get_world_size(), mesh.world
    if stages * W != world:
        raise ValueError(f"{stages} stages of mesh {mesh} need {stages * W} ranks but the process group has "
                         f"{world}; start {stages * W} processes")
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    stage, local = divmod(dist.get_rank(), W)
    by_axis = []
    for axis in range(mesh.ndim):
        mine = []
        for s in range(stages):
            for ranks in mesh.groups(axis):
                group = dist.new_group([s * W + r for r in ranks], timeout=timeout)
                if s == stage:
                    mine.append((tuple(ranks), group))
        by_axis.append(mine)
    return MeshGroups(mesh, local, by_axis)
