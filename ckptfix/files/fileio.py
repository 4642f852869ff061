"""Byte-range copies between open files, and their read-back check.

One loop copies: ``pread``/``pwrite`` through a reused 1 MiB buffer per thread, reading neighbouring
ranges of one source straight through (:func:`copy`), with the written piece read back and compared
with the source piece still in the buffer when asked.  A range whose source and output offsets sit at
the same place within a :data:`FOLIO` goes through ``copy_file_range`` instead (whole folios move in
the kernel, as ``cp`` copies), and is read back afterwards; where the kernel refuses, the loop copies it.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import zipfile
import zlib
from typing import Callable, Sequence

from ckptfix.errors import CorruptCheckpointError, OutputError
from ckptfix.files import pins
from ckptfix.files.progress import advance

#: what :mod:`zipfile` raises on a damaged archive (beyond ``BadZipFile``)
ZIP_ERRORS: tuple[type[BaseException], ...] = (
    zipfile.BadZipFile,
    OSError,
    ValueError,
    struct.error,
    EOFError,
    NotImplementedError,
    zlib.error,
    KeyError,
    IndexError,
    OverflowError,
)

#: ``copy_file_range`` between offsets congruent modulo this (the page cache's large folios) moves whole folios
FOLIO = 64 << 10

#: bytes per ``copy_file_range`` call: bounds the time between progress reports
STEP = 8 << 20

#: the buffer of the loop and of the read-back: 1 MiB stays in the CPU caches
BUFFER = 1 << 20

#: bytes per chunk of a tensor streamed through Python (converted, gathered, read back)
CHUNK = 8 << 20

#: a gap this small or smaller between two ranges of one source is read through (a zip record's local header)
SPAN_GAP = 64 << 10

#: ``copy_file_range`` errors after which the loop copies the range instead
_REFUSED = frozenset(
    (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTTY, errno.EBADF, errno.EPERM, errno.EIO)
)

_FULL = "no space left on the output device; free some space or write elsewhere with -o"

_LOCAL = threading.local()

Progress = Callable[[int], None]


def _write_error(e: OSError) -> OutputError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(_FULL)
    return OutputError(f"cannot write the output: {e}")


def _ended() -> CorruptCheckpointError:
    return CorruptCheckpointError("the source file ended early while copying a tensor (truncated?)")


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, off: int) -> int:
    """Write all of ``data`` at ``off`` of ``fd``; returns its length.

    Raises:
        OutputError: the disk is full, or the write failed.
    """
    data = memoryview(data).cast("B")
    done = 0
    while done < len(data):
        try:
            done += os.pwrite(fd, data[done:], off + done)
        except OSError as e:
            raise _write_error(e) from None
    return done


def in_kernel(src_off: int, dst_off: int) -> bool:
    """Whether :func:`copy` copies a range at these offsets with ``copy_file_range`` (else through the buffer)."""
    return hasattr(os, "copy_file_range") and (src_off - dst_off) % FOLIO == 0


def _buffers() -> tuple[bytearray, bytearray]:
    """This thread's two reused buffers (fresh pages cost a fault each)."""
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None or len(bufs[0]) != BUFFER:
        bufs = _LOCAL.bufs = (bytearray(BUFFER), bytearray(BUFFER))
    return bufs


def _read(fd: int, view: memoryview, off: int) -> int:
    """Fill ``view`` from ``off`` (a short read is continued); fewer bytes only at the end of the file."""
    done = os.preadv(fd, [view], off)
    while 0 < done < len(view):
        n = os.preadv(fd, [view[done:]], off + done)
        if n == 0:
            break
        done += n
    return done


def _read_source(fd: int, view: memoryview, off: int) -> int:
    """:func:`_read` of the input: a read error (a bad sector, a network file system gone) names the input."""
    try:
        return _read(fd, view, off)
    except OSError as e:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = "the input"
        raise CorruptCheckpointError(
            f"{name}: cannot be read at byte {off} ({e.strerror or e}); the file or its disk is damaged — "
            "re-copy it, or check the device (dmesg)"
        ) from None


def _kernel(src_fd: int, so: int, dst_fd: int, do: int, size: int, progress: Progress | None) -> int:
    """``copy_file_range`` as far as the kernel takes it; returns the bytes copied (fewer: it refused)."""
    done = 0
    while done < size:
        # a first step up to a folio boundary, then whole folios
        step = min(size - done, FOLIO - (so + done) % FOLIO if (so + done) % FOLIO else STEP)
        try:
            n = os.copy_file_range(src_fd, dst_fd, step, so + done, do + done)
        except OSError as e:
            if e.errno in _REFUSED:
                return done
            raise _write_error(e) from None
        if n == 0:  # the end of the source, or a file system that copies nothing: the loop tells which
            return done
        done += n
        advance(n)
        if progress is not None:
            progress(n)
    return done


