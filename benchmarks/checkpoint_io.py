"""Save and load time and bytes on disk of a sharded checkpoint (``runtime/checkpoint.py``).

    python benchmarks/checkpoint_io.py [--strategy dp=2] [--load-strategy tp=2] [--rounds 3] [--json]

The GPT example at the size of ``benchmarks/train_speed.py`` (4 layers, hidden 256, 8 heads, seq 128, batch 8,
vocab 1024; AdamW), float32, 2 gloo processes x 1 thread, after one training step. Each round saves a
checkpoint (``Trainer.save``: DCP write, ``rhino.json``, rename, ``latest``) and loads it back
(``load_checkpoint``, under ``--load-strategy``, default the same plan); the times are the slowest rank's,
between barriers; medians over the rounds. Under the same plan the loaded state is checked against the saved
one bit for bit (another plan: not checked here; tests/test_checkpoint.py does).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path
from statistics import median

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
SIZE = dict(layers=4, hidden=256, heads=8, seq=128, batch=8, vocab=1024)


def _gpt():
    spec = importlib.util.spec_from_file_location("bench_gpt", ROOT / "examples" / "gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.workload(**SIZE)


def _timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return out, time.perf_counter() - t0


def _rank(ctx, strategy: str, load_strategy: str, directory: str, rounds: int) -> dict:
    from rhino.runtime.checkpoint import load_checkpoint
    from rhino.runtime.trainer import Trainer
    torch.set_num_threads(1)
    trainer = Trainer(_gpt(), strategy=strategy)
    trainer.step()
    loader = trainer if load_strategy == strategy else Trainer(_gpt(), strategy=load_strategy)
    before = {k: v.clone() for k, v in trainer.state.items()}
    saves, loads, path = [], [], None
    for _ in range(rounds):
        path, dt = _timed(lambda: trainer.save(directory))
        saves.append(dt)
        _, dt = _timed(lambda: load_checkpoint(loader, path))
        loads.append(dt)
    exact = None if loader is not trainer else all(torch.equal(before[k], trainer.state[k]) for k in before)
    local_bytes = sum(t.numel() * t.element_size() for t in before.values())
    return {"save": saves, "load": loads, "path": str(path), "exact": exact, "local_state_bytes": local_bytes}


def main() -> None:
    from rhino.runtime.launch import launch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="dp=2")
    p.add_argument("--load-strategy")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    load_strategy = args.load_strategy or args.strategy
    with tempfile.TemporaryDirectory() as d:
        ranks = launch(_rank, 2, args.strategy, load_strategy, d, args.rounds, timeout_s=600)
        path = Path(ranks[0]["path"])
        on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    save = median(max(r["save"][i] for r in ranks) for i in range(args.rounds))
    load = median(max(r["load"][i] for r in ranks) for i in range(args.rounds))
    out = {"strategy": args.strategy, "load_strategy": load_strategy, "rounds": args.rounds, "save_s": save,
           "load_s": load, "bytes_on_disk": on_disk, "local_state_bytes": [r["local_state_bytes"] for r in ranks],
           "exact": None if ranks[0]["exact"] is None else all(r["exact"] for r in ranks),
           "load_average": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(out))
    else:
        exact = "not checked" if out["exact"] is None else out["exact"]
        print(f"GPT {SIZE}: save {args.strategy} {save * 1e3:.0f} ms, load under {load_strategy} {load * 1e3:.0f} ms "
              f"(medians of {args.rounds}), {on_disk / 2**20:.2f} MiB on disk, local state per rank "
              f"{[round(b / 2**20, 2) for b in out['local_state_bytes']]} MiB, loaded state bit-exact: {exact}, "
              f"load average {out['load_average']:.1f}")


if __name__ == "__main__":
    main()
