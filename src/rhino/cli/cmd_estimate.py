"""``rhino estimate FILE[:FUNC] --cluster C [--strategy S | --plan plan.json] [--profile P] [--json]``."""
from __future__ import annotations

from pathlib import Path

from ..capture import capture, load_workload
from ..cost.cluster import parse_cluster
from ..cost.estimate import Estimate, estimate, estimate_strategy
from ..cost.machine_profile import load_profile
from ..cost.pipeline import Schedule
from ..cost.step import StepOptions
from ..sharding.plan import ShardingPlan
from .common import emit_json, quiet_warnings, status

_CATEGORIES = ("params", "gradients", "optimizer", "activations", "temporaries", "buffers", "batch", "updated_state")


def add_parser(sub) -> None:
    p = sub.add_parser("estimate", help="predict step time and per-device memory of a plan on a cluster")
    p.add_argument("workload", metavar="FILE[:FUNC]")
    p.add_argument("--cluster", required=True, help="e.g. 8xA100-80G, 4x8xH100, cpu:4, or a YAML file")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--strategy", help="expert preset, e.g. dp=8 or tp=8,pp=4,microbatches=16,recompute=full "
                                      "(default: data parallelism over the whole cluster)")
    g.add_argument("--plan", help="a plan file (JSON) made for this workload")
    p.add_argument("--schedule", choices=[s.value for s in Schedule], default=Schedule.ONE_F_ONE_B.value,
                   help="pipeline schedule (default 1f1b)")
    p.add_argument("--profile", help="a measured machine profile from `rhino profile` (use on the machine it "
                                     "was measured on)")
    p.add_argument("--no-overlap", action="store_true",
                   help="do not overlap gradient reduction with the backward pass")
    p.add_argument("--allow-tf32", action="store_true", help="fp32 matmuls run on TF32 tensor cores")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _options(args, profile) -> StepOptions:
    return StepOptions(overlap_gradient_reduction=not args.no_overlap, allow_tf32=args.allow_tf32, profile=profile)


def run(args) -> int:
    cluster = parse_cluster(args.cluster)
    profile = None
    if args.profile:
        cluster, profile = load_profile(args.profile).apply(cluster)
    status(f"capturing {args.workload} ...", not args.json)
    with quiet_warnings():
        cap = capture(load_workload(args.workload))
    status(f"estimating on {cluster} ...", not args.json)
    if args.plan:
        path = Path(args.plan)
        if not path.exists():
            raise FileNotFoundError(f"plan file {args.plan!r} does not exist")
        plan = ShardingPlan.from_json(path.read_text())
        est = estimate(cap.graph, cluster, plan, schedule=args.schedule, options=_options(args, profile))
    else:
        est = estimate_strategy(cap.graph, cluster, args.strategy or f"dp={cluster.world}",
                                options=_options(args, profile), schedule=args.schedule)
    if args.json:
        emit_json({"ok": True, "capture_seconds": round(cap.seconds, 3), **est.to_dict()})
    else:
        print(render(est))
    return 0


def _b(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def _t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def render(e: Estimate) -> str:
    mesh = " ".join(f"{k}={v}" for k, v in e.mesh.items())
    lines = [f"estimate {e.strategy} on {e.cluster} (mesh {mesh}"
             + (f", {e.microbatches} micro-batches, {e.schedule}" if e.microbatches > 1 else "")
             + (f", recompute={e.recompute}" if e.recompute != "none" else "") + ")",
             f"  step time      {_t(e.step_seconds)} = compute {_t(e.compute_seconds)} + exposed communication "
             f"{_t(e.comm_seconds)} + pipeline bubble {_t(e.bubble_seconds)}",
             f"  throughput     {e.tflops_per_device:.2f} TFLOP/s per device (model FLOPs), MFU {e.mfu:.1%}"
             + (f"; {e.hardware_tflops_per_device:.2f} TFLOP/s with recomputation" if e.recompute != "none" else ""),
             f"  communication  {_t(e.comm_total_seconds)} in all"
             + (": " + ", ".join(f"{k} x{v}" for k, v in sorted(e.collectives.items())) if e.collectives else "")]
    mem = e.memory_bytes
    split = ", ".join(f"{k} {_b(mem[k])}" for k in _CATEGORIES if mem.get(k))
    lines.append(f"  memory/device  peak {_b(mem['peak'])} of {_b(e.capacity_bytes)}: "
                 f"{'fits' if e.fits else 'DOES NOT FIT'}")
    lines.append(f"                 at the peak: {split}")
    lines += [f"  note: {n}" for n in e.notes]
    return "\n".join(lines)
