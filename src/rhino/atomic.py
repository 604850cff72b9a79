"""Atomic file writes (no rhino imports; every package may use it).

A file is written to a temporary file in the target's directory and renamed over the target, so a reader
never sees it half-written and an interrupted write leaves the old file in place. The new file gets the
permissions ``open(path, "w")`` would give it (an existing target's own; else ``0o666`` less the umask),
not ``tempfile.mkstemp``'s ``0o600``.
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "check_file_target", "write_atomic"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; renamed over ``path`` when the block ends without an
    exception, removed otherwise."""
    path = check_file_target(path)
    fd, name = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _mode(path))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def check_file_target(path: str | os.PathLike) -> Path:
    """``path`` as a file that may be (over)written: a FileNotFoundError when its directory does not exist, a
    ValueError when it is a directory (the rename would fail only after the file was written)."""
    path = Path(path)
    if path.parent and not path.parent.is_dir():
        raise FileNotFoundError(f"directory {str(path.parent)!r} does not exist; create it or choose another path")
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory; give the path of a file to write")
    return path


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _mode(path: Path) -> int:
    if path.exists():
        return stat.S_IMODE(path.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
