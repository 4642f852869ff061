"""A conversion's input in object storage: tensors' byte ranges streamed from a URL into the output (issue #26).

The readers (:mod:`ckptfix.formats`) give every tensor of a remote checkpoint as a byte range of the object at
its URL, as they do for a local file; :class:`~ckptfix.ops.convert.write.Writer` hands the ranges whose source is a
URL to :func:`copy_remote`, which reads them through :class:`ckptfix.files.source.Source` in pieces of
:data:`PIECE` bytes and writes each at its offset in the output:

* ``--jobs N`` is the number of range requests in flight, over the whole conversion (:class:`Budget`): a big
  tensor is fetched as N parallel ranges, many small ones as N tensors at a time, and memory stays at most
  ``max(2, N) x`` :data:`PIECE` whatever the checkpoint's size;
* pieces are written in order; each is read back from the output and compared with the bytes received
  (the check a gathered chunk gets locally), and a range whose source stores a CRC-32 (a torch zip record
  holding exactly the tensor) is checked against it over the bytes received, so a wrong byte from the store
  is a typed error, never a wrong tensor;
* the store's own guarantees (the object's ETag pinned at open, retries) are the Source's.
"""

from __future__ import annotations

import threading
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any, Callable

from ckptfix.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from ckptfix.files.source import Source

#: bytes per range request of a tensor copy
PIECE = 8 << 20
#: neighbouring small tensors of one object closer than this are fetched in one request (the gap is read too)
GAP = 1 << 20


def is_remote(path: str | None) -> bool:
    """Whether ``path`` is a URL (read through a remote Source), not a local file.

    Args:
        path: a source path, or None.

    Returns:
        True for ``s3://``, ``https://`` ... URLs.
    """
    if not path or "://" not in path:
        return False
    from ckptfix.files.source import is_url

    return is_url(path)


class Sources:
    """Remote sources opened once per URL (thread-safe), and the pool their range requests run in."""

    def __init__(self, jobs: int = 1) -> None:
        from ckptfix.files.parallel import resolve_jobs

        self.jobs = resolve_jobs(jobs)
        self._open: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.budget = Budget(max(2, self.jobs))

    def get(self, url: str) -> Source:
        """The :class:`~ckptfix.files.source.Source` of ``url``, opened on first use (its ETag pinned then)."""
        with self._lock:
            src = self._open.get(url)
            if src is None:
                from ckptfix.files.source import open_source

                src = self._open[url] = open_source(url)
            return src

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="ckptfix-range")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            opened, self._open = list(self._open.values()), {}
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for s in opened:
            s.close()


def uncached_pread(src: Any, n: int, off: int) -> bytes:
    """``n`` bytes at ``off``, fetched without going through the Source's block cache (tensor data is read once).

    A :class:`~ckptfix.files.remote.file.RemoteFile` ranged fetch keeps its retries and ETag check; any other Source
    is read with its ``pread``.
    """
    rf = getattr(src, "rf", None)
    fetch = getattr(rf, "_fetch", None)
    if fetch is None or n <= 0 or off + n > src.size:
        return bytes(src.pread(n, off))
    return bytes(fetch(off, off + n))


def _one_remote_range(it: Any) -> tuple[str, int, int, int | None] | None:
    ranges = it.ranges()
    if ranges is None or len(ranges) != 1 or not is_remote(ranges[0][0]) or ranges[0][2] >= PIECE:
        return None
    return ranges[0]


def group_small(order: list[Any]) -> list[list[Any]]:
    """Items in source order, neighbouring small tensors of one object grouped (one request per group).

    A group's span (its tensors and the gaps between them, each under :data:`GAP`) stays under :data:`PIECE`,
    so memory stays bounded; every other item is a group of its own.

    Args:
        order: the items, sorted by source and offset.

    Returns:
        The groups, in order.
    """
    groups: list[list[Any]] = []
    span: tuple[str, int, int] | None = None  # (url, start, end) of the open group
    for it in order:
        r = _one_remote_range(it)
        if r is not None and span is not None:
            url, start, end = span
            if r[0] == url and end <= r[1] <= end + GAP and r[1] + r[2] - start <= PIECE:
                groups[-1].append(it)
                span = (url, start, r[1] + r[2])
                continue
        groups.append([it])
        span = (r[0], r[1], r[1] + r[2]) if r is not None else None
    return groups


