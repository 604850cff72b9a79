"""Predicted vs measured per-rank peak of live tensor bytes, every example x preset, on 4 gloo processes.

    python benchmarks/memory_accuracy.py [--out docs/benchmarks.md]

Each plan runs for real, in float64 (``run_plan(..., measure=True)``: the first step executes node by node
and counts the distinct tensor storages alive); the prediction is ``cost.memory.estimate_memory`` on the
same resolved plan. Writes the section "Cost model: memory" of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["mlp", "gpt", "llama", "bert", "resnet", "unet", "moe"]
PRESETS = ["dp=4", "dp=4,zero=3", "tp=4", "dp=2,tp=2", "dp=2,tp=2,sp=on"]


def measure(name: str, strategy: str):
    from rhino.capture import capture, load_workload
    from rhino.cost.memory import estimate_memory
    from rhino.runtime.run import run_plan
    from rhino.sharding.plan import resolve
    from rhino.sharding.presets import parse_strategy, preset_plan
    import torch
    from rhino.capture import default_dtype
    with default_dtype(torch.float64):    # equality where float32 noise cannot hide a wrong rule (or fail a right one)
        cap = capture(load_workload(str(ROOT / "examples" / f"{name}.py")))
    spec = parse_strategy(strategy)
    plan = preset_plan(cap.graph, spec)
    rp = resolve(cap.graph, plan)
    r = run_plan(cap, plan, spec.world, steps=1, measure=True)
    est = [estimate_memory(cap.graph, rp, k).peak for k in range(spec.world)]
    return r.ok, r.peak_live_bytes, est


def main() -> int:
    from rhino.benchmarks_doc import replace_section
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args()
    rows, worst = [], 0.0
    for name in EXAMPLES:
        for strategy in PRESETS:
            t = time.perf_counter()
            ok, measured, est = measure(name, strategy)
            err = max(abs(e / m - 1) for e, m in zip(est, measured))
            worst = max(worst, err)
            print(f"{name:7s} {strategy:16s} ok={ok} measured={max(measured)} predicted={max(est)} "
                  f"worst rank error {err:.2%} ({time.perf_counter() - t:.1f}s)", flush=True)
            rows.append(f"| {name} | {strategy} | {'OK' if ok else 'FAIL'} | {max(measured):,} | {max(est):,} | "
                        f"{err:.2%} |")
    body = ["Command: `python benchmarks/memory_accuracy.py` (4 gloo processes on this 2-core machine).", "",
            "Peak of live tensor bytes per rank, float64: measured while the plan runs (each rank's first step runs "
            "node by node and counts the distinct storages alive; the state an update replaces is handed to it and "
            "dies at its last use, as in training), predicted by `estimate_memory` on the same plan; run: every "
            "rank's losses and state equal single-device training. "
            "Error: the largest |predicted / measured - 1| over the ranks.", "",
            "| example | preset | run | measured peak (B, max rank) | predicted peak (B) | error |",
            "|---|---|---|---:|---:|---:|", *rows, "", f"Worst error: {worst:.2%} (target 5%)."]
    replace_section(args.out, "Cost model: memory", "\n".join(body))
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
