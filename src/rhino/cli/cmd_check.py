"""``rhino check FILE[:FUNC] [--steps N] [--json]``."""
from __future__ import annotations

from .common import BATCHES_UNUSED, DTYPE_NAMES, emit_json, quiet_warnings, status


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="run N steps through Rhino and plain PyTorch and compare")
    p.add_argument("workload", metavar="FILE[:FUNC]")
    p.add_argument("--steps", type=int, default=2, help="training steps to compare (default 2)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="build the workload under this default dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..capture import DTYPES, default_dtype
    with default_dtype(DTYPES.get(args.dtype)):
        return _run(args)


def _run(args) -> int:
    from ..capture import capture, load_workload
    from ..check import check_captured
    if args.steps < 1:
        raise ValueError("--steps must be at least 1")
    w = load_workload(args.workload)
    if w.on_meta:
        raise ValueError(f"{args.workload} builds its model on the meta device, which holds no values to run; "
                         f"build it on a real device for check (capture works on meta)")
    status(f"capturing {args.workload} ...", not args.json)
    with quiet_warnings():
        cap = capture(w)
    if w.batches is not None:
        status(f"note: {BATCHES_UNUSED}", not args.json)
    status(f"running {args.steps} steps through Rhino and through PyTorch ...", not args.json)
    r = check_captured(cap, steps=args.steps)
    nodes = len(cap.graph.nodes)
    if args.json:
        emit_json({"ok": r.ok, "steps": r.steps, "max_abs_diff": r.max_abs_diff, "nodes": nodes,
                   "opaque_ops": cap.opaque_ops, "losses": r.losses, "eager_losses": r.eager_losses,
                   "tensors_compared": r.compared, "first_mismatch": r.first_mismatch})
    elif r.ok:
        if cap.opaque_ops:
            status(f"note: opaque ops (run as they are, never sharded): {', '.join(cap.opaque_ops)}")
        print(f"check OK: steps={r.steps} nodes={nodes} opaque={len(cap.opaque_ops)} "
              f"max_abs_diff={r.max_abs_diff:.3g}")
    else:
        print(f"check FAILED: {r.first_mismatch}")
    return 0 if r.ok else 1
