"""``rhino demo``: check the GPT example and summarise its IR, then plan it for ``cpu:4``, run the plan on
four processes and check it against one device."""
from __future__ import annotations

from pathlib import Path

from ..ir.summary import summarize
from .common import emit_json, quiet_warnings, status

DEFAULT = Path(__file__).resolve().parents[3] / "examples" / "gpt.py"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="capture and check the GPT example, plan it for cpu:4 and run the plan")
    p.add_argument("workload", nargs="?", default=str(DEFAULT), metavar="FILE[:FUNC]")
    p.add_argument("--cluster", default="cpu:4", help="cluster to plan for and run on (cpu:N; default cpu:4)")
    p.add_argument("--time-limit", type=float, default=10.0, metavar="S", help="plan search budget (default 10 s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..capture import capture, load_workload
    from ..check import check_captured
    status(f"capturing {args.workload} ...", not args.json)
    with quiet_warnings():
        cap = capture(load_workload(args.workload))
    status("checking 2 steps against plain PyTorch ...", not args.json)
    r = check_captured(cap, steps=2)
    s = summarize(cap.graph)
    planned = _plan_and_run(cap, args)
    ok = r.ok and planned["ok"]
    if args.json:
        emit_json({"ok": ok, "max_abs_diff": r.max_abs_diff, "nodes": s.nodes, "ops_by_kind": s.ops_by_kind,
                   "flops": s.flops, "param_bytes": s.param_bytes, "opt_state_bytes": s.opt_state_bytes,
                   "opaque_ops": s.opaque_ops, "capture_seconds": cap.seconds, "plan": planned})
        return 0 if ok else 1
    print(f"workload   {args.workload}")
    print(f"graph      {s.nodes} nodes (forward + backward + {cap.workload.optimizer.__class__.__name__} update), "
          f"{s.params:,} parameters, captured in {cap.seconds:.2f} s")
    print(f"FLOPs      {s.flops:,} per step")
    print(f"state      params {_mb(s.param_bytes)}, optimizer {_mb(s.opt_state_bytes)}, "
          f"buffers {_mb(s.buffer_bytes)}, batch {_mb(s.batch_bytes)}")
    print("ops        " + ", ".join(f"{k} {v}" for k, v in s.ops_by_kind.items()))
    verdict = "OK" if r.ok else f"FAILED ({r.first_mismatch})"
    print(f"check {verdict}: steps=2 nodes={s.nodes} opaque={len(s.opaque_ops)} max_abs_diff={r.max_abs_diff:.3g}")
    print(f"plan       {planned['cluster']}: mesh {planned['mesh']}, predicted {planned['step_seconds'] * 1e3:.3f} ms "
          f"per step (best preset {planned['best_preset']}: {planned['preset_seconds'] * 1e3:.3f} ms), "
          f"searched in {planned['search_seconds']:.1f} s")
    verdict = "OK" if planned["ok"] else f"FAILED ({planned['first_mismatch']})"
    print(f"run {verdict}: nproc={planned['nproc']} mesh={planned['mesh']} steps=2 "
          f"max_abs_diff={planned['max_abs_diff']:.3g} (the searched plan against one device)")
    return 0 if ok else 1


def _plan_and_run(cap, args) -> dict:
    from ..api import plan_and_run
    from ..cost.cluster import parse_cluster
    cluster = parse_cluster(args.cluster)
    if cluster.device.name != "cpu" or cluster.nodes != 1:
        raise ValueError(f"rhino demo runs the plan on local processes: give a cluster like cpu:4, not {cluster}")
    return plan_and_run(cap, args.cluster, time_limit=args.time_limit, workload=args.workload,
                        status=lambda m: status(m, not args.json))


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
