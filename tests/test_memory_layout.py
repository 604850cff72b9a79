"""Layout of buffers with fixed lifetimes: the validator, the bound, greedy and exact solvers, CSV, CLI."""
from __future__ import annotations

import dataclasses
import itertools
import json
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rhino.cli.main import main
from rhino.memory import layout_bnb
from rhino.memory.layout import (Buffer, GreedyOrder, LayoutOptions, LayoutStatus, greedy_layout, height,
                                 lower_bound, solve_layout, validate_layout)
from rhino.memory.layout_bnb import Preorder, SearchStatus, search_layout
from rhino.memory.layout_greedy import place_in_order, slot_stack
from rhino.memory.layout_cpsat import CpsatRun, CpStrategy
from rhino.memory.layout_io import read_buffers, write_offsets

# MiniMalloc's examples/input.12.csv (github google/minimalloc, Apache-2.0): five buffers, height 12
INPUT_12 = "id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\nb3,0,9,4\nb4,9,21,4\nb5,0,21,4\n"


def test_validator_reports_each_kind_of_violation():
    a, b = Buffer("a", 0, 4, 8, alignment=4), Buffer("b", 2, 6, 8)
    assert validate_layout([a, b], {"a": 0, "b": 8}) == []
    assert any("overlap" in e for e in validate_layout([a, b], {"a": 0, "b": 4}))
    assert any("no offset" in e for e in validate_layout([a, b], {"a": 0}))
    assert any("negative" in e for e in validate_layout([a, b], {"a": 0, "b": -8}))
    assert any("alignment" in e for e in validate_layout([a, b], {"a": 2, "b": 16}))
    assert any("capacity" in e for e in validate_layout([a, b], {"a": 0, "b": 8}, capacity=12))
    # touching in time (half-open) or in address is fine
    c = Buffer("c", 4, 6, 8)
    assert validate_layout([a, c], {"a": 0, "c": 0}) == []


def test_lower_bound_is_the_most_live_bytes():
    bufs = [Buffer(0, 0, 2, 5), Buffer(1, 1, 3, 7), Buffer(2, 2, 4, 4)]
    assert lower_bound(bufs) == 12          # at time 1: 5 + 7; at 2: 7 + 4 (0 has ended)


def _brute(bufs: list[Buffer]) -> int:
    """Optimal height by trying every order of best-fit placement at the lowest feasible offset."""
    best = None
    for perm in itertools.permutations(bufs):
        offs = {}
        for b in perm:
            x = 0
            while any(offs[o.id] < x + b.size and x < offs[o.id] + o.size and o.lower < b.upper and b.lower < o.upper
                      for o in perm if o.id in offs):
                x += 1
            offs[b.id] = x
        h = height(bufs, offs)
        best = h if best is None else min(best, h)
    return best


_buffers = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4), st.integers(1, 6)), min_size=1, max_size=5)


@settings(derandomize=True, max_examples=40, deadline=None)
@given(_buffers)
def test_greedy_is_valid_and_exact_is_optimal(spec):
    bufs = [Buffer(i, lo, lo + ln, sz) for i, (lo, ln, sz) in enumerate(spec)]
    for order in GreedyOrder:
        assert validate_layout(bufs, greedy_layout(bufs, order)) == []
    res = solve_layout(bufs, time_limit=5)
    assert validate_layout(bufs, res.offsets) == []
    assert res.height == _brute(bufs) and res.status is LayoutStatus.OPTIMAL
    assert res.height >= res.lower_bound == lower_bound(bufs)


def test_exact_beats_greedy_where_greedy_is_stuck():
    # a classic: best-fit by size leaves a hole no later buffer fits; the optimum packs to the bound
    bufs = [Buffer(0, 0, 2, 2), Buffer(1, 1, 4, 2), Buffer(2, 3, 5, 2), Buffer(3, 0, 1, 2), Buffer(4, 2, 3, 2),
            Buffer(5, 4, 5, 2)]
    res = solve_layout(bufs, time_limit=10)
    assert res.height == lower_bound(bufs) == 4 and validate_layout(bufs, res.offsets) == []


def test_capacity_infeasible_and_fit():
    bufs = [Buffer(0, 0, 2, 4), Buffer(1, 1, 3, 4)]
    assert solve_layout(bufs, capacity=7).status is LayoutStatus.INFEASIBLE
    res = solve_layout(bufs, capacity=8)
    assert res.status is LayoutStatus.OPTIMAL and validate_layout(bufs, res.offsets, 8) == []


