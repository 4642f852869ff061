"""A remote object read by byte ranges: :class:`RemoteFile`.

Tuned for stores where a request costs tens of milliseconds and bytes are cheap:

* **one request at open** for the size and the ETag (HTTP ``HEAD``; ``fs.info`` elsewhere);
* **read-ahead**: a miss fetches at least :data:`READ_AHEAD` bytes, doubling (up to :data:`READ_AHEAD_MAX`)
  while reads stay sequential; a miss in the last :data:`TAIL` bytes fetches the whole tail (a zip's end
  record, its comment search and its central directory in one request) and one in the first :data:`HEAD`
  bytes the whole head; a file up to :data:`SMALL` bytes is fetched whole;
* a **bounded LRU cache** of fetched bytes in aligned :data:`BLOCK` blocks (:data:`CACHE_BYTES` in all);
* **coalescing** in :meth:`RemoteFile.read_ranges`: ranges closer than :data:`GAP` share one request;
* **parallel ranges**: a read over :data:`PART` bytes is split into parts fetched by ``jobs`` threads; reads of
  :data:`DIRECT` bytes or more (tensor bytes) bypass the cache, so memory stays flat whatever the file's size;
* **retries** of transient failures (5xx, 429, connection reset, timeouts, short reads) with exponential
  backoff and full jitter; after the last one :class:`~ckptfix.errors.RemoteUnavailableError` or
  :class:`~ckptfix.errors.RemoteThrottledError`;
* **ETag pinning**: the ETag read at open is sent as ``If-Match`` on every HTTP range request and checked on
  every response (with the object's total size from ``Content-Range``): a change is
  :class:`~ckptfix.errors.RemoteChangedError`, never a read that mixes two versions.

Environment: ``CKPTFIX_REMOTE_RETRIES`` (default 5), ``CKPTFIX_REMOTE_BACKOFF`` (first backoff in seconds,
default 0.25), ``CKPTFIX_REMOTE_TIMEOUT`` (seconds without data before a request counts as failed, default 60).
"""

from __future__ import annotations

import collections
import concurrent.futures
import io
import os
import random
import threading
import time
from typing import Any, Iterator

from ckptfix.errors import (
    CkptfixError,
    CorruptCheckpointError,
    RemoteAccessDeniedError,
    RemoteChangedError,
    RemoteNotFoundError,
    RemoteThrottledError,
    RemoteUnavailableError,
)
from ckptfix.remote import url as urls
from ckptfix.remote.stats import Stats

KiB = 1 << 10
MiB = 1 << 20

