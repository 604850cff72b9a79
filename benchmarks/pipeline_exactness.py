"""Pipelines against single-device training: every example (at batch 8, tests/workloads/pipelines.py) under
pp=2,microbatches=4; pp=2,dp=2,microbatches=4; pp=2,tp=2,microbatches=4 (``--strategies base``), and with
recomputation and ZeRO inside the stages (``--strategies inner``), float64, 2 steps, every rank's losses and
held state shards compared at 1e-9 (docs/benchmarks.md, "Pipelines: exactness").

    PYTHONPATH=src python benchmarks/pipeline_exactness.py          # real processes: rhino run (gloo)
    PYTHONPATH=src python benchmarks/pipeline_exactness.py --sim    # in one process (runtime.pipeline_sim)
    PYTHONPATH=src python benchmarks/pipeline_exactness.py --sim --strategies inner
    PYTHONPATH=src python benchmarks/pipeline_exactness.py --stash  # bytes kept per micro-batch per recompute mode
    PYTHONPATH=src python benchmarks/pipeline_exactness.py --sim --workloads tests/workloads/heldout_branches.py:t5,siamese

Prints one markdown table row per run."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["mlp", "gpt", "bert", "llama", "moe", "resnet", "unet"]
STRATEGIES = ["pp=2,microbatches=4", "pp=2,dp=2,microbatches=4", "pp=2,tp=2,microbatches=4"]
#: stages that are themselves sharded further: recomputation and ZeRO inside stages (``--strategies inner``)
INNER = ["pp=2,recompute=full,microbatches=4", "pp=2,recompute=selective,microbatches=4",
         "pp=2,dp=2,zero=1,microbatches=4", "pp=2,dp=2,zero=2,microbatches=4", "pp=2,dp=2,zero=3,microbatches=4",
         "pp=2,dp=2,zero=3,recompute=full,microbatches=4"]


def workload_spec(name: str) -> str:
    """``FILE:FUNC`` (relative to the checkout) of an example name or of a ``FILE:FUNC`` given as is."""
    return name if ":" in name else f"tests/workloads/pipelines.py:{name}"


def simulated(name: str, strategy: str) -> dict:
    import torch
    from rhino.capture import capture, default_dtype, load_workload
    from rhino.runtime.compare import TOLERANCES, reference_run
    from rhino.runtime.pipeline import compare_stages
    from rhino.runtime.pipeline_sim import simulate_pipeline
    from rhino.sharding.presets import parse_strategy, preset_plan
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        cap = capture(load_workload(f"{ROOT}/{workload_spec(name)}", dtype=torch.float64))
        plan = preset_plan(cap.graph, parse_strategy(strategy))
        res = simulate_pipeline(cap, plan, 2)
    ref = reference_run(cap, 2, plan.microbatches)
    st = res["steps"][0]
    cmp = compare_stages(st.rp, st.spec, {r: {"losses": res["losses"][r], "local": res["local"][r]}
                                          for r in res["losses"]}, ref, TOLERANCES[torch.float64])
    return {"ok": cmp.ok, "max_abs_diff": cmp.max_abs_diff, "losses": res["losses"][0], "nproc": plan.world,
            "first_mismatch": cmp.first_mismatch}


def real(name: str, strategy: str) -> dict:
    from rhino.sharding.presets import parse_strategy
    spec = parse_strategy(strategy)
    nproc = spec.pp * spec.dp * spec.tp
    out = subprocess.run([sys.executable, "-m", "rhino.cli.main", "run", workload_spec(name),
                          "--nproc", str(nproc), "--strategy", strategy, "--dtype", "float64", "--steps", "2",
                          "--timeout", "300", "--json"], cwd=ROOT, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def stash(name: str, strategy: str = "pp=2,microbatches=4") -> str:
    """One row: per stage, the forward values kept per micro-batch in flight for the backward (KiB, global
    sizes) and the bytes crossing stage boundaries, under recompute=none | selective | full."""
    import torch
    from rhino.capture import capture, default_dtype, load_workload
    from rhino.runtime.pipeline import PipelineStep
    from rhino.runtime.rank_step import microbatch_graph
    from rhino.sharding.presets import parse_strategy, preset_plan
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        cap = capture(load_workload(f"{ROOT}/{workload_spec(name)}", dtype=torch.float64))
        micro = microbatch_graph(cap, parse_strategy(strategy).microbatches)
    cells = []
    for rc in ("none", "selective", "full"):
        plan = preset_plan(cap.graph, parse_strategy(f"{strategy},recompute={rc}"))
        steps = [PipelineStep(cap.graph, plan, r, micro_graph=micro) for r in range(plan.stages)]
        kept = [sum(st.rp.graph.types[v].nbytes for kind, v in st.st.forward.outputs if kind == "export") +
                sum(st.rp.graph.types[v].nbytes for v, _, _ in st.st.forward.recvs) for st in steps]
        crossing = sum(steps[0].spec.assignment.boundary_bytes().values())
        cells.append(" / ".join(f"{k / 1024:.1f}" for k in kept) + f" ({crossing / 1024:.0f})")
    return f"| {name} | {strategy} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sim", action="store_true", help="run every rank in this process")
    ap.add_argument("--examples", default=",".join(EXAMPLES))
    ap.add_argument("--workloads", help="FILE:NAME1,NAME2,... instead of --examples (e.g. "
                                        "tests/workloads/heldout_branches.py:t5,siamese)")
    ap.add_argument("--strategies", default="base",
                    help="base (the 3 rows per example), inner (recompute and ZeRO in stages), all, or a ';'-list")
    ap.add_argument("--stash", action="store_true", help="print the stash and crossing bytes per recompute mode")
    args = ap.parse_args()
    if args.workloads:
        path, _, names = args.workloads.rpartition(":")
        args.examples = ",".join(f"{path}:{n}" for n in names.split(","))
    if args.stash:
        print("| example | strategy | none: KiB kept per micro-batch, stage 0 / 1 (KiB crossing) | selective | full |")
        print("|---|---|---|---|---|")
        for name in args.examples.split(","):
            print(stash(name), flush=True)
        return
    strategies = {"base": STRATEGIES, "inner": INNER, "all": STRATEGIES + INNER}.get(args.strategies) \
        or args.strategies.split(";")
    print("| example | strategy | ranks | ok | max abs diff | losses (2 steps) | idle fraction | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.examples.split(","):
        for strategy in strategies:
            t0 = time.perf_counter()
            try:
                d = simulated(name, strategy) if args.sim else real(name, strategy)
            except ValueError as exc:   # a plan the workload cannot take (e.g. a micro-batch too small to split)
                d = {"ok": False, "error": str(exc)}
            idle = d.get("pipeline", {}).get("idle_fraction", "-")
            losses = ", ".join(f"{x:.6f}" for x in d.get("losses", []))
            print(f"| {name.split(':')[-1]} | {strategy} | {d.get('nproc', '-')} | {'yes' if d.get('ok') else 'NO'} | "
                  f"{d.get('max_abs_diff', float('nan')):.2g} | {losses} | {idle} | {time.perf_counter() - t0:.0f} |",
                  flush=True)
            if not d.get("ok"):
                print(f"<!-- {d.get('first_mismatch') or d.get('error')} -->", flush=True)


if __name__ == "__main__":
    main()
