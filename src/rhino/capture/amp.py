"""Autocast regions written for an accelerator, traced on the CPU.

Capture traces on fake CPU tensors, where ``torch.autocast("cuda", ...)`` would do nothing (autocast acts
only on tensors of its own device type), so a step written for a GPU would be captured, checked and
priced in fp32. Inside ``autocast_on(device_type)``, an autocast region opened for any other device type
acts on ``device_type`` instead, with the same dtype (an unset dtype is the original device's default,
float16 for CUDA). The op lists are the tracing device's (CPU autocast runs the matmuls in the low
precision as CUDA autocast does; it keeps softmax in the input's dtype where CUDA autocast upcasts it).
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["autocast_on"]

_AUTOCAST = torch.amp.autocast_mode.autocast


@contextlib.contextmanager
def autocast_on(device_type: str = "cpu"):
    original = _AUTOCAST.__init__

    def init(self, *args, **kwargs):
        args = list(args)
        asked = args[0] if args else kwargs.get("device_type")
        if isinstance(asked, str) and asked != device_type:
            if len(args) < 2 and kwargs.get("dtype") is None:
                kwargs["dtype"] = torch.get_autocast_dtype(asked)
            if args:
                args[0] = device_type
            else:
                kwargs["device_type"] = device_type
        original(self, *args, **kwargs)

    _AUTOCAST.__init__ = init
    try:
        yield
    finally:
        _AUTOCAST.__init__ = original
