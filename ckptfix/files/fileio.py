"""Byte-range file I/O below the formats: in-kernel copies, positional writes, one-pass verification.

:func:`copy_range` copies a byte range between two open files the cheapest way measured for that
one call, trying in turn:

1. a reflink (``FICLONERANGE``): no bytes move at all, only extents are shared.  Only where the
   file system has it (btrfs, XFS, bcachefs ...) and the offsets and length sit on its blocks;
2. ``copy_file_range`` (what ``cp`` uses): page cache to page cache in the kernel.  Taken when the
   two offsets are congruent modulo :data:`FOLIO` (whole folios move), or for any offsets with
   ``kernel="any"``;
3. ``sendfile`` when ``copy_file_range`` refuses (``EXDEV`` between file systems on some kernels),
   through a private descriptor of the output so that threads writing one file do not share a
   file position;
4. ``pread``/``pwrite`` through a reused 1 MiB buffer (per thread).

Why not ``copy_file_range`` for every offset by default: on ext4 (kernel 6.x, this project's
machines) offsets that are not folio-congruent make the kernel split every folio and go through
its splice path, which measured 1.5-1.7x the CPU time of a 1 MiB user buffer (0.19-0.21 s vs
0.11-0.14 s for 0.5 GB, warm and cold; on tmpfs all ways cost the same); the 8 MiB buffer used
before was the slow one (it does not stay in the CPU caches).  ``kernel="any"`` keeps the other
choice available where a file system measures otherwise.

A refusal makes *this call* fall back, never the next one: the following copy tries the fast way
again (the cost of a refused system call is microseconds; a file opened once for many tensors
would otherwise lose the kernel path for all of them after one odd range).

Before a new output is written, :func:`preallocate` reserves its blocks where that measured faster
(ext4: the 1 MiB-buffer copy of 0.5 GB went from 0.104 to 0.072 s, ``cp`` takes 0.113 s).

Verification costs one pass: :func:`copy_checked` reads each written piece straight back (from
the page cache, while the piece is still in the CPU caches) and checks it against the CRC-32 the
source already stores (a torch zip record's) or against the piece just read from the source;
:func:`verify_crc` and :func:`verify_equal` do the same after the fact (with ``from_device``: after
an ``fsync``, with the range's cached pages dropped first).  The module imports neither torch nor
anything of ckptfix but the error types and the progress counter.
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
from ckptfix.files.pagecache import drop_cached, page_cached
from ckptfix.files.progress import advance

#: what :mod:`zipfile` raises on a damaged archive (beyond ``BadZipFile``): the torch-zip and the DCP chunk readers
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

#: the kernel's page cache works in large folios (64 KiB and more): ``copy_file_range`` between offsets
#: that sit at the same place within 64 KiB moves whole folios (as fast as ``cp``); other offsets are
#: copied too, through the kernel's splice path, which is somewhat slower but still beats a user buffer
FOLIO = 64 << 10

#: bytes per ``copy_file_range`` call: bounds the time between progress reports
STEP = 64 << 20

#: the user-space buffer of the copy through user space and of read-back verification: 1 MiB stays in
#: the CPU caches (an 8 MiB one measured 2-4x slower under load)
BUFFER = 1 << 20
READBACK = BUFFER

#: ``copy_file_range`` for offsets that are not folio-congruent too (see the module's description);
#: ``CKPTFIX_COPY_KERNEL=any`` sets it (to measure a file system other than those measured here)
KERNEL_ANY = os.environ.get("CKPTFIX_COPY_KERNEL", "") == "any"

_LOCAL = threading.local()

#: ``FICLONERANGE``: ``_IOW(0x94, 13, struct file_clone_range)`` (Linux, all architectures)
FICLONERANGE = 0x4020940D

#: errors after which this call copies another way (the file system or kernel cannot do it this way)
_FALLBACK_ERRNOS = frozenset(
    e
    for e in (
        errno.EXDEV,
        errno.EINVAL,
        errno.ENOSYS,
        errno.EOPNOTSUPP,
        getattr(errno, "ENOTSUP", errno.EOPNOTSUPP),
        errno.ENOTTY,
        errno.EBADF,
        errno.EPERM,
        errno.ETXTBSY,
        errno.EIO,
        errno.EOVERFLOW,
    )
)

_FULL = "no space left on the output device; free some space or write elsewhere with -o"


def _full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _ended() -> CorruptCheckpointError:
    return CorruptCheckpointError("the source file ended early while copying a tensor (truncated?)")


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, off: int) -> int:
    """Write all of ``data`` at ``off`` of ``fd``.

    Args:
        fd: the file descriptor.
        data: the bytes.
        off: the file offset.

    Returns:
        The number of bytes written (all of them).

    Raises:
        OutputError: the disk is full, or the write failed.
    """
    data = memoryview(data).cast("B")
    done = 0
    while done < len(data):
        try:
            done += os.pwrite(fd, data[done:], off + done)
        except OSError as e:
            if _full(e):
                raise OutputError(_FULL) from None
            raise OutputError(f"cannot write the output: {e}") from None
    return done


def reflink_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, size: int) -> bool:
    """Share the source's extents with the output (``FICLONERANGE``): no bytes copied.

    Args:
        src_fd: the source descriptor.
        src_off: where the range starts in the source.
        dst_fd: the output descriptor.
        dst_off: where it goes in the output.
        size: how many bytes.

    Returns:
        Whether the range was cloned.  False (nothing done) where the platform or file system has no
        reflinks, the files are on different file systems, or the offsets or length are not on its
        blocks.
    """
    if size <= 0 or not hasattr(os, "copy_file_range"):  # Linux only
        return False
    try:
        import fcntl

        fcntl.ioctl(dst_fd, FICLONERANGE, struct.pack("=qQQQ", src_fd, src_off, size, dst_off))
    except (OSError, ImportError, OverflowError):
        return False
    return True


def _block_size(fd: int) -> int:
    try:
        return max(512, os.fstat(fd).st_blksize)
    except OSError:
        return 4096


def copy_range(
    src_fd: int,
    src_off: int,
    dst_fd: int,
    dst_off: int,
    size: int,
    crc: bool = False,
    *,
    reflink: bool = True,
    kernel: str = "congruent",
) -> int:
    """Copy ``size`` bytes at ``src_off`` of ``src_fd`` to ``dst_off`` of ``dst_fd``, in the kernel where it pays.

    See the module's description for the order of the ways tried.  With ``crc`` the bytes pass
    through a user buffer once and their CRC-32 is returned (one read of the source for both).

    Args:
        src_fd: the source file descriptor.
        src_off: where to read from.
        dst_fd: the destination file descriptor (positional writes only: its file position is untouched).
        dst_off: where to write to.
        size: how many bytes.
        crc: also compute the bytes' CRC-32.
        reflink: try a reflink first (off: the output gets its own copy of the blocks).
        kernel: ``"congruent"``: ``copy_file_range`` when the offsets are congruent modulo
            :data:`FOLIO`, else a user buffer; ``"any"``: ``copy_file_range`` for any offsets;
            ``"never"``: always a user buffer.

    Returns:
        The CRC-32 with ``crc``, else 0.

    Raises:
        OutputError: the output device is full, or the write failed.
        CorruptCheckpointError: the source ends early.
    """
    if size <= 0:
        return 0
    if crc:
        return _buffered(src_fd, src_off, dst_fd, dst_off, size, crc=True)
    if reflink:
        blk = _block_size(dst_fd)
        body = size - size % blk
        if src_off % blk == 0 and dst_off % blk == 0 and body and reflink_range(src_fd, src_off, dst_fd, dst_off, body):
            advance(body)
            src_off, dst_off, size = src_off + body, dst_off + body, size - body
            if not size:
                return 0
    if not in_kernel(src_off, dst_off, kernel):
        _buffered(src_fd, src_off, dst_fd, dst_off, size)
        return 0
    done = _kernel_copy(src_fd, src_off, dst_fd, dst_off, size)
    if done < size:
        done += _sendfile(src_fd, src_off + done, dst_fd, dst_off + done, size - done)
    if done < size:
        _buffered(src_fd, src_off + done, dst_fd, dst_off + done, size - done)
    return 0


def copy_file_data(src_fd: int, dst_fd: int) -> int:
    """Copy a whole file's bytes into another (offsets 0 to 0: a reflink, else ``copy_file_range`` as ``cp`` does).

    For callers that copy whole files (a DCP data file that cannot be hard-linked): the same
    primitive and fallbacks as :func:`copy_range`.

    Args:
        src_fd: the source, read from offset 0 to its current size.
        dst_fd: the destination, written from offset 0 (positional writes; its file position is untouched).

    Returns:
        The number of bytes copied.

    Raises:
        OutputError: the output device is full, or the write failed.
        CorruptCheckpointError: the source shrank while being copied.
    """
    size = os.fstat(src_fd).st_size
    copy_range(src_fd, 0, dst_fd, 0, size)
    return size


def in_kernel(src_off: int, dst_off: int, kernel: str = "congruent") -> bool:
    """Whether :func:`copy_range` copies these offsets in the kernel (else through a user buffer).

    Args:
        src_off: the source offset.
        dst_off: the destination offset.
        kernel: the policy (see :func:`copy_range`).

    Returns:
        True for ``copy_file_range``.
    """
    if kernel == "never" or not hasattr(os, "copy_file_range"):
        return False
    return kernel == "any" or KERNEL_ANY or (src_off - dst_off) % FOLIO == 0


def _kernel_copy(src_fd: int, so: int, dst_fd: int, do: int, size: int) -> int:
    """``copy_file_range`` as far as the kernel takes it; returns the bytes copied (fewer: fall back)."""
    cfr = getattr(os, "copy_file_range", None)
    if cfr is None:
        return 0
    done = 0
    while done < size:
        left = size - done
        # a first step up to a folio boundary, so that congruent offsets then move whole folios
        step = min(left, (FOLIO - (so + done) % FOLIO) if (so + done) % FOLIO else STEP)
        try:
            n = cfr(src_fd, dst_fd, step, so + done, do + done)
        except OSError as e:
            if _full(e):
                raise OutputError(_FULL) from None
            if e.errno in _FALLBACK_ERRNOS:
                return done
            raise OutputError(f"cannot copy into the output: {e}") from None
        if n == 0:
            # end of the source, or a file system that copies nothing (some FUSE ones): the
            # fallback tells which (it raises on a real end of file)
            return done
        done += n
        advance(n)
    return done


def _sendfile(src_fd: int, so: int, dst_fd: int, do: int, size: int) -> int:
    """``sendfile`` into a private descriptor of the output (its own file position); returns bytes copied."""
    send = getattr(os, "sendfile", None)
    if send is None:
        return 0
    try:
        out = os.open(f"/proc/self/fd/{dst_fd}", os.O_WRONLY)
    except OSError:
        return 0
    done = 0
    try:
        os.lseek(out, do, os.SEEK_SET)
        while done < size:
            try:
                n = send(out, src_fd, so + done, min(size - done, STEP))
            except OSError as e:
                if _full(e):
                    raise OutputError(_FULL) from None
                return done
            if n == 0:
                return done
            done += n
            advance(n)
    except OSError:
        return done
    finally:
        os.close(out)
    return done


def _buffers() -> tuple[bytearray, bytearray]:
    """This thread's two reused buffers (fresh pages cost a fault each: reuse them across calls)."""
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None or len(bufs[0]) != BUFFER:
        bufs = _LOCAL.bufs = (bytearray(BUFFER), bytearray(BUFFER))
    return bufs