#: bytes a cache miss fetches at least
READ_AHEAD = 64 * KiB
#: the read-ahead doubles up to this while reads stay sequential
READ_AHEAD_MAX = 4 * MiB
#: a miss this close to the end fetches the whole tail (a zip's end record + 64 KiB comment search + its directory)
TAIL = 256 * KiB
#: a miss this close to the start fetches the whole head
HEAD = 64 * KiB
#: files up to this size are fetched whole by the first read
SMALL = 1 * MiB
#: ranges closer than this share one request (:meth:`RemoteFile.read_ranges`)
GAP = 1 * MiB
#: the most one coalesced request carries
MAX_REQUEST = 16 * MiB
#: reads over this are split into parts of this size, fetched in parallel
PART = 8 * MiB
#: reads of this size or more are fetched exactly and not cached (tensor bytes streaming through a convert or load)
DIRECT = 1 * MiB
#: what the window cache holds at most (e.g. 16 windows of 4 MiB)
CACHE_BYTES = 64 * MiB
#: the cache's unit: fetched ranges are kept as aligned blocks of this size
BLOCK = 16 * KiB


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def retries() -> int:
    """How many times a transient failure is retried (``CKPTFIX_REMOTE_RETRIES``, default 5)."""
    return max(0, int(_env_float("CKPTFIX_REMOTE_RETRIES", 5)))


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): full jitter over ``base * 2**attempt``, capped at 10 s.

    Args:
        attempt: the retry's number, from 0.

    Returns:
        The delay.
    """
    base = _env_float("CKPTFIX_REMOTE_BACKOFF", 0.25)
    return random.uniform(0, min(10.0, base * (2**attempt)))


def timeout() -> float:
    """Seconds a request may wait for data (``CKPTFIX_REMOTE_TIMEOUT``, default 60)."""
    return _env_float("CKPTFIX_REMOTE_TIMEOUT", 60.0)


class Transient(Exception):
    """A failure worth retrying (internal: it never leaves this module)."""

    def __init__(self, message: str, *, throttled: bool = False) -> None:
        super().__init__(message)
        self.throttled = throttled


def _http_status(name: str, status: int, reason: str = "") -> Exception:
    """The typed error (or :class:`Transient`) for an HTTP status."""
    if status in (404, 410):
        return RemoteNotFoundError(f"{name}: no such object (HTTP {status}); check the URL")
    if status in (401, 403):
        return RemoteAccessDeniedError(
            f"{name}: access denied (HTTP {status}); check your credentials and the object's permissions"
        )
    if status == 412:
        return RemoteChangedError(f"{name}: the object changed while it was read (HTTP 412); run the command again")
    if status == 429:
        return Transient(f"HTTP 429 {reason}".strip(), throttled=True)
    if status >= 500 or status == 408:
        return Transient(f"HTTP {status} {reason}".strip())
    return RemoteUnavailableError(f"{name}: unexpected HTTP {status} {reason}".strip())


class _HttpBackend:
    """Range requests over fsspec's aiohttp session, with ``If-Match`` and a check of every response."""

    def __init__(self, fs: Any, url: str, name: str) -> None:
        self.fs = fs
        self.url = url
        self.name = name
        self.etag: str | None = None
        self.size = -1

    def _run(self, coro_fn: Any, *args: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, coro_fn, *args)

    def _timeout(self) -> Any:
        import aiohttp

        t = timeout()
        return aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t)

    def _errors(self) -> tuple[type[BaseException], ...]:
        import asyncio

        import aiohttp

        return (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, TimeoutError)

    def info(self) -> tuple[int, str | None]:
        return tuple(self._guard(self._info))

    def _guard(self, coro_fn: Any, *args: Any) -> Any:
        try:
            return self._run(coro_fn, *args)
        except CkptfixError:  # already typed (some subclass ConnectionError): never retried
            raise
        except self._errors() as e:
            raise Transient(f"{type(e).__name__}: {e}") from None
        except Exception as e:  # fsspec's FSTimeoutError
            if type(e).__name__ == "FSTimeoutError":
                raise Transient("timed out") from None
            raise

    async def _info(self) -> tuple[int, str | None]:
        session = await self.fs.set_session()
        headers = {"Accept-Encoding": "identity"}
        async with session.head(self.url, headers=headers, allow_redirects=True, timeout=self._timeout()) as r:
            status = r.status
            h = r.headers
            final = str(r.url).split("?", 1)[0]
            if status < 300 and final.endswith("/") and not self.url.split("?", 1)[0].endswith("/"):
                raise IsADirectoryError(self.name)  # a folder URL the server redirected to its listing
            if status in (405, 501):  # no HEAD: one byte of GET tells the size
                return await self._info_get()
            if status >= 300:
                raise _http_status(self.name, status, r.reason or "")
            etag = h.get("ETag")
            if "Content-Length" not in h:
                return await self._info_get()
            return int(h["Content-Length"]), etag

    async def _info_get(self) -> tuple[int, str | None]:
        session = await self.fs.set_session()
        headers = {"Accept-Encoding": "identity", "Range": "bytes=0-0"}
        async with session.get(self.url, headers=headers, timeout=self._timeout()) as r:
            if r.status >= 300:
                raise _http_status(self.name, r.status, r.reason or "")
            cr = r.headers.get("Content-Range", "")
            if r.status != 206 or "/" not in cr or cr.endswith("/*"):
                raise RemoteUnavailableError(
                    f"{self.name}: the server does not answer range requests (HTTP {r.status}); "
                    "download the file and run the command on the local copy"
                )
            return int(cr.rsplit("/", 1)[1]), r.headers.get("ETag")

    def fetch(self, start: int, end: int) -> bytes:
        return bytes(self._guard(self._get, start, end))

    async def _get(self, start: int, end: int) -> bytes:
        session = await self.fs.set_session()
        headers = {"Accept-Encoding": "identity", "Range": f"bytes={start}-{end - 1}"}
        if self.etag:
            headers["If-Match"] = self.etag
        async with session.get(self.url, headers=headers, timeout=self._timeout()) as r:
            if r.status != 206:
                if r.status == 200:
                    raise RemoteUnavailableError(
                        f"{self.name}: the server ignored a range request (HTTP 200 instead of 206); "
                        "download the file and run the command on the local copy"
                    )
                raise _http_status(self.name, r.status, r.reason or "")
            etag = r.headers.get("ETag")
            if self.etag is not None and etag is not None and etag != self.etag:
                raise RemoteChangedError(
                    f"{self.name}: the object changed while it was read (ETag {self.etag} -> {etag}); "
                    "run the command again"
                )
            cr = r.headers.get("Content-Range", "")
            want = f"bytes {start}-{end - 1}/"
            if not cr.startswith(want):
                raise Transient(f"unexpected Content-Range {cr!r}")
            total = cr[len(want) :]
            if total != "*" and total != str(self.size):
                raise RemoteChangedError(
                    f"{self.name}: the object changed while it was read (size {self.size:,} -> {total} bytes); "
                    "run the command again"
                )
            data = await r.read()
        if len(data) != end - start:
            raise Transient(f"short read: {len(data):,} of {end - start:,} bytes")
        return data


