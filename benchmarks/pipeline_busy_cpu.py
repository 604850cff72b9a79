"""Per device of a pipelined step: the cost model's forward / backward seconds per micro-batch against the
CPU seconds the stage programs take, on a machine other processes load.

    PYTHONPATH=src python benchmarks/pipeline_busy_cpu.py [--model mlp] [--strategy pp=2,microbatches=8]

Wall-clock timings on a shared machine drift with the load (``estimate_cpu_pipeline.py`` needs a quiet
one); this check counts CPU time instead. The ``rhino profile`` numbers are measured in this process (one
thread, ``measure_profile(nproc=1, threads=1)``) with the profile's timer replaced by this thread's CPU
clock (``time.thread_time``), then each strategy runs on 2 gloo processes (``PipelineStep.run``) and
every stage program call is timed with the thread's CPU clock (median over 5 steps after 3 untimed ones).
Printed per device: measured and predicted forward seconds per micro-batch, backward seconds per micro-batch
(the mean over the step's micro-batches: the later ones accumulate), and predicted / measured. It checks
the pricing of the programs (compute, the thin-GEMM factor, the gradient accumulation), not waiting or
the schedule; a single-process profile does not see the other rank's use of shared caches and memory,
so the ratios sit below 1 by that much at every micro-batch count. Prints only; writes nothing.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from estimate_cpu import WORKLOADS, _capture  # noqa: E402  (same workloads and capture)
from estimate_cpu_pipeline import rank_steps  # noqa: E402  (same per-rank set-up)

STRATEGIES = ["pp=2,microbatches=2", "pp=2,microbatches=8", "pp=2,microbatches=8,schedule=interleaved,chunks=2"]
WARMUP, STEPS = 3, 5


def _rank_main(ctx, graph_json: str, runs: list, state: dict, batch: tuple) -> list[dict]:
    """Per plan: program key -> median thread-CPU seconds per call."""
    out = []
    for step, local, b in rank_steps(ctx, graph_json, runs, state, batch):
        for _ in range(WARMUP):
            step.run(local, b)
        calls = collections.defaultdict(list)
        for key, prog in step.programs.items():
            def timed(*args, _call=prog.module.forward, _key=key):
                t0 = time.thread_time()
                result = _call(*args)
                calls[_key].append(time.thread_time() - t0)
                return result
            prog.module.forward = timed          # an instance attribute over the GraphModule's method
        for _ in range(STEPS):
            step.run(local, b)
        for prog in step.programs.values():
            del prog.module.forward
        out.append({k: statistics.median(v) for k, v in calls.items()})
    return out


def _cpu_clock_profile():
    import rhino.runtime.profile as profile
    wall = profile.time.perf_counter
    profile.time.perf_counter = time.thread_time
    try:
        return profile.measure_profile(nproc=1, threads=1)
    finally:
        profile.time.perf_counter = wall


def main() -> int:
    import torch
    from rhino.cost.cluster import parse_cluster
    from rhino.cost.estimate import estimate
    from rhino.cost.step import StepOptions
    from rhino.runtime.launch import launch
    from rhino.runtime.rank_step import microbatch_graph
    from rhino.sharding.presets import parse_strategy, preset_plan
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", choices=[v[0] for v in WORKLOADS.values()])
    ap.add_argument("--strategy", action="append", help="only these strategies (repeatable)")
    args = ap.parse_args()
    strategies = args.strategy or STRATEGIES
    torch.set_num_threads(1)
    for label, (name, kw) in WORKLOADS.items():
        if args.model and name not in args.model:
            continue
        cap = _capture(name, kw)
        prof = _cpu_clock_profile()
        cluster, cost = prof.apply(parse_cluster("cpu:2"))
        thin = getattr(prof, "thin_gemm_d0", None)     # None: a checkout from before the thin-GEMM factor
        print(f"{label}: profile (CPU clock) matmul {prof.matmul_flops / 1e9:.1f} GFLOP/s, k0 {prof.k0:.3g}, thin-GEMM "
              f"d0 {'not measured' if thin is None else f'{thin:.1f}'} [load {os.getloadavg()[0]:.1f}]", flush=True)
        plans = [preset_plan(cap.graph, parse_strategy(s)) for s in strategies]
        runs = [(p.to_json(), microbatch_graph(cap, p.microbatches).to_json()) for p in plans]
        ranks = launch(_rank_main, 2, cap.graph.to_json(), runs, cap.initial_state(),
                       tuple(b.detach() for b in cap.workload.batch), timeout_s=1200)
        for k, (s, plan) in enumerate(zip(strategies, plans)):
            est = estimate(cap.graph, cluster, plan, options=StepOptions(profile=cost))
            print(f"  {s} [load {os.getloadavg()[0]:.1f}]")
            for d, per_rank in enumerate(ranks):
                med = per_rank[k]
                m = plan.microbatches
                f = sum(v for (key, first, _), v in med.items() if key == "F" and first)
                b_first = sum(v for (key, first, _), v in med.items() if key == "B" and first)
                b_later = sum(v for (key, first, _), v in med.items() if key == "B" and not first)
                b = (b_first + (m - 1) * b_later) / m if b_later else b_first   # the step's mean, as predicted
                pf, pb = est.stages[d]["forward_seconds"], est.stages[d]["backward_seconds"]
                print(f"    device {d}: forward per micro-batch {f * 1e3:.2f} ms measured, {pf * 1e3:.2f} predicted "
                      f"({pf / f:.2f}); backward {b * 1e3:.2f} / {pb * 1e3:.2f} ({pb / b:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
