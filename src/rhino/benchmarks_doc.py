"""Writing one section of docs/benchmarks.md without touching the others (benchmarks share the file)."""
from __future__ import annotations

import os
from pathlib import Path

from .atomic import write_atomic

__all__ = ["replace_section", "priority_note"]


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
    write_atomic(path, "\n".join(lines).rstrip("\n") + "\n")


def priority_note() -> str:
    """How this process is scheduled, for a timing benchmark's "Command" line: timing runs on this shared
    2-core machine are taken under ``chrt -r 1`` (SCHED_RR, priority 1; inherited by the ranks it starts),
    so other processes sharing the machine do not preempt the ranks or their communication threads."""
    policy = os.sched_getscheduler(0)
    if policy in (os.SCHED_RR, os.SCHED_FIFO):
        name = "chrt -r" if policy == os.SCHED_RR else "chrt -f"
        return (f"under `{name} {os.sched_getparam(0).sched_priority}` (real-time priority: other processes "
                "sharing the machine, e.g. background jobs, do not preempt it)")
    return "at normal priority (other processes sharing the machine compete for the cores)"
