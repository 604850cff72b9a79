"""Runtime: process launch (local gloo processes or a torchrun job), process groups of a device mesh,
and the redistribution steps executed with torch.distributed."""
from .collectives import apply_step, gather_tensor, shard_tensor
from .groups import MeshGroups, build_groups
from .launch import (Backend, RankContext, RankFailedError, in_torchrun, init_from_env, launch, run_from_env,
                     shutdown)

__all__ = ["Backend", "MeshGroups", "RankContext", "RankFailedError", "apply_step", "build_groups",
           "gather_tensor", "in_torchrun", "init_from_env", "launch", "run_from_env", "shard_tensor", "shutdown"]
