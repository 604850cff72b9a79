"""Predicted vs measured peak of live tensor bytes per pipeline stage, examples x pipelined strategies.

    python benchmarks/pipeline_memory_accuracy.py [--out docs/benchmarks.md]

Each plan's first step runs for real on gloo processes, every program node by node
(``PipelineStep.run_measured``: the state, the batch, every micro-batch's stash, the gradient accumulators
and the runtime's message buffers count as held); a stage's measured peak is the largest over its ranks.
The prediction is the stage's ``peak_bytes`` from ``cost.estimate`` on the same plan and ``cpu:N``.
Writes the section "Cost model: pipeline stage memory" of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [(name, s) for name in ("mlp", "gpt", "llama", "bert", "resnet", "unet", "moe")
         for s in ("pp=2,microbatches=2", "pp=2,microbatches=4")] + \
        [(name, s) for name in ("gpt", "llama", "bert")
         for s in ("pp=2,tp=2,microbatches=2", "pp=2,dp=2,microbatches=4", "pp=4,microbatches=4")] + \
        [("gpt", "pp=2"), ("llama", "pp=2"), ("gpt", "pp=4,microbatches=2"), ("bert", "pp=4")]   # fewer than pp


def _rank(ctx, path: str, strategy: str):
    from rhino.runtime.data import rank_batch
    from rhino.runtime.trainer import Trainer
    trainer = Trainer(path, strategy=strategy)
    batch = rank_batch(trainer.next_batch(), trainer.rp, trainer.mesh_rank, trainer.microbatches, trainer.device)
    _, peak = trainer.program.run_measured(trainer.state, batch)
    return peak


def measure(name: str, strategy: str) -> tuple[list[int], list[int]]:
    """(predicted, measured) bytes per stage."""
    from rhino.capture import capture, load_workload
    from rhino.cost.cluster import parse_cluster
    from rhino.cost.estimate import estimate
    from rhino.runtime.launch import launch
    from rhino.sharding.presets import parse_strategy, preset_plan
    path = str(ROOT / "examples" / f"{name}.py")
    cap = capture(load_workload(path))
    spec = parse_strategy(strategy)
    plan = preset_plan(cap.graph, spec)
    est = estimate(cap.graph, parse_cluster(f"cpu:{plan.world}"), plan)
    peaks = launch(_rank, plan.world, path, strategy, timeout_s=600)
    W = plan.mesh.world
    return [s["peak_bytes"] for s in est.stages], [max(peaks[s * W:(s + 1) * W]) for s in range(plan.stages)]


def main() -> int:
    from rhino.benchmarks_doc import replace_section
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args()
    rows, errors = [], []
    for name, strategy in CASES:
        t = time.perf_counter()
        pred, meas = measure(name, strategy)
        errs = [p / q - 1 for p, q in zip(pred, meas)]
        errors += errs
        cells = ", ".join(f"{s}: {p:,} / {q:,} ({e:+.1%})" for s, (p, q, e) in enumerate(zip(pred, meas, errs)))
        rows.append(f"| {name} | `{strategy}` | {cells} | {max(pred) / max(meas) - 1:+.1%} |")
        print(rows[-1], f"({time.perf_counter() - t:.1f}s)", flush=True)
    body = ["Command: `python benchmarks/pipeline_memory_accuracy.py` (gloo processes on this 2-core machine).", "",
            "Per stage: the cost model's peak (`cost.pipeline`: the pipeline phase scaled from the whole step's "
            "peak before the update, with the whole local batch every stage's runtime holds, the update phase "
            "counted over the stage's own update program) against the "
            "first step's peak of live tensor bytes, measured node by node (`PipelineStep.run_measured`; largest "
            "rank of the stage; the state an update replaces is handed to it and dies at its last use there, as "
            "in training). Bytes, float32.", "",
            "| example | strategy | stage: predicted / measured (B), error | error of the largest stage |",
            "|---|---|---|---|", *rows, "",
            f"Stage errors from {min(errors):+.1%} to {max(errors):+.1%}. Without a pipeline the same model "
            "counts every node of the step (\"Cost model: memory\"); here a stage's pipeline phase is scaled from "
            "the whole step's categories, not counted over its own programs in schedule order."]
    replace_section(args.out, "Cost model: pipeline stage memory", "\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
