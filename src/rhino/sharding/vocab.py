"""The words a plan is written in: recompute modes and strategy entries (pure). sharding/, cost/, search/,
lower/ and runtime/ parse and produce them here; they stay strings in plan files (``StrEnum`` values).

**Recompute** (a plan's ``recompute``, ``cost.remat``): ``none``, ``full`` or ``selective``.

**Strategy entries**, one per mesh axis of a node's strategy (``sharding.rules``), by ``EntryKind``:

- ``None``: replicated on the axis;
- ``"x"``: annotation letter ``x`` split;
- ``"x/k"``: strided split: ``x`` seen as ``k`` equal blocks, each rank holding its piece of every block
  (a fused QKV output with ``k = 3``);
- ``"~"``: partial passthrough: a linear op takes every tensor input as Partial(sum) and gives a
  Partial(sum) output, with no communication;
- ``"~k"``: passthrough with only tensor input ``k`` Partial (the others Replicate).

``parse_entry`` gives an entry's structure; ``strided`` and ``passthrough`` write one.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Sequence

__all__ = ["Recompute", "RECOMPUTE_MODES", "EntryKind", "Entry", "PASS", "parse_entry", "split_letter",
           "is_split", "is_passthrough", "strided", "passthrough"]


class Recompute(StrEnum):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


#: the recomputation modes' strings, as plan files and strategy strings write them
RECOMPUTE_MODES = tuple(m.value for m in Recompute)

#: The first character of a partial-passthrough entry.
PASS = "~"


class EntryKind(StrEnum):
    REPLICATE = "replicate"     # None
    SPLIT = "split"             # "x"
    STRIDED = "strided"         # "x/k"
    PASS_ALL = "pass"           # "~"
    PASS_ONE = "pass one"       # "~k"


@dataclass(frozen=True)
class Entry:
    kind: EntryKind
    letter: str | None = None       # SPLIT, STRIDED: the split letter
    blocks: int = 1                 # STRIDED: the block count k
    input: int | None = None        # PASS_ONE: the one Partial tensor input


def parse_entry(entry: str | None) -> Entry:
    """The structure of a strategy entry (module docstring)."""
    if entry is None:
        return Entry(EntryKind.REPLICATE)
    if entry.startswith(PASS):
        return Entry(EntryKind.PASS_ALL) if entry == PASS else Entry(EntryKind.PASS_ONE, input=int(entry[len(PASS):]))
    letter, k = split_letter(entry)
    return Entry(EntryKind.SPLIT, letter) if k == 1 else Entry(EntryKind.STRIDED, letter, k)


def split_letter(entry: str) -> tuple[str, int]:
    """A split entry ``"x"`` or ``"x/k"``: the letter ``x`` and the block count ``k`` (1 if not strided)."""
    letter, _, k = entry.partition("/")
    return letter, int(k) if k else 1


def is_passthrough(entry: str | None) -> bool:
    return entry is not None and entry.startswith(PASS)


def is_split(entry: str | None) -> bool:
    """The entry splits a letter (contiguous or strided)."""
    return entry is not None and not entry.startswith(PASS)


def strided(letter: str, blocks: int) -> str:
    """The entry splitting ``letter`` seen as ``blocks`` equal blocks (plain ``letter`` for one block)."""
    return letter if blocks == 1 else f"{letter}/{blocks}"


def passthrough(group: Sequence[int], n_inputs: int) -> str:
    """The passthrough entry for the tensor inputs ``group`` (of ``n_inputs``) taken as Partial: ``~`` when
    that is every input (or the only one), else ``~k`` for the first of the group."""
    return PASS if (len(group) == n_inputs and n_inputs > 1) or n_inputs == 1 else PASS + str(group[0])
