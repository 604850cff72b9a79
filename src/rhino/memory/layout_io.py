"""MiniMalloc CSV instances: ``id,lower,upper,size[,alignment][,offset]`` with half-open lifetimes; without an
``id`` column the buffers are numbered by row from 0."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from ..atomic import atomic_path
from .layout import Buffer

__all__ = ["read_buffers", "write_offsets"]

_REQUIRED = ("lower", "upper", "size")
# the solvers work in int64: every time, size and alignment below 2**62, the bytes live at once below 2**60
_BIG = 2 ** 62
_LIVE_MAX = 2 ** 60


def read_buffers(path: str | Path) -> list[Buffer]:
    """Buffers of a MiniMalloc CSV; a malformed row is a ValueError naming the file and line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir():  # (else IsADirectoryError's traceback)
        raise ValueError(f"{path} is a directory; give the path of a CSV file")
    # a spreadsheet's byte-order mark is not a name; rows are read one at a time (the rows of 1,000,000
    # buffers held at once took ~0.3 GB more)
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            return _read_rows(path.name, csv.reader(f))
    except UnicodeDecodeError as exc:  # (its own message names neither the file nor the line)
        raise ValueError(f"{path.name} is not UTF-8 text ({exc.reason}); save it as UTF-8 CSV") from None
    except csv.Error as exc:
        raise ValueError(f"{path.name}: {exc}") from None


def _read_rows(name: str, rows) -> list[Buffer]:
    """``read_buffers`` of the rows of a CSV reader."""
    first = next(rows, None)
    if first is None:
        raise ValueError(f"{name} is empty; expected the header id,lower,upper,size")
    header = [h.strip().lower() for h in first]
    missing = [k for k in _REQUIRED if k not in header]
    if missing:
        sep = next((c for c in ";\t|" if len(first) == 1 and c in first[0]), None)
        hint = f"; fields are separated by commas, not {sep!r}" if sep else " (expected id,lower,upper,size)"
        raise ValueError(f"{name} line 1: the header lacks {', '.join(missing)}{hint}")
    twice = sorted({h for h in header if h and header.count(h) > 1} & {"id", "alignment", "offset", *_REQUIRED})
    if twice:  # (the first would be read and the second ignored)
        raise ValueError(f"{name} line 1: the header names {', '.join(twice)} twice")
    col = {k: header.index(k) for k in header}
    numbered = "id" not in col
    out, seen, total = [], set(), 0
    for line, row in enumerate(rows, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) < len(header):
            raise ValueError(f"{name} line {line}: {len(row)} fields, expected {len(header)}")
        ident = str(len(out)) if numbered else row[col["id"]].strip()
        if not ident:
            raise ValueError(f"{name} line {line}: the id is empty")
        # an id is a number only where it reads back the same (``write_offsets`` writes it): "007" and "+1"
        # stay strings, distinct from 7 and 1
        vals = {"id": int(ident) if ident.lstrip("-").isdigit() and str(int(ident)) == ident else ident}
        for k in ("lower", "upper", "size") + (("alignment",) if "alignment" in col else ()):
            text = row[col[k]].strip()
            try:
                vals[k] = int(text)
            except ValueError:
                raise ValueError(f"{name} line {line}: {k} {text!r} is not an integer") from None
            if not -_BIG < vals[k] < _BIG:
                raise ValueError(f"{name} line {line}: {k} {text} is beyond 2**62; the layout works in 64-bit "
                                 f"integers: give times and sizes in larger units")
        if vals["size"] < 0:
            raise ValueError(f"{name} line {line}: size ({vals['size']}) must not be negative")
        if vals["upper"] <= vals["lower"]:
            raise ValueError(f"{name} line {line}: upper ({vals['upper']}) must be greater than lower "
                             f"({vals['lower']})")
        if vals.get("alignment", 1) < 1:
            raise ValueError(f"{name} line {line}: alignment must be at least 1")
        if vals["id"] in seen:
            raise ValueError(f"{name} line {line}: id {vals['id']} appears twice")
        seen.add(vals["id"])
        total += vals["size"]
        out.append(Buffer(vals["id"], vals["lower"], vals["upper"], vals["size"], vals.get("alignment", 1)))
    if total >= _LIVE_MAX:
        _check_live(name, out)
    return out


def _check_live(name: str, buffers: list[Buffer]) -> None:
    """The most bytes live at once below ``_LIVE_MAX``, so that heights of several times it fit in int64
    (computed in floats, which cannot overflow)."""
    lo, up, sz = (np.array([float(getattr(b, f)) for b in buffers]) for f in ("lower", "upper", "size"))
    t, d = np.concatenate([lo, up]), np.concatenate([sz, -sz])
    load = float(np.cumsum(d[np.lexsort((d, t))]).max())
    if load >= _LIVE_MAX:
        raise ValueError(f"{name}: the most bytes live at once (about {load:.3g}) must stay below 2**60, as the "
                         f"layout works in 64-bit integers; give sizes in larger units (e.g. KiB)")


def write_offsets(path: str | Path, buffers: list[Buffer], offsets: dict) -> None:
    """The instance with an ``offset`` column (and ``alignment`` where a buffer has one above 1, so that the
    file reads back as the same instance), written atomically."""
    aligned = any(b.alignment != 1 for b in buffers)
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "lower", "upper", "size"] + (["alignment"] if aligned else []) + ["offset"])
        for b in buffers:
            w.writerow([b.id, b.lower, b.upper, b.size] + ([b.alignment] if aligned else []) + [offsets[b.id]])
