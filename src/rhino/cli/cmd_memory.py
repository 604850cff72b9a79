"""``rhino memory FILE[:FUNC] [--level O1|O2] [--time-limit S] [--execute] [--report DIR] [--json]``.

Captures the step (fake/meta tensors: nothing is allocated), turns it into a memory problem
(``memory.from_graph``), plans an operator order and an arena layout (``memory.plan.plan_memory``) and
prints the four baselines next to Rhino's peak. ``--execute`` runs one step with the arena executor
(``lower.arena``) and compares it with the plain single-device program; ``--report DIR`` writes PNGs.
Peaks count the arena only (the step's tensors); the state (parameters, optimizer state, buffers) lives
outside it and is printed on its own line.
"""
from __future__ import annotations

import time
from pathlib import Path

from ..capture import capture, load_workload
from ..memory.from_graph import problem_from_graph
from .common import emit_json, quiet_warnings, status

LEVELS = ("O1", "O2")


def add_parser(sub) -> None:
    p = sub.add_parser("memory", help="plan an operator order and a memory layout (ROAM) for one device")
    p.add_argument("workload", metavar="FILE[:FUNC]")
    p.add_argument("--level", default="O2", choices=LEVELS, help="O1: heuristics (seconds); O2: + exact "
                   "CP-SAT windows (default)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S",
                   help="seconds for the solver (default 60); the best plan found by then is kept")
    p.add_argument("--execute", action="store_true",
                   help="run one step with the planned arena and compare with plain PyTorch")
    p.add_argument("--report", metavar="DIR", help="write PNGs: memory over time, layout")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def human(n: float) -> str:
    """Bytes in binary units: ``1536 -> '1.50 KiB'``."""
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
    if args.time_limit <= 0:
        raise ValueError("--time-limit must be a positive number of seconds")
    report = Path(args.report) if args.report else None
    if report is not None and report.exists() and not report.is_dir():
        raise ValueError(f"--report {args.report!r} is a file; give a directory")
    w = load_workload(args.workload)
    if args.execute and w.on_meta:
        raise ValueError(f"{args.workload} builds its model on the meta device, which holds no data; drop "
                         f"--execute to plan only, or build the workload on a real device to execute it")
    show = not args.json
    status(f"capturing {args.workload} ...", show)
    with quiet_warnings():
        cap = capture(w)
    problem, mapping = problem_from_graph(cap.graph, name=args.workload)
    problem.validate()
    status(f"planning {len(problem.ops)} ops, {len(problem.tensors)} tensors at {args.level} "
           f"(time limit {args.time_limit:g} s) ...", show)
    from ..memory.plan import plan_memory
    plan = plan_memory(problem, level=args.level, time_limit=args.time_limit, progress=_Progress(show))
    realigned = _align(problem, mapping, plan)
    check = _check(problem, plan)

    result = {
        "ok": bool(plan.valid and check is None),
        "workload": args.workload,
        "ops": len(problem.ops),
        "tensors": len(problem.tensors),
        "level": args.level,
        "pytorch_live_peak_bytes": int(plan.pytorch_live_peak),
        "pytorch_peak_bytes": int(plan.pytorch_peak),
        "bestfit_peak_bytes": int(plan.bestfit_peak),
        "heuristic_peak_bytes": int(plan.heuristic_peak),
        "rhino_peak_bytes": int(plan.height),
        "lower_bound_bytes": int(plan.lower_bound),
        "solve_seconds": round(float(plan.solve_seconds), 3),
        "valid": bool(plan.valid and check is None),
        "source": getattr(plan, "source", ""),
        "state_bytes": mapping.state_bytes,
        "param_bytes": mapping.param_bytes,
        "inplace_state_updates": len(mapping.inplace),
        "realigned": realigned,
        "reduction": {k: _reduction(plan.height, getattr(plan, attr)) for k, attr in _BASELINES},
    }
    if check is not None:
        result["invalid_reason"] = check
    if args.execute:
        status("executing one step in the arena and in plain PyTorch ...", show)
        result["execute"] = _execute(cap, problem, mapping, plan)
        result["ok"] = result["ok"] and result["execute"]["equal"] and result["execute"]["arena_equals_plan"]
    if report is not None:
        report.mkdir(parents=True, exist_ok=True)
        result["report"] = [str(p) for p in write_report(problem, plan, report)]
    if args.json:
        emit_json(result)
    else:
        _print_table(result)
    return 0 if result["ok"] else 1