def copy_group(
    sources: Sources,
    group: list[Any],
    write: Callable[[Any, memoryview], None],
    tick: Callable[[int], None] | None = None,
) -> None:
    """Fetch a group of small tensors of one object in one range request; ``write(item, bytes)`` each.

    Raises:
        CorruptCheckpointError: a short read, or a tensor's bytes do not match the CRC-32 its zip record stores.
    """
    first = group[0].ranges()[0]
    last = group[-1].ranges()[0]
    url, start = first[0], first[1]
    end = last[1] + last[2]
    budget = sources.budget
    budget.take()
    try:
        data = uncached_pread(sources.get(url), end - start, start)
        if len(data) != end - start:
            raise CorruptCheckpointError(
                f"{url}: got {len(data)} bytes at {start}, expected {end - start} (truncated?)"
            )
        view = memoryview(data)
        for it in group:
            _url, off, size, crc = it.ranges()[0]
            piece = view[off - start : off - start + size]
            if crc is not None and zlib.crc32(piece) != crc:
                raise CorruptCheckpointError(
                    f"{url}: tensor {it.name!r} does not match the CRC-32 its zip record stores; the object is "
                    "damaged (or was replaced while being read): re-upload it, or convert from another copy"
                )
            write(it, piece)
            if tick is not None:
                tick(size)
    finally:
        budget.give()


def spool_range(url: str, off: int, size: int) -> IO[bytes]:
    """``size`` bytes at ``off`` of ``url`` in an anonymous temp file (a strided view's span, to be mapped).

    Args:
        url: the object.
        off: the span's start.
        size: its length.

    Returns:
        An open temp file (``tempfile.TemporaryFile``) holding exactly the span; the caller closes it.

    Raises:
        CorruptCheckpointError: the object ended early.  The Source's typed errors.
    """
    import tempfile

    from ckptfix.files.fileio import pwrite_all
    from ckptfix.files.source import open_source

    f = tempfile.TemporaryFile(prefix="ckptfix-span-")
    try:
        with open_source(url) as src:
            for at in range(0, size, PIECE):
                n = min(PIECE, size - at)
                data = src.pread(n, off + at)
                if len(data) != n:
                    raise CorruptCheckpointError(f"{url}: the object ended inside a tensor at byte {off + at}")
                pwrite_all(f.fileno(), data, at)
    except BaseException:
        f.close()
        raise
    return f


class Budget:
    """Pieces in flight over all the tensors being copied (a semaphore that never deadlocks a copier).

    A copier that cannot take a token while it has pieces of its own in flight writes its oldest piece
    first (freeing a token); only a copier with nothing in flight waits.
    """

    def __init__(self, tokens: int) -> None:
        self._sem = threading.Semaphore(max(1, tokens))

    def try_take(self) -> bool:
        return self._sem.acquire(blocking=False)

    def take(self) -> None:
        self._sem.acquire()

    def give(self) -> None:
        self._sem.release()


def copy_remote(
    sources: Sources,
    url: str,
    off: int,
    size: int,
    crc: int | None,
    write: Callable[[bytes, int], None],
    *,
    name: str,
    tick: Callable[[int], None] | None = None,
) -> None:
    """Copy ``size`` bytes at ``off`` of the object ``url`` through ``write(data, at)`` (``at``: offset in the range).

    Args:
        sources: the open sources and the request pool.
        url: the object.
        off: the range's start in it.
        size: its length.
        crc: the CRC-32 the source stores for exactly this range, or None.
        write: writes (and, verifying, reads back and compares) one piece; raises on a mismatch.
        name: the tensor's name, for messages.
        tick: progress, bytes done.

    Raises:
        CorruptCheckpointError: a short piece, or the bytes received do not match the stored CRC-32.
        The Source's typed errors (RemoteChangedError, RemoteUnavailableError ...).
    """
    src = sources.get(url)
    pool = sources.pool()
    budget = sources.budget
    pieces = [(at, min(PIECE, size - at)) for at in range(0, size, PIECE)]
    inflight: deque[tuple[int, int, Future[bytes]]] = deque()
    running = 0 if crc is not None else None
    nxt = 0
    try:
        while nxt < len(pieces) or inflight:
            if nxt < len(pieces):
                got = budget.try_take()
                if not got and not inflight:  # nothing of ours to write meanwhile: wait for a token
                    budget.take()
                    got = True
                if got:
                    at, n = pieces[nxt]
                    inflight.append((at, n, pool.submit(uncached_pread, src, n, off + at)))
                    nxt += 1
                    continue
            at, n, fut = inflight.popleft()
            try:
                data = fut.result()
            finally:
                budget.give()
            if len(data) != n:
                raise CorruptCheckpointError(
                    f"{url}: tensor {name!r}: got {len(data)} bytes at {off + at}, expected {n} (truncated object?)"
                )
            if running is not None:
                running = zlib.crc32(data, running)
            write(data, at)
            if tick is not None:
                tick(n)
    except BaseException:
        for _at, _n, fut in inflight:
            fut.cancel()
            if not fut.cancelled():
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001 (the first error is the one raised)
                    pass
            budget.give()
        raise
    if running is not None and running != crc:
        raise CorruptCheckpointError(
            f"{url}: tensor {name!r} does not match the CRC-32 its zip record stores; the object is damaged "
            "(or was replaced while being read): re-upload it, or convert from another copy"
        )
