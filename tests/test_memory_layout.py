"""Layout of buffers with fixed lifetimes: the validator, the bound, greedy and exact solvers, CSV, CLI."""
from __future__ import annotations

import itertools
import json
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rhino.cli.main import main
from rhino.memory.layout import (Buffer, GreedyOrder, LayoutStatus, greedy_layout, height, lower_bound,
                                 solve_layout, validate_layout)
from rhino.memory.layout_io import read_buffers

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


def test_time_limit_still_returns_a_valid_layout():
    bufs = [Buffer(i, i % 7, i % 7 + 3 + i % 5, 1 + (i * 37) % 17) for i in range(120)]
    res = solve_layout(bufs, time_limit=0.2)
    assert validate_layout(bufs, res.offsets) == [] and res.height >= res.lower_bound


def test_csv_errors_name_the_line(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("id,lower,upper,size\n0,0,4,8\n1,9,5,3\n")
    with pytest.raises(ValueError, match="x.csv line 3: upper \\(5\\) must be greater than lower \\(9\\)"):
        read_buffers(p)
    p.write_text("id,lower,upper,size\n0,0,4,-8\n")
    with pytest.raises(ValueError, match="line 2: size"):
        read_buffers(p)
    p.write_text("id,lower,upper,size\n0,0,4\n")
    with pytest.raises(ValueError, match="line 2: 3 fields"):
        read_buffers(p)
    p.write_text("id,lower,size\n")
    with pytest.raises(ValueError, match="header lacks upper"):
        read_buffers(p)


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
