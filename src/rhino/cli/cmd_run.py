"""``rhino run FILE[:FUNC] [--nproc N] (--strategy S | --plan plan.json) [--steps K] [--emit DIR] [--json]``."""
from __future__ import annotations

from pathlib import Path

from ..atomic import check_dir_target, check_file_target
from ..sharding.plan import resolve
from ..sharding.presets import parse_strategy, preset_notes, preset_plan
from .common import BATCHES_UNUSED, DTYPE_NAMES, emit_json, quiet_warnings, status, write_atomic


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a sharded plan on N local processes and compare with one device")
    p.add_argument("workload", metavar="FILE[:FUNC]")
    p.add_argument("--nproc", type=int, help="number of processes (devices); under torchrun: its world size; "
                   "by default the device count of the plan or strategy")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--strategy", help="expert preset, e.g. dp=4, dp=2,tp=2,sp=on or dp=2,microbatches=4 (gradient "
                   "accumulation: the reference is PyTorch's accumulation loop); pp=2,microbatches=4[,dp=2|tp=2]"
                   "[,schedule=gpipe] runs a pipeline (stages cut automatically)")
    g.add_argument("--plan", help="a plan file (JSON) made for this workload")
    p.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    p.add_argument("--emit", metavar="DIR", help="write each rank's program as Python to DIR")
    p.add_argument("--save-plan", metavar="FILE", help="write the plan used as JSON")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck collective fails")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="build the workload and its reference under this "
                   "default dtype; float64 compares every rank at 1e-9 (float32: rtol 1e-4, atol 1e-5)")
    p.add_argument("--memory-plan", nargs="?", const="O1", choices=("O1", "O2"), metavar="LEVEL",
                   help="each rank runs its planned operator order inside one preallocated arena (memory plan per "
                   "rank at LEVEL, default O1); collectives block (no overlap) in this mode; one micro-batch")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..capture import DTYPES, default_dtype
    with default_dtype(DTYPES.get(args.dtype)):
        return _run(args)


def _run(args) -> int:
    from ..capture import capture, load_workload
    from ..runtime.launch import RankFailedError, in_torchrun
    from ..runtime.trainer import load_plan_file
    plan = load_plan_file(args.plan) if args.plan else None
    if args.nproc is None and in_torchrun():
        import os
        args.nproc = int(os.environ["WORLD_SIZE"])
    elif args.nproc is None:
        args.nproc = plan.world if plan is not None else parse_strategy(args.strategy).world
    if args.nproc < 1 or args.steps < 1:
        raise ValueError("--nproc and --steps must be at least 1")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.save_plan:  # paths that cannot be written: refused before the capture
        check_file_target(args.save_plan)
    if args.emit:
        check_dir_target(args.emit)
    w = load_workload(args.workload)
    if w.on_meta:
        raise ValueError(f"{args.workload} builds its model on the meta device; build it on a real device to run it")
    status(f"capturing {args.workload} ...", not args.json)
    with quiet_warnings():
        cap = capture(w)
    if plan is None:
        plan = preset_plan(cap.graph, parse_strategy(args.strategy))
    rp = resolve(cap.graph, plan)
    notes = preset_notes(cap.graph, plan) if args.strategy else []    # (a searched plan splits as it may)
    if w.batches is not None:
        notes.append(BATCHES_UNUSED)
    if plan.microbatches > 1:
        from ..runtime.microbatch import microbatch_note
        notes += [n for n in (microbatch_note(cap, plan.microbatches),) if n]
    for note in notes:
        status(f"note: {note}", not args.json)
    if args.save_plan:
        write_atomic(args.save_plan, plan.to_json())
    if args.emit:
        if plan.stages > 1:
            raise ValueError("--emit does not write pipeline programs yet; drop --emit or the pp key")
        _emit(cap, rp, args.emit)
    mesh = f"pp{plan.stages}x{plan.mesh}" if plan.stages > 1 else str(plan.mesh)
    status(f"running {args.steps} steps on {args.nproc} processes, mesh {mesh} ...", not args.json)
    from ..runtime.run import run_plan
    try:
        r = run_plan(cap, plan, args.nproc, args.steps, args.timeout, memory_plan=args.memory_plan)
    except RankFailedError as exc:
        raise ValueError(str(exc)) from None
    if in_torchrun() and int(__import__("os").environ.get("RANK", "0")) != 0:
        return 0 if r.ok else 1  # rank 0 reports for the job
    if args.json:
        emit_json({**r.to_dict(), **({"notes": notes} if notes else {})})
    elif r.ok:
        print(f"run OK: nproc={r.nproc} mesh={r.mesh} steps={r.steps} max_abs_diff={r.max_abs_diff:.3g} "
              f"comm_bytes_per_step={r.comm_bytes_per_step}"
              + (f" p2p_bytes_per_step={r.pipeline['p2p_bytes_per_step']} idle_fraction={r.pipeline['idle_fraction']}"
                 if r.pipeline else ""))
        for m in r.memory_plan:
            print(f"  rank {m['rank']}: arena {m['arena_bytes']} bytes "
                  f"({'=' if m['arena_bytes'] == m['plan_bytes'] else '!='} plan {m['plan_bytes']})")
    else:
        print(f"run FAILED: {r.first_mismatch}")
    return 0 if r.ok else 1


def _emit(cap, rp, directory: str) -> None:
    """Each rank's programs as Python files in ``directory`` (``runtime.rank_step.rank_program_sources``)."""
    from ..runtime.rank_step import rank_program_sources
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in rank_program_sources(cap, rp.plan).items():
        write_atomic(out / name, text)
