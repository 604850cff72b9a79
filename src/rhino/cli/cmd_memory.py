"""``rhino memory FILE[:FUNC] [--strategy S | --plan P | --cluster C] [--level O1|O2] [--time-limit S] [--execute]
[--report DIR] [--json]``.

Captures the step (fake/meta tensors: nothing is allocated) and calls ``rhino.api.memory_report``: a memory
problem (``memory.from_graph``), an operator order and an arena layout (``memory.plan.plan_memory``),
aligned and checked (``memory.step_report``); prints the four baselines next to Rhino's peak. ``--execute``
runs one step with the arena executor and compares it with the plain single-device program
(``lower.arena.compare_arena_step``); ``--report DIR`` writes PNGs.
Peaks count the arena only (the step's tensors); the state (parameters, optimizer state, buffers) lives
outside it and is printed on its own line.

With ``--strategy``, ``--plan`` or ``--cluster`` (a plan searched at O1) every rank of that parallel plan is
planned (``rhino.api.rank_memory_report``): each rank's program with its communication buffers, each distinct
program once; one table row per rank; ``--execute`` runs every rank in its arena in lockstep in this process
and compares it with the plain rank programs.
"""
from __future__ import annotations

import time
from pathlib import Path

from ..atomic import check_dir_target
from .common import emit_json, quiet_warnings, status

LEVELS = ("O1", "O2")


