"""Ejection chains (``memory.layout_eject``): valid, never higher, floors and alignment kept, and they lower
a layout that a greedy pass left high."""
from __future__ import annotations

import random
import time

import numpy as np

from conftest import Stopwatch
from rhino.memory.layout import Buffer, lower_bound, validate_layout
from rhino.memory.layout_eject import EjectOptions, Follower, eject_repair
from rhino.memory.layout_greedy import place_in_order


def _trace(seed: int, n: int = 800, horizon: int = 3000, aligned: bool = False) -> list[Buffer]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lo = rng.randrange(horizon)
        a = rng.choice((1, 8, 64)) if aligned else 1
        out.append(Buffer(i, lo, lo + max(1, int(2 ** rng.uniform(0, 10))), 64 * max(1, int(2 ** rng.uniform(0, 10))), a))
    return out


def _arrays(bufs):
    return tuple(np.array([getattr(b, f) for b in bufs], np.int64) for f in ("lower", "upper", "size", "alignment"))


def _start_order_layout(bufs, floor):
    """Lowest fit in order of start: a poor layout, far above the bound."""
    lo, up, sz, al = _arrays(bufs)
    return place_in_order(lo, up, sz, al, floor, np.lexsort((np.arange(len(bufs)), lo)), lowest=True)


def _poor(seed: int, n: int = 800):
    """A trace's arrays, zero floors, its start-order layout and that layout's height."""
    bufs = _trace(seed, n=n)
    lo, up, sz, al = _arrays(bufs)
    fl = np.zeros(len(bufs), np.int64)
    off = _start_order_layout(bufs, fl)
    return bufs, (lo, up, sz, al, fl), off, int((off + sz).max())


def _valid(bufs, off) -> bool:
    return not validate_layout(bufs, {b.id: int(o) for b, o in zip(bufs, off.tolist())})


def test_lowers_a_greedy_layout_and_stays_valid():
    bufs, arrays, off, h0 = _poor(1)
    lb = lower_bound(bufs)
    assert h0 > lb
    new, h, moved = eject_repair(*arrays, off, lb, time.monotonic() + 5)
    assert _valid(bufs, new)
    assert h == int((new + arrays[2]).max())
    assert moved > 0 and h < h0  # 1 round moves every buffer above the cap, so h drops by >= the step
    assert np.array_equal(off, _start_order_layout(bufs, arrays[4]))  # the input is not changed


def test_floors_alignment_and_never_higher():
    for seed in range(4):
        bufs = _trace(10 + seed, n=400, aligned=True)
        lo, up, sz, al = _arrays(bufs)
        rng = np.random.default_rng(seed)
        fl = rng.integers(0, 3, len(bufs)) * 4096  # some buffers may not go below a floor
        off = _start_order_layout(bufs, fl)
        h0 = int((off + sz).max())
        new, h, _ = eject_repair(lo, up, sz, al, fl, off, lower_bound(bufs), time.monotonic() + 2.5,
                                 EjectOptions(depth=2, tries=4))   # the constraints hold at any deadline
        assert h <= h0
        assert (new >= fl).all() and (new % al == 0).all()
        assert _valid(bufs, new)


def test_stops_at_the_target_and_at_the_deadline():
    bufs, arrays, off, h0 = _poor(3)
    new, h, moved = eject_repair(*arrays, off, h0, time.monotonic() + 10)  # already at the target
    assert (h, moved) == (h0, 0) and np.array_equal(new, off)
    with Stopwatch() as clock:
        new, h, _ = eject_repair(*arrays, off, lower_bound(bufs), time.monotonic() + 0.3)
    assert clock.seconds < 1.5 and h <= h0, clock
    assert _valid(bufs, new)


def test_follower_lowers_what_it_is_offered_and_finishes_at_once():
    bufs, arrays, off, h0 = _poor(2)
    f = Follower(*arrays, lower_bound(bufs), time.monotonic() + 30).start()
    f.offer(off, h0)
    time.sleep(3)
    with Stopwatch() as clock:
        new, h = f.finish()
    assert clock.seconds < 2.0, clock  # brought forward, not run to its deadline
    assert new is not None and h < h0 and h == int((new + arrays[2]).max())
    assert _valid(bufs, new)


def test_follower_without_an_offer_returns_nothing():
    bufs, arrays, _, _ = _poor(4, n=100)
    f = Follower(*arrays, lower_bound(bufs), time.monotonic() + 10).start()
    assert f.finish() == (None, 0)


def test_large_leaf_runs_the_chains_beside_or_after_the_search():
    """Both ways the solver runs them (a thread beside the squeaky wheel, which goes on after a search that
    stops early, or after it on one core) give a valid layout lower than the search alone (3 passes; no
    skyline start, which is lower than that on this trace; no window repair, which after the ``SIZE_START``
    pass lowers the search alone to within 0.02% of the bound and left the chains' leaf 0.06% above it
    under load; no core window, which lays this trace out before the search starts)."""
    from rhino.memory.layout import LayoutOptions, solve_layout
    from rhino.memory.layout_core import CoreOptions
    from rhino.memory.layout_improve import ImproveOptions
    from rhino.memory.layout_split import SplitOptions
    from rhino.memory.layout_window import WindowOptions
    from rhino.memory.warm import warm
    warm()  # compiled before the timed runs (after an edit numba compiles again, ~15 s)
    bufs = _trace(5, n=1500)

    def opts(**eject):
        return LayoutOptions(split=SplitOptions(above=0, max_leaf=100, cuts=False, revisit=False,
                                                improve=ImproveOptions(max_passes=3, skyline_start=False),
                                                eject=EjectOptions(**eject), window=WindowOptions(enabled=False),
                                                core=CoreOptions(enabled=False)))
    plain = solve_layout(bufs, time_limit=5.0, options=opts(enabled=False))
    for kw in ({"beside": False}, {"beside": True}):
        r = solve_layout(bufs, time_limit=5.0, options=opts(**kw))
        assert r.valid and validate_layout(bufs, r.offsets) == []
        assert r.height < plain.height and "+eject" in r.solver, (kw, r.height, plain.height, r.solver)
