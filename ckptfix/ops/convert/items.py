"""The tensors a conversion writes (:class:`Item`) and where their bytes come from.

An item's bytes are a contiguous byte range of a source file (copied by the writer), a strided
view gathered from the span of its storage (:func:`gather`: memory-mapped, strided ``memoryview``
slices, no numpy and no per-element Python loop), or a torch tensor.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Sequence

from ckptfix.errors import CorruptCheckpointError, UnsupportedError
from ckptfix.files.fileio import CHUNK, Fds
from ckptfix.formats.safetensors_fmt import DTYPE_TO_ST
from ckptfix.ops.convert.remote_in import is_remote
from ckptfix.pickles import TensorRecord

#: a byte range of a source file: ``(path, offset, nbytes, crc or None)``
Range = tuple[str, int, int, "int | None"]


@dataclass
class Item:
    """One tensor to write: where its bytes come from and what it is."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    path: str | None = None  # contiguous byte range of this file ...
    offset: int = 0
    rec: TensorRecord | None = None  # ... or a strided view to gather ...
    tensor: Any = None  # ... or a torch tensor
    begin: int = 0  # data offset in the output, filled by the planner
    crc: int | None = None  # CRC-32 of the byte range, when the source stores one (verification reads back once)

    @property
    def st_dtype(self) -> str:
        """The safetensors dtype code.

        Returns:
            ``"F32"``, ``"BF16"`` ...
        """
        return DTYPE_TO_ST[self.dtype]

    def ranges(self) -> list[Range] | None:
        """The item's bytes as byte ranges of source files, in order (copied in the kernel), or None.

        Returns:
            ``[(path, offset, nbytes, crc)]`` (``crc``: the CRC-32 the source stores for exactly
            that range, or None); None when the bytes must be gathered (:meth:`chunks`).
        """
        if self.path is None:
            return None
        return [(self.path, self.offset, self.nbytes, self.crc)]

    def chunks(self, fds: Fds) -> Iterator[bytes | bytearray | memoryview]:
        """The bytes of a gathered view or a torch tensor, C-contiguous, in bounded chunks.

        (Contiguous byte ranges of a file are copied by :class:`~ckptfix.ops.convert.write.Writer` instead.)

        Args:
            fds: open source files.

        Returns:
            An iterator of chunks of at most :data:`CHUNK` bytes (a few more for small gathered blocks).
        """
        if self.rec is not None:
            yield from _gather(self.rec, fds)
        elif self.tensor is not None:
            yield from _tensor_chunks(self.tensor)


#: memoryview formats by element size: a strided run of elements is one C-level slice copy
_FMT: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}


def check_view(name: str, rec: TensorRecord) -> None:
    """Refuse a tensor record no torch tensor can have: negative offset, size or stride.

    Args:
        name: the tensor's name, for the message.
        rec: its record.

    Raises:
        CorruptCheckpointError: naming the tensor.
    """
    bad = [int(x) for x in (rec.offset, *rec.shape, *rec.stride) if not isinstance(x, int) or x < 0]
    if bad or len(rec.shape) != len(rec.stride):
        raise CorruptCheckpointError(
            f"tensor {name!r} has offset {rec.offset}, shape {list(rec.shape)} and stride "
            f"{list(rec.stride)}: negative or mismatched values no torch tensor has; the "
            "checkpoint is corrupt"
        )


def _simplify(shape: Sequence[int], stride: Sequence[int]) -> tuple[list[int], list[int]]:
    """Drop size-1 dims and merge dims that step through memory as one (stride-0 runs included)."""
    dims = [(int(n), int(s)) for n, s in zip(shape, stride, strict=False) if n != 1]
    out: list[list[int]] = []
    for n, s in dims:
        if out and out[-1][1] == n * s:
            out[-1] = [out[-1][0] * n, s]
        else:
            out.append([n, s])
    if not out:
        out = [[1, 1]]
    return [n for n, _ in out], [s for _, s in out]


def _run(src: memoryview, o: int, n: int, s: int) -> bytes:
    """``n`` elements from element ``o`` of ``src``, ``s`` apart, as bytes (one C-level copy)."""
    if s == 0:
        return src[o : o + 1].tobytes() * n
    if s == 1:
        return src[o : o + n].tobytes()
    return src[o : o + (n - 1) * s + 1 : s].tobytes()