def add_parser(sub) -> None:
    p = sub.add_parser("memory", help="plan an operator order and a memory layout (ROAM) for one device")
    p.add_argument("workload", metavar="FILE[:FUNC]")
    p.add_argument("--level", default="O2", choices=LEVELS, help="O1: heuristics and at most 1 s of exact "
                   "layout search (seconds); O2: + exact CP-SAT windows (default)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S",
                   help="seconds for the solver (default 60); the best plan found by then is kept; with "
                        "--strategy/--plan/--cluster, for building and planning all rank programs together")
    p.add_argument("--execute", action="store_true",
                   help="run one step with the planned arena and compare with plain PyTorch")
    p.add_argument("--report", metavar="DIR", help="write PNGs: memory over time, layout (one device only)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--strategy", help="plan every rank of this parallel strategy, e.g. dp=2,tp=2 or dp=4,zero=3")
    g.add_argument("--plan", help="plan every rank of this plan file (JSON) made for the workload")
    g.add_argument("--cluster", help="plan every rank of the plan rhino plan --level O1 finds for this cluster")
    p.add_argument("--method", default="rhino", choices=("rhino", "model"),
                   help="rhino: the ROAM-style planner (default); model: the MODeL baseline, order and addresses "
                        "in one CP-SAT program (one device; larger graphs find no plan within the time limit)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def human(n: float | None) -> str:
    """Bytes in binary units: ``1536 -> '1.50 KiB'``; None (a baseline skipped for the time limit) -> ``'-'``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class _Progress:
    """Solver progress on stderr, one line per report, with the seconds since planning started."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            status(f"  [{time.perf_counter() - self.start:6.1f}s] {message}")


def run(args) -> int:
    from ..capture import capture, load_workload
    if args.time_limit <= 0:
        raise ValueError("--time-limit must be a positive number of seconds")
    report = check_dir_target(args.report) if args.report else None  # a file or unwritable: refused first
    w = load_workload(args.workload)
    if args.execute and w.on_meta:
        raise ValueError(f"{args.workload} builds its model on the meta device, which holds no data; drop "
                         f"--execute to plan only, or build the workload on a real device to execute it")
    show = not args.json
    ranks = args.strategy is not None or args.plan is not None or args.cluster is not None
    if ranks and args.method != "rhino":
        raise ValueError("--method model plans one device; drop it with --strategy, --plan or --cluster")
    if ranks and report is not None:
        raise ValueError("--report draws one device's plan; drop it with --strategy, --plan or --cluster")
    plan = None
    if args.plan is not None:
        from ..runtime.trainer import load_plan_file
        plan = load_plan_file(args.plan)
    status(f"capturing {args.workload} ...", show)
    with quiet_warnings():
        cap = capture(w)
    from ..api import memory_report
    if ranks:
        rep = memory_report(cap, level=args.level, time_limit=args.time_limit, execute=args.execute,
                            name=args.workload, progress=_Progress(show), status=lambda m: status(m, show),
                            strategy=args.strategy, plan=plan, cluster=args.cluster)
        result = rep.to_dict()
        emit_json(result) if args.json else _print_ranks(result)
        return 0 if result["ok"] else 1
    rep = memory_report(cap, level=args.level, time_limit=args.time_limit, execute=args.execute,
                        name=args.workload, progress=_Progress(show), status=lambda m: status(m, show),
                        method=args.method)
    result = rep.to_dict()
    if report is not None:
        report.mkdir(parents=True, exist_ok=True)
        result["report"] = [str(p) for p in write_report(rep.problem, rep.plan, report)]
    if args.json:
        emit_json(result)
    else:
        _print_table(result)
    return 0 if result["ok"] else 1


def _print_table(r: dict) -> None:
    print(f"memory plan for {r['workload']}: {r['ops']} ops, {r['tensors']} tensors, level {r['level']}")
    rows = [("PyTorch (live bytes)", r["pytorch_live_peak_bytes"], r["reduction"]["pytorch_live"]),
            ("PyTorch (caching allocator)", r["pytorch_peak_bytes"], r["reduction"]["pytorch"]),
            ("best-fit layout", r["bestfit_peak_bytes"], r["reduction"]["bestfit"]),
            ("heuristic (least-peak + long-lived-first)", r["heuristic_peak_bytes"], r["reduction"]["heuristic"])]
    w = max(len(n) for n, _, _ in rows) + 2
    print(f"{'':{w}}{'peak':>12}  {'Rhino saves':>11}")
    for name, b, red in rows:
        print(f"{name:{w}}{human(b):>12}  " + (f"{red * 100:>10.1f}%" if red is not None else "  (skipped)"))
    who = "MODeL (baseline)" if r.get("source") == "model" else "Rhino"
    print(f"{who:{w}}{human(r['rhino_peak_bytes']):>12}" + ("  optimal (equals a bound)" if r.get("optimal") else ""))
    print(f"{'live peak of this order':{w}}{human(r['lower_bound_bytes']):>12}  (no layout of it is lower)")
    print(f"{'order lower bound':{w}}{human(r['order_lower_bound_bytes']):>12}  (no order is lower)")
    if r.get("skipped_baselines"):
        print(f"baselines skipped for the time limit: {', '.join(r['skipped_baselines'])}")
    print(f"solve seconds: {r['solve_seconds']:.2f}   valid: {'yes' if r['valid'] else 'NO: ' + r.get('invalid_reason', '')}")
    print(f"state outside the arena: {human(r['state_bytes'])} (parameters {human(r['param_bytes'])}); "
          f"{r['inplace_state_updates']} state tensors updated in place")
    ex = r.get("execute")
    if ex:
        print(f"execute: {'OK' if ex['equal'] else 'MISMATCH'} (bitwise {'yes' if ex['bitwise'] else 'no'}, "
              f"max abs diff {ex['max_abs_diff']:.3g}); arena {human(ex['arena_bytes'])} "
              f"({'=' if ex['arena_equals_plan'] else '!='} plan); ops writing into their slot "
              f"{ex['out_variant_ops']}, copied in {ex['copied_ops']}, views {ex['view_ops']}")
    for p in r.get("report", []):
        print(f"wrote {p}")


def _print_ranks(r: dict) -> None:
    print(f"memory plans per rank for {r['workload']}: mesh {r['mesh']} ({r['strategy']}), level {r['level']}, "
          f"{r['distinct_programs']} distinct rank program(s)")
    cols = (("rank", "rank"), ("PyTorch live", "pytorch_live_peak_bytes"), ("PyTorch alloc", "pytorch_peak_bytes"),
            ("best-fit", "bestfit_peak_bytes"), ("heuristic", "heuristic_peak_bytes"), ("Rhino", "rhino_peak_bytes"),
            ("order bound", "order_lower_bound_bytes"), ("layout bound", "lower_bound_bytes"))
    print("".join(f"{name:>14}" for name, _ in cols) + "  valid")
    for row in r["ranks"]:
        cells = [f"{row['rank']:>14}"] + [f"{human(row[k]):>14}" for _, k in cols[1:]]
        print("".join(cells) + f"  {'yes' if row['valid'] else 'NO: ' + row.get('invalid_reason', '')}")
    ex = r.get("execute")
    if ex:
        print(f"execute (every rank, lockstep): {'OK' if ex['equal'] else 'MISMATCH'} (bitwise "
              f"{'yes' if ex['bitwise'] else 'no'}, max abs diff {ex['max_abs_diff']:.3g}); arena bytes "
              f"{'=' if ex['arena_equals_plan'] else '!='} plan on every rank")


def write_report(problem, plan, out: Path) -> list[Path]:
    """PNGs: live bytes per step (program vs planned order), and the layout (time x address)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    from ..memory.problem import lifetimes
    from ..memory.simulate import replay
    mib = 2 ** 20
    before = replay(problem, problem.op_ids()).live
    after = replay(problem, plan.order).live
    paths = []
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(range(len(before)), [b / mib for b in before], lw=1, label=f"program order (peak {human(max(before, default=0))})")
    ax.plot(range(len(after)), [b / mib for b in after], lw=1, label=f"planned order (peak {human(max(after, default=0))})")
    ax.axhline(plan.height / mib, color="k", ls="--", lw=0.8, label=f"arena (Rhino) {human(plan.height)}")
    ax.set_xlabel("step")
    ax.set_ylabel("live bytes (MiB)")
    ax.set_title(f"memory over time: {problem.name}")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    p = out / "memory_over_time.png"
    with quiet_warnings():
        fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    lt = lifetimes(problem, plan.order)
    polys = []
    for tid, t in problem.tensors.items():
        if t.size == 0 or tid not in plan.offsets:
            continue
        lo, hi = lt[tid]
        a, b = plan.offsets[tid] / mib, (plan.offsets[tid] + t.size) / mib
        polys.append([(lo, a), (hi, a), (hi, b), (lo, b)])
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.add_collection(PolyCollection(polys, facecolors="tab:blue", edgecolors="navy", linewidths=0.2, alpha=0.7))
    ax.set_xlim(0, max(len(plan.order), 1))
    ax.set_ylim(0, max(plan.height / mib, 1e-6) * 1.02)
    ax.set_xlabel("step (planned order)")
    ax.set_ylabel("address (MiB)")
    ax.set_title(f"layout: {len(polys)} tensors in {human(plan.height)}")
    fig.tight_layout()
    p = out / "layout.png"
    with quiet_warnings():
        fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
