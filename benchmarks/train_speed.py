"""Training speed: rhino's per-rank programs vs PyTorch's own DDP, FSDP2 and DTensor tensor parallelism.

Side by side in one run on 2 local gloo processes (1 torch thread each), the same model (the example's
initial weights), optimizer (the example's, with its parameter groups) and batch:

| rhino plan      | PyTorch baseline                                                                      |
|-----------------|---------------------------------------------------------------------------------------|
| ``dp=2``        | ``DistributedDataParallel`` (defaults: 25 MB buckets, 1 MB first bucket, overlap)      |
| ``dp=2,zero=3`` | FSDP2 ``fully_shard`` on a CPU device mesh, per block and root (torchtitan's wrapping) |
| ``tp=2``        | DTensor ``parallelize_module``: ``ColwiseParallel`` on q/k/v (GPT: the fused QKV) and  |
|                 | the MLP's up/gate, ``RowwiseParallel`` on the attention output and MLP down (torchtitan's |
|                 | plan); embeddings, norms and LM head replicated                                      |

GPT's fused QKV weight is colwise-split with its rows ordered ``[q_0 k_0 v_0 | q_1 k_1 v_1]`` (Megatron's
interleaved layout) and the attention runs on the local heads: the same model up to a fixed permutation
of the QKV rows. rhino runs as users run it: ``rhino.Trainer(workload, strategy=...)`` and
``trainer.step(global_batch)`` (what ``rhino train`` runs per rank: ``RankStep`` with ``lower_rank(...,
overlap=True)`` programs -- asynchronous, bucketed collectives, ``lower/overlap.py`` -- called with their
inputs released, so the old state is freed as the update consumes it; each step also cuts this rank's
share out of the global batch). ``--program`` adds the bare overlapped program (no Trainer) and
``--blocking`` the blocking program (called plainly) as further runners.

Timing: after warm-up, ``--rounds`` rounds; in each, every runner of a pair runs a block of steps
between barriers (the order alternates from round to round), so load from other processes hits all
alike; reported are medians of rank 0's per-step times and rhino / PyTorch.

Peak memory ("peak bytes"): the same count for every runner, each alone in 2 fresh processes (after the
timing): every allocation of 64 KiB or more gets its own mapping (a fixed glibc ``M_MMAP_THRESHOLD``) and
glibc's ``max mmap bytes`` is read after building the runner (the workload's model and optimizer
included) and after two steps; largest over the ranks. glibc counts on every thread, so buffers that the
collectives' background threads free count as freed (the profiler's memory events miss those, and
drifted upward from step to step for rhino and PyTorch alike). rhino's ``LiveBytesMeter`` count
(program values + held state) is reported beside it.

    python benchmarks/train_speed.py [--rounds 5] [--steps 3] [--model gpt|llama] [--pair dp|zero3|tp] [--json]
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import importlib.util
import json
import os
import re
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.10
SIZE = dict(layers=4, hidden=256, heads=8, seq=128, batch=8, vocab=1024)
PAIRS = {"dp": ("dp=2", "DDP"), "zero3": ("dp=2,zero=3", "FSDP2"), "tp": ("tp=2", "DTensor TP")}
WARMUP = 2


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _local_batch(batch, rank: int, world: int, split: bool):
    return tuple(b.chunk(world)[rank].contiguous() if split else b for b in batch)


# ----------------------------------------------------------------------------- PyTorch baselines

def _same_optimizer(opt: torch.optim.Optimizer, old_names: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer's class and parameter groups, over ``model``'s (possibly replaced) parameters."""
    params = dict(model.named_parameters(remove_duplicate=False))
    groups = []
    for g in opt.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": [params[old_names[id(p)]] for p in g["params"]]})
    return type(opt)(groups)


