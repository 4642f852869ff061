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
  :class:`~ckptfix.errors.RemoteChangedError`, never a read that mixes two versions.  The version also stays
  pinned for :data:`PIN_SECONDS` after the URL's last open in the process: a reader that opens the object again
  (the tensor copy after the header read) and finds another version gets the same error.

Environment: ``CKPTFIX_REMOTE_RETRIES`` (default 5), ``CKPTFIX_REMOTE_BACKOFF`` (first backoff in seconds,
default 0.25), ``CKPTFIX_REMOTE_TIMEOUT`` (seconds without data before a request counts as failed, default 60;
a whole HTTP request gets twice that plus its body at 64 KiB/s, so a server that trickles bytes is cut off).

How each kind of store is asked (one range request at a time):

* :class:`_HttpBackend` (``http(s)://``): fsspec's aiohttp session; ``HEAD`` for size and ETag, ``GET`` with one
  ``Range`` and ``If-Match``; every answer checked (206, ``Content-Range``, ``ETag``, length);
* :class:`_S3Backend` (``s3://``): s3fs' ``GetObject`` with ``Range`` and ``IfMatch``, the ETag checked;
* :class:`_HfBackend` (``hf://``, huggingface_hub's ``HfFileSystem``): the revision resolved to its commit at open,
  each range one ``GET`` of ``.../resolve/<commit>/<path>`` (or of the signed CDN URL an LFS/Xet file redirects to);
* :class:`_FsBackend` (any other fsspec file system: ``memory://``, ``gs://``, ``az://``):
  ``fs.info`` and ``fs.cat_file(path, start, end)``, the length checked.

Each raises :class:`Transient` for what is worth retrying (the caller retries with backoff) and the typed
errors of :mod:`ckptfix.errors` for the rest.  ``CKPTFIX_REMOTE_RETRIES`` and ``CKPTFIX_REMOTE_BACKOFF`` are read
here, ``CKPTFIX_REMOTE_TIMEOUT`` by :func:`ckptfix.files.remote.url.timeout` (the S3 client's timeouts too).
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
from ckptfix.files.remote import url as urls
from ckptfix.files.remote.stats import Stats
from ckptfix.files.remote.url import timeout


# -- how each kind of store is asked: one range request at a time --------------------------------------
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
    """
    base = _env_float("CKPTFIX_REMOTE_BACKOFF", 0.25)
    return random.uniform(0, min(10.0, base * (2**attempt)))


#: bytes per second: a range request whose body comes slower than this (after twice the timeout) has failed
MIN_RATE = 64 * 1024


def deadline(nbytes: int = 0) -> float:
    """Seconds a whole request for ``nbytes`` may take: twice :func:`timeout` plus the body at :data:`MIN_RATE` (a
    server that sends a byte now and then never trips a read timeout; this cuts it off)."""
    return 2 * timeout() + nbytes / MIN_RATE


class Transient(Exception):
    """A failure worth retrying (internal: it never leaves this module)."""

    def __init__(self, message: str, *, throttled: bool = False, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.throttled = throttled
        #: seconds the server asked to wait (``Retry-After``), honoured up to :data:`MAX_RETRY_AFTER`
        self.retry_after = retry_after


#: the longest ``Retry-After`` honoured (seconds); longer ones wait this long
MAX_RETRY_AFTER = 20.0


def _retry_after(headers: Any) -> float | None:
    """Seconds from a ``Retry-After`` header given in seconds (an HTTP date is ignored: the backoff applies)."""
    try:
        return max(0.0, float(headers.get("Retry-After", "")))
    except (TypeError, ValueError, AttributeError):
        return None


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
    return RemoteUnavailableError(
        f"{name}: unexpected HTTP {status} {reason}".strip()
        + "; check the URL, or download the file and run the command on the local copy"
    )


def no_credentials(name: str, e: BaseException) -> RemoteAccessDeniedError:
    """The error for a store that found no credentials to sign with (botocore's ``NoCredentialsError`` ...)."""
    hint = _CREDENTIALS.get(urls.SCHEMES.get(urls.scheme(name) or "", ("",))[0], "configure the store's credentials")
    return RemoteAccessDeniedError(f"{name}: no credentials for this store ({type(e).__name__}); {hint}")


#: how to give each store credentials (by fsspec protocol)
_CREDENTIALS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
    "gcs": "run gcloud auth application-default login, or set GOOGLE_APPLICATION_CREDENTIALS",
    "abfs": "run az login, or set AZURE_STORAGE_CONNECTION_STRING",
    "hf": "run huggingface-cli login, or set HF_TOKEN",
}


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

    def _timeout(self, nbytes: int = 0) -> Any:
        import aiohttp

        t = timeout()
        # a deadline for the whole request too: a server that sends a byte now and then (slow loris) never trips
        # ``sock_read``; twice the timeout plus the body at :data:`MIN_RATE` is generous for an honest server
        return aiohttp.ClientTimeout(total=deadline(nbytes), sock_connect=t, sock_read=t)

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
        except ValueError as e:  # aiohttp's InvalidURL (a bad port, no host): no retry makes it valid
            if type(e).__name__.startswith("InvalidUrl") or type(e).__name__ == "InvalidURL":
                raise RemoteNotFoundError(f"{self.name}: not a valid URL ({e}); check the URL") from None
            raise
        except self._errors() as e:
            kind = type(e).__name__
            if kind in ("NonHttpUrlRedirectClientError", "InvalidUrlRedirectClientError", "TooManyRedirects"):
                why = "in a loop" if kind == "TooManyRedirects" else f"to {e}, not an http(s) URL"
                raise RemoteUnavailableError(  # the server's answer, the same on every retry: refused now
                    f"{self.name}: the server redirects {why}; refused (check the URL, or download the file)"
                ) from None
            raise Transient(f"{kind}: {e}") from None
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
            total = cr.rsplit("/", 1)[1].strip()
            if not (total.isascii() and total.isdigit()):
                raise RemoteUnavailableError(
                    f"{self.name}: the server answered a malformed Content-Range ({cr!r}); "
                    "download the file and run the command on the local copy"
                )
            return int(total), r.headers.get("ETag")

    def fetch(self, start: int, end: int) -> bytes:
        return bytes(self._guard(self._get, start, end))

    async def _get(self, start: int, end: int) -> bytes:
        session = await self.fs.set_session()
        headers = {"Accept-Encoding": "identity", "Range": f"bytes={start}-{end - 1}"}
        if self.etag and not self.etag.startswith("W/"):  # a weak ETag never matches If-Match: compared below only
            headers["If-Match"] = self.etag
        async with session.get(self.url, headers=headers, timeout=self._timeout(end - start)) as r:
            if r.status != 206:
                if r.status == 200:
                    raise RemoteUnavailableError(
                        f"{self.name}: the server ignored a range request (HTTP 200 instead of 206); "
                        "download the file and run the command on the local copy"
                    )
                err = _http_status(self.name, r.status, r.reason or "")
                if isinstance(err, Transient):
                    err.retry_after = _retry_after(r.headers)
                raise err
            etag = r.headers.get("ETag")
            if self.etag is not None and etag is not None and etag != self.etag:
                raise RemoteChangedError(
                    f"{self.name}: the object changed while it was read (ETag {self.etag} -> {etag}); "
                    "run the command again"
                )
            check_content_range(self.name, r.headers.get("Content-Range", ""), start, end, self.size)
            enc = r.headers.get("Content-Encoding", "identity").strip().lower()
            if enc not in ("", "identity"):  # asked for identity: decoded bytes are not the object's (maybe a bomb)
                raise RemoteUnavailableError(
                    f"{self.name}: the server compressed a range answer (Content-Encoding: {enc}) though asked for "
                    "identity; download the file and run the command on the local copy"
                )
            data = await _read_at_most(r, end - start)
        if len(data) != end - start:
            raise Transient(f"short read: {len(data):,} of {end - start:,} bytes")
        return data


async def _read_at_most(r: Any, n: int, read: Any = None) -> bytes:
    """The body of ``r`` (an aiohttp response; or ``read(k)``, a coroutine giving up to ``k`` more bytes) if it is
    at most ``n`` bytes; a longer body (whatever its ``Content-Length``) is refused after ``n + 1`` bytes, so a
    server that answers a range with more than asked never fills the memory."""
    if read is None:
        read = r.content.read
    buf = bytearray()
    while len(buf) <= n:
        chunk = await read(min(1 << 20, n + 1 - len(buf)))
        if not chunk:
            break
        buf += chunk
    if len(buf) > n:
        raise Transient(f"the server sent more than the {n:,} bytes asked for")
    return bytes(buf)


#: the most bytes of an HTTP folder listing read (a listing page is the server's text: it may be endless)
MAX_LISTING = 16 << 20


async def _listing_links(backend: _HttpBackend) -> list[str]:
    """The links of an HTTP folder listing page (as fsspec's ``ls`` finds them), read under a size limit and the
    request deadline; a longer page is :class:`~ckptfix.errors.ResourceLimitError`."""
    from fsspec.implementations.http import ex

    from ckptfix.errors import ResourceLimitError

    session = await backend.fs.set_session()
    headers = {"Accept-Encoding": "identity"}
    async with session.get(backend.url, headers=headers, timeout=backend._timeout(MAX_LISTING)) as r:
        if r.status >= 300:
            raise _http_status(backend.name, r.status, r.reason or "")
        if r.headers.get("Content-Encoding", "identity").strip().lower() not in ("", "identity"):
            return []  # asked for identity: a compressed page is not read (nothing listed)
        if r.headers.get("Content-Type", "text/html").partition(";")[0].strip() not in ("text/html", ""):
            return []
        buf = bytearray()
        while True:
            chunk = await r.content.read(1 << 20)
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_LISTING:
                raise ResourceLimitError(
                    f"{backend.name}: the folder listing is over {MAX_LISTING >> 20} MiB; "
                    "pass the checkpoint file's URL instead of its folder"
                )
    return [m[2] for m in ex.findall(buf.decode("utf-8", "replace"))]


def http_links(fs: Any, url: str) -> list[str]:
    """The URLs an HTTP folder listing links to below ``url`` (what ``fs.ls`` gives, bounded in bytes and time).

    Raises:
        ResourceLimitError: the listing page is over :data:`MAX_LISTING` bytes.
        RemoteNotFoundError, RemoteAccessDeniedError, RemoteUnavailableError: the server's answer.
    """
    from urllib.parse import urlparse

    b = _HttpBackend(fs, url, url)
    try:
        links = b._guard(_listing_links, b)
    except Transient as e:
        raise RemoteUnavailableError(f"{url}: the store failed ({e}); run the command again") from None
    parts = urlparse(url)
    out = []
    for link in links:
        if link.startswith("/") and len(link) > 1:
            link = f"{parts.scheme}://{parts.netloc}{link}"
        if not link.startswith("http"):
            if link in ("..", "../"):
                continue
            link = url.rstrip("/") + "/" + link.lstrip("/")
        out.append(link)
    return out


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
        if "Credential" in kind or "NoAuth" in kind:
            return no_credentials(self.name, e)
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
        import asyncio

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
            try:  # at most one byte more than asked: a longer body is refused, never held whole
                data = await _read_at_most(body, end - start, lambda k: body.read(k))
            finally:
                body.close()
            return resp.get("ETag"), data

        async def bounded() -> tuple[str | None, bytes]:
            # the whole request has a deadline too (botocore's read timeout is per read: a drip never trips it)
            try:
                return await asyncio.wait_for(get(), deadline(end - start))
            except asyncio.TimeoutError:
                limit = deadline(end - start)
                raise Transient(f"no complete answer within the request deadline ({limit:.0f} s)") from None

        try:
            etag, data = sync(self.fs.loop, bounded)
        except (CkptfixError, Transient):
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


def hf_bad_url(name: str, e: BaseException) -> RemoteNotFoundError | None:
    """The error for an ``hf://`` URL that names no repository (HfFileSystem's ``ValueError``, ``HfUriError``, or
    ``NotImplementedError`` for ``hf://org``), or None.

    Returns:
        A one-line :class:`RemoteNotFoundError` with the URL's form, or None for any other error.
    """
    kind = type(e).__name__
    if not (isinstance(e, (ValueError, NotImplementedError)) or kind in ("HfUriError", "HFValidationError")):
        return None
    from ckptfix.display import mask_userinfo

    first = str(e).strip().splitlines()[0] if str(e).strip() else kind
    first = mask_userinfo(first, name)  # "Repository id must be 'namespace/name', got 'user:password'"
    return RemoteNotFoundError(
        f"{name}: not a file or folder of a Hub repository ({kind}: {first}); "
        "write hf://org/repo/path or hf://org/repo@revision/path"
    )


class _HfBackend(_FsBackend):
    """The Hugging Face Hub (``hf://``, huggingface_hub's ``HfFileSystem``): the file's revision is resolved to its
    commit at open (``X-Repo-Commit``) and every range is a ``GET .../resolve/<commit>/<path>`` with one ``Range``
    header, read exactly: a branch moved while the file is read cannot mix two versions, and no read pulls the
    file system's 5 MiB read-ahead block."""

    def __init__(self, fs: Any, path: str, name: str) -> None:
        super().__init__(fs, path, name)
        self.url: str | None = None  # .../resolve/<commit>/<path>
        #: where the Hub redirects it (an LFS/Xet file's signed CDN URL), asked directly: no redirect per range
        self.location: str | None = None

    def _map(self, e: BaseException) -> Exception:
        if any(type(x).__name__ == "OfflineModeIsEnabled" for x in (e, e.__cause__)):  # not worth a retry
            return RemoteUnavailableError(
                f"{self.name}: huggingface_hub's offline mode is on (HF_HUB_OFFLINE); unset HF_HUB_OFFLINE to read "
                "hf:// URLs"
            )
        return hf_bad_url(self.name, e) or self._denied(e) or super()._map(e)

    def _denied(self, e: BaseException | None, status: int | None = None) -> RemoteAccessDeniedError | None:
        """A private or gated repository (HTTP 401/403, ``GatedRepoError``, also behind HfFileSystem's
        ``FileNotFoundError``): access denied with the token's fix, or None."""
        gated = False
        for x in (e, e.__cause__ if e is not None else None):
            if x is None:
                continue
            gated = gated or type(x).__name__ == "GatedRepoError"
            got = getattr(getattr(x, "response", None), "status_code", None)
            status = got if isinstance(got, int) and status is None else status
        if not gated and status not in (401, 403):
            return None
        if gated:
            return RemoteAccessDeniedError(
                f"{self.name}: a gated repository (HTTP {status}): accept its conditions on its Hub page, "
                "then run huggingface-cli login or set HF_TOKEN"
            )
        return RemoteAccessDeniedError(
            f"{self.name}: the Hub refused (HTTP {status}): a private repository, or none by that name; "
            "check the URL, or run huggingface-cli login or set HF_TOKEN"
        )

    def info(self) -> tuple[int, str | None]:
        size, etag = super().info()  # type, size and missing repo / revision / file through HfFileSystem
        try:
            from huggingface_hub import get_hf_file_metadata

            rp = self.fs.resolve_path(self.path)
            url = _resolve_url(str(self.fs.endpoint), rp.repo_id, rp.path_in_repo, rp.repo_type, rp.revision)
            meta = get_hf_file_metadata(url, token=self.fs.token, timeout=timeout())
        except Exception as e:  # noqa: BLE001 - mapped to the typed errors
            raise self._map(e) from None
        revision = meta.commit_hash or rp.revision
        self.url = _resolve_url(str(self.fs.endpoint), rp.repo_id, rp.path_in_repo, rp.repo_type, revision)
        self.location = self._redirected(meta.location)
        if meta.size is not None and meta.size != size:
            # HfFileSystem caches listings per endpoint for the process's life: the HEAD just made is the truth
            self.fs.invalidate_cache(self.path)
            size = meta.size
        return size, (f"{revision}:{meta.etag or etag}" if meta.commit_hash else (meta.etag or etag))

    def _redirected(self, location: str | None) -> str | None:
        """``location`` when the Hub redirected the file elsewhere (an LFS/Xet file's signed CDN URL), else None:
        a resolve URL (the one asked, by branch, or a renamed repository's) is never used in place of the commit's."""
        from urllib.parse import urlsplit

        if not location:
            return None
        loc, hub = urlsplit(location), urlsplit(str(self.fs.endpoint))
        if loc.netloc == hub.netloc and "/resolve/" in loc.path:
            return None
        return location

    def _renew(self) -> None:
        """Ask the commit's resolve URL again for a fresh signed location (the one held expired)."""
        from huggingface_hub import get_hf_file_metadata

        assert self.url is not None
        try:
            meta = get_hf_file_metadata(self.url, token=self.fs.token, timeout=timeout())
        except Exception as e:  # noqa: BLE001 - mapped to the typed errors
            raise self._map(e) from None
        self.location = self._redirected(meta.location)

    def fetch(self, start: int, end: int) -> bytes:
        assert self.url is not None
        target = self.location or self.url
        n = end - start
        try:
            from huggingface_hub.utils import build_hf_headers

            # the token goes to the Hub only, never to the CDN a signed URL points at
            headers = build_hf_headers(token=self.fs.token) if target == self.url else {}
        except Exception as e:  # noqa: BLE001 - mapped to the typed errors
            raise self._map(e) from None
        headers.update({"Range": f"bytes={start}-{n + start - 1}", "Accept-Encoding": "identity"})
        limit = deadline(n)
        box: list[Any] = []
        done = threading.Event()
        cancel = threading.Event()

        def run() -> None:
            try:
                box.append(self._get(target, headers, start, end, time.monotonic() + limit, cancel))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box.append(e)
            finally:
                done.set()

        # a daemon thread: a server that drips its headers is left behind at the deadline (the thread ends at its
        # next byte or read timeout), never waited for, and never holds more than the range asked for
        threading.Thread(target=run, name="ckptfix-hf-range", daemon=True).start()
        if not done.wait(limit + 1.0):
            cancel.set()
            raise Transient(f"no complete answer within the request deadline ({limit:.0f} s)")
        out = box[0]
        if isinstance(out, BaseException):
            if isinstance(out, (CkptfixError, Transient)):
                raise out
            raise self._map(out) from None
        status, reason, resp_headers, data = out
        if status in (401, 403) and target != self.url:  # the signed URL expired: a fresh one, then retry
            self._renew()
            raise Transient(f"HTTP {status} from the signed download URL (expired); renewed")
        if status != 206:
            denied = self._denied(None, status) if status in (401, 403) else None
            if denied is not None:
                raise denied
            if status == 200:
                raise RemoteUnavailableError(
                    f"{self.name}: the Hub ignored a range request (HTTP 200 instead of 206); "
                    "download the file and run the command on the local copy"
                )
            err = _http_status(self.name, status, reason)
            if isinstance(err, Transient):
                err.retry_after = _retry_after(resp_headers)
            raise err
        if len(data) != n:
            raise Transient(f"short read: {len(data):,} of {n:,} bytes")
        return bytes(data)

    def _get(
        self, target: str, headers: dict[str, str], start: int, end: int, until: float, cancel: threading.Event
    ) -> tuple[int, str, Any, bytes]:
        """One ``GET`` of a range, streamed: ``(status, reason, headers, body)``; the body (of a 206 only) is read
        raw (never decoded) and at most ``end - start`` bytes of it, before ``until`` (a monotonic time)."""
        from huggingface_hub.utils import get_session

        t = timeout()
        n = end - start
        session: Any = get_session()  # httpx / httpx2 (huggingface_hub >= 1.0) or requests (0.x)
        top = type(session).__module__.split(".")[0]
        if top.startswith("httpx"):
            import importlib

            limits = importlib.import_module(top).Timeout(t, connect=t, read=t)
            with session.stream("GET", target, headers=headers, timeout=limits, follow_redirects=True) as r:
                reason = str(getattr(r, "reason_phrase", "") or "")
                if r.status_code != 206:
                    return r.status_code, reason, r.headers, b""
                self._check_206(r.headers, start, end)
                return r.status_code, reason, r.headers, _read_raw(r.iter_raw(), n, until, cancel)
        r = session.get(target, headers=headers, timeout=(t, t), allow_redirects=True, stream=True)
        try:
            if r.status_code != 206:
                return r.status_code, str(r.reason or ""), r.headers, b""
            self._check_206(r.headers, start, end)
            chunks = iter(lambda: r.raw.read(1 << 16, decode_content=False), b"")
            return r.status_code, str(r.reason or ""), r.headers, _read_raw(chunks, n, until, cancel)
        finally:
            r.close()

    def _check_206(self, headers: Any, start: int, end: int) -> None:
        check_content_range(self.name, headers.get("Content-Range", ""), start, end, self.size)
        enc = str(headers.get("Content-Encoding", "identity")).strip().lower()
        if enc not in ("", "identity"):  # asked for identity: decoded bytes are not the object's (maybe a bomb)
            raise RemoteUnavailableError(
                f"{self.name}: the server compressed a range answer (Content-Encoding: {enc}) though asked for "
                "identity; download the file and run the command on the local copy"
            )


def _read_raw(chunks: Any, n: int, until: float, cancel: threading.Event) -> bytes:
    """At most ``n`` bytes from an iterator of raw body chunks, before the monotonic time ``until``: a longer body is
    refused at its first byte over ``n``, a body still coming at the deadline is refused then."""
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        if len(buf) > n:
            raise Transient(f"the server sent more than the {n:,} bytes asked for")
        if cancel.is_set() or time.monotonic() > until:
            raise Transient(f"the answer was still coming at the request deadline ({len(buf):,} of {n:,} bytes)")
    return bytes(buf)


def _resolve_url(endpoint: str, repo_id: str, path: str, repo_type: str | None, revision: str | None) -> str:
    """The Hub's ``resolve`` URL of a file at ``endpoint``.

    ``huggingface_hub.hf_hub_url(endpoint=...)`` swaps the endpoint in only where its template (built from
    ``HF_ENDPOINT`` when huggingface_hub was imported) starts with the current ``constants.ENDPOINT``: after
    HF_ENDPOINT changed (set after the import: a script, a test), it kept the old host.  Built here instead.
    """
    from urllib.parse import quote

    prefix = {"dataset": "datasets/", "space": "spaces/"}.get(repo_type or "model", "")
    rev = quote(revision or "main", safe="")
    return f"{endpoint.rstrip('/')}/{prefix}{repo_id}/resolve/{rev}/{quote(path)}"


def check_content_range(name: str, cr: str, start: int, end: int, size: int) -> None:
    """A 206 answer's ``Content-Range`` must name the range asked (else retried) and the size opened (else the
    object changed: exit 44, never bytes of two versions)."""
    want = f"bytes {start}-{end - 1}/"
    if not cr.startswith(want):
        raise Transient(f"unexpected Content-Range {cr!r}")
    total = cr[len(want) :]
    if total != "*" and total != str(size):
        raise RemoteChangedError(
            f"{name}: the object changed while it was read (size {size:,} -> {total} bytes); run the command again"
        )


# -- the policy -----------------------------------------------------------------------------------------

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
#: ranges read with ``exact`` share one request only when closer than this
EXACT_GAP = 16 * KiB
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


#: a version seen at open stays pinned this long (seconds since the URL's last open in this process): a later open of
#: the same URL that finds another version (a convert's header read, then its tensor copy) is an error, not a mix
PIN_SECONDS = 60.0
_PINS_MAX = 256
_PINS: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
_PINS_LOCK = threading.Lock()


def _check_pin(url: str, etag: str | None) -> None:
    """Pin ``etag`` for ``url``; raise :class:`RemoteChangedError` if another version was pinned moments ago."""
    if etag is None:
        return
    now = time.monotonic()
    with _PINS_LOCK:
        old = _PINS.pop(url, None)
        if old is not None and old[0] != etag and now - old[1] <= PIN_SECONDS:
            raise RemoteChangedError(  # not re-pinned: running the command again starts from the new version
                f"{url}: the object changed since this process first read it (ETag {old[0]} -> {etag}); "
                "run the command again"
            )
        _PINS[url] = (etag, now)
        while len(_PINS) > _PINS_MAX:
            _PINS.popitem(last=False)


def forget_version(url: str) -> None:
    """Forget the version pinned for ``url`` (call it after this process wrote the object itself)."""
    with _PINS_LOCK:
        _PINS.pop(url, None)


_unpin = forget_version


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
            fs, path = urls.filesystem(url, retried=True)
        else:
            path = url
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        if "http" in protocols or "https" in protocols:
            self._backend: Any = _HttpBackend(fs, path, url)
        elif ("s3" in protocols or "s3a" in protocols) and hasattr(fs, "_call_s3"):
            self._backend = _S3Backend(fs, path, url)
        elif "hf" in protocols and hasattr(fs, "resolve_path"):
            self._backend = _HfBackend(fs, path, url)
        else:
            self._backend = _FsBackend(fs, path, url)
        self.fs = fs
        self.path = path
        size, etag = self._retry(self._backend.info)
        self.size: int = size
        self.etag: str | None = etag
        self._backend.size = size
        self._backend.etag = etag
        _check_pin(url, etag)
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
            except CkptfixError as e:  # a typed answer (changed, not found, denied): the request counts, no retry
                if self.stats is not None:
                    self.stats.add(requests=1)
                if isinstance(e, RemoteChangedError):
                    _unpin(self.name)  # the next open starts from the new version
                raise
            except Transient as e:
                last = e
                if self.stats is not None:
                    self.stats.add(requests=1, retries=1 if attempt < n else 0)
                if attempt < n:
                    wait = backoff(attempt)
                    if e.retry_after is not None:  # the server said when: at least that (capped)
                        wait = max(wait, min(e.retry_after, MAX_RETRY_AFTER))
                    time.sleep(wait)
                continue
            if self.stats is not None:
                self.stats.add(requests=1, nbytes=len(out) if isinstance(out, (bytes, bytearray)) else 0)
            return out
        assert last is not None
        # the drivers do not retry under this loop (urls.filesystem(retried=True)): n retries are n + 1 requests
        tries = f"after {n} {'retry' if n == 1 else 'retries'} ({n + 1} request{'s' if n else ''})"
        if last.throttled:
            raise RemoteThrottledError(
                f"{self.name}: the store is throttling requests ({last}) {tries}; "
                "wait and run the command again (or set CKPTFIX_REMOTE_RETRIES higher)"
            )
        raise RemoteUnavailableError(
            f"{self.name}: the store failed ({last}) {tries}; "
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
        """Fill ``view`` with the bytes at ``off`` (all of it, or an error)."""
        view = memoryview(view).cast("B")
        n = len(view)
        self._check(n, off)
        if n >= DIRECT and self._lookup(off, n) is None:
            self._fetch_parts(off, n, jobs, into=view)
            return n
        view[:] = self.pread(n, off)
        return n

    def read_ranges(
        self, ranges: list[tuple[int, int]], jobs: int = 1, *, exact: bool = False
    ) -> Iterator[tuple[int, bytes]]:
        """The bytes of many ``(offset, length)`` ranges, in the order given; ranges closer than :data:`GAP`
        share one request (up to :data:`MAX_REQUEST` bytes), and ``jobs`` requests run at once.

        Memory: at most ``jobs`` requests' bytes (plus a range being yielded) are held at a time.

        Args:
            ranges: ``(offset, length)`` pairs.
            jobs: parallel requests.
            exact: the bytes between the ranges will be read anyway, later (a zip's local headers before the copy
                of its records): ranges share a request only when under :data:`EXACT_GAP` apart, and each request
                is the ranges' span, no read-ahead, so no byte is fetched twice but in those small gaps.
        """
        for off, n in ranges:
            self._check(n, off)
        order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        groups: list[tuple[int, int, list[int]]] = []  # (start, end, indices)
        for i in order:
            off, n = ranges[i]
            if groups:
                s, e, idx = groups[-1]
                if off - e <= (EXACT_GAP if exact else GAP) and max(e, off + n) - s <= MAX_REQUEST:
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
                    pending[gi] = ex.submit(self._group, s, e, jobs, exact)
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

    def _group(self, s: int, e: int, jobs: int, exact: bool = False) -> bytes:
        hit = self._lookup(s, e - s)
        if hit is not None:
            return hit
        if exact and self.size > SMALL:  # the span only (a small file is fetched whole once, then cached)
            return self._fetch(s, e) if e - s <= PART else bytes(self._fetch_parts(s, e - s, 1) or b"")
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

    #: tells the scanner (:mod:`ckptfix.pickles.opcodes`) to read windows instead of memory-mapping or reading it all
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

    #: tells the scanner (:mod:`ckptfix.pickles.opcodes`) to read windows instead of memory-mapping or reading it all
    remote = True

    @property
    def size(self) -> int:
        """The object's size."""
        return int(self.raw.size)  # type: ignore[attr-defined]