#: top-level modules of the HTTP clients fsspec drivers use: their errors are the store's (network, auth ...)
_CLIENT_MODULES = frozenset(
    {
        "httpx",
        "httpcore",
        "requests",
        "urllib3",
        "aiohttp",
        "botocore",
        "aiobotocore",
        "huggingface_hub",
        "google",
        "azure",
    }
)

#: fsspec info keys that identify an object's version, most specific first
_VERSION_KEYS = ("ETag", "etag", "VersionId", "version_id", "generation", "blob_id", "md5Hash", "content_md5")


class _FsBackend:
    """Any other fsspec file system: ``cat_file(path, start, end)``; the version is checked by size and,
    where the file system reports one, by its ETag at open."""

    def __init__(self, fs: Any, path: str, name: str) -> None:
        self.fs = fs
        self.path = path
        self.name = name
        self.etag: str | None = None
        self.size = -1

    def _map(self, e: BaseException) -> Exception:
        if isinstance(e, CkptfixError):
            return e
        if isinstance(e, FileNotFoundError):
            return RemoteNotFoundError(f"{self.name}: no such object; check the URL")
        if isinstance(e, PermissionError):
            return RemoteAccessDeniedError(
                f"{self.name}: access denied ({e}); check your credentials and the object's permissions"
            )
        text = str(e)
        if "SlowDown" in text or "Throttl" in text or "429" in text or "TooManyRequests" in text:
            return Transient(text, throttled=True)
        if isinstance(e, (OSError, ConnectionError, TimeoutError)):
            return Transient(f"{type(e).__name__}: {e}")
        kind = type(e).__name__
        top = type(e).__module__.split(".")[0]
        if top in _CLIENT_MODULES or top.startswith("httpx") or any(w in kind for w in ("Connect", "Timeout", "HTTP")):
            if "NotFound" in kind:
                return RemoteNotFoundError(f"{self.name}: no such object ({kind}); check the URL")
            if any(w in kind for w in ("Auth", "Forbidden", "Permission", "Gated", "Denied")):
                return RemoteAccessDeniedError(
                    f"{self.name}: access denied ({kind}: {e}); check your credentials and the object's permissions"
                )
            return Transient(f"{kind}: {e}")
        return e  # type: ignore[return-value]

    def info(self) -> tuple[int, str | None]:
        try:
            inf = self.fs.info(self.path)
        except Exception as e:  # noqa: BLE001 - mapped to the typed errors
            raise self._map(e) from None
        if inf.get("type") == "directory":
            raise IsADirectoryError(self.name)
        etag = next((str(inf[k]) for k in _VERSION_KEYS if inf.get(k)), None)
        return int(inf["size"]), etag

    def fetch(self, start: int, end: int) -> bytes:
        try:
            data = self.fs.cat_file(self.path, start=start, end=end)
        except Exception as e:  # noqa: BLE001 - mapped to the typed errors
            raise self._map(e) from None
        if len(data) != end - start:
            raise Transient(f"short read: {len(data):,} of {end - start:,} bytes")
        return bytes(data)


