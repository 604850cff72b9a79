"""Window repair (``memory.layout_window``): never higher, valid, on the floors, and lower where a window
has room."""
from __future__ import annotations

import random
import time

import numpy as np

from rhino.memory.layout import Buffer, lower_bound, validate_layout
from rhino.memory.layout_greedy import place_in_order
from rhino.memory.layout_window import WindowOptions, window_repair, windows_small
from layout_traces import arrays, by_id, log_uniform


def _few_live(seed: int, n: int = 3000, horizon: int = 60_000) -> list[Buffer]:
    """``hugebytes``'s shape, small: ~15 buffers live at a time, sizes uniform over five decades."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lo = rng.randrange(horizon)
        out.append(Buffer(i, lo, lo + 1 + rng.randrange(600), rng.randint(1, 10 ** 5)))
    return out


def test_repair_lowers_a_first_fit_layout_and_keeps_it_valid_on_its_floors():
    """Start-ordered lowest fit (an allocator's layout) on ``hugebytes``-shaped traces, with floors on 5% of
    the buffers, ends 6.0-20.5% above the max-load bound; window repair down to the bound reaches it on
    every seed (0.2 s each), valid and on the floors."""
    for seed in range(3):
        bufs = _few_live(seed)
        lo, up, sz, al = arrays(bufs)
        rng = np.random.default_rng(seed)
        lb = lower_bound(bufs)
        fl = np.where(rng.random(len(bufs)) < 0.05, rng.integers(0, lb // 4, len(bufs)), 0)
        start = place_in_order(lo, up, sz, al, fl, np.lexsort((-sz, lo)), lowest=True)
        h0 = int((start + sz).max())
        assert h0 > 1.05 * lb
        off, h, fixed = window_repair(lo, up, sz, al, fl, start, lb, time.monotonic() + 60)
        assert h == int((off + sz).max()) == lb and fixed >= 1, (seed, h, h0, lb)
        assert validate_layout(bufs, by_id(bufs, off)) == [] and (off >= fl).all()


def test_repair_never_rises_and_stops_at_the_deadline():
    """Random traces with a tight target: the height is never above the start, and a deadline already
    past returns the start unchanged."""
    for seed in range(3):
        bufs = log_uniform(seed)
        lo, up, sz, al = arrays(bufs)
        fl = np.zeros(len(bufs), np.int64)
        start = place_in_order(lo, up, sz, al, fl, np.lexsort((lo, lo - up, -sz)), lowest=True)
        h0 = int((start + sz).max())
        off, h, _ = window_repair(lo, up, sz, al, fl, start, lower_bound(bufs), time.monotonic() + 5,
                                  WindowOptions(passes=20))
        assert h <= h0 and validate_layout(bufs, by_id(bufs, off)) == []
        same, h1, fixed = window_repair(lo, up, sz, al, fl, start, 0, time.monotonic() - 1)
        assert (same == start).all() and h1 == h0 and fixed == 0


def test_windows_small_tells_few_live_traces_from_long_lived_crowds():
    """Around the buffers of largest ``size x lifetime``: a few-live trace has small windows; a trace where
    those buffers outlive a thousand others (log-uniform lifetimes up to 16k steps, ~600 live) does not."""
    lo, up, sz, _ = arrays(_few_live(0))
    assert windows_small(lo, up, sz)
    rng = np.random.default_rng(0)
    lo = rng.integers(0, 40_000, 12_000)
    up = lo + np.maximum(1, (2 ** rng.uniform(0, 14, lo.size)).astype(np.int64))
    sz = 64 * (2 ** rng.uniform(0, 16, lo.size)).astype(np.int64)
    assert not windows_small(lo, up, sz)