_BASELINES = (("pytorch_live", "pytorch_live_peak"), ("pytorch", "pytorch_peak"), ("bestfit", "bestfit_peak"),
              ("heuristic", "heuristic_peak"))


def _reduction(ours: int, base: int) -> float:
    return round(1.0 - ours / base, 4) if base > 0 else 0.0


def _align(problem, mapping, plan) -> bool:
    """Offsets the executor can use: each a multiple of ``mapping.align`` (re-placed if not; never higher)."""
    from ..memory.from_graph import aligned_offsets
    if all(plan.offsets.get(t, 0) % mapping.align == 0 for t, x in problem.tensors.items() if x.size):
        return False
    plan.offsets, height = aligned_offsets(problem, plan.order, plan.offsets, mapping.align)
    plan.valid = plan.valid and height <= plan.height  # aligning never raises the arena; the check reports it
    plan.height = max(height, plan.height)
    return True


def _check(problem, plan) -> str | None:
    """Independent check of the plan: the order (``check_order``) and the layout (``validate_layout``)."""
    from ..memory.layout import validate_layout
    from ..memory.problem import buffers
    from ..memory.simulate import check_order
    try:
        check_order(problem, plan.order)
    except ValueError as exc:
        return f"order: {exc}"
    errors = validate_layout(buffers(problem, plan.order), plan.offsets, capacity=plan.height)
    return f"layout: {errors[0]}" if errors else None


def _execute(cap, problem, mapping, plan) -> dict:
    import torch

    from ..check import ATOL, RTOL
    from ..lower import StepProgram
    from ..lower.arena import ArenaProgram
    arena = ArenaProgram(cap.graph, problem, mapping, plan.order, plan.offsets, plan.height, debug=True)
    ref = StepProgram(cap.graph)
    s_ref, s_arena = cap.initial_state(), cap.initial_state()
    batch = cap.workload.batch
    torch.manual_seed(0)
    loss_ref = ref.step(s_ref, batch)
    torch.manual_seed(0)
    loss_arena = arena.step(s_arena, batch)
    pairs = [("loss", loss_ref, loss_arena)] + [(k, s_ref[k], s_arena[k]) for k in s_ref]
    max_diff, equal, bitwise = 0.0, True, True
    for _, a, b in pairs:
        if a.numel() == 0:
            continue
        a64, b64 = a.double(), b.double()
        max_diff = max(max_diff, float((a64 - b64).abs().max()))
        equal = equal and bool(torch.allclose(a64, b64, rtol=RTOL, atol=ATOL, equal_nan=True))
        bitwise = bitwise and bool(torch.equal(a, b))
    st = arena.stats
    return {"equal": equal, "bitwise": bitwise, "max_abs_diff": max_diff, "arena_bytes": st.arena_bytes,
            "arena_equals_plan": st.arena_bytes == plan.height, "out_variant_ops": st.out_variant,
            "copied_ops": st.copied, "view_ops": st.views, "view_copies": st.view_copies,
            "inplace_state": st.inplace_state, "loss": float(loss_arena)}


def _print_table(r: dict) -> None:
    print(f"memory plan for {r['workload']}: {r['ops']} ops, {r['tensors']} tensors, level {r['level']}")
    rows = [("PyTorch (live bytes)", r["pytorch_live_peak_bytes"], r["reduction"]["pytorch_live"]),
            ("PyTorch (caching allocator)", r["pytorch_peak_bytes"], r["reduction"]["pytorch"]),
            ("best-fit layout", r["bestfit_peak_bytes"], r["reduction"]["bestfit"]),
            ("heuristic (least-peak + long-lived-first)", r["heuristic_peak_bytes"], r["reduction"]["heuristic"])]
    w = max(len(n) for n, _, _ in rows) + 2
    print(f"{'':{w}}{'peak':>12}  {'Rhino saves':>11}")
    for name, b, red in rows:
        print(f"{name:{w}}{human(b):>12}  {red * 100:>10.1f}%")
    print(f"{'Rhino':{w}}{human(r['rhino_peak_bytes']):>12}")
    print(f"{'lower bound':{w}}{human(r['lower_bound_bytes']):>12}")
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
