"""Predicted vs measured step time and bubble (idle) fraction of pipelined plans on this CPU.

    python benchmarks/estimate_cpu_pipeline.py [--model gpt] [--out docs/benchmarks.md]

For each workload (the sizes of ``benchmarks/estimate_cpu.py``) and each pipelined strategy (``pp=2`` with
2/4/8 micro-batches, 1F1B and GPipe, and interleaved 1F1B with 2 chunks per device): ``rhino profile``
numbers are measured on 2 concurrent processes (one torch thread each, as ``rhino run`` sets on this
2-core machine), then every strategy runs for real on 2 gloo processes (one launch per workload:
``runtime.pipeline.PipelineStep.run``, point-to-point boundary values), and is predicted by ``estimate`` on
``cpu:2`` with that profile (the same plan: ``preset_plan``, same stage cut and schedule).

Measured: the median over ``STEPS`` steps after ``WARMUP`` untimed ones of the slowest rank's step
(``busy + idle`` of ``StepTimes``), and the idle fraction ``sum idle / sum (busy + idle)`` over both
ranks and the timed steps (busy: seconds inside stage programs; idle: everything else of the step, i.e.
waiting for boundary values, the schedule's fill and drain, posting messages, the loss broadcast).
Predicted: ``Estimate.step_seconds`` and the model's idle fraction over the whole step
(``PipelineTime.step_idle_fraction``: the same definition, programs = forward, backward and update).
Writes the section "Cost model: pipelines on CPU" of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from estimate_cpu import WORKLOADS, _capture  # noqa: E402  (same workloads and capture)

TIME_TARGET, BUBBLE_TARGET = 0.30, 0.10
STRATEGIES = [f"pp=2,microbatches={m}" + s for s in ("", ",schedule=gpipe") for m in (2, 4, 8)] + \
    ["pp=2,microbatches=4,schedule=interleaved,chunks=2", "pp=2,microbatches=8,schedule=interleaved,chunks=2"]
WARMUP = 2   # untimed steps: the first steps of a process pay for page faults and allocator growth
STEPS = 5


def rank_steps(ctx, graph_json: str, runs: list, state: dict, batch: tuple):
    """Per plan of ``runs`` on this rank: (its ``PipelineStep``, the rank's local state, its local batch)."""
    from rhino.ir.graph import Graph
    from rhino.lower.spmd_ops import set_context
    from rhino.runtime.collectives import TORCH_COLLECTIVES
    from rhino.runtime.groups import build_stage_groups
    from rhino.runtime.pipeline import PipelineStep
    from rhino.runtime.pipeline_run import pipeline_rank_state
    from rhino.sharding.plan import ShardingPlan
    graph = Graph.from_json(graph_json)
    groups = None
    for plan_json, micro_json in runs:
        plan = ShardingPlan.from_json(plan_json)
        groups = groups or build_stage_groups(plan.mesh, plan.stages, 600)
        step = PipelineStep(graph, plan, ctx.rank, ctx.device, micro_graph=Graph.from_json(micro_json))
        set_context(plan.mesh, step.local, groups, TORCH_COLLECTIVES)
        yield step, pipeline_rank_state(step, state, ctx.device), step.local_batch(batch)


def _rank_main(ctx, graph_json: str, runs: list, state: dict, batch: tuple) -> list[list[tuple]]:
    """Per plan: (busy, idle, waiting, posting) of each timed step on this rank."""
    out = []
    for step, local, b in rank_steps(ctx, graph_json, runs, state, batch):
        for _ in range(WARMUP + STEPS):
            step.run(local, b)
        out.append([(t.busy, t.idle, t.waiting, t.posting) for t in step.times[WARMUP:]])
    return out


def _measure(cap, plans: list) -> list[dict]:
    """Per plan: median slowest-rank step seconds, idle fraction, and per rank busy / waiting / posting / other
    seconds per step (medians)."""
    from rhino.runtime.launch import launch
    from rhino.runtime.rank_step import microbatch_graph
    runs = [(p.to_json(), microbatch_graph(cap, p.microbatches).to_json()) for p in plans]
    ranks = launch(_rank_main, 2, cap.graph.to_json(), runs, cap.initial_state(),
                   tuple(b.detach() for b in cap.workload.batch), timeout_s=1200)
    out = []
    for k in range(len(plans)):
        per = [r[k] for r in ranks]
        step = statistics.median(max(t[0] + t[1] for t in ts) for ts in zip(*per))
        busy = sum(t[0] for ts in per for t in ts)
        idle = sum(t[1] for ts in per for t in ts)
        detail = [tuple(statistics.median(t[j] for t in ts) for j in range(4)) for ts in per]
        out.append({"step": step, "idle": idle / (busy + idle),
                    "ranks": [{"busy": b, "waiting": w, "posting": p, "other": i - w - p} for b, i, w, p in detail]})
    return out


def main() -> int:
    from rhino.benchmarks_doc import priority_note, replace_section
    from rhino.cost.cluster import parse_cluster
    from rhino.cost.estimate import estimate
    from rhino.cost.step import StepOptions
    from rhino.runtime.profile import measure_profile
    from rhino.sharding.presets import parse_strategy, preset_plan
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--model", action="append", choices=[v[0] for v in WORKLOADS.values()])
    ap.add_argument("--strategy", action="append", help="only these strategies (repeatable)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    strategies = args.strategy or STRATEGIES
    t0 = time.perf_counter()
    rows, worst_t, worst_b = [], 0.0, 0.0
    for label, (name, kw) in WORKLOADS.items():
        if args.model and name not in args.model:
            continue
        cap = _capture(name, kw)
        plans = [preset_plan(cap.graph, parse_strategy(s)) for s in strategies]
        prof = measure_profile(nproc=2)     # right before this workload's runs: the same load hits both
        cluster, cost = prof.apply(parse_cluster("cpu:2"))
        print(f"{label}: profile matmul {prof.matmul_flops / 1e9:.1f} GFLOP/s, point-to-point "
              f"{prof.p2p_bandwidth / 1e9:.2f} GB/s {prof.p2p_latency_s * 1e6:.0f} us, "
              f"{prof.p2p_message_s * 1e6:.0f} us per message end [load {os.getloadavg()[0]:.1f}]", flush=True)
        measured = _measure(cap, plans)
        for s, plan, meas in zip(strategies, plans, measured):
            mt, mi = meas["step"], meas["idle"]
            est = estimate(cap.graph, cluster, plan, options=StepOptions(profile=cost))
            pt, pi = est.step_seconds, est.step_idle_fraction
            print("   measured per rank (ms/step): " + "; ".join(
                f"busy {r['busy'] * 1e3:.1f} waiting {r['waiting'] * 1e3:.1f} posting {r['posting'] * 1e3:.1f} "
                f"other {r['other'] * 1e3:.1f}"
                for r in meas["ranks"]) + " | predicted busy per stage (ms/step): " + ", ".join(
                f"{(st['forward_seconds'] + st['backward_seconds']) * plan.microbatches * 1e3:.1f}"
                for st in est.stages), flush=True)
            worst_t, worst_b = max(worst_t, abs(pt / mt - 1)), max(worst_b, abs(pi - mi))
            rel = abs(pi - mi) / mi if mi else 0.0
            rows.append(f"| {label} | {s} | {mt * 1e3:.1f} | {pt * 1e3:.1f} | {pt / mt:.2f} | {mi:.3f} | {pi:.3f} | "
                        f"{pi - mi:+.3f} ({rel:.0%}) |")
            print(rows[-1], f"[load {os.getloadavg()[0]:.1f}]", flush=True)
    load = os.getloadavg()
    cmd = " ".join(["PYTHONPATH=src python benchmarks/estimate_cpu_pipeline.py"] + sys.argv[1:])
    body = [f"Command: `{cmd}` ({time.perf_counter() - t0:.0f} s, {priority_note()}; 2 gloo processes of one "
            f"torch thread each on {os.cpu_count()} cores; load average {load[0]:.1f} / {load[1]:.1f} (1 / 5 min) at the end, from "
            "other processes sharing the machine).", "",
            "Measured: median over "
            f"{STEPS} steps after {WARMUP} untimed ones of the slowest rank's step (`PipelineStep.run`: "
            "point-to-point boundary values over gloo) and the idle fraction `sum idle / sum (busy + idle)` over "
            "both ranks (busy: time inside stage programs). Predicted: `estimate` on `cpu:2` with the `rhino "
            "profile` numbers of 2 concurrent processes measured first, the same plan (`preset_plan`: stage cut "
            "and schedule); idle: the model's idle share of the whole step (`step_idle_fraction`). Bubble error: "
            "predicted - measured idle fraction (absolute, and relative to the measured one).", "",
            "| workload | strategy | measured (ms) | predicted (ms) | pred / meas | idle measured | idle predicted "
            "| idle error |", "|---|---|---:|---:|---:|---:|---:|---:|", *rows, "",
            f"Largest step-time error: {worst_t:.0%} (target {TIME_TARGET:.0%}); largest idle-fraction error: "
            f"{worst_b:.3f} absolute (target {BUBBLE_TARGET})."]
    if not args.no_write:
        replace_section(args.out, "Cost model: pipelines on CPU", "\n".join(body))
    print("\n".join(body[-1:]))
    return 0 if worst_t <= TIME_TARGET and worst_b <= BUBBLE_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
