"""Rhino: capture a PyTorch training step into one IR, plan it, run it.

The Python API (``rhino.capture_step``, ``rhino.estimate``, ``rhino.plan``, ``rhino.memory_plan``,
``rhino.memory_report``, ``rhino.train``, ``rhino.Trainer``) lives in ``rhino.api`` and is imported on first
use, so that the pure packages (``rhino.ir``, ``rhino.sharding``, ``rhino.cost``, ``rhino.search``,
``rhino.memory``) load without torch.
"""
__version__ = "0.1.0"

_API = ("capture_step", "estimate", "plan", "plan_and_run", "memory_plan", "memory_report", "train", "Trainer",
        "TrainResult", "ShardingPlan")

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module 'rhino' has no attribute {name!r}")
