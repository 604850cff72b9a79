"""Logical device meshes: named axes with sizes; rank <-> coordinates (row-major)."""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

__all__ = ["Mesh"]


@dataclass(frozen=True)
class Mesh:
    """A logical mesh, e.g. ``Mesh(("dp", "tp"), (2, 2))``; rank r has coordinates in row-major order."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.sizes):
            raise ValueError(f"mesh has {len(self.names)} axis names but {len(self.sizes)} sizes")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh axis names must be distinct, got {self.names}")
        if any(s < 1 for s in self.sizes):
            raise ValueError(f"mesh axis sizes must be positive, got {self.sizes}")

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def world(self) -> int:
        return prod(self.sizes)

    def size(self, axis: int | str) -> int:
        return self.sizes[self.axis(axis)]

    def axis(self, axis: int | str) -> int:
        return self.names.index(axis) if isinstance(axis, str) else axis

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.sizes):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def rank_of(self, coords: tuple[int, ...]) -> int:
        r = 0
        for c, s in zip(coords, self.sizes):
            r = r * s + c
        return r

    def groups(self, axis: int | str) -> list[list[int]]:
        """The rank groups that communicate along ``axis`` (one group per other-coordinate)."""
        a = self.axis(axis)
        groups: dict[tuple, list[int]] = {}
        for r in range(self.world):
            c = self.coords(r)
            groups.setdefault(c[:a] + c[a + 1:], []).append(r)
        return list(groups.values())

    def __str__(self) -> str:
        return "x".join(f"{n}{s}" for n, s in zip(self.names, self.sizes))

    @classmethod
    def parse(cls, text: str) -> "Mesh":
        """``"dp2xtp2"`` -> Mesh(("dp", "tp"), (2, 2))."""
        names, sizes = [], []
        for part in text.split("x"):
            name = part.rstrip("0123456789")
            if not name or name == part:
                raise ValueError(f"mesh axis {part!r} must be a name followed by a size, e.g. dp2")
            names.append(name)
            sizes.append(int(part[len(name):]))
        return cls(tuple(names), tuple(sizes))
