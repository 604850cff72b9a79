"""The peak split (memory.layout_peak) and where solve_layout runs it."""
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest

from rhino.memory.layout import Buffer, LayoutOptions, LayoutStatus, solve_layout, validate_layout
from rhino.memory.layout_greedy import place_in_order
from rhino.memory.layout_improve import ImproveOptions
from rhino.memory.layout_peak import PeakOptions, peak_split, peak_time


def _wide_window(seed: int, n: int = 4000, horizon: int = 8000, half: int = 600):
    """``benchmarks/layout_scale.py``'s ``wide`` shape (uniform starts, exponential lifetimes of mean 800,
    sizes 64 B-256 KiB), lifetimes cut to ``half`` steps either side of the peak: ~1,000 buffers."""
    rng = random.Random(seed)
    lo, up, sz = [], [], []
    for _ in range(n):
        s = rng.randrange(horizon)
        lo.append(s)
        up.append(s + 1 + int(rng.expovariate(1 / 800)))
        sz.append(64 * rng.randint(1, 4096))
    lo, up, sz = (np.array(x, np.int64) for x in (lo, up, sz))
    t = peak_time(lo, up, sz)
    live = (lo < t + half + 1) & (up > t - half)
    return np.maximum(lo[live], t - half), np.minimum(up[live], t + half + 1), sz[live]


def _bound(lo, up, sz) -> int:
    t = peak_time(lo, up, sz)
    return int(sz[(lo <= t) & (up > t)].sum())


def _check(lo, up, sz, al, off, floor=None) -> None:
    bufs = [Buffer(i, int(a), int(b), int(s), int(g)) for i, (a, b, s, g) in enumerate(zip(lo, up, sz, al))]
    assert validate_layout(bufs, dict(enumerate(off.tolist()))) == []
    if floor is not None:  # empty buffers go to 0 (``place_in_order``)
        assert (off[sz > 0] >= floor[sz > 0]).all()


def test_peak_time_is_where_the_most_bytes_are_live():
    lo, up, sz = np.array([0, 2, 3, 9]), np.array([5, 4, 8, 10]), np.array([1, 10, 2, 100])
    assert peak_time(lo, up, sz) == 9
    assert peak_time(lo[:3], up[:3], sz[:3]) == 3  # 1 + 10 + 2 live at 3


def test_the_clique_is_stacked_in_start_order_and_both_sides_around_it():
    lo, up, sz = _wide_window(1)
    n = len(sz)
    one, zero = np.ones(n, np.int64), np.zeros(n, np.int64)
    off, h, passes = peak_split(lo, up, sz, one, zero, _bound(lo, up, sz), time.monotonic() + 60,
                                PeakOptions(improve=ImproveOptions(max_passes=3)))
    assert off is not None and h == int((off + sz).max()) and 2 <= passes <= 6
    _check(lo, up, sz, one, off)
    t = peak_time(lo, up, sz)
    clique = np.flatnonzero((lo <= t) & (up > t))
    by_start = clique[np.argsort(lo[clique], kind="stable")]
    assert off[by_start].tolist() == np.concatenate([[0], np.cumsum(sz[by_start])[:-1]]).tolist()


def test_the_split_reaches_a_window_that_lowest_fit_misses():
    # seed 1: lowest fit by size 3.7% above the bound, the split 0.05% within 50 passes a side
    lo, up, sz = _wide_window(1)
    n = len(sz)
    one, zero = np.ones(n, np.int64), np.zeros(n, np.int64)
    bound = _bound(lo, up, sz)
    greedy = place_in_order(lo, up, sz, one, zero, np.lexsort((lo, lo - up, -sz)), lowest=True)
    assert (greedy + sz).max() > 1.02 * bound
    off, h, _ = peak_split(lo, up, sz, one, zero, bound, time.monotonic() + 120,
                           PeakOptions(improve=ImproveOptions(max_passes=50)))
    assert h <= 1.005 * bound
    _check(lo, up, sz, one, off)


