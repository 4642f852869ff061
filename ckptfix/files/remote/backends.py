"""How a :class:`~ckptfix.files.remote.file.RemoteFile` talks to each kind of store: one range request at a time.

* :class:`_HttpBackend` (``http(s)://``): fsspec's aiohttp session; ``HEAD`` for size and ETag, ``GET`` with one
  ``Range`` and ``If-Match``; every answer checked (206, ``Content-Range``, ``ETag``, length);
* :class:`_S3Backend` (``s3://``): s3fs' ``GetObject`` with ``Range`` and ``IfMatch``, the ETag checked;
* :class:`_HfBackend` (``hf://``, huggingface_hub's ``HfFileSystem``): the revision resolved to its commit at open,
  each range one ``GET`` of ``.../resolve/<commit>/<path>`` (or of the signed CDN URL an LFS/Xet file redirects to);
* :class:`_FsBackend` (any other fsspec file system: ``memory://``, ``gs://``, ``az://``):
  ``fs.info`` and ``fs.cat_file(path, start, end)``, the length checked.

Each raises :class:`Transient` for what is worth retrying (the caller retries with backoff) and the typed
errors of :mod:`ckptfix.errors` for the rest.  The retry policy's knobs (``CKPTFIX_REMOTE_RETRIES``,
``CKPTFIX_REMOTE_BACKOFF``, ``CKPTFIX_REMOTE_TIMEOUT``) are read here.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

from ckptfix.errors import (
    CkptfixError,
    RemoteAccessDeniedError,
    RemoteChangedError,
    RemoteNotFoundError,
    RemoteUnavailableError,
)
from ckptfix.files.remote import url as urls


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
    """Seconds a request may wait for data (``CKPTFIX_REMOTE_TIMEOUT``, default 60); a whole HTTP request may take
    twice that plus its body at :data:`MIN_RATE`."""
    return _env_float("CKPTFIX_REMOTE_TIMEOUT", 60.0)


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

    Args:
        fs: fsspec's HTTP file system.
        url: the folder's URL, ending with ``/``.

    Returns:
        Absolute URLs (sub-folders end with ``/``).

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

    Args:
        name: the URL.
        e: what HfFileSystem raised.

    Returns:
        A one-line :class:`RemoteNotFoundError` with the URL's form, or None for any other error.
    """
    kind = type(e).__name__
    if not (isinstance(e, (ValueError, NotImplementedError)) or kind in ("HfUriError", "HFValidationError")):
        return None
    first = str(e).strip().splitlines()[0] if str(e).strip() else kind
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
