"""``rhino train FILE[:FUNC] --nproc N (--strategy S | --plan P | --cluster C [--level O1|O2]) --steps K
[--log FILE] [--checkpoint DIR [--every M] [--resume]] [--json]``: train for real, with no single-device
reference (``rhino run`` is the check). ``--checkpoint``: sharded checkpoints every M steps and after the last;
``--resume``: continue from DIR's latest checkpoint (any plan or world size) up to K steps in total, or start
from step 0 when DIR holds none (so a restarted job and its first start run the same command)."""
from __future__ import annotations

from .common import DTYPE_NAMES, emit_json, status

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a workload under a plan on N processes (no reference run)")
    p.add_argument("workload", metavar="FILE[:FUNC]")
    p.add_argument("--nproc", type=int, help="local processes to start (gloo); under torchrun: this job's "
                   "world size; default: the plan's device count, else 1")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--strategy", help="expert preset, e.g. dp=2 or dp=2,tp=2,microbatches=4,recompute=full")
    g.add_argument("--plan", help="a plan file (JSON) made for this workload by rhino plan")
    g.add_argument("--cluster", help="search a plan for this cluster first, e.g. cpu:4 or 8xA100-80G")
    p.add_argument("--level", choices=["O1", "O2"], default="O1", help="search level with --cluster (default O1)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--log", metavar="FILE", help="append one JSON line per step (step, loss, seconds, samples/s)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="default dtype while the workload is built")
    p.add_argument("--no-overlap", action="store_true", help="blocking collectives, one per tensor (for comparison)")
    p.add_argument("--release-memory", action="store_true", help="return freed memory to the OS at once: peak RSS "
                   "follows the live bytes (for models near the memory limit; slower steps)")
    p.add_argument("--checkpoint", metavar="DIR", help="save sharded checkpoints (torch.distributed.checkpoint) "
                   "under DIR: every --every steps and after the last step")
    p.add_argument("--every", type=int, default=0, metavar="M", help="save a checkpoint every M steps (default 0: "
                   "only after the last step)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint DIR "
                   "(under this run's plan and world size) up to --steps in total; from step 0 if DIR holds none")
    p.add_argument("--max-restarts", type=int, metavar="N", help="run under torchrun's elastic agent: restart the "
                   "job from the last checkpoint up to N times when a rank dies (needs --checkpoint)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    p.add_argument("--memory-plan", nargs="?", const="O1", choices=("O1", "O2"), metavar="LEVEL",
                   help="each rank runs its planned operator order inside one preallocated arena (memory plan per "
                   "rank at LEVEL, default O1); collectives block (no overlap) in this mode; one micro-batch")
    p.add_argument("--json", action="store_true", help="print one JSON object: losses, step_seconds, "
                   "samples_per_second, peak_live_bytes, peak_rss_bytes, resumed_from_step, checkpoints")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..capture import DTYPES
    from ..runtime.launch import RankFailedError, in_torchrun
    if args.steps < 1:
        raise ValueError("--steps must be at least 1")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.log:  # a missing directory, a directory or an unwritable path: refused before processes start
        from ..atomic import check_file_target
        check_file_target(args.log, append=True)
    from ..runtime.trainer import check_checkpointing
    check_checkpointing(args.checkpoint, args.every, args.resume)
    if args.max_restarts is not None:
        if args.memory_plan:
            raise ValueError("--memory-plan does not run under the elastic agent yet; drop --max-restarts or --memory-plan")
        return _run_elastic(args)
    if in_torchrun():
        return _run_torchrun(args)
    nproc = args.nproc if args.nproc is not None else _default_nproc(args)
    from ..runtime.trainer import train
    status(f"training {args.workload} on {nproc} process(es) for {args.steps} steps ...")
    try:
        r = train(args.workload, nproc, plan=args.plan, strategy=args.strategy, cluster=args.cluster,
                  level=args.level, steps=args.steps, dtype=DTYPES.get(args.dtype), overlap=not args.no_overlap,
                  timeout_s=args.timeout, log=args.log, release_memory=args.release_memory,
                  checkpoint=args.checkpoint, every=args.every, resume=args.resume, memory_plan=args.memory_plan)
    except RankFailedError as exc:
        raise ValueError(str(exc)) from None
    _report(r, args.json)
    return 0


def _run_elastic(args) -> int:
    """``--max-restarts``: the job runs under torchrun's elastic agent (``runtime/elastic.py``)."""
    from ..capture import DTYPES
    from ..runtime.launch import in_torchrun
    if in_torchrun():
        raise ValueError("--max-restarts starts its own elastic agent; under torchrun, give torchrun --max-restarts "
                         "and rhino train --checkpoint DIR --resume instead")
    if args.checkpoint is None:
        raise ValueError("--max-restarts needs a checkpoint directory to restart from: add --checkpoint DIR")
    from ..runtime.elastic import ElasticJob
    from .cmd_launch import run_job
    job = ElasticJob(workload=args.workload, checkpoint=args.checkpoint, steps=args.steps,
                     nproc=args.nproc if args.nproc is not None else _default_nproc(args), plan=args.plan,
                     strategy=args.strategy, cluster=args.cluster, level=args.level, every=args.every,
                     resume=args.resume, max_restarts=args.max_restarts, dtype=DTYPES.get(args.dtype),
                     overlap=not args.no_overlap, timeout_s=args.timeout, log=args.log,
                     release_memory=args.release_memory)
    status(f"training {args.workload} on {job.nproc} process(es) for {args.steps} steps under the elastic agent "
           f"(up to {args.max_restarts} restart(s)) ...")
    return run_job(job, args.json)


def _report(r, as_json: bool) -> None:
    if as_json:
        emit_json({"ok": True, **r.to_dict()})
        return
    if r.resumed_from_step is not None:
        print(f"resumed from step {r.resumed_from_step}")
    if not r.losses:
        print(f"nothing to train: the checkpoint is already at step {r.resumed_from_step}")
    else:
        print(f"trained {r.steps} steps on mesh {r.mesh}: loss {r.losses[0]:.6g} -> {r.losses[-1]:.6g}, "
              f"{r.step_seconds * 1e3:.1f} ms per step, {r.samples_per_second:.1f} samples/s, "
              f"peak live {r.peak_live_bytes / 2**20:.1f} MiB, peak RSS {r.peak_rss_bytes / 2**20:.0f} MiB")
    if r.checkpoints:
        print(f"saved {len(r.checkpoints)} checkpoint(s), the last {r.checkpoints[-1]}")


def _default_nproc(args) -> int:
    from ..runtime.trainer import plan_world
    return plan_world(args.plan, args.strategy, args.cluster)


def _run_torchrun(args) -> int:
    """One rank of a torchrun job: every rank trains; rank 0 prints the summary."""
    from ..capture import DTYPES
    from ..runtime.trainer import train_torchrun
    r = train_torchrun(args.workload, plan=args.plan, strategy=args.strategy, cluster=args.cluster,
                       level=args.level, steps=args.steps, dtype=DTYPES.get(args.dtype), overlap=not args.no_overlap,
                       timeout_s=args.timeout, log=args.log, release_memory=args.release_memory,
                       checkpoint=args.checkpoint, every=args.every, resume=args.resume,
                       memory_plan=args.memory_plan)
    if r is not None:
        _report(r, args.json)
    return 0