def test_floors_alignments_and_empty_buffers_are_kept():
    lo, up, sz = _wide_window(2, n=2000, half=300)
    rng = np.random.default_rng(0)
    n = len(sz)
    sz = sz + rng.integers(0, 64, n)  # sizes the alignments do not divide
    sz[::17] = 0
    al = rng.choice([1, 8, 512, 4096], n)
    floor = np.where(rng.random(n) < 0.2, rng.integers(0, 1 << 20, n), 0)
    off, _, _ = peak_split(lo, up, sz, al, floor, _bound(lo, up, sz), time.monotonic() + 60,
                           PeakOptions(improve=ImproveOptions(max_passes=5)))
    assert off is not None
    assert (off % al == 0).all()
    _check(lo, up, sz, al, off, floor)


def test_an_expired_deadline_gives_nothing():
    lo, up, sz = _wide_window(3, n=1000)
    n = len(sz)
    off, h, _ = peak_split(lo, up, sz, np.ones(n, np.int64), np.zeros(n, np.int64), 0, time.monotonic() - 1)
    assert off is None and h == 0


def test_no_side_pass_starts_after_the_deadline(monkeypatch):
    """A side below ``place_in_order``'s 4,096-buffer chunk is one pass with no look at the clock: once the
    deadline has passed, no further pass starts (a 5,000-buffer staircase ran a batch of four 0.27 s passes
    after it: wall 3.3 s at ``--time-limit 2``). Here the clock moves 10 s per pass."""
    import rhino.memory.layout_peak as peak_mod
    clock = [0.0]
    passes = []

    def fake_place(*a, **k):
        passes.append(k.get("given") is not None)
        clock[0] += 10.0
        return place_in_order(*a, **k)

    monkeypatch.setattr(peak_mod, "place_in_order", fake_place)
    monkeypatch.setattr(peak_mod, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    n = 300
    lo = np.arange(n, dtype=np.int64)
    up, sz = lo + 100, np.full(n, 64, np.int64)
    off, h, done = peak_split(lo, up, sz, np.ones(n, np.int64), np.zeros(n, np.int64), 0, 5.0)
    assert passes == [False]  # the clique's pass, then no side pass
    assert off is None and done == 0


def test_options_are_checked():
    with pytest.raises(ValueError, match="share"):
        PeakOptions(share=1.5)
    with pytest.raises(ValueError, match="batch"):
        PeakOptions(batch=0)


def _bufs(seed: int) -> list[Buffer]:
    lo, up, sz = _wide_window(seed)
    return [Buffer(i, int(a), int(b), int(s)) for i, (a, b, s) in enumerate(zip(lo, up, sz))]


def test_solve_layout_runs_the_split_where_the_exact_search_is_unanswered():
    # share 1: the exact search's try gets no time, so it is unanswered and the split runs (50 passes a
    # side, as above: 0.05% over the bound); at a capacity its layout is the answer
    bufs = _bufs(1)
    lb = _bound(*(np.array([getattr(b, f) for b in bufs]) for f in ("lower", "upper", "size")))
    opts = LayoutOptions(cpsat=False, peak=PeakOptions(share=1.0, improve=ImproveOptions(max_passes=50)))
    res = solve_layout(bufs, capacity=int(1.005 * lb), time_limit=60, options=opts)
    assert res.valid and res.solver == "peak-split" and res.height <= 1.005 * lb
    assert res.status is LayoutStatus.FEASIBLE


def test_solve_layout_minimizes_from_the_split():
    # without a capacity: the split runs in the first try at the bound, then the exact search goes on
    # below its height (it may lower it further)
    bufs = _bufs(1)
    lb = _bound(*(np.array([getattr(b, f) for b in bufs]) for f in ("lower", "upper", "size")))
    said = []
    opts = LayoutOptions(cpsat=False, peak=PeakOptions(share=1.0, improve=ImproveOptions(max_passes=50)))
    res = solve_layout(bufs, time_limit=5, options=opts, progress=said.append)
    assert res.valid and res.height <= 1.005 * lb
    assert any(m.startswith("layout: peak split") for m in said)


def test_solve_layout_without_the_split_never_names_it():
    bufs = _bufs(1)
    opts = LayoutOptions(cpsat=False, peak=PeakOptions(enabled=False))
    res = solve_layout(bufs, time_limit=3, options=opts)
    assert res.valid and res.solver != "peak-split"
