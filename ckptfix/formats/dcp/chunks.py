"""Where a DCP chunk's bytes are, found without torch; and the C-order bytes of any block of a chunk.

With torch's default ``FileSystemWriter`` every tensor chunk is a small
``torch.save`` archive at ``(relative_path, offset, length)`` of a ``.distcp``
file, and every non-tensor object a ``torch.save``'d pickle there.  The archive
is read with :mod:`zipfile` through a window of the file and its ``data.pkl``
with the restricted reader, giving the storage record's byte offset, shape and
strides; tensor bytes are then read in place, never the whole archive.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ckptfix.errors import (
    CorruptCheckpointError,
    PartitionedCheckpointError,
    ResourceLimitError,
    UnsafePickleError,
    UnsupportedError,
)
from ckptfix.files import pins, source
from ckptfix.files.fileio import ZIP_ERRORS
from ckptfix.formats.dcp.meta import BytesEntry, Chunk, Location, TensorEntry
from ckptfix.pickles import RecordingUnpickler, TensorRecord, is_c_contiguous

#: a tensor chunk's ``data.pkl`` is a few hundred bytes; anything this large is not one
MAX_TENSOR_PKL = 1 << 20
#: a non-tensor object (``torch.save``'d pickle) larger than this is refused; CKPTFIX_DCP_MAX_OBJECT lifts it
MAX_OBJECT_PKL = int(os.environ.get("CKPTFIX_DCP_MAX_OBJECT", str(64 << 20)))
#: a non-contiguous (transposed) chunk is gathered from memory up to this many bytes of span
MAX_GATHER_SPAN = int(os.environ.get("CKPTFIX_DCP_MAX_GATHER", str(256 << 20)))


class FileWindow(io.RawIOBase):
    """A read-only, seekable window ``[start, start + length)`` of an open file descriptor (``pread`` only)."""

    def __init__(self, fd: int, start: int, length: int, src: source.Source | None = None) -> None:
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, start, length, 0
        self.src = src  # a remote file: read through it instead of the descriptor

    def readable(self) -> bool:
        """The window can be read.

        Returns:
            True.
        """
        return True

    def seekable(self) -> bool:
        """The window can seek.

        Returns:
            True.
        """
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        """Move the read position, as :meth:`io.IOBase.seek`.

        Args:
            off: the offset.
            whence: 0 from the start, 1 from the current position, 2 from the end of the window.

        Returns:
            The new position.

        Raises:
            ValueError: a negative position.
        """
        self.pos = off if whence == 0 else self.pos + off if whence == 1 else self.length + off
        if self.pos < 0:
            raise ValueError("negative seek position")
        return self.pos

    def tell(self) -> int:
        """The read position.

        Returns:
            The position in the window.
        """
        return self.pos

    def readinto(self, b: Any) -> int:
        """Read into ``b`` from the window (one ``pread``), as :meth:`io.RawIOBase.readinto`.

        Args:
            b: a writable buffer.

        Returns:
            The number of bytes read (0 at the end of the window).
        """
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        if self.src is not None:
            n = max(0, min(n, self.src.size - self.start - self.pos))
            data = self.src.pread(n, self.start + self.pos)
        else:
            data = os.pread(self.fd, n, self.start + self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


class Files:
    """Read-only descriptors of a DCP directory's data files, opened once each."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.fds: dict[str, int] = {}
        self.sources: dict[str, source.Source] = {}
        self.sizes: dict[str, int] = {}  # decompressed items (:meth:`item`)

    def source(self, rel: str) -> source.Source | None:
        """A remote data file (opened on first use), or None when the directory is local (use :meth:`fd`).

        Args:
            rel: the file's path relative to the directory.

        Returns:
            The :class:`~ckptfix.files.source.Source` (closed by :meth:`close`), or None.
        """
        if not source.is_url(self.root) or "\x00" in rel:  # (a decompressed item: a local temporary file)
            return None
        src = self.sources.get(rel)
        if src is None:
            src = self.sources[rel] = source.open_source(source.join(self.root, rel))
        return src

    def item(self, loc: Location, what: str) -> tuple[str, int, int]:
        """Where an item's plain bytes are: ``(rel, offset, length)`` of its data file, or, for a compressed item
        (torch's ZStandard extension), of a decompressed copy in a temporary file (made once, removed on close;
        its ``rel`` holds a NUL, which no data file name may: :meth:`fd` opens the copy, :meth:`source` is None).

        Args:
            loc: the item's location.
            what: names the item in messages.

        Returns:
            ``(rel, offset, length)`` to read with :meth:`fd` / :meth:`source`.

        Raises:
            CorruptCheckpointError: the stream does not decompress.
        """
        if loc.transform is None:
            return loc.relative_path, loc.offset, loc.length
        key = f"{loc.relative_path}\x00{loc.offset}"
        if key not in self.fds:
            import tempfile

            import zstandard

            src = self.source(loc.relative_path)
            raw = (
                src.pread(max(0, min(loc.length, src.size - loc.offset)), loc.offset)
                if src is not None
                else os.pread(self.fd(loc.relative_path), loc.length, loc.offset)
            )
            if len(raw) != loc.length:
                raise CorruptCheckpointError(f"{what}: {loc.relative_path} ended inside the item (truncated?)")
            with tempfile.TemporaryFile() as tmp:
                try:
                    reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
                    while True:
                        block = reader.read(8 << 20)
                        if not block:
                            break
                        tmp.write(block)
                except zstandard.ZstdError as e:
                    raise CorruptCheckpointError(
                        f"{what}: its zstd stream does not decompress ({e}); corrupt"
                    ) from None
                tmp.flush()
                self.sizes[key] = tmp.tell()
                self.fds[key] = os.dup(tmp.fileno())
        return key, 0, self.sizes[key]

    def fd(self, rel: str) -> int:
        """The read-only descriptor of a data file, opened on first use.

        Args:
            rel: the file's path relative to the directory.

        Returns:
            The descriptor (closed by :meth:`close`).
        """
        fd = self.fds.get(rel)
        if fd is None:
            fd = self.fds[rel] = pins.open_fd(os.path.join(self.root, rel))
        return fd

    def close(self) -> None:
        """Close every descriptor opened."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.sizes.clear()
        for src in self.sources.values():
            src.close()
        self.sources.clear()

    def __enter__(self) -> Files:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ChunkData:
    """The bytes of one tensor chunk: element ``(i, j, ...)`` is at ``data_offset + sum(i*stride) * es``."""

    rel: str
    data_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    element_size: int
    crc: int | None = None  # CRC-32 of the chunk's bytes when its zip record holds exactly them

    def contiguous(self) -> bool:
        """Are the chunk's bytes in C order?

        Returns:
            True when they are (size-1 dimensions ignored).
        """
        return is_c_contiguous(self.shape, self.stride)


def _archive(files: Files, loc: Location, what: str, cap: int) -> tuple[zipfile.ZipFile, FileWindow, bytes, str]:
    rel, offset, length = files.item(loc, what)
    src = files.source(rel)
    fd = files.fd(rel) if src is None else -1
    win = FileWindow(fd, offset, length, src)
    try:
        zf = zipfile.ZipFile(win)
        names = zf.namelist()
        if len(names) != len(set(names)):
            raise CorruptCheckpointError(f"{what}: the chunk archive names a member twice; refused")
        pkl = next((n for n in names if n.endswith("/data.pkl") and n.count("/") == 1), None)
        if pkl is None:
            pkl = "data.pkl" if "data.pkl" in names else None
        if pkl is None:
            raise CorruptCheckpointError(f"{what}: the chunk archive has no data.pkl; not a DCP chunk")
        info = zf.getinfo(pkl)
        if info.file_size > cap:
            raise ResourceLimitError(
                f"{what}: its pickle is {info.file_size} bytes, over the {cap}-byte limit; "
                "set CKPTFIX_DCP_MAX_OBJECT to read it"
            )
        data = zf.read(pkl)
    except (CorruptCheckpointError, ResourceLimitError):
        raise
    except ZIP_ERRORS as e:
        head = os.pread(fd, 9, 0) if src is None else src.pread(min(9, src.size), 0)
        if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (100 << 20):
            raise UnsupportedError(
                f"{what}: {loc.relative_path} is a safetensors file (DCP's safetensors "
                "serialization format / Hugging Face storage writer); ckptfix reads DCP's default "
                "torch_save format — load it with torch's dcp.load or consolidate it with "
                "torch's consolidate_safetensors_files"
            ) from None
        raise CorruptCheckpointError(
            f"{what}: damaged chunk at bytes {loc.offset}+{loc.length} of "
            f"{loc.relative_path} ({type(e).__name__}: {e}); the file is truncated or "
            "the .metadata belongs to a different run"
        ) from None
    return zf, win, data, pkl[: -len("data.pkl")]


def _unpickle(data: bytes, what: str) -> tuple[Any, RecordingUnpickler]:
    up = RecordingUnpickler.for_bytes(data)
    try:
        obj = up.load()
    except (CorruptCheckpointError, UnsafePickleError, ResourceLimitError):
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure of a chunk is corruption
        raise CorruptCheckpointError(
            f"{what}: its pickle cannot be read ({type(e).__name__}: {str(e)[:200]}); the chunk is corrupt"
        ) from None
    return obj, up


def locate_chunk(files: Files, e: TensorEntry, i: int, where: str = "") -> ChunkData:
    """Find chunk ``i`` of ``e``: its storage bytes' offset in the ``.distcp`` file, shape and strides.

    Args:
        files: the open ``.distcp`` files.
        e: the tensor's metadata entry.
        i: the chunk's index.
        where: names the checkpoint in messages.

    Returns:
        The chunk's :class:`ChunkData`.

    Raises:
        CorruptCheckpointError: damaged archive, wrong shape/dtype, bytes past the end of the record.
        UnsafePickleError: the chunk's pickle names anything but a tensor rebuild.
    """
    c: Chunk = e.chunks[i]
    loc = e.locations[i]
    what = f"{where}tensor {e.fqn!r} chunk {list(c.offsets)}"
    zf, _, data, root = _archive(files, loc, what, MAX_TENSOR_PKL)
    obj, up = _unpickle(data, what)
    if up.stubbed:
        raise UnsafePickleError(
            f"{what}: its pickle references {', '.join(sorted(up.stubbed)[:3])}, which a "
            "tensor chunk never needs; refused"
        )
    if not isinstance(obj, TensorRecord) or obj.kind != "dense" or obj.storage is None:
        raise CorruptCheckpointError(
            f"{what}: holds {type(obj).__name__}, not a dense tensor; the checkpoint is corrupt"
        )
    if obj.dtype != e.dtype:
        raise CorruptCheckpointError(
            f"{what}: holds {obj.dtype}, the metadata says {e.dtype}; .metadata belongs to a different run"
        )
    if tuple(obj.shape) != c.sizes:
        raise CorruptCheckpointError(
            f"{what}: holds shape {list(obj.shape)}, the metadata says {list(c.sizes)}; "
            ".metadata belongs to a different run"
        )
    if obj.offset < 0 or any(s < 0 for s in obj.stride):
        raise CorruptCheckpointError(f"{what}: negative storage offset or stride; the chunk is corrupt")
    name = f"{root}data/{obj.storage.key}"
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise CorruptCheckpointError(f"{what}: storage record {name} is missing from the chunk archive") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise UnsupportedError(f"{what}: a compressed storage record; DCP writes them uncompressed")
    rel, offset, length = files.item(loc, what)
    src = files.source(rel)
    at = offset + info.header_offset
    hdr = os.pread(files.fd(rel), 30, at) if src is None else src.pread(max(0, min(30, src.size - at)), at)
    if len(hdr) < 30 or hdr[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{what}: damaged archive entry {name}; the chunk is corrupt")
    nlen, elen = struct.unpack("<HH", hdr[26:30])
    start = info.header_offset + 30 + nlen + elen
    es = obj.element_size
    need = (obj.span()[1] * es) if obj.numel else 0
    if need > info.file_size or start + info.file_size > length:
        raise CorruptCheckpointError(
            f"{what}: its bytes run past the end of the chunk record (truncated file, "
            "or .metadata from a different run)"
        )
    whole = obj.offset == 0 and need == info.file_size and is_c_contiguous(tuple(obj.shape), tuple(obj.stride))
    return ChunkData(
        rel,
        offset + start + obj.offset * es,
        tuple(obj.shape),
        tuple(obj.stride),
        es,
        info.CRC if whole else None,
    )


def read_object(files: Files, e: BytesEntry, where: str = "") -> tuple[Any, set[str]]:
    """A non-tensor entry, unpickled by the restricted reader.

    Args:
        files: the open ``.distcp`` files.
        e: the entry.
        where: names the checkpoint in messages.

    Returns:
        ``(object with placeholders, stubbed globals)``.

    Raises:
        CorruptCheckpointError: damaged archive or pickle.
        ResourceLimitError: a pickle over :data:`MAX_OBJECT_PKL`.
        PartitionedCheckpointError: the object holds DTensors (one rank's shards, pickled whole).
        UnsupportedError: it holds other tensors.
    """
    assert e.location is not None
    what = f"{where}object {e.fqn!r}"
    _, _, data, _ = _archive(files, e.location, what, MAX_OBJECT_PKL)
    obj, up = _unpickle(data, what)
    if "torch.distributed.tensor.DTensor" in up.stubbed:
        raise PartitionedCheckpointError(
            f"{where or files.root + ': '}entry {e.fqn!r} holds DTensor shards of one rank: partial (saved with "
            "DefaultSavePlanner(flatten_state_dict=False), which keeps the entry as one pickled object and records "
            "one rank's shards only); the full tensors are not in the folder: save again with the default planner"
        )
    if isinstance(obj, TensorRecord) or up.storages:
        raise UnsupportedError(
            f"{what}: holds tensors inside a pickled object; ckptfix reads DCP tensors only as "
            "tensor entries — load it with torch's dcp.load if you trust it"
        )
    return obj, set(up.stubbed)


def raw_object_bytes(files: Files, e: BytesEntry) -> bytes:
    """The bytes of a non-tensor entry exactly as stored (a ``torch.save`` archive), for ``torch.load``.

    Args:
        files: the open ``.distcp`` files.
        e: the entry.

    Returns:
        The bytes.

    Raises:
        ResourceLimitError: over :data:`MAX_OBJECT_PKL`.
        CorruptCheckpointError: the file ends early.
    """
    assert e.location is not None
    loc = e.location
    if loc.length > MAX_OBJECT_PKL:
        raise ResourceLimitError(
            f"object {e.fqn!r} is {loc.length} bytes, over the {MAX_OBJECT_PKL}-byte limit; "
            "set CKPTFIX_DCP_MAX_OBJECT to read it"
        )
    rel, offset, length = files.item(loc, f"object {e.fqn!r}")
    src = files.source(rel)
    if src is not None:  # a remote folder: one range read (a short object is caught below)
        data = src.pread(max(0, min(length, src.size - offset)), offset)
    else:
        data = os.pread(files.fd(rel), length, offset)
    if len(data) != length:
        raise CorruptCheckpointError(f"object {e.fqn!r}: file {loc.relative_path} ended early (truncated?)")
    return data


# --------------------------------------------------------------------------- reading blocks of a chunk


def _pread_exact(fd: Any, n: int, off: int, what: str) -> bytes:
    if not isinstance(fd, int):  # a remote Source
        if off + n > fd.size:
            raise CorruptCheckpointError(f"{what}: the file ended inside the chunk (truncated?)")
        return bytes(fd.pread(n, off))
    data = os.pread(fd, n, off)
    if len(data) != n:
        raise CorruptCheckpointError(f"{what}: the file ended inside the chunk (truncated?)")
    return data


_CAST: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}


def _strided_row(buf: bytes | memoryview, n: int, step: int, es: int) -> bytes:
    """``n`` elements of ``es`` bytes, every ``step``-th element of ``buf`` (vectorised with memoryview casts)."""
    if step == 1 or n <= 1:
        return bytes(buf[: n * es])
    if es in _CAST:
        mv = memoryview(buf)[: ((n - 1) * step + 1) * es]
        return mv.cast(_CAST[es])[::step].tobytes()
    parts = [memoryview(buf)[k :: es * step] for k in range(es)]  # es = 16 (complex128) and odd sizes
    out = bytearray(n * es)
    for k, p in enumerate(parts):
        out[k::es] = p[:n]
    return bytes(out)


def read_block(
    files: Files, cd: ChunkData, prefix: tuple[int, ...], lo: int, hi: int, what: str, into: Any = None
) -> bytes | bytearray:
    """C-order bytes of ``chunk[prefix..., lo:hi, ...]`` (``prefix`` fixes the leading dims).

    One ``pread`` for a C-contiguous chunk (into the bytearray ``into(nbytes)`` returns, when given,
    so that a caller can reuse buffers); a permuted (e.g. transposed) chunk is gathered row by row.

    Args:
        files: the open ``.distcp`` files.
        cd: the chunk.
        prefix: indices fixing the leading dimensions.
        lo, hi: the range of the next dimension.
        what: names the chunk in messages.
        into: ``into(nbytes)`` returns a bytearray to read into, or None.

    Returns:
        The bytes.

    Raises:
        CorruptCheckpointError: the file ends inside the chunk.
        UnsupportedError: a chunk layout that cannot be gathered.
    """
    remote = files.source(cd.rel)
    fd: Any = files.fd(cd.rel) if remote is None else remote  # a remote folder: its Source instead of a descriptor
    es = cd.element_size
    d = len(prefix)
    shape, stride = cd.shape, cd.stride
    if not shape:
        return _pread_exact(fd, es, cd.data_offset, what)
    base = sum(i * s for i, s in zip(prefix, stride, strict=False)) + lo * stride[d]
    inner = 1
    for s in shape[d + 1 :]:
        inner *= s
    if cd.contiguous():
        n = (hi - lo) * inner * es
        if into is None:
            return _pread_exact(fd, n, cd.data_offset + base * es, what)
        buf = into(n)
        view, done = memoryview(buf), 0
        if remote is not None:  # one range read
            view[:n] = _pread_exact(remote, n, cd.data_offset + base * es, what)
            done = n
        while done < n:
            k = os.preadv(fd, [view[done:]], cd.data_offset + base * es + done)
            if k <= 0:
                raise CorruptCheckpointError(f"{what}: the file ended inside the chunk (truncated?)")
            done += k
        return buf
    sub_shape = (hi - lo,) + tuple(shape[d + 1 :])
    sub_stride = tuple(stride[d:])
    if not all(sub_shape):
        return b""
    span = 1 + sum((n - 1) * s for n, s in zip(sub_shape, sub_stride, strict=False))
    if span * es > MAX_GATHER_SPAN:
        raise UnsupportedError(
            f"{what}: a non-contiguous chunk (saved from a transposed or permuted view) whose "
            f"block spans {span * es} bytes; ckptfix gathers such chunks in memory only up to "
            f"{MAX_GATHER_SPAN} bytes (CKPTFIX_DCP_MAX_GATHER lifts it)"
        )
    buf = memoryview(_pread_exact(fd, span * es, cd.data_offset + base * es, what))
    out = bytearray()
    n, step = sub_shape[-1], sub_stride[-1]
    for idx in _ndindex(sub_shape[:-1]):
        off = sum(i * s for i, s in zip(idx, sub_stride[:-1], strict=False)) * es
        out += _strided_row(buf[off:], n, step, es)
    return bytes(out)


def _ndindex(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    idx = [0] * len(shape)
    if any(s == 0 for s in shape):
        return
    while True:
        yield tuple(idx)
        k = len(shape) - 1
        while k >= 0:
            idx[k] += 1
            if idx[k] < shape[k]:
                break
            idx[k] = 0
            k -= 1
        if k < 0:
            return


def ndindex(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every index tuple of ``shape`` in C order (``()`` once for a 0-d shape).

    Args:
        shape: the dimensions.

    Returns:
        An iterator of index tuples.
    """
    return _ndindex(shape)