def test_an_invalid_solver_layout_is_never_counted(monkeypatch, tmp_path, capsys):
    """A solver that claims a fit with overlapping buffers is caught by the validator: the layout is
    discarded (the status never says it fits), and ``rhino layout`` does not count it as solved."""
    from rhino.memory import layout as layout_mod
    bufs = _perfect_packing(3, 100)  # greedy cannot reach the bound 64
    overlapping = {b.id: 0 for b in bufs}
    monkeypatch.setattr(layout_mod, "_fit", lambda buffers, capacity, *a: (SearchStatus.FOUND, overlapping, "liar", 1))
    res = solve_layout(bufs, capacity=64, time_limit=5)
    assert res.status is LayoutStatus.UNKNOWN and res.valid and res.offsets != overlapping and res.height > 64
    res = solve_layout(bufs, time_limit=5)  # bisection: every false fit is discarded too
    assert res.status is LayoutStatus.FEASIBLE and res.valid and res.height > 64
    csv = tmp_path / "packing.csv"
    csv.write_text("id,lower,upper,size\n" + "".join(f"{b.id},{b.lower},{b.upper},{b.size}\n" for b in bufs))
    assert main(["layout", str(csv), "--capacity", "64", "--json"]) == 1
    assert not json.loads(capsys.readouterr().out)["ok"]


def test_time_limit_still_returns_a_valid_layout():
    bufs = [Buffer(i, i % 7, i % 7 + 3 + i % 5, 1 + (i * 37) % 17) for i in range(120)]
    res = solve_layout(bufs, time_limit=0.2)
    assert validate_layout(bufs, res.offsets) == [] and res.height >= res.lower_bound


def _refused(path, content: str | bytes, match: str) -> None:
    """``read_buffers`` of a file holding ``content`` raises a ValueError matching ``match``."""
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=match):
        read_buffers(path)


def test_csv_errors_name_the_line(tmp_path):
    p = tmp_path / "x.csv"
    _refused(p, "id,lower,upper,size\n0,0,4,8\n1,9,5,3\n",
             "x.csv line 3: upper \\(5\\) must be greater than lower \\(9\\)")
    _refused(p, "id,lower,upper,size\n0,0,4,-8\n", "line 2: size")
    _refused(p, "id,lower,upper,size\n0,0,4\n", "line 2: 3 fields")
    _refused(p, "id,lower,size\n", "header lacks upper")


def test_csv_without_ids_and_alignments_round_trip(tmp_path):
    """A trace without an ``id`` column numbers its rows from 0 (it was refused); a layout written with
    ``write_offsets`` keeps the alignments, so it reads back as the same instance."""
    p = tmp_path / "x.csv"
    p.write_text("lower,upper,size,alignment\n0,4,8,16\n2,6,3,1\n")
    bufs = read_buffers(p)
    assert [(b.id, b.lower, b.upper, b.size, b.alignment) for b in bufs] == [(0, 0, 4, 8, 16), (1, 2, 6, 3, 1)]
    out = tmp_path / "out.csv"
    write_offsets(out, bufs, {0: 0, 1: 16})
    assert read_buffers(out) == bufs and out.read_text().splitlines()[0] == "id,lower,upper,size,alignment,offset"


def test_csv_beyond_int64_is_one_sentence(tmp_path):
    """The solvers work in int64: a value beyond 2**62 or 2**60 bytes live at once is refused at reading (they
    crashed with an OverflowError; a capacity past the branch and bound's range killed its thread with a
    traceback). 2,000 buffers of 1e15 B one after another stay fine."""
    p = tmp_path / "x.csv"
    p.write_text("id,lower,upper,size\n0,0,5,99999999999999999999\n")
    with pytest.raises(ValueError, match="line 2: size 99999999999999999999 is beyond 2\\*\\*62"):
        read_buffers(p)
    p.write_text("id,lower,upper,size\n" + "".join(f"{i},{i % 7},{100 + i % 5},{10 ** 16}\n" for i in range(2000)))
    with pytest.raises(ValueError, match="most bytes live at once \\(about 2e\\+19\\) must stay below 2\\*\\*60"):
        read_buffers(p)
    p.write_text("id,lower,upper,size\n" + "".join(f"{i},{10 * i},{10 * i + 5},{10 ** 15}\n" for i in range(2000)))
    bufs = read_buffers(p)
    res = solve_layout(bufs, time_limit=5)
    assert res.height == res.lower_bound == 10 ** 15 and validate_layout(bufs, res.offsets) == []