class _S3Backend(_FsBackend):
    """S3 (s3fs): ``GetObject`` with a ``Range`` and ``If-Match`` (the ETag read at open), the ETag of every answer
    checked, as over HTTP."""

    def _map_s3(self, e: BaseException) -> Exception:
        cause = e.__cause__ if e.__cause__ is not None else e
        code = str(getattr(cause, "response", {}).get("Error", {}).get("Code", ""))
        if code in ("PreconditionFailed", "412"):
            return RemoteChangedError(
                f"{self.name}: the object changed while it was read (its ETag no longer matches); run the command again"
            )
        if code in ("SlowDown", "503", "Throttling", "ThrottlingException", "RequestLimitExceeded"):
            return Transient(f"S3 {code}", throttled=True)
        if code in ("InternalError", "500", "ServiceUnavailable"):
            return Transient(f"S3 {code}")
        return self._map(e)

    def fetch(self, start: int, end: int) -> bytes:
        from fsspec.asyn import sync

        bucket, key, version = self.fs.split_path(self.path)
        kw: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
        if self.etag:
            kw["IfMatch"] = self.etag
        if version:
            kw["VersionId"] = version

        async def get() -> tuple[str | None, bytes]:
            resp = await self.fs._call_s3("get_object", **kw)
            body = resp["Body"]
            try:
                data = await body.read()
            finally:
                body.close()
            return resp.get("ETag"), data

        try:
            etag, data = sync(self.fs.loop, get)
        except CkptfixError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to the typed errors
            raise self._map_s3(e) from None
        if self.etag is not None and etag is not None and etag != self.etag:
            raise RemoteChangedError(
                f"{self.name}: the object changed while it was read (ETag {self.etag} -> {etag}); run the command again"
            )
        if len(data) != end - start:
            raise Transient(f"short read: {len(data):,} of {end - start:,} bytes")
        return bytes(data)


