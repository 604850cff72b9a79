"""Step time: a Rhino-captured GPT training step vs the same step in plain eager PyTorch.

For each configuration of ``examples/gpt.py`` the step is captured once, then
both runners are warmed up and timed side by side in one process: ``--rounds``
rounds, each one block of N eager steps and one block of N Rhino steps (the
order alternates from round to round), so that load on a shared machine hits
both alike. Reported: the median milliseconds per step of each runner over the
rounds, and rhino/eager of those medians; also rhino/eager of the fastest
blocks (``min``), which is less hurt by bursts of load from other processes
(``--json`` adds every block and the median of the per-round ratios). "spread"
is the slowest block over the fastest, per runner: far above 1 means other load
disturbed the run. Torch's
default thread count is left as it is unless ``--threads`` is given.

    .venv/bin/python benchmarks/step_time.py [--rounds 7] [--steps N] [--json]
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from rhino.capture import capture
from rhino.capture.workload import Workload
from rhino.lower import StepProgram

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
TARGET = 1.25
NOISY = 1.5  # slowest block / fastest block of one runner above this: the run was disturbed

CONFIGS: dict[str, dict] = {
    "default": {},  # workload() defaults: layers=2, hidden=64, heads=4, seq=32, batch=4, vocab=256
    "medium": dict(layers=4, hidden=256, heads=8, seq=128, batch=8, vocab=1024),
}


def _gpt_module():
    spec = importlib.util.spec_from_file_location("rhino_bench_gpt", GPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _workload(mod, kwargs: dict) -> Workload:
    model, opt, loss_fn, batch = mod.workload(**kwargs)
    return Workload(model, opt, loss_fn, tuple(batch), str(GPT.relative_to(ROOT)), "workload")


def _block(fn, n: int) -> float:
    """Seconds per step over ``n`` back-to-back steps."""
    gc.collect()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _fastest(fn, budget_s: float = 1.0, at_least: int = 3) -> float:
    """The fastest single step over ``budget_s`` seconds (and ``at_least`` steps)."""
    times, start = [], time.perf_counter()
    while len(times) < at_least or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench(name: str, kwargs: dict, rounds: int, steps: int | None, block_s: float) -> dict:
    mod = _gpt_module()
    w = _workload(mod, kwargs)
    cap = capture(w)
    state = cap.initial_state()
    prog = StepProgram(cap.graph)
    model, opt = copy.deepcopy((w.model, w.optimizer))
    batch = w.batch
    last, count = {}, {"eager": 0, "rhino": 0}

    def rhino_step():
        last["rhino"] = prog.step(state, batch)
        count["rhino"] += 1

    def eager_step():
        opt.zero_grad(set_to_none=True)
        loss = w.loss_fn(model, *batch)
        loss.backward()
        opt.step()
        last["eager"] = loss
        count["eager"] += 1

    # Warm-up (allocator, lazy init, first-call costs), then N from the fastest single steps seen, so
    # that a burst of load from elsewhere during calibration does not shrink the blocks.
    for _ in range(2):
        eager_step(), rhino_step()
    t_e, t_r = _fastest(eager_step), _fastest(rhino_step)
    while count["eager"] < count["rhino"]:  # equal step counts, so the final losses are comparable
        eager_step()
    while count["rhino"] < count["eager"]:
        rhino_step()
    n = steps or max(3, round(block_s / max(t_e, t_r, 1e-6)))

    eager_t, rhino_t = [], []
    for r in range(rounds):
        order = [(eager_step, eager_t), (rhino_step, rhino_t)]
        for fn, out in (order if r % 2 == 0 else order[::-1]):
            out.append(_block(fn, n))

    # Both runners took the same number of steps from the same start: their losses should agree.
    assert count["eager"] == count["rhino"], count
    loss_diff = abs(float(last["rhino"]) - float(last["eager"].detach()))
    eager_med, rhino_med = statistics.median(eager_t), statistics.median(rhino_t)
    ratio = rhino_med / eager_med
    defaults = {k: v.default for k, v in inspect.signature(mod.workload).parameters.items()}
    cfg = {k: kwargs.get(k, defaults[k]) for k in ("layers", "hidden", "heads", "seq", "batch", "vocab")}
    return {
        "config": name, "shape": cfg,
        "params": sum(p.numel() for p in {id(p): p for p in w.model.parameters()}.values()),
        "nodes": len(cap.graph.nodes), "capture_s": round(cap.seconds, 3),
        "steps_per_block": n, "rounds": rounds,
        "eager_ms": eager_med * 1e3, "rhino_ms": rhino_med * 1e3, "ratio": ratio,
        "ratio_median_per_round": statistics.median(r / e for r, e in zip(rhino_t, eager_t)),
        "eager_ms_min": min(eager_t) * 1e3, "rhino_ms_min": min(rhino_t) * 1e3,
        "ratio_of_mins": min(rhino_t) / min(eager_t),
        "spread_eager": max(eager_t) / min(eager_t), "spread_rhino": max(rhino_t) / min(rhino_t),
        "noisy": max(eager_t) / min(eager_t) > NOISY or max(rhino_t) / min(rhino_t) > NOISY,
        "eager_ms_rounds": [t * 1e3 for t in eager_t], "rhino_ms_rounds": [t * 1e3 for t in rhino_t],
        "steps_each": count["rhino"], "final_loss_abs_diff": loss_diff, "target": TARGET, "pass": ratio <= TARGET,
    }


def _shape(cfg: dict) -> str:
    return "L{layers} H{hidden} h{heads} T{seq} B{batch} V{vocab}".format(**cfg)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--steps", type=int, default=None, help="steps per block (default: about --block-s seconds)")
    p.add_argument("--block-s", type=float, default=0.25, help="target seconds per block when --steps is unset")
    p.add_argument("--config", choices=sorted(CONFIGS), action="append", help="only these configs (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--save", metavar="FILE", help="also write the JSON object to FILE")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    results = [bench(name, CONFIGS[name], args.rounds, args.steps, args.block_s)
               for name in (args.config or list(CONFIGS))]
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    report = json.dumps({"env": env, "results": results}, indent=1)
    if args.save:
        Path(args.save).write_text(report + "\n")
    if args.json:
        print(report)
        return 0
    print(f"torch {env['torch']}, {env['threads']} threads on {env['cpus']} CPUs, {args.rounds} interleaved rounds, "
          f"medians per step; 1-min load average {load_before[0]:.2f} before, {env['loadavg_after'][0]:.2f} after")
    print()
    print("| config | shape | params | nodes | steps/block | eager ms | rhino ms | rhino/eager | rhino/eager (min) "
          "| spread e/r | final loss diff | target |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        mark = "noisy" if r["noisy"] else "ok" if r["pass"] else "MISSED"
        print(f"| {r['config']} | {_shape(r['shape'])} | {r['params']:,} | {r['nodes']} | {r['steps_per_block']} | "
              f"{r['eager_ms']:.2f} | {r['rhino_ms']:.2f} | {r['ratio']:.2f} | {r['ratio_of_mins']:.2f} | "
              f"{r['spread_eager']:.2f}/{r['spread_rhino']:.2f} | {r['final_loss_abs_diff']:.1e} | "
              f"<= {TARGET} {mark} |")
    if any(r["noisy"] for r in results):
        print(f"\nnoisy: some blocks took over {NOISY}x the fastest block of the same runner (spread e/r), i.e. "
              f"other load on the machine; the medians are not trustworthy there: rerun on a quiet machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
