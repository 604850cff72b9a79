"""Helpers shared by subcommands."""
from __future__ import annotations

import json
import sys
import warnings

from .. import atomic

__all__ = ["emit_json", "write_atomic", "status", "quiet_warnings", "DTYPE_NAMES", "BATCHES_UNUSED"]

#: what ``rhino check`` and ``rhino run`` say when the workload file defines ``batches()``
BATCHES_UNUSED = "the file's batches() is not used here: the example batch repeats (rhino train iterates it)"

#: ``capture.DTYPES``'s names, for ``--dtype`` choices without importing torch before the command runs
#: (``rhino layout`` and ``rhino memory`` never need it; tests/test_cli.py keeps the two equal)
DTYPE_NAMES = ("float32", "float64")


def emit_json(obj: dict) -> None:
    print(json.dumps(obj, indent=None, sort_keys=False))


write_atomic = atomic.write_atomic  # (a missing directory or a directory as the path: one sentence, before writing)


def status(message: str, enabled: bool = True) -> None:
    """Progress line on stderr (kept off stdout so --json stays parseable)."""
    if enabled:
        print(message, file=sys.stderr, flush=True)


class quiet_warnings(warnings.catch_warnings):
    """Collect warnings instead of printing them; ``.messages`` has their text."""

    def __enter__(self):
        self.log = super().__enter__()  # type: ignore[assignment]
        warnings.simplefilter("always")
        return self

    @property
    def messages(self) -> list[str]:
        return [str(w.message) for w in (self.log or [])]

    def __init__(self) -> None:
        super().__init__(record=True)
