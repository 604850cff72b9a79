"""``rhino estimate FILE[:FUNC] --cluster C [--strategy S | --plan plan.json] [--profile P] [--json]``."""
from __future__ import annotations

from ..cost.cluster import parse_cluster
from ..cost.machine_profile import load_profile
from ..cost.pipeline import Schedule
from .common import emit_json, quiet_warnings, status


def add_parser(sub) -> None:
    p = sub.add_parser("estimate", help="predict step time and per-device memory of a plan on a cluster")
    p.add_argument("workload", metavar="FILE[:FUNC]")
    p.add_argument("--cluster", required=True, help="e.g. 8xA100-80G, 4x8xH100, cpu:4, or a YAML file")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--strategy", help="expert preset, e.g. dp=8 or tp=8,pp=4,microbatches=16,recompute=full "
                                      "(default: data parallelism over the whole cluster)")
    g.add_argument("--plan", help="a plan file (JSON) made for this workload")
    p.add_argument("--schedule", choices=[s.value for s in Schedule],
                   help="pipeline schedule (default: the strategy's schedule= or the plan's, else 1f1b)")
    p.add_argument("--profile", help="a measured machine profile from `rhino profile` (use on the machine it "
                                     "was measured on)")
    p.add_argument("--no-overlap", action="store_true",
                   help="do not overlap gradient reduction with the backward pass")
    p.add_argument("--allow-tf32", action="store_true", help="fp32 matmuls run on TF32 tensor cores")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..capture import capture, load_workload
    from ..api import estimate
    from ..runtime.trainer import load_plan_file
    cluster = parse_cluster(args.cluster)   # a bad cluster, profile or plan file fails before the capture
    profile = load_profile(args.profile) if args.profile else None
    plan = load_plan_file(args.plan) if args.plan else None
    schedule = _schedule(args, plan)
    status(f"capturing {args.workload} ...", not args.json)
    with quiet_warnings():
        cap = capture(load_workload(args.workload))
    status(f"estimating on {cluster} ...", not args.json)
    est = estimate(cap, args.cluster, strategy=args.strategy, plan=plan, schedule=schedule,
                   overlap=not args.no_overlap, allow_tf32=args.allow_tf32, profile=profile)
    if args.json:
        emit_json({"ok": True, "capture_seconds": round(cap.seconds, 3), **est.to_dict()})
    else:
        print(est.text())
    return 0


def _schedule(args, plan) -> str:
    """The schedule to price: ``--schedule`` where given (a plan file's own is replaced; a strategy string
    that names another is refused), else 1f1b, which ``api.estimate`` reads as "the strategy's or the plan's
    own" (so an explicit 1f1b cannot be passed on as such: the plan's schedule is set to it here)."""
    from ..sharding.presets import parse_strategy
    if args.schedule is None:
        return Schedule.ONE_F_ONE_B.value
    if args.strategy and "schedule=" in args.strategy.replace(" ", ""):
        named = parse_strategy(args.strategy).schedule
        if named != args.schedule:
            raise ValueError(f"--schedule {args.schedule} and the strategy's schedule={named} disagree; "
                             f"give the schedule once")
    if plan is not None:
        plan.schedule = args.schedule
    return args.schedule