def _block(src: memoryview, off: int, a: int, sa: int, b: int, sb: int, es: int) -> Iterator[bytes | bytearray]:
    """The C-order bytes of an ``a x b`` view (element strides ``sa``, ``sb``) from element ``off``, in chunks.

    Per chunk the Python loop runs over the smaller of its two dimensions; each step is one strided
    slice copy of the other (``bytes * n`` for stride 0), so no per-element Python work.
    """
    row = b * es
    if row >= CHUNK:
        per = max(1, CHUNK // es)
        for i in range(a):
            o = off + i * sa
            for j0 in range(0, b, per):
                yield _run(src, o + j0 * sb, min(per, b - j0), sb)
        return
    rows = max(1, CHUNK // row)
    same: bytes | None = None
    for i0 in range(0, a, rows):
        n = min(rows, a - i0)
        if sa == 0:
            if same is None:
                same = _run(src, off, b, sb)
            yield same * n
        elif n <= b:
            yield b"".join(_run(src, off + i * sa, b, sb) for i in range(i0, i0 + n))
        else:
            out = bytearray(n * row)
            ov: Any = memoryview(out)
            ov = ov.cast(src.format)
            for j in range(b):
                o = off + i0 * sa + j * sb
                ov[j::b] = src[o : o + (n - 1) * sa + 1 : sa]
            ov.release()
            yield out


def _gather(rec: TensorRecord, fds: Fds) -> Iterator[bytes | bytearray]:
    """C-order bytes of a strided view in bounded chunks, reading only its span of the storage.

    The span is memory-mapped (pages come and go through the page cache, however large the storage)
    and copied with strided slices of a typed ``memoryview``: no numpy, no per-element Python loop,
    and stride-0 (expanded) dimensions repeat bytes instead of re-reading them.
    """
    import mmap

    if rec.numel == 0:
        return
    es = rec.element_size
    fmt = _FMT.get(es)
    if fmt is None:
        raise UnsupportedError(f"tensor of dtype {rec.dtype} ({es}-byte elements) cannot be gathered")
    first, end = rec.span()
    st = rec.storage
    assert st is not None and st.source is not None and st.file_offset is not None
    start = st.file_offset + first * es
    length = (end - first) * es
    spool = None
    if is_remote(st.source):  # a URL: its span spooled to a private temp file (flat memory), mapped like a local one
        from ckptfix.ops.convert.remote_in import spool_range

        spool = spool_range(st.source, start, length)
        fd, start = spool.fileno(), 0
    else:
        fd = fds.get(st.source)
    if os.fstat(fd).st_size < start + length:
        raise CorruptCheckpointError(f"{st.source}: file ended inside storage {st.key!r} (truncated?)")
    shape, stride = _simplify(rec.shape, rec.stride)
    if len(shape) == 1:
        shape, stride = [1] + shape, [0] + stride
    base = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        mm = mmap.mmap(fd, start + length - base, offset=base, prot=mmap.PROT_READ)
    finally:
        if spool is not None:  # the mapping keeps the pages; the file is gone once closed
            spool.close()
    raw = memoryview(mm)
    src = raw[start - base : start - base + length].cast(fmt)
    pending: list[bytes | bytearray] = []
    size = 0
    try:
        outer = shape[:-2]
        a, b = shape[-2:]
        sa, sb = stride[-2:]
        for idx in itertools.product(*(range(n) for n in outer)):
            off = sum(i * s for i, s in zip(idx, stride, strict=False))
            for chunk in _block(src, off, a, sa, b, sb, es):
                pending.append(chunk)
                size += len(chunk)
                if size >= CHUNK:  # small blocks are written together, not one syscall each
                    yield pending[0] if len(pending) == 1 else b"".join(pending)
                    pending, size = [], 0
        if pending:
            yield pending[0] if len(pending) == 1 else b"".join(pending)
    finally:
        src.release()
        raw.release()
        mm.close()


def _tensor_chunks(t: Any) -> Iterator[memoryview]:
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    for i in range(0, n, CHUNK):
        yield memoryview(flat[i : i + CHUNK].numpy())


def check_dtype(name: str, dtype: str, kind: str = "dense") -> None:
    """Refuse a tensor safetensors cannot store.

    Args:
        name: the tensor's name, for the message.
        dtype: its torch dtype name (``"float32"``).
        kind: ``"dense"``, or ``"sparse"``, ``"quantized"``, ``"meta"`` ...

    Raises:
        UnsupportedError: not dense, or a dtype safetensors has no code for; says what to do.
    """
    if kind != "dense":
        raise UnsupportedError(
            f"tensor {name!r} is a {kind} tensor; safetensors stores dense tensors only — "
            "convert it to dense in torch first, or drop it"
        )
    if dtype not in DTYPE_TO_ST:
        raise UnsupportedError(
            f"tensor {name!r} has dtype {dtype}, which safetensors cannot store; "
            "cast it (e.g. complex128 -> complex64 or a real view) or drop it"
        )
