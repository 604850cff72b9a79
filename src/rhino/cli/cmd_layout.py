"""``rhino layout FILE.csv [--capacity C] [--time-limit S] [--out OUT.csv] [--json]``."""
from __future__ import annotations

import os

from ..atomic import check_file_target
from .common import emit_json, status


def add_parser(sub) -> None:
    p = sub.add_parser("layout", help="lay out buffers with fixed lifetimes in one arena (MiniMalloc CSV)")
    p.add_argument("csv", metavar="FILE.csv", help="id,lower,upper,size[,alignment] rows (half-open lifetimes; without id, rows are numbered from 0)")
    p.add_argument("--capacity", type=int, help="find a layout within this many bytes (else minimise the height)")
    p.add_argument("--time-limit", type=float, default=60.0,
                   help="seconds for the whole run, from the process start (default 60)")
    p.add_argument("--out", help="write the instance with an offset column here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


#: share of ``--time-limit`` kept for the solver's last pass past its deadline (see ``run``)
FINISH_SHARE = 0.04


def run(args) -> int:
    from ..memory.layout import LayoutStatus, solve_layout
    from ..memory.layout_io import read_buffers, write_offsets
    if args.capacity is not None and args.capacity < 0:
        raise ValueError(f"--capacity must be >= 0, got {args.capacity}")
    if args.time_limit <= 0:
        raise ValueError(f"--time-limit must be positive, got {args.time_limit}")
    if args.out:  # its directory missing, or a directory: refused before the solve, not after it
        check_file_target(args.out)
    bufs = read_buffers(args.csv)
    # the limit covers the whole run: start-up and reading so far, and half of that for writing the output
    # after the solver (1,000,000 buffers: 1.7-2.0 s to start and read, 0.8 s to write), plus FINISH_SHARE
    # of the limit: the solver may end its last pass past its deadline (measured: the training traces of
    # benchmarks/layout_scale.py ended 1.0-1.1 s past it with the revisit search, walls 60.9 and 61.0 s at
    # --time-limit 60 before this reserve)
    read_s = _since_start()
    left = max(0.1, args.time_limit * (1 - FINISH_SHARE) - 1.5 * read_s)
    res = solve_layout(bufs, args.capacity, left, progress=lambda m: status(m, not args.json))
    valid = res.valid  # ``validate_layout`` in ``solve_layout``, at the capacity when it says the layout fits
    # solved only when the independent validator passes the layout at the capacity
    fits = res.status in (LayoutStatus.OPTIMAL, LayoutStatus.FEASIBLE) and valid
    if args.out and fits:
        write_offsets(args.out, bufs, res.offsets)
    if args.json:
        emit_json({"ok": fits, "status": res.status.value, "height": res.height, "lower_bound": res.lower_bound,
                   "seconds": round(res.seconds, 3), "valid": valid, "buffers": len(bufs), "solver": res.solver,
                   "out": args.out if fits else None})
    else:
        print(f"layout {res.status.value if valid else 'INVALID'}: height={res.height} "
              f"lower_bound={res.lower_bound} seconds={res.seconds:.2f}")
    return 0 if fits else 1


def _since_start() -> float:
    """Seconds since this process started (Linux ``/proc``; 0 where it is not there)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
    except OSError:
        return 0.0
    return max(0.0, up - ticks / os.sysconf("SC_CLK_TCK"))