#: bytes of the source asked for ahead of the copy (``POSIX_FADV_WILLNEED``): a cold input's next
#: reads are under way while this piece is written
AHEAD = 8 << 20


def _ahead(fd: int, off: int, end: int) -> None:
    """Ask the kernel to start reading ``[off, min(off + AHEAD, end))`` of ``fd`` (no-op where unsupported).

    Not when the window's last page is already cached (a warm input): ``WILLNEED`` walks every page of
    the window even then, which measured 6% of a warm 0.5 GB copy (0.114 vs 0.107 s).
    """
    if off < end and hasattr(os, "posix_fadvise"):
        n = min(AHEAD, end - off)
        if page_cached(fd, off + n - 1):
            return
        try:
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


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
    """:func:`_read` of the input: a read error (``EIO``: a bad sector, a network file system gone) is the
    input's, named with its path, not an internal error."""
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


def _buffered(src_fd: int, so: int, dst_fd: int, do: int, size: int, crc: bool = False) -> int:
    """``pread`` + ``pwrite`` through this thread's buffer; returns the CRC-32 with ``crc``."""
    buf = memoryview(_buffers()[0])
    checksum = 0
    done = 0
    _ahead(src_fd, so, so + size)
    while done < size:
        want = min(size - done, len(buf))
        if (done + want) % AHEAD < want:  # crossing into the next window: ask for the one after it
            _ahead(src_fd, so + done + AHEAD, so + size)
        n = _read_source(src_fd, buf[:want], so + done)
        if n == 0:
            raise _ended()
        if crc:
            checksum = zlib.crc32(buf[:n], checksum)
        pwrite_all(dst_fd, buf[:n], do + done)
        done += n
        advance(n)
    return checksum & 0xFFFFFFFF


