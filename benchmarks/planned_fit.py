"""#14 item 4: the search's fit check by the planned per-rank peak (``SearchOptions.fit_memory``).

The MLP example in float64 on 2 cpu devices of ``--capacity`` bytes each (default 180,000): the O1 search with
``fit_memory="program"`` and with ``"planned"``; then the planned search's plan run on 2 gloo processes with
each rank in its planned arena (``runtime.run.run_plan(..., memory_plan="O1")``, what ``rhino run --plan FILE
--memory-plan`` does), every rank compared with single-device training, and each rank's arena + state
against the capacity. Prints one table (or ``--json``).

    .venv/bin/python benchmarks/planned_fit.py [--capacity 180000] [--json]
    .venv/bin/python benchmarks/planned_fit.py --compare        # torch-free vs lowered rank problems (float64)
    .venv/bin/python benchmarks/planned_fit.py --gpt2xl 1 3     # plan_memory(time_limit=T) wall on GPT-2 XL b1
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from rhino.capture import capture, load_workload
from rhino.cost.cluster import make_cluster
from rhino.cost.devices import get_device
from rhino.runtime.run import run_plan
from rhino.search import NoPlanFits, SearchOptions, search
from rhino.search.rank_memory import rank_problem_ir
from rhino.sharding.plan import resolve
from rhino.sharding.presets import parse_strategy, preset_plan


def _capture64(example: str):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return capture(load_workload(f"examples/{example}.py"))
    finally:
        torch.set_default_dtype(old)


def compare() -> None:
    """Torch-free rank problem (``rank_problem_ir``) vs the lowered one (``lower.rank_graph``), rank 0, float64:
    ops, program-order peak, O1 arena, and the bytes of the lowered problem's extra tensors."""
    from collections import Counter

    from rhino.lower.rank_graph import rank_memories
    from rhino.memory.plan import plan_memory
    from rhino.memory.simulate import replay
    print("| example | strategy | ops (torch-free / lowered) | program-order peak | O1 arena | extra tensors (lowered) |")
    print("|---|---|---|---|---|---|")
    for example in ("mlp", "gpt", "resnet"):
        cap = _capture64(example)
        for strategy in ("dp=2,tp=2", "dp=4,zero=3"):
            rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy(strategy)))
            p, q = rank_problem_ir(rp)[0], rank_memories(rp, [0])[0].problem
            extra = Counter(t.size for t in q.tensors.values()) - Counter(t.size for t in p.tensors.values())
            a, b = plan_memory(p, "O1", 20).height, plan_memory(q, "O1", 20).height
            print(f"| {example} | `{strategy}` | {len(p.ops)} / {len(q.ops)} | {replay(p, p.op_ids()).peak:,} / "
                  f"{replay(q, q.op_ids()).peak:,} | {a:,} / {b:,} | {sum(k * v for k, v in extra.items()):,} B |")


def gpt2xl(limits: list[float]) -> None:
    """Wall seconds of ``plan_memory(problem, "O1", T)`` on GPT-2 XL batch 1 (benchmarks/roam_models.py)."""
    from pathlib import Path

    from rhino.memory.from_graph import problem_from_graph
    from rhino.memory.plan import plan_memory
    spec = f"{Path(__file__).parent / 'roam_models.py'}:gpt2_xl_1"
    problem, _ = problem_from_graph(capture(load_workload(spec)).graph)
    for t in limits:
        t0 = time.perf_counter()
        plan = plan_memory(problem, "O1", t)
        print(f"GPT-2 XL b1 ({len(problem.ops):,} ops): time limit {t:g} s -> {time.perf_counter() - t0:.2f} s wall, "
              f"baselines skipped: {', '.join(plan.skipped_baselines) or 'none'}, valid {plan.valid}")


def _search(graph, cluster, fit_memory: str) -> dict:
    t = time.perf_counter()
    try:
        r = search(graph, cluster, SearchOptions(level="O1", time_limit=10, fit_memory=fit_memory))
    except NoPlanFits as exc:
        return {"fit_memory": fit_memory, "found": False, "why": str(exc), "seconds": time.perf_counter() - t}
    e = r.estimate
    return {"fit_memory": fit_memory, "found": True, "plan": r.plan, "mesh": str(r.best.mesh), "pp": e.pp,
            "recompute": e.recompute, "step_ms": e.step_seconds * 1e3, "program_peak": e.memory_bytes["peak"],
            "planned_peak": r.plan.meta.get("planned_peak_bytes"), "seconds": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=float, default=180_000, help="bytes per device (default 180000)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compare", action="store_true", help="torch-free vs lowered rank problems instead")
    ap.add_argument("--gpt2xl", type=float, nargs="+", metavar="T", help="time plan_memory on GPT-2 XL instead")
    args = ap.parse_args()
    if args.compare or args.gpt2xl:
        return compare() if args.compare else gpt2xl(args.gpt2xl)
    cap = _capture64("mlp")
    cluster = make_cluster(1, 2, dataclasses.replace(get_device("cpu"), memory_bytes=args.capacity))
    rows = [_search(cap.graph, cluster, fm) for fm in ("program", "planned")]
    run = None
    if rows[1]["found"]:
        plan = rows[1]["plan"]
        state = rank_problem_ir(resolve(cap.graph, plan))[1].state_bytes
        r = run_plan(cap, plan, 2, steps=2, memory_plan="O1")
        run = {"ok": r.ok, "max_abs_diff": r.max_abs_diff, "state_bytes": state,
               "ranks": [{**m, "total": m["arena_bytes"] + state, "fits": m["arena_bytes"] + state <= args.capacity}
                         for m in r.memory_plan]}
    out = {"capacity": args.capacity, "searches": [{k: v for k, v in row.items() if k != "plan"} for row in rows],
           "run": run}
    if args.json:
        print(json.dumps(out, indent=1, default=str))
        return
    print(f"mlp float64, 2 devices of {args.capacity:,.0f} B")
    for row in out["searches"]:
        if not row["found"]:
            print(f"  {row['fit_memory']:8} no plan fits ({row['seconds']:.1f} s)")
            continue
        print(f"  {row['fit_memory']:8} mesh {row['mesh']} pp={row['pp']} recompute={row['recompute']}: "
              f"{row['step_ms']:.2f} ms/step, program-order peak {row['program_peak']:,} B, planned peak "
              + ("-" if row["planned_peak"] is None else f"{row['planned_peak']:,} B") + ", "
              f"search {row['seconds']:.1f} s")
    if run:
        print(f"  run (2 gloo processes, --memory-plan O1, 2 steps): {'OK' if run['ok'] else 'MISMATCH'}, max abs "
              f"diff {run['max_abs_diff']:.2g}; per rank arena + state = "
              + ", ".join(f"{m['arena_bytes']:,} + {run['state_bytes']:,} = {m['total']:,} B "
                          f"({'<=' if m['fits'] else '>'} capacity, arena {'=' if m['arena_bytes'] == m['plan_bytes'] else '!='} plan)"
                          for m in run["ranks"]))


if __name__ == "__main__":
    main()
