"""``rhino profile [--out profile.json] [--threads T] [--nproc N] [--json]``."""
from __future__ import annotations

import json

from ..atomic import check_file_target
from .common import emit_json, status, write_atomic


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="micro-benchmark this machine (matmul, memory, collectives) for the "
                                       "cost model")
    p.add_argument("--out", help="write the profile (JSON) here; `rhino estimate --profile` reads it")
    p.add_argument("--threads", type=int, help="torch threads per device (default: cores / nproc, as rhino run)")
    p.add_argument("--nproc", type=int, default=2, help="devices of the run to profile for (default 2): that many "
                         "processes measure compute at the same time, then all-reduce; 1 profiles one device "
                         "using this process")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..runtime.profile import measure_profile
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    if args.out:  # a path that cannot be written: refused before the measurements, not after them
        check_file_target(args.out)
    prof = measure_profile(args.threads, args.nproc, progress=lambda m: status(m, not args.json))
    text = prof.to_json()
    if args.out:
        write_atomic(args.out, text)
    if args.json:
        emit_json({"ok": True, "out": args.out, **json.loads(text)})
    else:
        print(f"profile OK: matmul {prof.matmul_flops / 1e9:.1f} GFLOP/s, memory {prof.memory_bandwidth / 1e9:.2f} "
              f"GB/s, op overhead {prof.launch_overhead_s * 1e6:.2f} us"
              + (f", all-reduce {prof.link_bandwidth / 1e9:.2f} GB/s + {prof.link_latency_s * 1e6:.1f} us"
                 if prof.link_bandwidth else "")
              + (f", point-to-point {prof.p2p_bandwidth / 1e9:.2f} GB/s + {prof.p2p_latency_s * 1e6:.1f} us, "
                 f"{prof.p2p_message_s * 1e6:.1f} us per message end" if prof.p2p_bandwidth else "")
              + (f" -> {args.out}" if args.out else ""))
    return 0
