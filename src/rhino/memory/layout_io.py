"""MiniMalloc CSV instances: ``id,lower,upper,size[,alignment][,offset]`` with half-open lifetimes; without an
``id`` column the buffers are numbered by row from 0."""
from __future__ import annotations

import csv
import gc
import io
import itertools
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
    # the collector paused: a million new objects set off collections of all of them (1,000,000 buffers:
    # 1.6 s -> 0.7 s to make); a spreadsheet's byte-order mark is not a name; rows are read one at a time
    # (the rows of 1,000,000 buffers held at once took ~0.3 GB more)
    paused = gc.isenabled()
    gc.disable()
    try:
        fast = _read_plain(path)
        if fast is not None:
            return fast
        with path.open(newline="", encoding="utf-8-sig") as f:
            return _read_rows(path.name, csv.reader(f))
    except UnicodeDecodeError as exc:  # (its own message names neither the file nor the line)
        raise ValueError(f"{path.name} is not UTF-8 text ({exc.reason}); save it as UTF-8 CSV") from None
    except csv.Error as exc:
        raise ValueError(f"{path.name}: {exc}") from None
    finally:
        if paused:
            gc.enable()


# a plain file's body: digits, commas, minus signs and line ends only
_PLAIN = b"0123456789,-\n"
# each byte's class: a digit 1-9, a zero, a separator (comma, line end), a minus
_DIGIT, _ZERO, _SEP, _MINUS = range(4)
_CLASS = np.zeros(256, np.uint8)
_CLASS[ord("0")], _CLASS[ord(",")], _CLASS[ord("\n")], _CLASS[ord("-")] = _ZERO, _SEP, _SEP, _MINUS


def _bad_triples() -> np.ndarray:
    """Which classes of three bytes in a row numpy would read otherwise than ``_read_rows``: an empty field
    or a blank line, a minus inside a field or before no digit, "-0", a leading zero ("007", "-0" are ids
    that stay strings there)."""
    def pair(a, b):
        return (a == b == _SEP or a == _MINUS and b != _DIGIT or b == _MINUS and a != _SEP)
    bad = np.zeros(64, bool)
    for a, b, c in itertools.product(range(4), repeat=3):
        lead = a in (_SEP, _MINUS) and b == _ZERO and c in (_DIGIT, _ZERO)
        bad[16 * a + 4 * b + c] = pair(a, b) or pair(b, c) or lead
    return bad


_BAD = _bad_triples()


def _plain(body: bytes) -> bool:
    """Whether numpy reads ``body`` as ``_read_rows`` does: only ``_PLAIN`` bytes, none of ``_BAD`` (a table
    of byte classes: 0.2 s on 1,000,000 rows, where a regex took 1.7 s)."""
    if not body.strip(b"\n") or body.translate(None, _PLAIN):
        return False
    c = _CLASS[np.frombuffer(b"\n" + body.rstrip(b"\n") + b"\n", np.uint8)]
    return not _BAD[(c[:-2] << 4) | (c[1:-1] << 2) | c[2:]].any()


def _read_plain(path: Path) -> list[Buffer] | None:
    """``read_buffers`` in one numpy call, for a file whose rows are plain integers (``_plain``), as many as
    the header names, that passes every check of ``_read_rows``; None for any other file, which
    ``_read_rows`` reads (and names the line of what is wrong). The same buffers: 1,000,000 rows in 1.4 s
    instead of 3.5 s (both with the collector paused)."""
    data = path.read_bytes()
    data = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    head, _, body = data.partition(b"\n")
    if not head.isascii() or not _plain(body):
        return None
    header = _header(path.name, next(csv.reader([head.decode()]), []))
    col = {k: header.index(k) for k in header}
    try:
        rows = np.loadtxt(io.BytesIO(body), delimiter=",", dtype=np.int64, ndmin=2)
    except (ValueError, OverflowError):  # a row of another length, a number beyond int64
        return None
    if rows.shape[1] != len(header):
        return None
    lo, up, sz = (rows[:, col[k]] for k in _REQUIRED)
    al = rows[:, col["alignment"]] if "alignment" in col else np.ones(len(rows), np.int64)
    ids = rows[:, col["id"]] if "id" in col else np.arange(len(rows))
    big = any(((x <= -_BIG) | (x >= _BIG)).any() for x in (lo, up, sz, al))
    s = np.sort(ids)
    if big or (sz < 0).any() or (up <= lo).any() or (al < 1).any() or (s[1:] == s[:-1]).any():
        return None
    out = list(map(Buffer, ids.tolist(), lo.tolist(), up.tolist(), sz.tolist(), al.tolist()))
    if float(sz.sum(dtype=np.float64)) >= _LIVE_MAX / 2:  # (int64 sums may wrap: checked as _read_rows does)
        _check_live(path.name, out)
    return out


def _header(name: str, first: list[str]) -> list[str]:
    """The column names of the first row, lower case; a ValueError if one is missing or named twice."""
    header = [h.strip().lower() for h in first]
    missing = [k for k in _REQUIRED if k not in header]
    if missing:
        sep = next((c for c in ";\t|" if len(first) == 1 and c in first[0]), None)
        hint = f"; fields are separated by commas, not {sep!r}" if sep else " (expected id,lower,upper,size)"
        raise ValueError(f"{name} line 1: the header lacks {', '.join(missing)}{hint}")
    twice = sorted({h for h in header if h and header.count(h) > 1} & {"id", "alignment", "offset", *_REQUIRED})
    if twice:  # (the first would be read and the second ignored)
        raise ValueError(f"{name} line 1: the header names {', '.join(twice)} twice")
    return header


def _read_rows(name: str, rows) -> list[Buffer]:
    """``read_buffers`` of the rows of a CSV reader."""
    first = next(rows, None)
    if first is None:
        raise ValueError(f"{name} is empty; expected the header id,lower,upper,size")
    header = _header(name, first)
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
        if all(type(b.id) is int for b in buffers):  # nothing to quote: the rows as csv writes them, 2.5x faster
            a = ",{}".format if aligned else "".format
            f.writelines([f"{b.id},{b.lower},{b.upper},{b.size}{a(b.alignment)},{offsets[b.id]}\r\n" for b in buffers])
            return
        for b in buffers:
            w.writerow([b.id, b.lower, b.upper, b.size] + ([b.alignment] if aligned else []) + [offsets[b.id]])
