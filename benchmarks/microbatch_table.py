"""Gradient accumulation against PyTorch's accumulation loop: every example x {dp=2, dp=2,tp=2} with
microbatches=4, real processes (gloo), float64, every rank compared (``rhino run``). Prints a Markdown
table for docs/benchmarks.md.

    PYTHONPATH=src python benchmarks/microbatch_table.py [STRATEGY ...]   (default: the two above)
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ["mlp", "gpt", "llama", "bert", "resnet", "unet", "unet_batchnorm", "moe"]
STRATEGIES = ["dp=2,microbatches=4", "dp=2,tp=2,microbatches=4"]


def run(name: str, strategy: str) -> dict:
    nproc = 2 if "tp" not in strategy else 4
    cmd = [sys.executable, "-m", "rhino.cli.main", "run", f"{ROOT}/tests/workloads/microbatch.py:{name}",
           "--nproc", str(nproc), "--strategy", strategy, "--dtype", "float64", "--steps", "2", "--json",
           "--timeout", "600"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    out = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {"ok": False, "first_mismatch": p.stderr[-300:]}
    out["wall"] = time.perf_counter() - t0
    return out


def main() -> None:
    print("| workload (batch) | strategy | ranks | ok | max abs diff vs accumulation loop | losses (2 steps) | wall s |")
    print("|---|---|---|---|---|---|---|")
    for name in WORKLOADS:
        for strategy in sys.argv[1:] or STRATEGIES:
            r = run(name, strategy)
            losses = ", ".join(f"{x:.6f}" for x in r.get("losses", []))
            print(f"| {name} | {strategy} | {r.get('nproc', '-')} | {'yes' if r['ok'] else 'NO: ' + str(r.get('first_mismatch'))} "
                  f"| {r.get('max_abs_diff', float('nan')):.2g} | {losses} | {r['wall']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
