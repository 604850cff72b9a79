"""Float64 exactness of the Hugging Face workloads: capture + ``rhino check`` at 1e-9, and sharded training
under a preset through ``runtime.exact.simulate_plan`` (every rank's program run in one process in
lockstep, collectives simulated; every rank's loss and every rank's shard of every parameter, buffer
and optimizer-state tensor compared with single-device eager PyTorch at 1e-9)."""
from __future__ import annotations

import warnings

import torch

import hf_workloads as hf
from rhino.capture import Workload, capture, default_dtype
from rhino.check import check_captured
from rhino.runtime.exact import simulate_plan
from rhino.sharding.presets import parse_strategy, preset_plan

TOL = 1e-9   # absolute and relative, float64


def capture64(name: str, **sizes):
    """Build workload ``name`` with float64 as the default dtype (restored after) and capture it."""
    with default_dtype(torch.float64):
        m, opt, loss_fn, batch = getattr(hf, name)(**sizes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(Workload(m, opt, loss_fn, tuple(batch), "hf_workloads.py", name))


def check64(cap, steps: int = 2):
    """``rhino check`` at TOL: the captured step against eager PyTorch."""
    return check_captured(cap, steps=steps, rtol=TOL, atol=TOL)


def exact_under(cap, strategy: str, steps: int = 2):
    """``steps`` sharded steps of ``cap`` under preset ``strategy``, every rank compared (float64: 1e-9).
    A ``RunResult``: ok, max_abs_diff, first_mismatch, seconds."""
    r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy(strategy)), steps)
    return r