class TorchRunner:
    def __init__(self, kind: str, workload, rank: int, world: int) -> None:
        model, opt, self.loss_fn, batch = workload
        model, opt = copy.deepcopy((model, opt))
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.batch = _local_batch(batch, rank, world, split=kind != "tp")
        if kind == "dp":
            from torch.nn.parallel import DistributedDataParallel
            self.model = DistributedDataParallel(model)
        elif kind == "zero3":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model = model
            opt = _same_optimizer(opt, names, model)
        else:
            self.model = _tensor_parallel(model, world)
            opt = _same_optimizer(opt, names, model)
        self.opt = opt

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model, *self.batch)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def _gpt_tp_attention(self, x):
    """GPT attention on this rank's heads: the colwise-split QKV holds [q_r k_r v_r]."""
    b, t, h = x.shape
    local = self.proj.weight.shape[1] if not hasattr(self.proj.weight, "to_local") else \
        self.proj.weight.to_local().shape[1]
    heads = self.heads * local // h
    q, k, v = self.qkv(x).split(local, dim=-1)
    q, k, v = (z.view(b, t, heads, local // heads).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, t, local))


def _interleave_qkv(linear: torch.nn.Linear, tp: int) -> None:
    """Rows [q k v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 ...] so that a colwise split gives each rank its heads."""
    h = linear.weight.shape[0] // 3
    idx = torch.cat([torch.arange(j * h + r * h // tp, j * h + (r + 1) * h // tp)
                     for r in range(tp) for j in range(3)])
    with torch.no_grad():
        linear.weight.copy_(linear.weight[idx])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[idx])


def _tensor_parallel(model: torch.nn.Module, tp: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (tp,))
    for block in model.blocks:
        if hasattr(block.attn, "qkv"):          # GPT
            _interleave_qkv(block.attn.qkv, tp)
            block.attn.forward = types.MethodType(_gpt_tp_attention, block.attn)
            plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                    "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
        else:                                   # LLaMA
            block.attn.heads //= tp
            block.attn.n_kv_heads //= tp
            plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                    "attn.wo": RowwiseParallel(), "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
                    "mlp.w2": RowwiseParallel()}
        parallelize_module(block, mesh, plan)
    return model


# ----------------------------------------------------------------------------- rhino

class RhinoRunner:
    def __init__(self, cap, strategy: str, rank: int, overlap: bool) -> None:
        from rhino.ir.graph import Role
        from rhino.lower.overlap import release_inputs
        from rhino.lower.spmd import lower_rank
        from rhino.lower.spmd_ops import set_context
        from rhino.runtime.collectives import TORCH_COLLECTIVES, shard_tensor
        from rhino.runtime.groups import build_groups
        from rhino.sharding.plan import resolve
        from rhino.sharding.presets import parse_strategy, preset_plan
        plan = preset_plan(cap.graph, parse_strategy(strategy))
        self.prog_plan = plan
        rp = resolve(cap.graph, plan)
        self.groups = build_groups(plan.mesh)
        self.mesh, self.rank = plan.mesh, rank
        set_context(plan.mesh, rank, self.groups, TORCH_COLLECTIVES)
        self.prog = lower_rank(rp, rank, overlap=overlap)
        self.boxed = release_inputs(self.prog).module if overlap else None
        state, batch = cap.initial_state(), tuple(cap.workload.batch)
        self.names = [i.name for i in cap.graph.inputs if i.role is not Role.BATCH]
        self.local = {n: shard_tensor(state[n], rp.value[i.value], plan.mesh, rank)
                      for i in cap.graph.inputs for n in [i.name] if i.role is not Role.BATCH}
        self.batch = [shard_tensor(batch[int(i.name.split("/")[1])], rp.value[i.value], plan.mesh, rank)
                      for i in cap.graph.inputs if i.role is Role.BATCH]

    def args(self) -> list:
        return [self.local[n] for n in self.names] + self.batch

    def step(self) -> float:
        from rhino.lower.spmd_ops import set_context
        from rhino.runtime.collectives import TORCH_COLLECTIVES
        set_context(self.mesh, self.rank, self.groups, TORCH_COLLECTIVES)
        with torch.no_grad():
            if self.boxed is not None:       # the old state is freed as the update consumes it
                args = [self.local.pop(n) for n in self.names] + self.batch
                outs = self.boxed(args)
            else:
                outs = self.prog.module(*self.args())
        for name, value in zip(self.prog.output_names[1:], outs[1:]):
            self.local[name] = value
        return float(outs[0])

    def live_peak(self) -> int:
        from rhino.lower.spmd_ops import set_context
        from rhino.runtime.collectives import TORCH_COLLECTIVES
        from rhino.runtime.measure import LiveBytesMeter
        set_context(self.mesh, self.rank, self.groups, TORCH_COLLECTIVES)
        meter = LiveBytesMeter(self.prog.module, [self.local[n] for n in self.names])
        with torch.no_grad():
            outs = meter.run(*self.args())
        for name, value in zip(self.prog.output_names[1:], outs[1:]):
            self.local[name] = value
        return meter.peak


class TrainerRunner:
    """rhino as users run it: ``rhino.Trainer`` (what ``rhino train`` runs per rank: ``RankStep`` with
    overlapped programs that free the old state as the update consumes it); ``step`` takes the global batch
    and keeps this rank's share, as ``Trainer.step`` does every step."""

    def __init__(self, workload: tuple, strategy: str) -> None:
        from rhino.runtime.trainer import Trainer
        self.trainer = Trainer(workload, strategy=strategy)
        self.batch = tuple(workload[3])
        self.prog = self.trainer.program.programs[0]

    def step(self) -> float:
        return self.trainer.step(self.batch)

    def live_peak(self) -> int:
        from rhino.runtime.data import rank_batch
        t = self.trainer
        _, peak = t.program.run_measured(t.state, rank_batch(self.batch, t.rp, t.rank, t.microbatches))
        return peak


# ----------------------------------------------------------------------------- measuring

def _max_mapped_bytes() -> int:
    """glibc's ``max mmap bytes`` (``malloc_stats(3)``): the most bytes ever held in mmapped blocks by
    this process, counted by the allocator itself on every thread."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    with tempfile.TemporaryFile() as f:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            libc.malloc_stats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read().decode()
    m = re.search(r"max mmap bytes\s*=\s*(\d+)", text)
    if m is None:
        raise RuntimeError(f"malloc_stats printed no 'max mmap bytes': {text[-200:]!r}")
    return int(m.group(1))


def _memory_main(ctx, name: str, pair: str, which: str) -> dict:
    """One runner in fresh processes, every allocation of 64 KiB or more its own mapping
    (``runtime.init.return_freed_memory``: a fixed ``M_MMAP_THRESHOLD``): the peak of those bytes
    after building it (workload included) and after two steps. Process-wide, so buffers freed by the
    collectives' background threads count as freed when they are (profiler memory events miss frees on
    other threads, which made the earlier per-step count drift from step to step)."""
    from rhino.capture.workload import Workload
    from rhino.runtime.init import return_freed_memory
    if not return_freed_memory():
        raise RuntimeError("the memory phase needs glibc (mallopt)")
    torch.set_num_threads(1)
    mod = _example(name)
    w = Workload(*mod.workload(**SIZE), str(ROOT / "examples" / f"{name}.py"), "workload")
    workload = (w.model, w.optimizer, w.loss_fn, tuple(w.batch))
    strategy, _ = PAIRS[pair]
    runner = TrainerRunner(workload, strategy) if which == "rhino" else \
        TorchRunner(pair, workload, ctx.rank, ctx.world_size)
    built = _max_mapped_bytes()
    for _ in range(2):
        runner.step()
    dist.barrier()
    return {"built": built, "peak": _max_mapped_bytes()}


def _memory(name: str, pair: str) -> dict:
    from rhino.runtime.launch import launch
    out = {}
    for which in ("rhino", PAIRS[pair][1]):
        ranks = launch(_memory_main, 2, name, pair, which, timeout_s=600)
        out[which] = {k: max(r[k] for r in ranks) for k in ("built", "peak")}
    return out


def _block(runner, n: int) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        loss = runner.step()
    dist.barrier()
    return (time.perf_counter() - t0) / n, loss


def _rank_main(ctx, models: list[str], pairs: list[str], rounds: int, steps: int, blocking: bool,
               memory: bool, program: bool = False) -> list[dict]:
    from rhino.capture import capture
    from rhino.capture.workload import Workload
    torch.set_num_threads(1)
    out = []
    for name in models:
        mod = _example(name)
        w = Workload(*mod.workload(**SIZE), str(ROOT / "examples" / f"{name}.py"), "workload")
        cap = capture(w)
        workload = (w.model, w.optimizer, w.loss_fn, tuple(w.batch))
        for pair in pairs:
            strategy, baseline = PAIRS[pair]
            runners = {"rhino": TrainerRunner(workload, strategy),
                       baseline: TorchRunner(pair, workload, ctx.rank, ctx.world_size)}
            if blocking:
                runners["rhino blocking"] = RhinoRunner(cap, strategy, ctx.rank, overlap=False)
            if program:
                runners["rhino program"] = RhinoRunner(cap, strategy, ctx.rank, overlap=True)
            for r in runners.values():
                for _ in range(WARMUP):
                    r.step()
            times = {k: [] for k in runners}
            losses = {}
            keys = list(runners)
            for rnd in range(rounds):
                for k in (keys if rnd % 2 == 0 else keys[::-1]):
                    t, losses[k] = _block(runners[k], steps)
                    times[k].append(t)
            row = {"model": name, "strategy": strategy, "baseline": baseline,
                   "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
                   "ms_rounds": {k: [x * 1e3 for x in v] for k, v in times.items()},
                   "final_loss": losses, "steps_each": WARMUP + rounds * steps,
                   "overlap": vars(runners["rhino"].prog.overlap) if runners["rhino"].prog.overlap else None}
            if memory:
                row["rhino_live_meter"] = runners["rhino"].live_peak()
            del runners
            out.append(row)
    return out


def main(argv=None) -> int:
    from rhino.runtime.launch import launch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per block")
    p.add_argument("--model", action="append", choices=["gpt", "llama"])
    p.add_argument("--pair", action="append", choices=sorted(PAIRS))
    p.add_argument("--blocking", action="store_true", help="also time rhino's blocking program")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory phase")
    p.add_argument("--program", action="store_true", help="also time the bare overlapped per-rank program "
                   "(lower_rank + release_inputs, without the Trainer)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", metavar="MD", help="also write the table as a section of this markdown file")
    args = p.parse_args(argv)
    load = os.getloadavg()
    ranks = launch(_rank_main, 2, args.model or ["gpt", "llama"], args.pair or list(PAIRS), args.rounds,
                   args.steps, args.blocking, not args.no_memory, args.program, timeout_s=1800)
    rows = ranks[0]
    for row, other in zip(rows, ranks[1]):
        if row["strategy"] != "tp=2":        # the baseline's loss is its rank's half of the batch: average
            b = row["baseline"]
            row["final_loss"][b] = (row["final_loss"][b] + other["final_loss"][b]) / 2
        if "rhino_live_meter" in row:
            row["rhino_live_meter"] = max(row["rhino_live_meter"], other["rhino_live_meter"])
            pair = next(k for k, v in PAIRS.items() if v[0] == row["strategy"])
            mem = _memory(row["model"], pair)
            row["peak_bytes"] = {k: v["peak"] for k, v in mem.items()}
            row["built_bytes"] = {k: v["built"] for k, v in mem.items()}
        row["ratio"] = row["ms"]["rhino"] / row["ms"][row["baseline"]]
        row["ratio_of_mins"] = min(row["ms_rounds"]["rhino"]) / min(row["ms_rounds"][row["baseline"]])
        row["ratio_per_round"] = statistics.median(a / b for a, b in zip(row["ms_rounds"]["rhino"],
                                                                          row["ms_rounds"][row["baseline"]]))
        row["loss_diff"] = abs(row["final_loss"]["rhino"] - row["final_loss"][row["baseline"]])
    env = {"torch": torch.__version__, "cpus": os.cpu_count(), "threads_per_rank": 1, "loadavg_before": load,
           "loadavg_after": os.getloadavg(), "size": SIZE, "rounds": args.rounds, "steps_per_block": args.steps}
    if args.json:
        print(json.dumps({"env": env, "rows": rows}, indent=1))
        return 0
    lines = _table(env, rows, args)
    print("\n".join(lines))
    if args.out:
        from rhino.benchmarks_doc import replace_section
        replace_section(args.out, "Training speed: rhino vs DDP, FSDP2 and DTensor TP", "\n".join(lines))
    return 0


def _table(env: dict, rows: list[dict], args) -> list[str]:
    load = env["loadavg_before"]
    cmd = " ".join(["python benchmarks/train_speed.py"] + sys.argv[1:])
    lines = [f"Command: `{cmd}`. torch {env['torch']}, 2 gloo processes x 1 thread on {env['cpus']} CPUs; GPT and "
             "LLaMA examples at 4 layers, hidden 256, 8 heads, seq 128, batch 8, vocab 1024; "
             f"{args.rounds} interleaved rounds of {args.steps} steps after {WARMUP} warm-up steps, medians of "
             f"rank 0's step times (between barriers; a round's ratio compares blocks run back to back). 1-minute load average {load[0]:.1f} before and "
             f"{env['loadavg_after'][0]:.1f} after (the machine is shared: other processes ran; the ratios are "
             "side by side in one run, and the fastest-round ratio is less hurt by bursts of load).", "",
             "rhino: `rhino.Trainer(workload, strategy=...).step(global_batch)`, what `rhino train` runs per rank "
             "(`RankStep`: `lower_rank(..., overlap=True)` programs with asynchronous bucketed collectives and "
             "ZeRO-3 re-gathers with one-ahead prefetch, `lower/overlap.py`, called with their inputs released). "
             "Baselines: see the module docstring of `benchmarks/train_speed.py`. Peak MB: each runner alone in "
             "2 fresh processes with every allocation of 64 KiB or more mmapped (fixed glibc M_MMAP_THRESHOLD), "
             "glibc's `max mmap bytes` from the start of the process (workload, model and state built) through "
             "two steps, largest rank; in parentheses the same after building only. rhino live-meter (the old state counted to the end of the update, as the cost model prices it): `LiveBytesMeter` "
             "(`RankStep.run_measured`). Final loss diff: |rhino - baseline| of the "
             "global-batch loss after the same steps (float32).", "",
             "| model | plan | baseline | rhino ms | baseline ms | rhino / baseline | median of per-round ratios | "
             "fastest rounds | rhino blocking ms | bare program ms | peak MB rhino / baseline | "
             "rhino live-meter MB | final loss diff |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b = r["baseline"]
        mem = (f"{r['peak_bytes']['rhino'] / 2**20:.1f} / {r['peak_bytes'][b] / 2**20:.1f} "
               f"({r['built_bytes']['rhino'] / 2**20:.1f} / {r['built_bytes'][b] / 2**20:.1f})"
               if "peak_bytes" in r else "-")
        live = f"{r['rhino_live_meter'] / 2**20:.1f}" if "rhino_live_meter" in r else "-"
        blk = f"{r['ms']['rhino blocking']:.1f}" if "rhino blocking" in r["ms"] else "-"
        rs = f"{r['ms']['rhino program']:.1f}" if "rhino program" in r["ms"] else "-"
        lines.append(f"| {r['model']} | {r['strategy']} | {b} | {r['ms']['rhino']:.1f} | {r['ms'][b]:.1f} | "
                     f"{r['ratio']:.2f} | {r['ratio_per_round']:.2f} | {r['ratio_of_mins']:.2f} | {blk} | {rs} | {mem} | {live} | {r['loss_diff']:.1e} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
