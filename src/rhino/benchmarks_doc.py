"""Writing one section of docs/benchmarks.md without touching the others (benchmarks share the file)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["replace_section"]


def replace_section(path: str | Path, title: str, body: str) -> None:
    """Replace the text under ``## title`` (up to the next ``## `` heading) with ``body``, or append the
    section; the file is rewritten atomically."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    head = f"## {title}"
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == head)
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        lines[start:end] = [head, "", *body.strip("\n").splitlines(), ""]
    except StopIteration:
        lines += ["", head, "", *body.strip("\n").splitlines(), ""]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n")
    os.replace(tmp, path)
