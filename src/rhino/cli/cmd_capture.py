"""``rhino capture FILE[:FUNC] [--out graph.json] [--json]``."""
from __future__ import annotations

from ..ir.summary import summarize
from ..atomic import check_file_target
from .common import emit_json, status, write_atomic


def add_parser(sub) -> None:
    p = sub.add_parser("capture", help="capture a training step into the IR (fake/meta tensors)")
    p.add_argument("workload", metavar="FILE[:FUNC]")
    p.add_argument("--out", help="write the IR graph as JSON here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..capture import capture, load_workload
    if args.out:  # a path that cannot be written: refused before the capture
        check_file_target(args.out)
    status(f"capturing {args.workload} ...", not args.json)
    cap = capture(load_workload(args.workload))
    s = summarize(cap.graph)
    if args.out:
        write_atomic(args.out, cap.graph.to_json())
    if args.json:
        emit_json({"ok": True, "nodes": s.nodes, "params": s.params, "seconds": round(cap.seconds, 3),
                   "flops": s.flops, "param_bytes": s.param_bytes, "opaque_ops": cap.opaque_ops,
                   "fingerprint": cap.graph.fingerprint(), "out": args.out})
    else:
        print(f"capture OK: nodes={s.nodes} params={s.params} opaque={len(cap.opaque_ops)} "
              f"seconds={cap.seconds:.2f}" + (f" -> {args.out}" if args.out else ""))
    return 0
