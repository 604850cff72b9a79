"""MiniMalloc's "challenging" instances at their capacity: ``rhino layout FILE --capacity C --time-limit 60``.

Each instance runs the CLI in a child process (``--json``: status, height, lower bound, seconds, solver);
the CLI does not print branch-and-bound nodes, so the nodes column comes from an in-process
``solve_layout`` with the same arguments (a second run). Writes the section "Memory layout: MiniMalloc
challenging instances" of docs/benchmarks.md.

    .venv/bin/python benchmarks/minimalloc.py [INSTANCES_DIR] [--capacity 1048576] [--time-limit 60]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from rhino.benchmarks_doc import replace_section
from rhino.memory.layout import solve_layout
from rhino.memory.layout_io import read_buffers

ROOT = Path(__file__).resolve().parents[1]
TITLE = "Memory layout: MiniMalloc challenging instances"


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "rhino"
    if script.is_file():
        return [str(script)]
    exe = shutil.which("rhino")
    return [exe] if exe else [sys.executable, "-m", "rhino.cli.main"]


def run_instance(path: Path, capacity: int, time_limit: float) -> dict:
    cmd = [*_cli(), "layout", str(path), "--capacity", str(capacity), "--time-limit", str(time_limit), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=time_limit + 120)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr[-2000:]}")
    row = json.loads(out.stdout)
    row["nodes"] = solve_layout(read_buffers(path), capacity, time_limit).nodes
    row["load"] = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("instances", nargs="?", default=str(ROOT.parent / "shared/data/minimalloc/challenging"))
    ap.add_argument("--capacity", type=int, default=1048576)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--doc", default=str(ROOT / "docs/benchmarks.md"))
    args = ap.parse_args(argv)
    files = sorted(Path(args.instances).glob(f"*.{args.capacity}.csv"))
    if not files:
        raise FileNotFoundError(f"no *.{args.capacity}.csv instances in {args.instances}")
    rows = []
    for f in files:
        r = run_instance(f, args.capacity, args.time_limit)
        rows.append((f.name.split(".")[0], r))
        print(f"{f.name}: {r['status']} height={r['height']} seconds={r['seconds']} solver={r['solver']} "
              f"nodes={r['nodes']} load={r['load']}", flush=True)
    solved = sum(r["ok"] and r["valid"] and r["height"] <= args.capacity for _, r in rows)
    body = [f"Command, per instance: `rhino layout <dir>/X.{args.capacity}.csv --capacity {args.capacity} "
            f"--time-limit {args.time_limit:g}` (written by `benchmarks/minimalloc.py`). Instances: MiniMalloc's "
            f"`challenging` set (github google/minimalloc, Apache-2.0). Seconds are those the CLI reports "
            f"(after reading the CSV; they include about 1 s per process to load the compiled search from numba's "
            f"cache); nodes are branch-and-bound nodes from a second, in-process run. "
            f"Machine: {os.cpu_count()} cores, shared (1-minute load average at each row).",
            "", f"Solved {solved} of {len(rows)} within {args.time_limit:g} s. "
            f"Date: {datetime.date.today().isoformat()}.", "",
            "| instance | buffers | lower bound | status | height | seconds | solver | nodes | load |",
            "|---|---:|---:|---|---:|---:|---|---:|---:|"]
    for name, r in rows:
        body.append(f"| {name} | {r['buffers']} | {r['lower_bound']} | {r['status']} | {r['height']} | "
                    f"{r['seconds']:.2f} | {r['solver']} | {r['nodes']} | {r['load']} |")
    replace_section(args.doc, TITLE, "\n".join(body))
    return 0 if solved == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