def test_exact_search_skips_capacities_beyond_its_range(monkeypatch):
    """A capacity whose sums overflow the branch and bound's int64 arithmetic leaves it out (CP-SAT and the
    heuristics remain) instead of ending its thread with a traceback."""
    import random
    import threading
    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    rng = random.Random(1)
    starts = [rng.randint(0, 1000) for _ in range(1000)]
    bufs = [Buffer(i, a, a + rng.randint(1, 300), rng.randint(1, 10 ** 16)) for i, a in enumerate(starts)]
    res = solve_layout(bufs, time_limit=3)
    assert validate_layout(bufs, res.offsets) == [] and raised == []


def test_csv_from_a_spreadsheet(tmp_path):
    # a byte-order mark, capitalised names with spaces and CRLF line ends read as the plain file does
    p = tmp_path / "x.csv"
    p.write_bytes(b"\xef\xbb\xbfID, Lower, Upper, Size\r\n0,0,4,8\r\n1,2,6,3\r\n")
    assert [(b.id, b.lower, b.upper, b.size) for b in read_buffers(p)] == [(0, 0, 4, 8), (1, 2, 6, 3)]


def test_csv_odd_inputs_are_one_sentence_and_ids_read_back(tmp_path, capsys):
    """A directory (IsADirectoryError's traceback), bytes that are not UTF-8 (the codec's message, naming no
    file), a column named twice (the second was ignored) and a header split by semicolons are refused in one
    sentence; an id "007" or "+1" stays a string (it was read as 7 and written back as "7", and "1" with "01"
    was refused as one id twice); an --out directory is refused before the solve, not after it."""
    p = tmp_path / "x.csv"
    with pytest.raises(ValueError, match="is a directory; give the path of a CSV file"):
        read_buffers(tmp_path)
    _refused(p, b"id,lower,upper,size\n0,0,4,\xff\n", "x.csv is not UTF-8 text")
    _refused(p, "id,lower,upper,size,lower\n0,0,4,8,2\n", "line 1: the header names lower twice")
    _refused(p, "id;lower;upper;size\n0;0;4;8\n", "separated by commas, not ';'")
    p.write_text('id,lower,upper,size\n1,0,4,8\n01,0,4,8\n007,0,4,8\n+1,0,4,8\n"a,b",0,4,8\n')
    bufs = read_buffers(p)
    assert [b.id for b in bufs] == [1, "01", "007", "+1", "a,b"]
    out = tmp_path / "out.csv"
    write_offsets(out, bufs, {b.id: 8 * k for k, b in enumerate(bufs)})
    assert read_buffers(out) == bufs
    assert main(["layout", str(p), "--out", str(tmp_path), "--time-limit", "60"]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_cli(tmp_path, capsys):
    example = tmp_path / "input.12.csv"
    example.write_text(INPUT_12)
    out = tmp_path / "out.csv"
    assert main(["layout", str(example), "--out", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["status"] == "optimal" and d["valid"] and d["height"] == d["lower_bound"] == 12
    assert out.read_text().splitlines()[0] == "id,lower,upper,size,offset"
    assert main(["layout", str(example), "--capacity", "11"]) == 1
    assert capsys.readouterr().out.startswith("layout infeasible: height=")
    bad = tmp_path / "bad.csv"
    bad.write_text("id,lower,upper,size\n0,3,3,1\n")
    assert main(["layout", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err


# -- the exact branch and bound (layout_bnb) --------------------------------------------------------------

_RULES = [f.name for f in dataclasses.fields(LayoutOptions) if f.type in (bool, "bool") and f.name != "cpsat"]


def _random_instance(rng: random.Random, n: int) -> list[Buffer]:
    out = []
    for i in range(n):
        lo = rng.randrange(0, 10)
        out.append(Buffer(i, lo, rng.randint(lo + 1, 11), rng.choice([0, 1, 2, 3, 4, 6, 8]), rng.choice([1, 1, 1, 2, 4])))
    return out


def _perfect_packing(seed: int, n: int, width: int = 64, span: int = 48) -> list[Buffer]:
    """Cut a ``width`` (bytes) x ``span`` (time) rectangle into ``n`` rectangles by random guillotine
    cuts: live bytes == ``width`` at every time, so the only layout at capacity ``width`` is a perfect one."""
    rng = random.Random(seed)
    rects = [(0, span, 0, width)]
    while len(rects) < n:
        rects.sort(key=lambda r: (r[1] - r[0]) * (r[3] - r[2]))
        t0, t1, y0, y1 = rects.pop(rng.randrange(len(rects) // 2, len(rects)))
        if (rng.random() < 0.5 and t1 - t0 > 1) or y1 - y0 < 2:
            c = rng.randint(t0 + 1, t1 - 1)
            rects += [(t0, c, y0, y1), (c, t1, y0, y1)]
        else:
            c = rng.randint(y0 + 1, y1 - 1)
            rects += [(t0, t1, y0, c), (t0, t1, c, y1)]
    return [Buffer(i, t0, t1, y1 - y0) for i, (t0, t1, y0, y1) in enumerate(rects)]


def _search(bufs: list[Buffer], capacity: int, options: LayoutOptions = LayoutOptions(), **kw):
    return search_layout([b.lower for b in bufs], [b.upper for b in bufs], [b.size for b in bufs],
                         [b.alignment for b in bufs], capacity, options, **kw)


def _cpsat(bufs: list[Buffer], capacity: int) -> SearchStatus:
    st, _ = CpsatRun().solve([b.lower for b in bufs], [b.upper for b in bufs], [b.size for b in bufs],
                             [b.alignment for b in bufs], capacity, CpStrategy.DEFAULT, None, 20.0)
    assert st is not SearchStatus.LIMIT
    return st


def test_rules_list_is_every_option():
    assert len(_RULES) == 11 and "dynamic_preorder" in _RULES and "nogood_cache" in _RULES


def test_bnb_agrees_with_cpsat_with_each_rule_off():
    """At the optimum (from CP-SAT) and one below, every rule set gives CP-SAT's answer; all rules on
    prove infeasibility with fewer nodes than all off."""
    rng = random.Random(5)
    variants = [LayoutOptions()] + [LayoutOptions(**{r: False}, preorders=(p,))
                                    for r, p in zip(_RULES, itertools.cycle(Preorder))]
    variants.append(LayoutOptions(**{r: False for r in _RULES}, preorders=(Preorder.TWA,)))
    nodes_on = nodes_off = 0
    for _ in range(10):
        bufs = _random_instance(rng, rng.randint(8, 10))
        opt = lower_bound(bufs)
        while _cpsat(bufs, opt) is not SearchStatus.FOUND:
            opt += 1
        for cap in (opt, opt - 1):
            want = SearchStatus.FOUND if cap == opt else SearchStatus.INFEASIBLE
            for opts in variants:
                res = _search(bufs, cap, opts)
                assert res.status is want, (opts, cap, bufs)
                if res.offsets is not None:
                    assert validate_layout(bufs, dict(enumerate(res.offsets)), cap) == []
                if want is SearchStatus.INFEASIBLE and opts is variants[-1]:
                    nodes_off += res.nodes
                    nodes_on += _search(bufs, cap, LayoutOptions(preorders=(Preorder.TWA,))).nodes
    assert nodes_on < nodes_off


def test_bnb_solves_a_perfect_packing_greedy_cannot():
    bufs = _perfect_packing(3, 100)
    assert lower_bound(bufs) == 64 and min(height(bufs, greedy_layout(bufs, o)) for o in GreedyOrder) > 64
    res = solve_layout(bufs, capacity=64, time_limit=20, options=LayoutOptions(cpsat=False))
    assert res.status is LayoutStatus.OPTIMAL and res.solver == "bnb" and res.height == 64
    assert validate_layout(bufs, res.offsets, 64) == []
    assert _search(bufs, 63).status is SearchStatus.INFEASIBLE


def test_bnb_resumes_across_chunks(monkeypatch):
    """The compiled search stops every ``_CHUNK`` nodes and resumes: same answer, same node count."""
    bufs = _perfect_packing(1, 60)
    one = LayoutOptions(preorders=(Preorder.WAT,))
    whole = [_search(bufs, cap, one) for cap in (64, 63)]
    monkeypatch.setattr(layout_bnb, "_CHUNK", 3)
    chunked = [_search(bufs, cap, one) for cap in (64, 63)]
    assert [r.status for r in whole] == [SearchStatus.FOUND, SearchStatus.INFEASIBLE]
    assert [(r.status, r.offsets, r.nodes) for r in chunked] == [(r.status, r.offsets, r.nodes) for r in whole]


def test_bnb_limits():
    bufs = _perfect_packing(1, 100)
    slow = LayoutOptions(preorders=(Preorder.WAT,), dynamic_preorder=False)
    res = _search(bufs, 64, slow, node_limit=1000)
    assert res.status is SearchStatus.LIMIT and 1000 <= res.nodes <= 1001
    stop = threading.Event()
    stop.set()
    assert _search(bufs, 64, slow, stop=stop).status is SearchStatus.LIMIT
    t0 = time.monotonic()
    assert _search(bufs, 64, slow, deadline=t0 + 0.3).status is SearchStatus.LIMIT
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError, match="preorders"):
        _search(bufs, 64, LayoutOptions(preorders=()))


def test_bnb_large_training_like_chain_within_node_budget():
    """3,700 buffers shaped like a training graph (weights live throughout, a chain of activations,
    saved tensors freed in reverse): found at the lower bound within 2n nodes. Per-node work is
    incremental, so this also stays quick (timings are not asserted)."""
    rng = random.Random(0)
    t = 3000
    bufs = [Buffer(("w", j), 0, t + 1, rng.randint(1, 64)) for j in range(200)]
    bufs += [Buffer(("a", i), i, i + 2, rng.randint(1, 64)) for i in range(t)]
    bufs += [Buffer(("g", i), i, t + 1 - i, rng.randint(1, 8)) for i in range(0, t // 2, 3)]
    lb = lower_bound(bufs)
    r = _search(bufs, lb, node_limit=2 * len(bufs))
    assert r.status is SearchStatus.FOUND and r.nodes <= 2 * len(bufs)
    assert validate_layout(bufs, {b.id: o for b, o in zip(bufs, r.offsets)}, lb) == []


def test_an_unfinished_pass_shares_slots_over_time():
    # a pass out of time places the rest in slots by size class, reused over time, not one stack of all
    rng = np.random.default_rng(3)
    n = 3000
    lo = rng.integers(0, 100_000, n)
    up = lo + 1 + rng.integers(0, 300, n)
    sz = 64 * rng.integers(1, 4096, n)
    bufs = [Buffer(i, int(a), int(b), int(s)) for i, (a, b, s) in enumerate(zip(lo, up, sz))]
    offs = greedy_layout(bufs, deadline=time.monotonic() - 1, finish=True)
    assert validate_layout(bufs, offs) == []
    cls = np.ceil(np.log2(sz)).astype(int)
    most = 0  # each class's slots: the most of its buffers live at once, 2^class bytes each
    for c in np.unique(cls).tolist():
        l, u = lo[cls == c], up[cls == c]
        most += (1 << c) * max(int(((l <= t) & (u > t)).sum()) for t in l.tolist())
    assert lower_bound(bufs) < height(bufs, offs) <= most < int(sz.sum()) // 10
    al = rng.choice([1, 256, 4096], n)
    fl = rng.integers(0, 1000, n)
    at = slot_stack(lo, up, sz, al, fl, 12_345)
    bufs = [Buffer(i, int(a), int(b), int(s), int(g)) for i, (a, b, s, g) in enumerate(zip(lo, up, sz, al))]
    assert validate_layout(bufs, dict(enumerate(at.tolist()))) == [] and (at >= np.maximum(fl, 12_345)).all()
    off = place_in_order(lo, up, sz, al, fl, np.argsort(-sz), deadline=time.monotonic() - 1, finish=True)
    assert validate_layout(bufs, dict(enumerate(off.tolist()))) == []


def test_alignments_larger_than_sizes_raise_the_bound_and_it_holds():
    """``layout_bound.aligned_bound``: ten 64-byte buffers live together, each at a multiple of 4096, need
    9 x 4096 + 64 B, not 640 (the layout meets it: optimal); on random small instances with alignments above
    their sizes the branch and bound proves that nothing fits one byte below the bound."""
    from rhino.memory.layout_bnb import SearchStatus, search_layout
    bufs = [Buffer(i, 0, 5, 64, 4096) for i in range(10)]
    res = solve_layout(bufs, time_limit=5)
    assert res.lower_bound == 9 * 4096 + 64 == res.height and res.status.value == "optimal"
    rng = random.Random(21)
    raised = 0
    for _ in range(30):
        bufs = []
        for i in range(9):
            a = rng.randint(0, 6)
            bufs.append(Buffer(i, a, a + rng.randint(1, 5), rng.choice([8, 24, 40, 100]), rng.choice([1, 16, 64, 128])))
        lb = lower_bound(bufs)
        raised += lb > max(sum(b.size for b in bufs if b.lower <= t < b.upper) for t in range(12))
        res = search_layout([b.lower for b in bufs], [b.upper for b in bufs], [b.size for b in bufs],
                            [b.alignment for b in bufs], lb - 1)
        assert res.status is SearchStatus.INFEASIBLE
    assert raised >= 10