def copy(
    src_fd: int,
    pieces: Sequence[tuple[int, int, int]],
    dst_fd: int,
    *,
    check: bool = False,
    progress: Progress | None = None,
    kernel: bool = True,
) -> tuple[int, int] | None:
    """Copy byte ranges of one source into the output, and with ``check`` read each back and compare it.

    Args:
        src_fd: the source.
        pieces: ``(source offset, output offset, size)``, in source order, not overlapping.
        dst_fd: the output (open for reading too with ``check``).
        check: compare every written byte with the source.
        progress: called with each count of bytes copied (and checked).
        kernel: ``copy_file_range`` where the offsets line up (False: the buffer only).

    Returns:
        None when every piece reads back right (or without ``check``); else ``(index of the piece, offset
        within it)`` at or before the first difference.

    Raises:
        OutputError: the output device is full, or the write failed.
        CorruptCheckpointError: the source ends early or cannot be read.
    """
    raw, raw_back = _buffers()
    buf, back = memoryview(raw), memoryview(raw_back)
    i, count = 0, len(pieces)
    while i < count:
        so, do, size = pieces[i]
        if kernel and in_kernel(so, do):
            done = _kernel(src_fd, so, dst_fd, do, size, None if check else progress)
            if done < size:
                rest = [(so + done, do + done, size - done)]
                bad = copy(src_fd, rest, dst_fd, check=check, progress=progress, kernel=False)
                if bad is not None:
                    return i, done + bad[1]
            if check:
                at = verify_equal(src_fd, so, dst_fd, do, done)
                if at is not None:
                    return i, at
                if progress is not None:
                    progress(done)
            i += 1
            continue
        # pieces[i:j]: one span of the source, read straight through in BUFFER pieces
        j, end = i + 1, so + size
        while j < count and 0 <= pieces[j][0] - end <= SPAN_GAP and not (kernel and in_kernel(*pieces[j][:2])):
            end = pieces[j][0] + pieces[j][2]
            j += 1
        cur = so
        while cur < end:
            got = _read_source(src_fd, buf[: min(len(buf), end - cur)], cur)
            if got == 0:
                raise _ended()
            top = cur + got
            while i < j:
                so, do, size = pieces[i]
                a, b = max(so, cur), min(so + size, top)
                if a < b:
                    pwrite_all(dst_fd, buf[a - cur : b - cur], do + a - so)
                    advance(b - a)
                    if check and not (
                        _read(dst_fd, back[: b - a], do + a - so) == b - a and raw.startswith(back[: b - a], a - cur)
                    ):
                        return i, a - so
                    if progress is not None:
                        progress(b - a)
                if so + size > top:
                    break
                i += 1
            cur = top
        i = j
    return None


def copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, size: int) -> None:
    """Copy ``size`` bytes at ``src_off`` of ``src_fd`` to ``dst_off`` of ``dst_fd`` (:func:`copy` of one range)."""
    if size > 0:
        copy(src_fd, [(src_off, dst_off, size)], dst_fd)


def copy_file_data(src_fd: int, dst_fd: int) -> int:
    """Copy a whole file's bytes into another, offset 0 to 0; returns the number of bytes."""
    size = os.fstat(src_fd).st_size
    copy_range(src_fd, 0, dst_fd, 0, size)
    return size


def drop_cached(fd: int, off: int, size: int) -> None:
    """Drop the clean cached pages of a range, so that the next read comes from the device (after an fsync)."""
    if size > 0 and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, off, size, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def crc_range(fd: int, off: int, size: int, *, from_device: bool = False) -> int:
    """The CRC-32 of ``size`` bytes at ``off`` of ``fd`` (``from_device``: :func:`drop_cached` first).

    Raises:
        CorruptCheckpointError: the file ends before the range does.
    """
    if from_device:
        drop_cached(fd, off, size)
    buf = memoryview(_buffers()[1])
    checksum = 0
    done = 0
    while done < size:
        n = _read(fd, buf[: min(size - done, len(buf))], off + done)
        if n == 0:
            raise _ended()
        checksum = zlib.crc32(buf[:n], checksum)
        done += n
    return checksum & 0xFFFFFFFF


def verify_crc(fd: int, off: int, size: int, expected: int, *, from_device: bool = False) -> int | None:
    """None when the range's CRC-32 is ``expected``, else 0 (the CRC says only that it differs)."""
    try:
        got = crc_range(fd, off, size, from_device=from_device)
    except CorruptCheckpointError:
        return 0
    return None if got == expected & 0xFFFFFFFF else 0


def verify_equal(
    src_fd: int, src_off: int, dst_fd: int, dst_off: int, size: int, *, from_device: bool = False
) -> int | None:
    """Compare a written range with its source; None when equal, else the offset of the first differing MiB.

    With ``from_device`` the output's cached pages are dropped first (after an fsync: the device is read).
    """
    if from_device:
        drop_cached(dst_fd, dst_off, size)
    a, b = _buffers()
    va, vb = memoryview(a), memoryview(b)
    done = 0
    while done < size:
        want = min(size - done, len(a))
        na = _read_source(src_fd, va[:want], src_off + done)
        nb = _read(dst_fd, vb[:want], dst_off + done)
        if na != want:
            raise _ended()
        if nb != want or not a.startswith(vb[:want]):  # memcmp, no copy
            return done
        done += want
    return None


class Fds:
    """Read-only file descriptors, opened once per path."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def get(self, path: str) -> int:
        """The read-only descriptor of ``path``, opened on first use (closed by :meth:`close`)."""
        fd = self.fds.get(path)
        if fd is None:  # two threads may race here: one descriptor is kept, the other closed
            new = pins.open_fd(path)
            fd = self.fds.setdefault(path, new)
            if fd != new:
                os.close(new)
        return fd

    def close(self) -> None:
        """Close every descriptor opened."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
