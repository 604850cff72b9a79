"""Megatron-LM's published 3D configurations against ``rhino plan`` (issue #12).

    python benchmarks/megatron_3d.py [--rows 39.1B,175B,1T] [--level O1] [--out docs/benchmarks.md]

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21 (arXiv 2104.04473), Table 1: GPT with sequence 2048 and vocabulary 51,200 on
A100-80GB DGX nodes of 8; 39.1B on 512 GPUs (tp 8, pp 2, batch 1536), 1T (1008B) on 3072 GPUs (tp 8,
pp 64, batch 3072); and section 5.1: GPT-3 175B on 1024 GPUs (tp 8, pp 8, batch 1536). Micro-batch size
1 (``microbatches = batch / dp``), 1F1B, full recomputation, as ``estimate_published.py`` assumes.

Each model is captured as mixed precision is usually written (``examples/gpt.py:megatron`` with
``autocast=True``: fp32 master parameters and AdamW state, the forward under bf16 autocast) on the meta
device. The published configuration is priced by the same cost model as the plan (``cost.estimate``,
default ``StepOptions``, the stage cut of ``search.stages``); ``rhino plan``'s search (no preset
fallback) gives the plan. Checked: the plan's predicted step <= the published configuration's, and the
plan has ``pp > 1`` where no single-stage candidate fits.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name, heads, hidden, layers, tp, pp, GPUs, batch (arXiv 2104.04473 Table 1; 175B: section 5.1)
ROWS = [
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536),
    ("175B", 96, 12288, 96, 8, 8, 1024, 1536),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072),
]


def _row(name, heads, hidden, layers, tp, pp, gpus, batch, level: str, time_limit: float) -> dict:
    from rhino.capture import capture
    from rhino.capture.workload import Workload
    from rhino.cost.cluster import parse_cluster
    from rhino.cost.estimate import estimate, estimate_strategy
    from rhino.search import SearchOptions, search
    from rhino.search.stages import stage_cut
    import gpt  # noqa: E402  (the example model file)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(Workload(*gpt.megatron(layers, hidden, heads, batch, autocast=True),
                                 str(ROOT / "examples" / "gpt.py"), "megatron")).graph
    t_cap = time.perf_counter() - t0
    cluster = parse_cluster(f"{gpus // 8}x8xA100-80G")
    dp = gpus // (tp * pp)
    published = f"dp={dp},tp={tp},pp={pp},microbatches={batch // dp},recompute=full"
    pub = estimate_strategy(graph, cluster, published, stages=stage_cut(capacity=cluster.device.memory_bytes))
    t1 = time.perf_counter()
    load = os.getloadavg()[0]

    def say(event, info):
        if event == "scored":
            print(f"  {time.perf_counter() - t1:7.1f} s  {info}", file=sys.stderr, flush=True)
    r = search(graph, cluster, SearchOptions(level=level, time_limit=time_limit), progress=say)
    secs = time.perf_counter() - t1
    again = estimate(graph, cluster, r.plan, recompute=r.estimate.recompute)   # re-priced from scratch
    single = [c for c in r.candidates if c.estimate is not None and c.estimate.pp == 1]
    piped = [c.estimate for c in r.candidates if c.estimate is not None and c.estimate.pp > 1]
    bp = min(piped, key=lambda x: (not x.fits, x.step_seconds)) if piped else None
    e = r.estimate
    return {"name": name, "gpus": gpus, "nodes": len(graph.nodes), "published": published,
            "published_step": pub.step_seconds, "published_fits": pub.fits,
            "published_peak": pub.memory_bytes["peak"], "plan_mesh": dict(e.mesh), "plan_pp": e.pp,
            "plan_microbatches": e.microbatches, "plan_recompute": e.recompute, "plan_step": e.step_seconds,
            "plan_peak": e.memory_bytes["peak"], "single_stage_fits": any(c.fits for c in single),
            "search_seconds": secs, "capture_seconds": t_cap, "load": (load, os.getloadavg()[0]),
            "repriced_step": again.step_seconds,
            "best_pipelined": None if bp is None else f"{_mesh(bp.mesh)}, m={bp.microbatches}: {bp.step_seconds:.2f} s"
            + ("" if bp.fits else " (does not fit)")}


def _mesh(mesh: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.items())


def main() -> int:
    from rhino.benchmarks_doc import replace_section
    sys.path.insert(0, str(ROOT / "examples"))
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", help="comma-separated row names (default: all)")
    ap.add_argument("--level", default="O1", choices=["O1", "O2"])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args()
    wanted = set(args.rows.split(",")) if args.rows else None
    lines, ok = [], True
    for row in ROWS:
        if wanted and row[0] not in wanted:
            continue
        d = _row(*row, level=args.level, time_limit=args.time_limit)
        good = d["plan_step"] <= d["published_step"] * (1 + 1e-9) and (d["single_stage_fits"] or d["plan_pp"] > 1) \
            and abs(d["repriced_step"] / d["plan_step"] - 1) <= 1e-9
        ok &= good
        print(d, flush=True)
        mesh = _mesh(d["plan_mesh"])
        lines.append(f"| {d['name']} | {d['gpus']} | {d['nodes']:,} | {d['published']} | {d['published_step']:.2f} | "
                     f"{d['published_peak'] / 2**30:.1f} | {mesh}, m={d['plan_microbatches']}, "
                     f"recompute={d['plan_recompute']} | {d['plan_step']:.2f} | {d['plan_peak'] / 2**30:.1f} | "
                     f"{'yes' if d['single_stage_fits'] else 'no'} | {d['best_pipelined'] or 'not tried'} | "
                     f"{d['search_seconds']:.0f} | {d['load'][0]:.1f} / {d['load'][1]:.1f} | "
                     f"{'ok' if good else 'FAIL'} |")
    body = [f"Command: `python benchmarks/megatron_3d.py --level {args.level}` (this 2-core machine, shared; "
            "default `SearchOptions`: rule `pipeline=memory`).", "",
            "Published: Megatron-LM (arXiv 2104.04473) Table 1 (39.1B, 1T) and section 5.1 (175B), micro-batch "
            "size 1, full recomputation; as mixed-precision workloads (`examples/gpt.py:megatron`, "
            "`autocast=True`) on A100-80GB nodes of 8. Both columns are priced by the same cost model "
            "(`cost.estimate`, stage cut of `search.stages`). Plan: `search` at the level given, no preset "
            "fallback. Check: plan step <= published step, and pp > 1 where no single-stage plan fits. Load: 1-minute "
            "load average before / after the search.", "",
            "| model | GPUs | nodes | published config | published step (s) | its peak (GiB) | plan | plan step (s) | "
            "plan peak (GiB) | single stage fits | best pipelined candidate | search (s) | load | check |",
            "|---|---:|---:|---|---:|---:|---|---:|---:|---|---|---:|---|---|", *lines]
    replace_section(args.out, "Pipelines: Megatron-LM 3D configurations", "\n".join(body))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
