"""Skyline passes and their squeaky wheel (``memory.layout_skyline``)."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest

from rhino.memory.layout import Buffer, lower_bound, validate_layout
from rhino.memory.layout_improve import ImproveOptions, plain_skyline, search_kind, squeaky_wheel
from rhino.memory.layout_skyline import skyline_pass, skyline_search
from layout_traces import arrays as _arrays, by_id as _with, log_uniform as _trace


def _wide(seed: int, n: int = 2000, horizon: int = 1000) -> list[Buffer]:
    """``benchmarks/layout_scale.py``'s ``wide`` shape, smaller: uniform sizes, exponential lifetimes
    (~200 buffers live at a time; 68-74% of them hot on seeds 0-2)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lo = rng.randrange(horizon)
        out.append(Buffer(i, lo, lo + 1 + int(rng.expovariate(1 / 100)), 64 * rng.randint(1, 4096)))
    return out


def test_a_pass_is_valid_on_floors_alignments_and_empty_buffers():
    """Random traces with floors on a fifth of the buffers, alignments of 1-4096 and empty buffers:
    every pass valid (the independent checker), on the floors, aligned."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        n = 800
        lo = rng.integers(0, 500, n)
        up = lo + rng.integers(1, 80, n)
        sz = rng.integers(0, 5000, n) * (rng.random(n) > 0.05)
        al = rng.choice([1, 8, 64, 4096], n)
        fl = np.where(rng.random(n) < 0.2, rng.integers(0, 20000, n), 0)
        bufs = [Buffer(i, int(a), int(b), int(s), int(g)) for i, (a, b, s, g) in enumerate(zip(lo, up, sz, al))]
        off = skyline_pass(lo, up, sz, al, fl, rng.random(n))
        assert validate_layout(bufs, _with(bufs, off)) == [], seed
        live = sz > 0
        assert (off[live] >= fl[live]).all() and (off % al == 0).all() and (off[~live] == 0).all()


def test_nested_lifetimes_longest_first_reach_the_bound():
    """Nested lifetimes with the longest first: the skyline stacks them with no gap (the max-load bound),
    and none sits on empty space."""
    rng = np.random.default_rng(3)
    n = 300
    lo = np.arange(n)
    up = 2 * n - lo
    sz = rng.integers(1, 1000, n)
    al, fl = np.ones(n, np.int64), np.zeros(n, np.int64)
    bound = int(sz.sum())
    off = skyline_pass(lo, up, sz, al, fl, (up - lo).astype(float))
    assert int((off + sz).max()) == bound and (off == np.concatenate([[0], np.cumsum(sz)[:-1]])).all()


def test_search_lowers_a_wide_trace_and_keeps_its_contract():
    """On a small ``wide`` trace: up to 30 passes (fewer only at the bound) end lower than the first,
    valid; a start at the target is returned as is; a deadline in the past finishes no pass; a pass past
    its deadline is dropped."""
    bufs = _wide(0)
    lo, up, sz, al = _arrays(bufs)
    fl = np.zeros(len(bufs), np.int64)
    lb = lower_bound(bufs)
    first, h1, p1 = skyline_search(lo, up, sz, al, fl, lb, time.monotonic() + 600, max_passes=1)
    seen = []
    off, h, passes = skyline_search(lo, up, sz, al, fl, lb, time.monotonic() + 600, max_passes=30,
                                    on_best=lambda o, hh: seen.append(hh))
    assert p1 == 1 and (passes == 30 or h == lb) and lb <= h < h1 and seen[0] == h1 and seen[-1] == h and seen == sorted(seen)[::-1]
    assert validate_layout(bufs, _with(bufs, off)) == []
    same, hs, ps = skyline_search(lo, up, sz, al, fl, h, time.monotonic() + 600, start=off)
    assert ps == 0 and hs == h and (same == off).all()
    none, _, p0 = skyline_search(lo, up, sz, al, fl, lb, time.monotonic() - 1)
    assert none is None and p0 == 0
    big = _wide(1, n=20000, horizon=10000)
    blo, bup, bsz, bal = _arrays(big)
    assert skyline_pass(blo, bup, bsz, bal, np.zeros(len(big), np.int64), np.zeros(len(big)),
                        deadline=time.monotonic() - 1) is None


def test_the_plain_search_is_the_skyline_where_most_buffers_are_hot():
    """``wide`` traces are mostly hot: ``squeaky_wheel`` runs skyline passes there (the same layout as
    ``skyline_search``), and the lowest-fit passes with ``plain="lowest-fit"``."""
    bufs = _wide(2)
    lo, up, sz, al = _arrays(bufs)
    fl = np.zeros(len(bufs), np.int64)
    lb = lower_bound(bufs)
    assert plain_skyline(lo, up, sz, fl, lb) and not plain_skyline(lo, up, sz, fl, lb, ImproveOptions(plain="lowest-fit"))
    assert search_kind(lo, up, sz, fl, lb, ImproveOptions(plain="lowest-fit")) == "lowest-fit"
    off, h, _ = squeaky_wheel(lo, up, sz, al, fl, lb, time.monotonic() + 600, ImproveOptions(max_passes=5))
    ref, href, _ = skyline_search(lo, up, sz, al, fl, lb, time.monotonic() + 600, max_passes=5)
    assert h == href and (off == ref).all()
    low, hl, _ = squeaky_wheel(lo, up, sz, al, fl, lb, time.monotonic() + 600,
                               ImproveOptions(max_passes=5, plain="lowest-fit"))
    assert validate_layout(bufs, _with(bufs, low)) == [] and hl == int((low + sz).max())


def test_an_unknown_plain_search_is_refused():
    with pytest.raises(ValueError, match="'skyline' or 'lowest-fit'"):
        ImproveOptions(plain="sky")


def test_plain_forces_the_skyline_search_where_the_focus_would_apply():
    """Few buffers hot: ``squeaky_wheel`` would focus, but with ``plain=True`` it runs the skyline search
    (the same layout as ``skyline_search``)."""
    bufs = _trace(1)
    lo, up, sz, al = _arrays(bufs)
    fl = np.zeros(len(bufs), np.int64)
    lb = lower_bound(bufs)
    assert not plain_skyline(lo, up, sz, fl, lb) and search_kind(lo, up, sz, fl, lb) == "focus"
    off, h, _ = squeaky_wheel(lo, up, sz, al, fl, lb, time.monotonic() + 600, ImproveOptions(max_passes=4),
                              plain=True)
    ref, href, _ = skyline_search(lo, up, sz, al, fl, lb, time.monotonic() + 600, max_passes=4)
    assert h == href and (off == ref).all()


def test_a_skyline_pass_far_below_the_greedy_one_starts_the_search():
    """A leaf above ``max_leaf`` whose first skyline pass (``first_priorities``) is 0.002% above the bound
    against 1.128% for the greedy pass by size: the solver keeps it (its result is at most that pass's
    height, valid); with ``skyline_start`` off the same short search (3 passes, no ejection chains) ends
    higher."""
    from rhino.memory.layout import LayoutOptions, solve_layout
    from rhino.memory.layout_eject import EjectOptions
    from rhino.memory.layout_greedy import place_in_order
    from rhino.memory.layout_skyline import first_priorities
    from rhino.memory.layout_split import SplitOptions
    bufs = _trace(1)
    lo, up, sz, al = _arrays(bufs)
    fl = np.zeros(len(bufs), np.int64)
    sky = int((skyline_pass(lo, up, sz, al, fl, first_priorities(lo, up, sz)) + sz).max())
    greedy = int((place_in_order(lo, up, sz, al, fl, np.lexsort((lo, lo - up, -sz)), lowest=True) + sz).max())
    lb = lower_bound(bufs)
    assert sky - lb <= 0.5 * (greedy - lb)  # the trace is what the test needs

    def opts(start: bool) -> LayoutOptions:
        improve = ImproveOptions(max_passes=3, skyline_start=start)
        return LayoutOptions(split=SplitOptions(above=0, max_leaf=100, cuts=False, revisit=False, improve=improve,
                                                eject=EjectOptions(enabled=False)))
    on = solve_layout(bufs, time_limit=10.0, options=opts(True))
    off = solve_layout(bufs, time_limit=10.0, options=opts(False))
    assert on.valid and validate_layout(bufs, on.offsets) == [] and on.height <= sky < off.height, \
        (on.height, sky, off.height, off.solver)


def test_the_skyline_pass_beside_the_first_greedy_pass_stops_and_yields():
    """``SkylineRace`` (the skyline pass in a thread beside the first greedy pass, ``layout._greedy_phase``)
    gives skyline_pass's offsets, and stops at once when told (its deadline is an array the caller moves);
    ``place_in_order``'s ``stop`` drops a pass (None) and, never true, changes nothing."""
    from rhino.memory.layout_greedy import place_in_order
    from rhino.memory.layout_skyline import SkylineRace, first_priorities
    bufs = _wide(0)
    lo, up, sz, al = _arrays(bufs)
    fl = np.zeros(len(bufs), np.int64)
    pri = first_priorities(lo, up, sz)
    race = SkylineRace(lo, up, sz, al, fl, pri, time.monotonic() + 60)
    assert (race.result() == skyline_pass(lo, up, sz, al, fl, pri)).all()
    assert race.height == int((race.offsets + sz).max())
    big = _wide(1, n=60_000, horizon=30_000)
    blo, bup, bsz, bal = _arrays(big)
    race = SkylineRace(blo, bup, bsz, bal, np.zeros(len(big), np.int64), first_priorities(blo, bup, bsz),
                       time.monotonic() + 600)
    t = time.monotonic()
    assert race.result(stop=True) is None and race.height is None and time.monotonic() - t < 5
    asked = []
    assert place_in_order(blo, bup, bsz, bal, np.zeros(len(big), np.int64), np.lexsort((blo, blo - bup, -bsz)),
                          lowest=True, stop=lambda done, top: asked.append((done, top)) or True) is None
    assert asked == [(4096 / len(big), asked[0][1])] and asked[0][1] > 0
    order = np.lexsort((lo, lo - up, -sz))
    assert (place_in_order(lo, up, sz, al, fl, order, lowest=True, stop=lambda done, top: False)
            == place_in_order(lo, up, sz, al, fl, order, lowest=True)).all()
