"""``layout_io``'s two readers: numpy's for plain integer files and the row-by-row one for everything else read
the same buffers, and anything the plain reader would read otherwise goes to the row reader."""
from __future__ import annotations

import csv
import random

from rhino.memory import layout_io
from rhino.memory.layout import Buffer
from rhino.memory.layout_io import read_buffers, write_offsets

# fields that read differently as numbers and as ids ("007", "-0", "+1"), or are refused, next to plain ones
_ODD = ["0", "7", "12", "-3", "-0", "007", "0012", "+1", " 5", "5 ", "", "x", "1e3", "9" * 20, str(2 ** 62),
        str(-2 ** 62), str(2 ** 62 - 1), "-", "--5", "3-4", "1.0"]
_HEADERS = ["id,lower,upper,size", "lower,upper,size", "id,lower,upper,size,alignment",
            "lower,upper,size,alignment,id", "ID, Lower,upper,size", "id,lower,upper,size,"]


def _rows_reader(path):
    """The row-by-row reader alone: its buffers, or its refusal's message."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            return layout_io._read_rows(path.name, csv.reader(f))
    except ValueError as exc:
        return str(exc)


def test_plain_reader_reads_what_the_row_reader_reads(tmp_path):
    """On 1,500 small files of odd fields, blank lines, short and long rows: where the numpy reader reads a
    file, the row reader reads the same buffers (ids of the same type); where it refuses the header, with
    the same message. Each of its checks matters here: without the leading-zero one, "007" became 7."""
    rng = random.Random(5)
    p, plain = tmp_path / "x.csv", 0
    for _ in range(1500):
        head = rng.choice(_HEADERS)
        rows = []
        for _ in range(rng.randint(0, 6)):
            k = len(head.split(",")) + (rng.choice([-1, 1]) if rng.random() < 0.05 else 0)
            rows.append("" if rng.random() < 0.05 else ",".join(
                rng.choice(_ODD) if rng.random() < 0.1 else str(rng.randint(0, 30) if c != 3 else rng.randint(0, 9))
                for c in range(k)))
        p.write_text(head + "\n" + "\n".join(rows) + ("\n" if rng.random() < 0.8 else ""))
        try:
            fast = layout_io._read_plain(p)
        except ValueError as exc:
            assert str(exc) == _rows_reader(p)
            continue
        if fast is not None:
            plain += 1
            slow = _rows_reader(p)
            assert fast == slow and [type(b.id) for b in fast] == [type(b.id) for b in slow], p.read_text()
    assert plain > 50  # (the plain reader is not always refusing)
    for odd in ("-0", "007", "-07", "0"):  # ids that are strings but for "0", each in a file otherwise plain
        p.write_text(f"id,lower,upper,size\n{odd},0,4,8\n1,2,6,3\n")
        assert read_buffers(p) == _rows_reader(p) and read_buffers(p)[0].id == (0 if odd == "0" else odd)


def test_large_plain_file_round_trips(tmp_path):
    """A plain 20,000-row file is read by numpy, equal to the row reader; written back with offsets (ids
    written without the csv module where all are integers) it reads back the same, offsets included."""
    rng = random.Random(2)
    bufs = []
    for i in range(20_000):
        a = rng.randrange(-1000, 10 ** 6)
        bufs.append(Buffer(3 * i, a, a + rng.randint(1, 500), rng.randint(0, 10 ** 6), rng.choice([1, 64, 4096])))
    p = tmp_path / "t.csv"
    p.write_text("id,lower,upper,size,alignment\n" +
                 "".join(f"{b.id},{b.lower},{b.upper},{b.size},{b.alignment}\n" for b in bufs))
    assert layout_io._read_plain(p) == _rows_reader(p) == bufs == read_buffers(p)
    out = tmp_path / "o.csv"
    offsets = {b.id: 4096 * k for k, b in enumerate(bufs)}
    write_offsets(out, bufs, offsets)
    with out.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["id", "lower", "upper", "size", "alignment", "offset"]
    assert [int(r[5]) for r in rows[1:]] == [offsets[b.id] for b in bufs] and read_buffers(out) == bufs
