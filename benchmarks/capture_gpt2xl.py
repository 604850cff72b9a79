"""Capture cost at GPT-2 XL size: ``rhino capture examples/gpt.py:gpt2_xl --json`` in a child process.

The workload lives on the meta device, so capture allocates no parameter
memory. Measured per run: wall seconds of the child (start to exit, including
Python and torch imports), its peak resident set size (``ru_maxrss`` of that
child, from ``os.wait4``), and from its JSON output the node count, parameter
count and the capture seconds Rhino reports itself.

    .venv/bin/python benchmarks/capture_gpt2xl.py [--repeat 1] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = "examples/gpt.py:gpt2_xl"
TARGET_S, TARGET_GB = 30.0, 3.0


def _command() -> list[str]:
    script = Path(sys.executable).parent / "rhino"
    if script.is_file():
        return [str(script), "capture", SPEC, "--json"]
    exe = shutil.which("rhino")
    return [exe, "capture", SPEC, "--json"] if exe else [sys.executable, "-m", "rhino.cli.main", "capture", SPEC,
                                                          "--json"]


def run_once(cmd: list[str], timeout: float) -> dict:
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err)
        try:
            out = proc.stdout.read()  # small: one JSON line
            deadline = t0 + timeout
            while True:  # wait4 with a deadline: poll, so a hung child is killed
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.perf_counter() > deadline:
                    proc.kill()
                    pid, status, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.01)
        finally:
            proc.stdout.close()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}:\n{stderr[-2000:]}\n{out.decode()[-2000:]}")
    lines = [ln for ln in out.decode().splitlines() if ln.startswith("{")]
    data = json.loads(lines[-1])
    if not data.get("ok"):
        raise SystemExit(f"capture failed: {data.get('error')}")
    rss_gb = usage.ru_maxrss * 1024 / 1e9  # Linux: kilobytes
    return {"nodes": data["nodes"], "params": data["params"], "capture_s": data["seconds"], "wall_s": wall,
            "peak_rss_gb": rss_gb, "fingerprint": data.get("fingerprint")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=1, help="runs (medians are reported; default 1)")
    p.add_argument("--timeout", type=float, default=600, help="kill a run after this many seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)

    cmd = _command()
    runs = [run_once(cmd, args.timeout) for _ in range(args.repeat)]
    med = {k: statistics.median(r[k] for r in runs) for k in ("capture_s", "wall_s", "peak_rss_gb")}
    result = {"command": " ".join([Path(cmd[0]).name if cmd[0].endswith("rhino") else cmd[0]] + cmd[1:]),
              "nodes": runs[0]["nodes"], "params": runs[0]["params"], **med,
              "runs": runs, "target_s": TARGET_S, "target_gb": TARGET_GB,
              "pass": med["wall_s"] <= TARGET_S and med["peak_rss_gb"] <= TARGET_GB,
              "env": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['command']}  ({args.repeat} run(s), medians)")
    print()
    print("| workload | nodes | params | capture s (reported) | wall s | peak RSS GB | target |")
    print("|---|---:|---:|---:|---:|---:|---|")
    mark = "ok" if result["pass"] else "MISSED"
    print(f"| {SPEC} | {result['nodes']:,} | {result['params']:,} | {med['capture_s']:.2f} | {med['wall_s']:.2f} | "
          f"{med['peak_rss_gb']:.2f} | <= {TARGET_S:g} s, <= {TARGET_GB:g} GB {mark} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
