"""Compile the memory planner's numba code once (``make install`` runs it), so that the first
``rhino layout`` does not spend its time limit compiling (``layout_eject`` alone takes ~13 s here).

    python -m rhino.memory.warm
"""
from __future__ import annotations

import time

import numpy as np

from .layout import Buffer, lower_bound, solve_layout
from .layout_eject import eject_repair
from .layout_greedy import place_in_order
from .layout_improve import ImproveOptions, lifetime_pressure, squeaky_wheel
from .layout_skyline import skyline_pass
from .layout_split import decompose


def warm() -> None:
    rng = np.random.default_rng(0)
    n = 64
    lo = rng.integers(0, 100, n)
    up = lo + rng.integers(1, 30, n)
    sz = rng.integers(1, 50, n) * 8
    al, fl = np.ones(n, np.int64), np.zeros(n, np.int64)
    order = np.argsort(-sz)
    bufs = [Buffer(i, int(a), int(b), int(s)) for i, (a, b, s) in enumerate(zip(lo, up, sz))]
    lb = lower_bound(bufs)
    for lowest in (False, True):
        off = place_in_order(lo, up, sz, al, fl, order, lowest=lowest)
    lifetime_pressure(lo, up, sz, fl + 8)
    skyline_pass(lo, up, sz, al, fl, sz.astype(np.float64))
    decompose(lo, up, sz)
    # targets below the bound, so that every compiled step runs (and fails)
    squeaky_wheel(lo, up, sz, al, fl, lb - 1, time.monotonic() + 5, ImproveOptions(max_passes=3), start=off)
    eject_repair(lo, up, sz, al, fl, off, lb - 1, time.monotonic() + 5)
    solve_layout(bufs, time_limit=2)


if __name__ == "__main__":
    t = time.perf_counter()
    warm()
    print(f"rhino.memory: numba code compiled ({time.perf_counter() - t:.1f} s)")
