"""What the page cache holds of a file, asked and left as found.

:func:`page_cached` asks whether a page is cached (``RWF_NOWAIT``); :func:`read_scattered` makes small reads
spread over a file without leaving cached islands in it (they break the kernel's readahead of the sequential
copy after them); :func:`drop_cached` drops clean cached pages, so that a read-back comes from the device.
Below :mod:`ckptfix.files.fileio`, which copies and verifies byte ranges with them.
"""

from __future__ import annotations

import contextlib
import os
from typing import Sequence

__all__ = ["drop_cached", "page_cached", "read_scattered"]

#: the page size (the unit of the page cache)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def page_cached(fd: int, off: int) -> bool:
    """Is the page holding byte ``off`` of ``fd`` in the page cache?  Asked without waiting for the device.

    One byte is read with ``RWF_NOWAIT`` (``preadv2``), which fails with ``EAGAIN`` at once rather than
    wait for a page that is not cached.  The kernel may start reading that page (its readahead) without
    waiting for it, so only the first answer about a page tells its state.

    Args:
        fd: an open file.
        off: a byte offset.

    Returns:
        True when it is; False when it is not, or where the kernel or file system cannot tell.
    """
    return _cached(fd, off) is True


def read_scattered(fd: int, ranges: Sequence[tuple[int, int]]) -> dict[int, bytes]:
    """Small reads scattered over a file, leaving its page cache as it was: ``{offset: bytes}``.

    For reads spread over a file that is then read in one sequential pass (a zip's local headers, before
    its members are copied).  Pages these reads bring in from the device are dropped again: cached islands
    in a cold file break the kernel's readahead when the sequential pass reaches them (a 0.5 GB cold copy
    measured 0.18 s without them, 0.28-0.45 s after 149 header reads, 0.18 s again with those pages
    dropped).  Pages that were cached already stay cached.  The pages not cached are asked for all at once
    (``POSIX_FADV_WILLNEED``), so the device serves them together: 149 headers of a cold 0.5 GB checkpoint
    in 1.4 ms, against 8 ms read one by one.

    Args:
        fd: an open file; advised ``POSIX_FADV_RANDOM`` here, so that a read brings in just its pages.
        ranges: ``(offset, length)`` pairs.

    Returns:
        Each range's bytes by offset (fewer bytes at the end of the file).
    """
    advise = getattr(os, "posix_fadvise", None)
    cold: list[int] = []  # pages known not to be cached (where the kernel cannot tell: none)
    if advise is not None:
        with contextlib.suppress(OSError):
            advise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        pages = sorted({p for off, n in ranges if n > 0 for p in range(off // PAGE, (off + n - 1) // PAGE + 1)})
        cold = [p for p in pages if _cached(fd, p * PAGE) is False]
        for p in cold:
            with contextlib.suppress(OSError):
                advise(fd, p * PAGE, PAGE, os.POSIX_FADV_WILLNEED)  # queued together: read in parallel
    out: dict[int, bytes] = {}
    for off, n in ranges:
        out[off] = _read_at(fd, n, off)
    for p in cold:
        drop_cached(fd, p * PAGE, PAGE)
    return out


def _cached(fd: int, off: int) -> bool | None:
    """Is the page holding byte ``off`` cached?  None where the kernel or file system cannot tell."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return None
    try:
        return os.preadv(fd, [bytearray(1)], off, flag) == 1
    except BlockingIOError:
        return False
    except OSError:
        return None


def drop_cached(fd: int, off: int, size: int) -> None:
    """Drop the clean cached pages of a range (``POSIX_FADV_DONTNEED``): the next read comes from the device.

    Dirty pages (written, not yet flushed) stay cached: after an ``fsync`` the range is clean and a
    read-back really reads the device.

    Args:
        fd: the file.
        off: where the range starts.
        size: its length.
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None or size <= 0:
        return
    try:
        advise(fd, off, size, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


def _read_at(fd: int, n: int, off: int) -> bytes:
    """Up to ``n`` bytes at ``off`` (a short read is continued; fewer only at the end of the file)."""
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, off + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
