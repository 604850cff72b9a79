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

__all__ = ["atomic_path", "check_dir_target", "check_file_target", "write_atomic"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; renamed over ``path`` when the block ends without an
    exception, removed otherwise."""
    path = check_file_target(path)
    tmp = _temporary(path.parent, f".{path.name}.")
    try:
        yield tmp
        os.chmod(tmp, _mode(path))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def check_file_target(path: str | os.PathLike, *, append: bool = False) -> Path:
    """``path`` as a file that may be (over)written: a FileNotFoundError when its directory does not exist, a
    ValueError when it is a directory or when no file can be created in its directory (the rename would fail
    only after the file was written). ``append``: the file is opened for appending (an existing file must
    be writable itself; nothing is created beside it)."""
    path = Path(path)
    if path.parent and not path.parent.is_dir():
        raise FileNotFoundError(f"directory {str(path.parent)!r} does not exist; create it or choose another path")
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory; give the path of a file to write")
    if append and path.exists():
        try:
            with open(path, "a"):
                pass
        except OSError as exc:
            raise ValueError(f"cannot write to {str(path)!r} ({_reason(exc)}); choose another path") from None
    else:
        _temporary(path.parent, f".{path.name}.").unlink()
    return path


def check_dir_target(path: str | os.PathLike) -> Path:
    """``path`` as a directory that files will be written into (created if missing, by the caller): a
    ValueError when it or the nearest existing folder above it is a file, or when no file can be created
    there; nothing is created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{str(path)!r} is a file; give a directory")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{str(existing)!r} is a file, so directory {str(path)!r} cannot be made; choose another path")
    _temporary(existing, ".rhino-probe.").unlink()
    return path


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _temporary(directory: Path, prefix: str) -> Path:
    """A new empty file in ``directory``; a ValueError naming the directory when none can be created there
    (no permission, a read-only file system)."""
    try:
        fd, name = tempfile.mkstemp(dir=directory or ".", prefix=prefix, suffix=".tmp")
    except OSError as exc:
        raise ValueError(f"cannot create files in directory {str(directory)!r} ({_reason(exc)}); choose a writable "
                         f"path") from None
    os.close(fd)
    return Path(name)


def _reason(exc: OSError) -> str:
    return (exc.strerror or type(exc).__name__).lower()


def _mode(path: Path) -> int:
    if path.exists():
        return stat.S_IMODE(path.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