class RemoteFile:
    """A remote object read by byte ranges (see the module's description for the policy).

    Args:
        url: the object's URL.
        stats: counters to add to, or None.
        fs: an fsspec file system to use instead of the URL's (tests); ``path`` is then the URL's path in it.

    Raises:
        RemoteNotFoundError: no such object.
        RemoteAccessDeniedError: the store refused.
        RemoteDriverMissingError: the scheme's driver is not installed.
        RemoteUnavailableError: the store could not be reached after every retry.
        IsADirectoryError: the URL names a folder.
    """

    def __init__(self, url: str, *, stats: Stats | None = None, fs: Any = None) -> None:
        self.name = url
        self.stats = stats
        if fs is None:
            fs, path = urls.filesystem(url)
        else:
            path = url
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        if "http" in protocols or "https" in protocols:
            self._backend: Any = _HttpBackend(fs, path, url)
        elif ("s3" in protocols or "s3a" in protocols) and hasattr(fs, "_call_s3"):
            self._backend = _S3Backend(fs, path, url)
        else:
            self._backend = _FsBackend(fs, path, url)
        self.fs = fs
        self.path = path
        size, etag = self._retry(self._backend.info)
        self.size: int = size
        self.etag: str | None = etag
        self._backend.size = size
        self._backend.etag = etag
        if stats is not None:
            stats.add(files=1)
        self._cache: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # block number -> bytes
        self._cached = 0
        self._lock = threading.Lock()
        self._ra = READ_AHEAD
        self._last_end = -1
        self.closed = False

    # -- requests ---------------------------------------------------------------------------------

    def _retry(self, fn: Any, *args: Any) -> Any:
        n = retries()
        last: Transient | None = None
        for attempt in range(n + 1):
            try:
                out = fn(*args)
            except CkptfixError:  # a typed answer (changed, not found, denied): the request counts, no retry
                if self.stats is not None:
                    self.stats.add(requests=1)
                raise
            except Transient as e:
                last = e
                if self.stats is not None:
                    self.stats.add(requests=1, retries=1 if attempt < n else 0)
                if attempt < n:
                    time.sleep(backoff(attempt))
                continue
            if self.stats is not None:
                self.stats.add(requests=1, nbytes=len(out) if isinstance(out, (bytes, bytearray)) else 0)
            return out
        assert last is not None
        if last.throttled:
            raise RemoteThrottledError(
                f"{self.name}: the store is throttling requests ({last}) after {n} {'retry' if n == 1 else 'retries'}; "
                "wait and run the command again (or set CKPTFIX_REMOTE_RETRIES higher)"
            )
        raise RemoteUnavailableError(
            f"{self.name}: the store failed ({last}) after {n} {'retry' if n == 1 else 'retries'}; "
            "check the network and run the command again (or set CKPTFIX_REMOTE_RETRIES higher)"
        )

    def _fetch(self, start: int, end: int) -> bytes:
        """One range request ``[start, end)`` with retries."""
        return bytes(self._retry(self._backend.fetch, start, end))

    def _fetch_parts(self, off: int, n: int, jobs: int, into: memoryview | None = None) -> bytes | None:
        """``[off, off+n)`` in parts of :data:`PART`, ``jobs`` at a time; into ``into`` when given."""
        parts = [(s, min(s + PART, off + n)) for s in range(off, off + n, PART)]
        out = into if into is not None else memoryview(bytearray(n))

        def one(p: tuple[int, int]) -> None:
            data = self._fetch(*p)
            out[p[0] - off : p[1] - off] = data

        if jobs <= 1 or len(parts) == 1:
            for p in parts:
                one(p)
        else:
            with concurrent.futures.ThreadPoolExecutor(min(jobs, len(parts))) as ex:
                for f in [ex.submit(one, p) for p in parts]:
                    f.result()
        return None if into is not None else bytes(out)

    # -- the cache --------------------------------------------------------------------------------

    def _lookup(self, off: int, n: int) -> bytes | None:
        """The bytes if every block of ``[off, off+n)`` is cached, else None."""
        b0, b1 = off // BLOCK, (off + n - 1) // BLOCK
        with self._lock:
            blocks = []
            for b in range(b0, b1 + 1):
                data = self._cache.get(b)
                if data is None:
                    return None
                self._cache.move_to_end(b)
                blocks.append(data)
        if b0 == b1:
            start = off - b0 * BLOCK
            return blocks[0][start : start + n]
        joined = b"".join(blocks)
        start = off - b0 * BLOCK
        return joined[start : start + n]

    def _store(self, start: int, data: bytes) -> None:
        """Cache a fetched range (``start`` on a block boundary) as blocks, dropping the least recently used."""
        if len(data) > CACHE_BYTES // 2:
            return
        with self._lock:
            for k in range(0, len(data), BLOCK):
                b = (start + k) // BLOCK
                self._cache[b] = data[k : k + BLOCK]
                self._cache.move_to_end(b)
            while len(self._cache) > max(1, CACHE_BYTES // BLOCK):
                self._cache.popitem(last=False)
        self._cached = len(self._cache) * BLOCK

    def _window(self, off: int, n: int) -> tuple[int, int]:
        """The block-aligned range a miss at ``[off, off+n)`` fetches (the read-ahead policy)."""
        size = self.size
        if size <= SMALL:
            return 0, size
        b0, b1 = off // BLOCK, (off + n - 1) // BLOCK
        with self._lock:  # skip what is cached at either end: fetch from the first missing block to the last
            while b0 <= b1 and b0 in self._cache:
                b0 += 1
            while b1 >= b0 and b1 in self._cache:
                b1 -= 1
        start, end = b0 * BLOCK, (b1 + 1) * BLOCK
        if start == self._last_end:  # sequential: the read-ahead doubles
            self._ra = min(self._ra * 2, READ_AHEAD_MAX)
        else:
            self._ra = READ_AHEAD
        end = max(end, start + self._ra)
        if size - start <= TAIL:
            start, end = max(0, size - TAIL) // BLOCK * BLOCK, size
        if start < HEAD:
            start, end = 0, max(end, HEAD)
        with self._lock:  # do not fetch cached blocks again at the end of the range
            while end - start > BLOCK and (end - 1) // BLOCK in self._cache:
                end = (end - 1) // BLOCK * BLOCK
        end = min(end, size)
        self._last_end = end
        return start, end

    # -- the Source interface ---------------------------------------------------------------------

    def _check(self, n: int, off: int) -> None:
        if self.closed:
            raise ValueError("I/O operation on a closed RemoteFile")
        if n < 0 or off < 0 or off + n > self.size:
            raise CorruptCheckpointError(
                f"{self.name}: a read of {n:,} bytes at offset {off:,} runs past the end of the object "
                f"({self.size:,} bytes): the file is truncated or damaged"
            )

    def pread(self, n: int, off: int, *, jobs: int = 1) -> bytes:
        """Exactly ``n`` bytes at ``off``.

        Args:
            n: how many bytes.
            off: where.
            jobs: parallel requests for a read over :data:`PART` bytes.

        Returns:
            The bytes.

        Raises:
            CorruptCheckpointError: the range runs past the end of the object.
        """
        self._check(n, off)
        if n == 0:
            return b""
        hit = self._lookup(off, n)
        if hit is not None:
            return hit
        if n >= DIRECT:  # tensor bytes streaming through: fetched exactly, never cached (memory stays flat)
            out = self._fetch_parts(off, n, jobs)
            assert out is not None
            return out
        start, end = self._window(off, n)
        data = self._fetch(start, end)
        self._store(start, data)
        hit = self._lookup(off, n)
        if hit is None:  # more than the cache holds at once: assemble from what was fetched and the cache
            hit = self._assemble(off, n, start, data)
        return hit

    def _assemble(self, off: int, n: int, start: int, data: bytes) -> bytes:
        out = bytearray()
        pos = off
        while pos < off + n:
            if start <= pos < start + len(data):
                take = data[pos - start : min(start + len(data), off + n) - start]
            else:
                k = min(off + n, (pos // BLOCK + 1) * BLOCK) - pos
                take = self._lookup(pos, k) or self._fetch(pos, pos + k)
            out += take
            pos += len(take)
        return bytes(out)

    def readinto(self, view: memoryview, off: int, *, jobs: int = 1) -> int:
        """Fill ``view`` with the bytes at ``off`` (all of it, or an error).

        Args:
            view: a writable buffer.
            off: where.
            jobs: parallel requests for a read over :data:`PART` bytes.

        Returns:
            ``len(view)``.
        """
        view = memoryview(view).cast("B")
        n = len(view)
        self._check(n, off)
        if n >= DIRECT and self._lookup(off, n) is None:
            self._fetch_parts(off, n, jobs, into=view)
            return n
        view[:] = self.pread(n, off)
        return n

    def read_ranges(self, ranges: list[tuple[int, int]], jobs: int = 1) -> Iterator[tuple[int, bytes]]:
        """The bytes of many ``(offset, length)`` ranges, in the order given; ranges closer than :data:`GAP`
        share one request (up to :data:`MAX_REQUEST` bytes), and ``jobs`` requests run at once.

        Memory: at most ``jobs`` requests' bytes (plus a range being yielded) are held at a time.

        Args:
            ranges: ``(offset, length)`` pairs.
            jobs: parallel requests.

        Yields:
            ``(offset, data)`` for each range, in the order given.
        """
        for off, n in ranges:
            self._check(n, off)
        order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        groups: list[tuple[int, int, list[int]]] = []  # (start, end, indices)
        for i in order:
            off, n = ranges[i]
            if groups:
                s, e, idx = groups[-1]
                if off - e <= GAP and max(e, off + n) - s <= MAX_REQUEST:
                    groups[-1] = (s, max(e, off + n), idx + [i])
                    continue
            groups.append((off, off + n, [i]))
        # fetch groups in windows of `jobs`, yield ranges in the caller's order as far as they are ready
        got: dict[int, bytes] = {}
        done: set[int] = set()
        pos = 0
        gi = 0
        where = {i: g for g, (_, _, idx) in enumerate(groups) for i in idx}
        jobs = max(1, jobs)
        with concurrent.futures.ThreadPoolExecutor(jobs) as ex:
            pending: dict[int, concurrent.futures.Future[bytes]] = {}
            while pos < len(ranges):
                need = where[pos]
                while gi < len(groups) and (gi <= need or len(pending) < jobs):
                    s, e, _ = groups[gi]
                    pending[gi] = ex.submit(self._group, s, e, jobs)
                    gi += 1
                if need not in done:
                    data = pending.pop(need).result()
                    s, _, idx = groups[need]
                    for i in idx:
                        o, n = ranges[i]
                        got[i] = data[o - s : o - s + n]
                    done.add(need)
                off, n = ranges[pos]
                yield off, got.pop(pos)
                pos += 1

    def prefetch(self, ranges: list[tuple[int, int]], jobs: int = 8) -> None:
        """Bring ``(offset, length)`` ranges into the cache ahead of many small reads (coalesced, ``jobs`` requests at
        once), up to half the cache; what does not fit is simply read later.

        Args:
            ranges: ``(offset, length)`` pairs.
            jobs: parallel requests.
        """
        want: list[tuple[int, int]] = []
        budget = CACHE_BYTES // 2
        for off, n in sorted(ranges):
            off, end = max(0, off) // BLOCK * BLOCK, min(self.size, off + n)
            end = min(self.size, -(-end // BLOCK) * BLOCK)
            if end <= off or self._lookup(off, end - off) is not None:
                continue
            if want and off - want[-1][1] <= GAP and end - want[-1][0] <= MAX_REQUEST:
                want[-1] = (want[-1][0], max(want[-1][1], end))
            else:
                want.append((off, end))
            budget -= end - off
            if budget <= 0:
                break
        if not want:
            return

        def one(r: tuple[int, int]) -> None:
            self._store(r[0], self._fetch(*r))

        with concurrent.futures.ThreadPoolExecutor(max(1, min(jobs, len(want)))) as ex:
            for f in [ex.submit(one, r) for r in want]:
                f.result()

    def _group(self, s: int, e: int, jobs: int) -> bytes:
        hit = self._lookup(s, e - s)
        if hit is not None:
            return hit
        if e - s < DIRECT:  # through the cache: only the blocks missing are fetched
            return self.pread(e - s, s)
        if e - s > PART:
            out = self._fetch_parts(s, e - s, 1)
            assert out is not None
            return out
        return self._fetch(s, e)

    def fileobj(self) -> RemoteBufferedReader:
        """A seekable read-only file object over the object (for :mod:`zipfile`, :mod:`tarfile`, ``json.load``).

        Returns:
            A new buffered file object (its own position, a 64 KiB buffer so that the C unpickler's small
            reads stay cheap) sharing this file's cache.
        """
        return RemoteBufferedReader(RemoteFileObj(self), 64 * KiB)

    def close(self) -> None:
        """Drop the cache."""
        self.closed = True
        with self._lock:
            self._cache.clear()
            self._cached = 0

    def __enter__(self) -> RemoteFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteFileObj(io.RawIOBase):
    """A file object over a :class:`RemoteFile`: reads at the position, short only at the end."""

    #: tells the scanner (:mod:`ckptfix.scanner`) to read windows instead of memory-mapping or reading it all
    remote = True

    def __init__(self, rf: RemoteFile) -> None:
        super().__init__()
        self.rf = rf
        self.pos = 0
        self.name = rf.name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        if whence == 0:
            pos = off
        elif whence == 1:
            pos = self.pos + off
        elif whence == 2:
            pos = self.rf.size + off
        else:
            raise ValueError(f"bad whence {whence}")
        if pos < 0:
            raise OSError(22, "negative seek position")
        self.pos = pos
        return pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self.rf.size - self.pos)
        n = left if n is None or n < 0 else min(n, left)
        data = self.rf.pread(n, self.pos)
        self.pos += n
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), max(0, self.rf.size - self.pos))
        if n:
            self.rf.readinto(view[:n], self.pos)
        self.pos += n
        return n

    @property
    def size(self) -> int:
        return self.rf.size


class RemoteBufferedReader(io.BufferedReader):
    """:class:`io.BufferedReader` over a :class:`RemoteFileObj`, with ``remote``/``size`` for the scanner."""

    #: tells the scanner (:mod:`ckptfix.scanner`) to read windows instead of memory-mapping or reading it all
    remote = True

    @property
    def size(self) -> int:
        """The object's size."""
        return int(self.raw.size)  # type: ignore[attr-defined]
