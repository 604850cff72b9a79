"""Capture: a PyTorch training step -> one IR graph."""
from .trace import CaptureError, Captured, capture
from .workload import DTYPES, Workload, WorkloadError, default_dtype, load_workload

__all__ = ["CaptureError", "Captured", "capture", "Workload", "WorkloadError", "load_workload", "default_dtype",
           "DTYPES"]
