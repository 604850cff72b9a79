"""``rhino plan FILE[:FUNC] --cluster C [--level O1|O2] [--time-limit S] [--dtype D] [--out plan.json] [--report DIR]
[--json]``:
search the fastest plan that fits, show it next to the best expert preset, write it for ``rhino run``."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..atomic import check_dir_target, check_file_target
from ..cost.cluster import parse_cluster
from .common import DTYPE_NAMES, emit_json, quiet_warnings, status, write_atomic

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="search the fastest plan that fits a cluster (no configuration)")
    p.add_argument("workload", metavar="FILE[:FUNC]")
    p.add_argument("--cluster", required=True, help="e.g. 8xA100-80G, 2x8xH100, cpu:4, or a YAML file")
    p.add_argument("--level", choices=["O1", "O2"], default="O2", help="O1: seconds; O2: one ILP (default)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="search budget in seconds (default 60)")
    p.add_argument("--out", metavar="FILE", help="write the plan (JSON) for rhino run --plan")
    p.add_argument("--report", metavar="DIR", help="write report.txt, report.json and plan.json to DIR")
    p.add_argument("--no-presets", action="store_true", help="skip the expert-preset comparison")
    p.add_argument("--fit-memory", choices=["program", "planned"], default="program",
                   help="fit check: program (the cost model's program-order peak, default) or planned (a plan "
                        "over capacity fits when its rank program's memory plan, as rhino run --memory-plan "
                        "runs it, plus the state does)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="capture the workload under this default dtype (a plan "
                   "applies to the graph it was made for: plan with float64 to check it with rhino run --dtype "
                   "float64)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


class _Progress:
    """A live status line on a terminal (rich), plain lines otherwise; nothing with --json."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.live = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            self.live = Console(stderr=True).status("planning ...")
            self.live.start()

    def __call__(self, event: str, info: dict) -> None:
        if not self.enabled:
            return
        text = _describe(event, info)
        if text is None:
            return
        line = f"[{time.perf_counter() - self.t0:6.1f} s] {text}"
        if self.live is not None:
            self.live.update(line)
        elif event in ("meshes", "scored", "preset-done"):
            status(line)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()


def _describe(event: str, info: dict) -> str | None:
    if event == "cones":
        return f"coarsening {info['nodes']} nodes into cones, hashing repeated layers ..."
    if event == "meshes":
        return (f"{info['cones']} cones in {info['classes']} classes; meshes to try: {', '.join(info['meshes'])}")
    if event == "build":
        return f"mesh {info['mesh']}: strategy space and costs ..."
    if event == "solve":
        return f"mesh {info['mesh']}: solving ({info['classes']} classes, {info['candidates']} strategies) ..."
    if event == "refit":
        return f"mesh {info['mesh']}: over memory at {info['node']}, solving again (round {info['round']}) ..."
    if event == "scored":
        fits = "fits" if info["fits"] else "does not fit"
        return (f"mesh {info['mesh']}: {info['step_seconds'] * 1e3:.3f} ms per step, peak "
                f"{info['peak'] / 1e9:.2f} GB ({fits})")
    if event == "preset":
        return f"pricing expert preset {info['strategy']} ..."
    return None


def run(args) -> int:
    from ..capture import DTYPES, capture, default_dtype, load_workload
    from ..api import plan as api_plan
    parse_cluster(args.cluster)   # a bad cluster fails before the capture
    if args.time_limit <= 0:
        raise ValueError("--time-limit must be a positive number of seconds")
    if args.out:  # paths that cannot be written: refused before the capture and the search
        check_file_target(args.out)
    if args.report:
        check_dir_target(args.report)
    status(f"capturing {args.workload} ...", not args.json)
    with quiet_warnings(), default_dtype(DTYPES.get(args.dtype)):
        cap = capture(load_workload(args.workload))
    progress = _Progress(not args.json)
    try:
        plan, report = api_plan(cap, args.cluster, level=args.level, time_limit=args.time_limit,
                                presets=not args.no_presets, workload=args.workload, progress=progress,
                                fit_memory=args.fit_memory)
    finally:
        progress.stop()
    text = plan.to_json()
    if args.out:
        write_atomic(args.out, text)
    if args.report:
        d = Path(args.report)
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / "plan.json", text)
        write_atomic(d / "report.txt", report.text() + "\n")
        write_atomic(d / "report.json", json.dumps(report.to_dict(), indent=1, default=str))
    if args.json:
        out = {"ok": True, **report.to_dict()}
        if args.out:
            out["plan_file"] = args.out
        emit_json(json.loads(json.dumps(out, default=str)))
    else:
        print(report.text())
        if args.out:
            print(f"\nplan written to {args.out}; run it with: rhino run {args.workload} --plan {args.out}")
    return 0
