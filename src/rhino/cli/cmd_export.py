"""``rhino export DIR --out FILE [--optimizer] [--json]``: a sharded checkpoint as one plain ``state_dict``
file (``torch.save``) that eager PyTorch's ``model.load_state_dict(sd, strict=True)`` accepts; with
``--optimizer`` the file holds ``{"model": ..., "optimizer": ...}`` (``runtime/export.py``)."""
from __future__ import annotations

from .common import emit_json, status

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a plain single-device state_dict file")
    p.add_argument("checkpoint", metavar="DIR", help="a checkpoint root (its latest checkpoint) or one step-N dir")
    p.add_argument("--out", required=True, metavar="FILE", help="the file to write (torch.save)")
    p.add_argument("--optimizer", action="store_true", help="also the optimizer state: the file holds "
                   "{'model': state_dict, 'optimizer': optimizer state_dict}")
    p.add_argument("--json", action="store_true", help="print one JSON object: checkpoint, step, out, keys, bytes")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..runtime.export import write_export
    status(f"exporting {args.checkpoint} ...", not args.json)
    r = write_export(args.checkpoint, args.out, optimizer=args.optimizer)
    if args.json:
        emit_json({"ok": True, **r})
    else:
        print(f"exported step {r['step']} of {r['checkpoint']} to {r['out']}: {r['keys']} model keys"
              f"{' and the optimizer state' if r['optimizer'] else ''}, {r['bytes'] / 2**20:.2f} MiB")
    return 0
