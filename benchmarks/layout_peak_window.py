"""A clipped window around a trace's peak, laid out three ways side by side (#14, session 18).

Cutting every lifetime to ``[a, b)`` relaxes a layout problem and keeps the max-load bound when the peak
is inside, so a window that cannot be laid out within 1% of the bound would show the whole trace cannot.
Session 17 found no layout within 1% on ``wide-3``'s windows of 1,412 and 2,129 buffers (branch and bound,
CP-SAT, the skyline squeaky wheel) and wrote that such a window was beyond every method here. Per window:

- ``before``: ``solve_layout`` without the peak split (``PeakOptions(enabled=False)``), ``2 * --seconds``;
- ``solve_layout``: with it (the default since session 18), the same time;
- ``peak_split``: the split alone (``memory.layout_peak``) for the same time.

Every layout is checked by ``memory.layout.validate_layout``. Prints one JSON object per window:

    .venv/bin/python benchmarks/layout_peak_window.py wide-3 --window 31600:33100 --window 31000:33700 \\
        --window 30360:34361 --seconds 10

A trace is a CSV path or a ``benchmarks/layout_scale.py`` name (written to ``--dir``). Without
``--window``: 750 steps either side of the trace's peak.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from layout_scale import make_trace  # noqa: E402
from rhino.memory.layout import Buffer, LayoutOptions, solve_layout, validate_layout  # noqa: E402
from rhino.memory.layout_peak import PeakOptions, peak_split, peak_time  # noqa: E402


def clip(rows: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lifetimes cut to ``[a, b)`` of the buffers live in it (columns id, lower, upper, size)."""
    live = (rows[:, 1] < b) & (rows[:, 2] > a)
    return np.maximum(rows[live, 1], a), np.minimum(rows[live, 2], b), rows[live, 3]


def _gap(h: int, bound: int) -> float:
    return round(100 * (h / bound - 1), 3)


def window_row(rows: np.ndarray, a: int, b: int, seconds: float) -> dict:
    lo, up, sz = clip(rows, a, b)
    bufs = [Buffer(i, int(x), int(y), int(s)) for i, (x, y, s) in enumerate(zip(lo, up, sz))]
    t = peak_time(lo, up, sz)
    clique = (lo <= t) & (up > t)
    bound = int(sz[clique].sum())  # the max-load bound: the bytes live at the peak
    row = {"window": [a, b], "buffers": len(bufs), "peak_time": t, "clique": int(clique.sum()), "lower_bound": bound}
    for name, opts in (("before", LayoutOptions(peak=PeakOptions(enabled=False))), ("solve_layout", LayoutOptions())):
        res = solve_layout(bufs, time_limit=2 * seconds, options=opts)
        row[name] = {"height": res.height, "gap_pct": _gap(res.height, bound), "solver": res.solver,
                     "seconds": round(res.seconds, 1), "valid": res.valid}
    t0 = time.monotonic()
    n = len(sz)
    off, h, passes = peak_split(lo, up, sz, np.ones(n, np.int64), np.zeros(n, np.int64), bound,
                                t0 + 2 * seconds)
    row["peak_split"] = {"height": h, "gap_pct": _gap(h, bound), "passes": passes,
                         "seconds": round(time.monotonic() - t0, 1),
                         "valid": off is not None and not validate_layout(bufs, dict(enumerate(off.tolist())))}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", help="a CSV (id,lower,upper,size) or a benchmarks/layout_scale.py trace name")
    p.add_argument("--window", action="append", default=[], metavar="A:B",
                   help="a window [A, B) of times (repeatable; default: 750 steps either side of the peak)")
    p.add_argument("--seconds", type=float, default=10.0,
                   help="each of the three runs gets twice this (default 10: 20 s a run)")
    p.add_argument("--dir", type=Path, default=Path("/tmp/rhino_layout_scale"), help="where named traces go")
    args = p.parse_args(argv)
    path = Path(args.trace)
    if not path.exists():
        args.dir.mkdir(parents=True, exist_ok=True)
        try:
            path = make_trace(args.trace, args.dir)
        except ValueError as e:
            p.error(str(e))
    rows = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
    windows = []
    for w in args.window:
        a, sep, b = w.partition(":")
        if not (sep and a.lstrip("-").isdigit() and b.lstrip("-").isdigit() and int(a) < int(b)):
            p.error(f"--window {w!r}: write A:B with integers A < B")
        windows.append((int(a), int(b)))
    if not windows:
        t = peak_time(rows[:, 1], rows[:, 2], rows[:, 3])
        windows = [(t - 750, t + 751)]
    for a, b in windows:
        if not ((rows[:, 1] < b) & (rows[:, 2] > a)).any():
            p.error(f"--window {a}:{b}: no buffer is live in it")
        print(json.dumps(window_row(rows, a, b, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