def copy_checked(
    src_fd: int,
    src_off: int,
    dst_fd: int,
    dst_off: int,
    size: int,
    expected_crc: int | None = None,
    *,
    kernel: str = "congruent",
    progress: Callable[[int], None] | None = None,
) -> int | None:
    """Copy a range as :func:`copy_range` does and read it back once to check it.

    A range copied through the user buffer is checked piece by piece right after each write: the
    piece is read back and compared with the source piece still in the buffer (``memcmp``), or fed
    to a CRC-32 compared with ``expected_crc`` at the end.  A range copied in the kernel is read
    back afterwards (:func:`verify_crc` / :func:`verify_equal`).

    Args:
        src_fd: the source.
        src_off: where the range starts in the source.
        dst_fd: the output, open for reading too (the written pieces are read back through it).
        dst_off: where it goes.
        size: its length.
        expected_crc: the CRC-32 the source stores for exactly this range, or None.
        kernel: the copy policy (see :func:`copy_range`).
        progress: called with the number of bytes after each piece is copied and checked.

    Returns:
        None when the output reads back right; else an offset within the range at or before the
        first difference (0 when only the CRC-32 tells).  With ``expected_crc`` a difference may
        also mean a damaged source: :func:`verify_equal` tells which.

    Raises:
        OutputError: the output device is full, or the write failed.
        CorruptCheckpointError: the source ends early.
    """
    if size <= 0:
        return None
    if in_kernel(src_off, dst_off, kernel):
        for at in range(0, size, STEP):
            n = min(STEP, size - at)
            copy_range(src_fd, src_off + at, dst_fd, dst_off + at, n, kernel=kernel)
            if progress is not None:
                progress(n // 2)
        if expected_crc is not None:
            bad = verify_crc(dst_fd, dst_off, size, expected_crc)
        else:
            bad = verify_equal(src_fd, src_off, dst_fd, dst_off, size)
        if progress is not None:
            progress(size - sum(min(STEP, size - at) // 2 for at in range(0, size, STEP)))
        return bad
    raw, raw_back = _buffers()
    buf, back = memoryview(raw), memoryview(raw_back)
    checksum = 0
    done = 0
    _ahead(src_fd, src_off, src_off + size)
    while done < size:
        want = min(size - done, len(buf))
        if (done + want) % AHEAD < want:  # crossing into the next window: ask for the one after it
            _ahead(src_fd, src_off + done + AHEAD, src_off + size)
        n = _read_source(src_fd, buf[:want], src_off + done)
        if n == 0:
            raise _ended()
        pwrite_all(dst_fd, buf[:n], dst_off + done)
        if _read(dst_fd, back[:n], dst_off + done) != n:
            return done
        if expected_crc is not None:
            checksum = zlib.crc32(back[:n], checksum)
        elif not raw.startswith(back[:n]):  # memcmp of the n bytes read from the source, no copy
            return done
        done += n
        if progress is not None:
            progress(n)
    if expected_crc is not None and checksum != expected_crc & 0xFFFFFFFF:
        return 0
    return None


#: a gap between two pieces of one source this small or smaller is read through (:func:`copy_pieces`): a zip's
#: local header and alignment padding between two records, a few hundred bytes
SPAN_GAP = 64 << 10


def in_user_buffer(src_off: int, dst_off: int, size: int, dst_fd: int) -> bool:
    """Whether :func:`copy_range` would copy ``size`` bytes from ``src_off`` to ``dst_off`` of ``dst_fd`` through
    the user buffer (no reflink, no in-kernel copy): :func:`copy_pieces` copies such a range the same way."""
    if in_kernel(src_off, dst_off):
        return False
    blk = _block_size(dst_fd)
    return not (src_off % blk == 0 and dst_off % blk == 0 and size >= blk)


def copy_pieces(
    src_fd: int,
    pieces: Sequence[tuple[int, int, int]],
    dst_fd: int,
    *,
    check: bool = False,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, int] | None:
    """Copy byte ranges of one source, reading the source once in order, through this thread's buffer.

    The source is read in :data:`BUFFER` pieces across neighbouring ranges (gaps up to :data:`SPAN_GAP` bytes
    read through): one sequential stream, as ``cp`` reads it; range by range, the 0.5 GB GPT-2-layout
    checkpoint's 149 records measured 6-9 ms slower cold, and small tensors cost a read each.

    Args:
        src_fd: the source.
        pieces: ``(source offset, output offset, size)``, in source order, not overlapping.
        dst_fd: the output, open for reading too with ``check``.
        check: read each piece back right after writing it and compare it with the buffer (``memcmp``).
        progress: called with the number of bytes after each piece is written (and checked).

    Returns:
        None when every piece reads back right (or without ``check``); else ``(index of the piece,
        offset within it)``, at or before the first difference.

    Raises:
        OutputError: the output device is full, or the write failed.
        CorruptCheckpointError: the source ends early.
    """
    raw, raw_back = _buffers()
    buf, back = memoryview(raw), memoryview(raw_back)
    i, count = 0, len(pieces)
    while i < count:
        j, end = i + 1, pieces[i][0] + pieces[i][2]  # pieces[i:j]: one span of the source, read straight through
        while j < count and 0 <= pieces[j][0] - end <= SPAN_GAP:
            end = pieces[j][0] + pieces[j][2]
            j += 1
        cur = pieces[i][0]
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


def crc_range(fd: int, off: int, size: int, *, from_device: bool = False) -> int:
    """The CRC-32 of ``size`` bytes at ``off`` of ``fd``, read in 1 MiB steps.

    Args:
        fd: the file.
        off: where the range starts.
        size: its length.
        from_device: drop the range's clean cached pages first (:func:`drop_cached`).

    Returns:
        The CRC-32 (as ``zlib.crc32``).

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
    """Read a written range back once and check it against a CRC-32 the source stores.

    Args:
        fd: the output.
        off: where the range starts.
        size: its length.
        expected: the source's CRC-32 of these bytes (a torch zip member's).
        from_device: drop the range's clean cached pages first.

    Returns:
        None when the range matches; else an approximate offset within the range of the
        difference (0: the CRC says only that it differs).
    """
    try:
        got = crc_range(fd, off, size, from_device=from_device)
    except CorruptCheckpointError:
        return 0
    return None if got == expected & 0xFFFFFFFF else 0


def verify_equal(
    src_fd: int, src_off: int, dst_fd: int, dst_off: int, size: int, *, from_device: bool = False
) -> int | None:
    """Read a written range and its source back once each and compare them (``memcmp``).

    Args:
        src_fd: the source.
        src_off: where the range starts in the source.
        dst_fd: the output.
        dst_off: where it was written.
        size: its length.
        from_device: drop the output range's clean cached pages first.

    Returns:
        None when equal; else the offset within the range of the first differing 1 MiB block
        (or of where the output ends early).
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
        if nb != want:
            return done
        if not a.startswith(vb[:want]):  # memcmp of the first ``want`` bytes, no copy
            return done
        done += want
    return None


#: file systems on which reserving an output's blocks before writing it (:func:`preallocate`) measured
#: faster: ext4 (kernel 6.18, 0.5 GB GPT-2-layout copy through the 1 MiB buffer, warm): 0.125 -> 0.092 s
#: with the read-back check, 0.104 -> 0.072 s without (``cp`` 0.113 s): the writes then skip delayed
#: allocation page by page.  On tmpfs it measured slower (0.257 -> 0.271 s; the pages are zeroed twice),
#: so it is not done there nor on any file system not measured.
PREALLOCATE_FS = frozenset({"ext4"})

#: smaller outputs are not preallocated: the gain (about 0.07 ms per MiB) would not pay for looking up the
#: file system and loading ``ctypes`` (about 2 ms, once)
PREALLOCATE_MIN = 32 << 20


def fs_type(fd: int) -> str | None:
    """The type of the file system holding ``fd`` (``"ext4"``, ``"tmpfs"`` ...), from ``/proc/self/mountinfo``.

    Args:
        fd: an open file.

    Returns:
        The type, or None where it cannot be told (not Linux, no ``/proc``).
    """
    try:
        dev = os.fstat(fd).st_dev
        want = f"{os.major(dev)}:{os.minor(dev)}"
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return None


def preallocate(fd: int, size: int) -> bool:
    """Reserve the blocks of ``[0, size)`` of a new output before it is written, where that measured faster.

    Only for outputs of :data:`PREALLOCATE_MIN` bytes or more, on :data:`PREALLOCATE_FS`, through
    ``fallocate(2)`` itself (never glibc's ``posix_fallocate`` emulation, which writes a byte per block
    where the file system has no ``fallocate``).  The file's size becomes ``size``; its bytes read as
    zeros until written.  A full disk is found here, before a single tensor is copied.

    Args:
        fd: the output, open for writing.
        size: its final size.

    Returns:
        Whether the blocks were reserved (False: nothing done; the writes allocate them as usual).

    Raises:
        OutputError: the output device has no room for ``size`` bytes.
    """
    if size < max(1, PREALLOCATE_MIN) or fs_type(fd) not in PREALLOCATE_FS:
        return False
    err = _fallocate(fd, size)
    if err in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        raise OutputError(_FULL)
    return err == 0


#: ``FS_IOC_GETFLAGS`` (``_IOR('f', 1, long)``) where ioctl numbers have the generic layout, and the flag of a file
#: whose blocks are mapped by extents (``EXT4_EXTENTS_FL``): ``fallocate(2)`` is native for it
_GETFLAGS = 0x80086601 if os.uname().machine in ("x86_64", "aarch64", "arm64", "riscv64") else None
_EXTENTS_FL = 0x80000


def _extent_mapped(fd: int) -> bool:
    """Whether ``fd`` is an ext4 file mapped by extents (False where that cannot be told)."""
    if _GETFLAGS is None:
        return False
    try:
        import fcntl

        flags = struct.unpack("=I", fcntl.ioctl(fd, _GETFLAGS, bytes(8))[:4])[0]
    except (ImportError, OSError, struct.error):
        return False
    return bool(flags & _EXTENTS_FL)


def _fallocate(fd: int, size: int) -> int | None:
    """``fallocate(fd, 0, 0, size)``; returns 0, the errno, or None where libc has no ``fallocate``.

    For an ext4 file mapped by extents, ``os.posix_fallocate``: glibc makes the ``fallocate`` call and falls
    back to its emulation only on ``EOPNOTSUPP``, which such a file never answers; this spares loading
    ``ctypes`` (2.5 ms of every conversion of 32 MiB or more).  Any other file: ``fallocate`` through ``ctypes``.
    """
    if _extent_mapped(fd):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            return e.errno
        return 0
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.fallocate
        call.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        call.restype = ctypes.c_int
    except (ImportError, OSError, AttributeError):
        return None
    return 0 if call(fd, 0, 0, size) == 0 else ctypes.get_errno()


#: bytes per chunk read, gathered or compared (a tensor streamed through Python: converted, gathered, read back)
CHUNK = 8 << 20


class Fds:
    """Read-only file descriptors, opened once per path."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def get(self, path: str) -> int:
        """The read-only descriptor of ``path``, opened on first use.

        Args:
            path: a source file.

        Returns:
            The descriptor (closed by :meth:`close`).
        """
        fd = self.fds.get(path)
        if fd is None:  # two threads may race here: one descriptor is kept, the other closed
            new = pins.open_fd(path)
            if hasattr(os, "posix_fadvise"):  # read in file order: a larger readahead window for a cold input
                os.posix_fadvise(new, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            fd = self.fds.setdefault(path, new)
            if fd != new:
                os.close(new)
        return fd

    def close(self) -> None:
        """Close every descriptor opened."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
