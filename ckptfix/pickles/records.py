"""Tensor and storage records: what the restricted reader builds for torch's rebuild calls and storages.

Plain data (storage key, dtype, offset, shape, stride), with the dtype tables they use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (
    Any,
    Sequence,
)

# --------------------------------------------------------------------------- dtypes

#: legacy storage class name -> dtype name
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "QInt8Storage": "qint8",
    "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8",
    "TypedStorage": "uint8",
}

#: dtype name -> bytes per element
ELEMENT_SIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "float4_e2m1fn_x2": 1,
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
}


# --------------------------------------------------------------------------- records


@dataclass(eq=False)
class StorageRecord:
    """One storage as a persistent id names it; where its bytes live is filled in by the container."""

    key: str
    dtype: str
    location: str
    numel: int | None = None
    storage_type: type | None = None  # the Stub class the pickle named, e.g. torch.FloatStorage
    view_metadata: Any = None  # legacy format only
    # filled in by the container reader:
    file_offset: int | None = None  # absolute byte offset of the data in `source`
    nbytes: int | None = None
    source: str | None = None  # the file that holds the bytes
    crc: int | None = None  # CRC-32 of exactly these bytes, when the container stores one (a zip member's)

    @property
    def element_size(self) -> int:
        """Bytes per element of ``dtype`` (1 for a dtype ckptfix does not know)."""
        return ELEMENT_SIZE.get(self.dtype, 1)

    def pid(self) -> tuple[Any, ...]:
        """The persistent id torch.save writes for this storage.

        Returns:
            ``("storage", storage class, key, location, numel)``, plus the view metadata in legacy files.
        """
        pid: tuple[Any, ...] = ("storage", self.storage_type, self.key, self.location, self.numel)
        if self.view_metadata is not None or self._legacy:
            pid = pid + (self.view_metadata,)
        return pid

    _legacy: bool = False


def is_c_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` is that of a C-contiguous tensor of ``shape`` (as ``Tensor.is_contiguous``).

    Args:
        shape: the sizes.
        stride: the strides, in elements.

    Returns:
        True when contiguous (size-1 dimensions may have any stride).

    >>> is_c_contiguous((2, 3), (3, 1)), is_c_contiguous((2, 3), (1, 2)), is_c_contiguous((1, 4), (99, 1))
    (True, False, True)
    """
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride), strict=False):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


@dataclass(eq=False)
class TensorRecord:
    """What a torch rebuild call would build, without building it.

    ``offset`` and ``stride`` are in elements of ``dtype``, as in torch.
    ``kind`` is ``"dense"`` for ordinary tensors and parameters, else
    ``"quantized"``, ``"sparse"``, ``"nested"``, ``"meta"``, ``"subclass"``,
    ``"numpy"``.
    """

    storage: StorageRecord | None
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    kind: str = "dense"
    parameter: bool = False
    # how to write it back: the rebuild global and its arguments
    reduce_func: type | None = None
    reduce_args: tuple = ()

    @property
    def numel(self) -> int:
        """Number of elements (the product of ``shape``)."""
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def element_size(self) -> int:
        """Bytes per element of ``dtype`` (1 for a dtype ckptfix does not know)."""
        return ELEMENT_SIZE.get(self.dtype, 1)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements (``numel * element_size``), not of its storage."""
        return self.numel * self.element_size

    @property
    def location(self) -> str | None:
        """The storage's device tag as saved (``"cpu"``, ``"cuda:0"``); None without a storage."""
        return self.storage.location if self.storage else None

    def is_contiguous(self) -> bool:
        """Whether the strides are those of a C-contiguous tensor of this shape (as ``Tensor.is_contiguous``).

        Returns:
            True when contiguous (size-1 dimensions may have any stride).
        """
        return is_c_contiguous(self.shape, self.stride)

    def covers_storage(self) -> bool:
        """Whether this tensor is exactly its whole storage, contiguous, from offset 0.

        Returns:
            True when so; False too when the storage's size is not known.
        """
        if self.storage is None or self.storage.nbytes is None:
            return False
        return self.offset == 0 and self.is_contiguous() and self.nbytes == self.storage.nbytes

    def span(self) -> tuple[int, int]:
        """The range of storage elements this view touches.

        Returns:
            ``(first, last + 1)`` element indices in the storage (``(offset, offset)`` when empty).
        """
        if self.numel == 0:
            return (self.offset, self.offset)
        last = self.offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=False))
        return (self.offset, last + 1)

    def __repr__(self) -> str:  # compact, used in reports
        loc = self.location or "-"
        key = self.storage.key if self.storage else None
        return f"TensorRecord({self.dtype}, shape={list(self.shape)}, storage={key}@{loc})"


def is_tensor_like(v: Any) -> bool:
    """Whether ``v`` is a :class:`TensorRecord` or a real ``torch.Tensor`` (checked without importing torch).

    Args:
        v: anything.

    Returns:
        True for a tensor record or a tensor.
    """
    if isinstance(v, TensorRecord):
        return True
    t = type(v)
    return t.__module__.startswith("torch") and hasattr(v, "shape") and hasattr(v, "dtype") and hasattr(v, "stride")
