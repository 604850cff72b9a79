"""Core window (``memory.layout_core``): the full steps' window laid out first, the rest around it."""
from __future__ import annotations

import random
import time

import numpy as np

from rhino.memory.layout import Buffer, LayoutOptions, lower_bound, solve_layout, validate_layout
from rhino.memory.layout_check import any_overlap
from rhino.memory.layout_core import CoreOptions, core_window, hot_window
from rhino.memory.layout_greedy import place_in_order
from rhino.memory.layout_split import SplitOptions


def _realloc(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Growing arrays (``benchmarks/layout_scale.py``'s ``realloc`` shape, smaller): each copy twice the last,
    allocated one step before the last is freed."""
    rng = random.Random(seed)
    rows, t = [], 0
    while len(rows) < n:
        t += rng.randint(1, 20)
        size, at = 64 * rng.randint(1, 64), t
        for _ in range(rng.randint(1, 8)):
            nxt = at + rng.randint(5, 100)
            rows.append((at, nxt + 1, size))
            at, size = nxt, 2 * size
        rows.append((at, at + rng.randint(1, 100), size))
    lo, up, sz = (np.array(c, np.int64) for c in zip(*rows[:n]))
    return lo, up, sz


def _greedy_solve(lo, up, sz, al, fl, target, deadline):
    """A stand-in for the exact search: lowest fit by size on the floors."""
    return place_in_order(lo, up, sz, al, fl, np.argsort(-sz, kind="stable"), lowest=True)


def test_hot_window_spans_the_steps_near_the_highest_pressure():
    lo = np.array([0, 10, 11, 12, 30], np.int64)
    up = np.array([40, 13, 14, 13, 35], np.int64)
    sz = np.array([10, 50, 50, 1, 55], np.int64)
    # load: 10 on [0, 10), 60 at 10, 110 at 11, 111 at 12, 60 at 13, 10 after, 65 on [30, 35)
    assert hot_window(lo, up, sz, np.zeros(5, np.int64), 0.05) == (11, 13)
    # a floor under the last buffer makes its steps the fullest
    assert hot_window(lo, up, sz, np.array([0, 0, 0, 0, 100], np.int64), 0.05) == (30, 35)


def test_core_window_layout_is_valid_on_floors_and_keeps_the_core_offsets():
    lo, up, sz = _realloc(3, 1500)
    n = len(sz)
    al = np.ones(n, np.int64)
    fl = np.where(np.arange(n) % 7 == 0, 4096, 0).astype(np.int64)
    seen = {}

    def solve(*args):
        seen["lo"], seen["offs"] = args[0], _greedy_solve(*args)
        return seen["offs"]
    off, h = core_window(lo, up, sz, al, fl, 1, time.monotonic() + 2, CoreOptions(margins=(0.5,)), solve)
    assert off is not None and h == int((off + sz).max())
    assert not any_overlap(lo, up, off, off + sz) and (off >= fl).all()
    first, last = hot_window(lo, up, sz, fl, CoreOptions().hot)
    life = int(np.median(up - lo)) // 2
    core = np.flatnonzero((lo < last + life) & (up > first - life))
    assert len(seen["lo"]) == len(core) < n and (off[core] == seen["offs"]).all()


def test_core_window_is_skipped_where_the_window_holds_too_many_buffers():
    lo, up, sz = _realloc(4, 800)
    calls = []
    off, h = core_window(lo, up, sz, np.ones(len(sz), np.int64), np.zeros(len(sz), np.int64), 1, time.monotonic() + 2,
                         CoreOptions(max_core=5), lambda *a: calls.append(1))
    assert (off, h, calls) == (None, 0, [])


def test_solve_layout_with_and_without_the_core_window_is_valid():
    """One large leaf (``max_leaf`` lowered): its search runs the core window first where it is on (said in the
    progress), and the layout is valid either way."""
    lo, up, sz = _realloc(5, 2000)
    bufs = [Buffer(i, int(a), int(b), int(s)) for i, (a, b, s) in enumerate(zip(lo, up, sz))]
    for enabled in (True, False):
        opts = LayoutOptions(split=SplitOptions(above=0, max_leaf=100, cuts=False, core=CoreOptions(enabled=enabled)))
        said: list[str] = []
        res = solve_layout(bufs, time_limit=3, options=opts, progress=said.append)
        assert res.valid and not validate_layout(bufs, res.offsets)
        assert res.height >= lower_bound(bufs)
        assert any("core window of" in m for m in said) == enabled, said
