"""``rhino demo``: check the GPT example and summarise its IR."""
from __future__ import annotations

from pathlib import Path

from ..capture import capture, load_workload
from ..check import check_captured
from ..ir.summary import summarize
from .common import emit_json, quiet_warnings, status

DEFAULT = Path(__file__).resolve().parents[3] / "examples" / "gpt.py"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="capture and check the GPT example, print an IR summary")
    p.add_argument("workload", nargs="?", default=str(DEFAULT), metavar="FILE[:FUNC]")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    status(f"capturing {args.workload} ...", not args.json)
    with quiet_warnings():
        cap = capture(load_workload(args.workload))
    status("checking 2 steps against plain PyTorch ...", not args.json)
    r = check_captured(cap, steps=2)
    s = summarize(cap.graph)
    if args.json:
        emit_json({"ok": r.ok, "max_abs_diff": r.max_abs_diff, "nodes": s.nodes, "ops_by_kind": s.ops_by_kind,
                   "flops": s.flops, "param_bytes": s.param_bytes, "opt_state_bytes": s.opt_state_bytes,
                   "opaque_ops": s.opaque_ops, "capture_seconds": cap.seconds})
        return 0 if r.ok else 1
    print(f"workload   {args.workload}")
    print(f"graph      {s.nodes} nodes (forward + backward + {cap.workload.optimizer.__class__.__name__} update), "
          f"{s.params:,} parameters, captured in {cap.seconds:.2f} s")
    print(f"FLOPs      {s.flops:,} per step")
    print(f"state      params {_mb(s.param_bytes)}, optimizer {_mb(s.opt_state_bytes)}, "
          f"buffers {_mb(s.buffer_bytes)}, batch {_mb(s.batch_bytes)}")
    print("ops        " + ", ".join(f"{k} {v}" for k, v in s.ops_by_kind.items()))
    verdict = "OK" if r.ok else f"FAILED ({r.first_mismatch})"
    print(f"check {verdict}: steps=2 nodes={s.nodes} opaque={len(s.opaque_ops)} max_abs_diff={r.max_abs_diff:.3g}")
    return 0 if r.ok else 1


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
