"""Shared by the layout tests: a MiniMalloc-style random trace and conversions to and from arrays."""
from __future__ import annotations

import random

import numpy as np

from rhino.memory.layout import Buffer


def log_uniform(seed: int, n: int = 1500, horizon: int = 5000) -> list[Buffer]:
    """MiniMalloc-style random buffers: log-uniform lifetimes and sizes, starts uniform (17-30% hot)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lo = rng.randrange(horizon)
        out.append(Buffer(i, lo, lo + max(1, int(2 ** rng.uniform(0, 10))), 64 * max(1, int(2 ** rng.uniform(0, 12)))))
    return out


def arrays(bufs: list[Buffer]) -> tuple[np.ndarray, ...]:
    """``lower``, ``upper``, ``size``, ``alignment`` as int64 arrays."""
    return tuple(np.array([getattr(b, f) for b in bufs], np.int64) for f in ("lower", "upper", "size", "alignment"))


def by_id(bufs: list[Buffer], off: np.ndarray) -> dict:
    """Offsets in ``bufs`` order as a dict by buffer id."""
    return {b.id: int(o) for b, o in zip(bufs, off.tolist())}
