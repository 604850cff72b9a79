"""``rhino``: the command line. Each subcommand lives in its own module."""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading

__all__ = ["entry", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse's parser; with ``json_errors`` a usage error is ``{"ok": false, "error": ...}`` on stdout, as
    every other error of a ``--json`` command (subcommand parsers are of this class too)."""

    json_errors = False

    def error(self, message: str):
        if self.json_errors:
            print(json.dumps({"ok": False, "error": f"{self.prog}: {message}"}))
            self.exit(2)
        super().error(message)


def _parser(json_errors: bool = False) -> argparse.ArgumentParser:
    from . import (cmd_capture, cmd_check, cmd_demo, cmd_estimate, cmd_export, cmd_launch, cmd_layout, cmd_memory,
                   cmd_plan, cmd_profile, cmd_run, cmd_train)
    _Parser.json_errors = json_errors
    p = _Parser(prog="rhino", description="Automatic parallelization and memory planning "
                "for PyTorch training steps.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in (cmd_demo, cmd_check, cmd_capture, cmd_run, cmd_train, cmd_launch, cmd_export, cmd_estimate,
                cmd_profile, cmd_plan, cmd_memory, cmd_layout):
        mod.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(json_errors="--json" in argv).parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:  # WorkloadError and VerifyError are ValueErrors
        message = str(exc).strip() or type(exc).__name__
        if getattr(args, "json", False):
            print(json.dumps({"ok": False, "error": message}))
        else:
            print(f"rhino {args.command}: error: {message}", file=sys.stderr)
        return 2


def entry() -> None:
    """The ``rhino`` executable: ``main``, then exit. A layout search thread left running at its deadline
    (``memory.layout``: its set-up cannot be interrupted) may still be inside OR-Tools' native code; at
    interpreter shutdown such a daemon thread is ended mid-call, which aborts the process (SIGABRT) after
    the result was printed. So when one is alive, leave at once once the output is flushed."""
    from ..memory.layout import SOLVER_THREAD
    code = main()
    if any(t.is_alive() and t.name.startswith(SOLVER_THREAD) for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
