"""Tensor types of the IR: dtypes and static shapes. Pure Python, no framework import."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from math import prod

__all__ = ["DType", "TensorType", "Device", "Layout", "MemoryFormat"]


class DType(str, Enum):
    """Element types, named as in PyTorch (``torch.<name>``)."""

    float64 = "float64"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    complex64 = "complex64"
    complex128 = "complex128"
    int64 = "int64"
    int32 = "int32"
    int16 = "int16"
    int8 = "int8"
    uint8 = "uint8"
    bool = "bool"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_floating(self) -> bool:
        return self in (DType.float64, DType.float32, DType.float16, DType.bfloat16)

    @property
    def is_complex(self) -> bool:
        return self in (DType.complex64, DType.complex128)


_ITEMSIZE = {
    DType.float64: 8, DType.float32: 4, DType.float16: 2, DType.bfloat16: 2,
    DType.complex64: 8, DType.complex128: 16, DType.int64: 8, DType.int32: 4,
    DType.int16: 2, DType.int8: 1, DType.uint8: 1, DType.bool: 1,
}


@dataclass(frozen=True)
class TensorType:
    """A tensor's static type: shape and element type."""

    shape: tuple[int, ...]
    dtype: DType

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype.value}[{','.join(map(str, self.shape))}]"


# Non-tensor constants that appear among op arguments. They are plain tagged
# strings so a graph stays framework independent and JSON friendly.
@dataclass(frozen=True)
class Device:
    """A device argument. Lowering replaces it with the executing device."""

    name: str


@dataclass(frozen=True)
class Layout:
    name: str  # e.g. "strided"


@dataclass(frozen=True)
class MemoryFormat:
    name: str  # e.g. "contiguous_format", "preserve_format"
