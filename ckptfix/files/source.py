"""The one file-access abstraction for inputs, local or remote: :class:`Source` and the folder helpers.

``open_source(path)`` gives a local file (a thin wrapper of a descriptor: ``os.pread``; ``local_path`` is set so
that the fd / mmap / ``copy_file_range`` fast paths keep using the path) or a remote object
(:class:`ckptfix.files.remote.file.RemoteFile`: byte ranges through fsspec, read-ahead, cache, retries, ETag
pinning) behind the same methods.  :func:`listdir`, :func:`isdir`, :func:`exists` and :func:`join` do the same
for folders (DCP folders, sharded indexes' siblings, framework folders).

Nothing here imports fsspec at module level: ``import ckptfix`` never needs it, and a URL whose driver is
missing is :class:`~ckptfix.errors.RemoteDriverMissingError` (exit 45) with the pip line.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from typing import Any, BinaryIO, Callable, Iterator, TypeVar

from ckptfix.errors import CkptfixError, CorruptCheckpointError
from ckptfix.files import pins
from ckptfix.files.containment import remote_name_escapes
from ckptfix.files.remote import url as _urls
from ckptfix.files.remote.stats import Stats, active
from ckptfix.files.remote.stats import session as _remote_session

__all__ = [
    "LocalSource",
    "RemoteSource",
    "Source",
    "basename",
    "dirname",
    "exists",
    "getsize",
    "in_session",
    "is_metadata_only",
    "is_url",
    "isdir",
    "isfile",
    "join",
    "listdir",
    "metadata_only",
    "open_file",
    "open_source",
    "session",
]


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a remote URL (``s3://``, ``gs://``, ``gcs://``, ``az://``, ``abfs://``, ``hf://``,
    ``http(s)://``, ``memory://``).

    Returns:
        True for a URL.
    """
    return _urls.is_url(path)


class Source:
    """A readable file: local (fd + pread) or remote (fsspec, ranges).  A context manager."""

    #: the path or URL as the user gave it (for messages)
    name: str
    #: its size in bytes
    size: int
    #: set for local files: the fd / mmap / copy_file_range fast paths keep using it
    local_path: str | None = None

    def pread(self, n: int, off: int) -> bytes:
        """Exactly ``n`` bytes at ``off``.

        Raises:
            CorruptCheckpointError: the file ends before ``off + n`` (truncated).
        """
        raise NotImplementedError

    def readinto(self, view: memoryview, off: int) -> int:
        """Fill ``view`` with the bytes at ``off``."""
        view = memoryview(view).cast("B")
        view[:] = self.pread(len(view), off)
        return len(view)

    def read_ranges(
        self, ranges: list[tuple[int, int]], jobs: int = 1, *, exact: bool = False
    ) -> Iterator[tuple[int, bytes]]:
        """The bytes of ``(offset, length)`` ranges, in the order given (remote: coalesced, ``jobs`` parallel).

        Args:
            ranges: ``(offset, length)`` pairs.
            jobs: parallel requests.
            exact: (remote) fetch the ranges' spans only, no read-ahead, no wide coalescing.
        """
        for off, n in ranges:
            yield off, self.pread(n, off)

    def fileobj(self) -> BinaryIO:
        """A new seekable read-only file object over the file (for zipfile, tarfile, json.load); close it after use."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the descriptor or the cache."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, size={self.size})"


def _truncated(name: str, n: int, off: int, size: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{name}: a read of {n:,} bytes at offset {off:,} runs past the end of the file ({size:,} bytes): "
        "the file is truncated or damaged"
    )


class LocalSource(Source):
    """A local file: one read-only descriptor, ``os.pread`` (not counted in :class:`Stats`: those count what
    goes over the network)."""

    def __init__(self, path: str | os.PathLike[str], *, stats: Stats | None = None) -> None:
        self.name = os.fspath(path)
        self.local_path = self.name
        self.stats = stats
        self.fd = pins.open_fd(self.name)
        try:
            self.size = os.fstat(self.fd).st_size
        except OSError:
            os.close(self.fd)
            raise

    def pread(self, n: int, off: int) -> bytes:
        if n < 0 or off < 0:
            raise _truncated(self.name, n, off, self.size)
        data = os.pread(self.fd, n, off)
        if len(data) < n:  # a short pread of a regular file: keep reading (rare), or the file ended
            parts = [data]
            got = len(data)
            while got < n:
                more = os.pread(self.fd, n - got, off + got)
                if not more:
                    raise _truncated(self.name, n, off, self.size)
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data

    def readinto(self, view: memoryview, off: int) -> int:
        view = memoryview(view).cast("B")
        done = 0
        while done < len(view):
            k = os.preadv(self.fd, [view[done:]], off + done)
            if k <= 0:
                raise _truncated(self.name, len(view), off, self.size)
            done += k
        return done

    def fileobj(self) -> BinaryIO:
        return pins.open_binary(self.name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RemoteSource(Source):
    """A remote object: :class:`ckptfix.files.remote.file.RemoteFile` behind the Source methods."""

    def __init__(self, url: str, *, stats: Stats | None = None, fs: Any = None, rf: Any = None) -> None:
        from ckptfix.files.remote.file import RemoteFile

        #: shared with the session (closed when it ends), or this Source's own
        self.shared = rf is not None
        self.rf = rf if rf is not None else RemoteFile(url, stats=stats, fs=fs)
        self.name = url
        self.size = self.rf.size
        self.local_path = None
        self.stats = stats

    @property
    def etag(self) -> str | None:
        """The version pinned at open (ETag, version id...), or None where the store reports none."""
        return self.rf.etag

    def pread(self, n: int, off: int) -> bytes:
        return self.rf.pread(n, off)

    def readinto(self, view: memoryview, off: int, jobs: int = 1) -> int:
        return self.rf.readinto(view, off, jobs=jobs)

    def read_ranges(
        self, ranges: list[tuple[int, int]], jobs: int = 1, *, exact: bool = False
    ) -> Iterator[tuple[int, bytes]]:
        return self.rf.read_ranges(ranges, jobs=jobs, exact=exact)

    def prefetch(self, ranges: list[tuple[int, int]], jobs: int = 8) -> None:
        """Bring ranges into the cache ahead of many small reads (see :meth:`RemoteFile.prefetch`)."""
        self.rf.prefetch(ranges, jobs)

    def fileobj(self) -> BinaryIO:
        return self.rf.fileobj()

    def close(self) -> None:
        if not self.shared:
            self.rf.close()


def _remote_file(url: str, st: Stats | None) -> Any:
    """The session's RemoteFile for ``url`` (opened once per session), or None outside a session."""
    if st is None:
        return None
    rf = st.files_open.get(url)
    if rf is None:
        from ckptfix.files.remote.file import RemoteFile

        try:
            rf = RemoteFile(url, stats=st)
        except IsADirectoryError:
            st.probed[url] = "dir"
            raise
        except FileNotFoundError:
            st.probed[url] = None
            raise
        st.files_open[url] = rf
        st.probed[url] = "file"
    return rf


@contextlib.contextmanager
def session() -> Iterator[Stats]:
    """One operation's view of its inputs: each remote object opened once (one ETag-pinned version, the
    active collector's) and each local file opened once (:func:`ckptfix.files.pins.scope`: a file replaced
    meanwhile is still read as it was).  Library entry points enter it; nested sessions share the outer one.
    """
    with _remote_session() as st, pins.scope():
        yield st


F = TypeVar("F", bound=Callable[..., Any])


def in_session(fn: F) -> F:
    """``fn``'s call inside :func:`session` (a library entry point: each input opened once for the whole call)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with session():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


_METADATA_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptfix_metadata_only", default=False)


@contextlib.contextmanager
def metadata_only() -> Iterator[None]:
    """Within the block, readers of a remote file skip checks that need the bytes next to each tensor record (a
    zip's local headers of tensor records, a legacy stream's per-storage counts): what ``inspect`` of a URL needs
    is the zip's central directory and ``data.pkl`` (a handful of requests).  Only for callers whose
    result never reads tensor bytes (the records' offsets are then unverified: -1 for a zip's records).
    """
    token = _METADATA_ONLY.set(True)
    try:
        yield
    finally:
        _METADATA_ONLY.reset(token)


def is_metadata_only(path: str | os.PathLike[str]) -> bool:
    """Whether a reader of ``path`` may skip the per-record checks (a URL inside :func:`metadata_only`).

    Returns:
        True for a URL inside :func:`metadata_only`.
    """
    return _METADATA_ONLY.get() and is_url(path)


def open_source(path: str | os.PathLike[str], *, stats: Stats | None = None) -> Source:
    """Open a local file or a remote object for positional reads.

    Args:
        path: a local path or a URL (see :func:`is_url`).
        stats: counters to add to; None: the collector :func:`ckptfix.files.remote.stats.collect` made active, if any.

    Returns:
        A :class:`LocalSource` or a :class:`RemoteSource` (close it, or use it as a context manager).

    Raises:
        OSError: a local file cannot be opened (as ``open`` raises it).
        RemoteNotFoundError: no such remote object (exit 40).
        RemoteAccessDeniedError: the store refused (exit 41).
        RemoteUnavailableError: the store failed after every retry (exit 43).
        RemoteDriverMissingError: the URL's fsspec driver is not installed (exit 45).
    """
    st = stats if stats is not None else active()
    if is_url(path):
        url = os.fspath(path)
        return RemoteSource(url, stats=st, rf=_remote_file(url, st))
    return LocalSource(path, stats=st)


def open_file(path: str | os.PathLike[str]) -> BinaryIO:
    """``open(path, "rb")`` for a local path (the same file object as before), a seekable read-only file
    object over the remote object for a URL (shared cache within a session).
    """
    if not is_url(path):
        return pins.open_binary(path)
    src = open_source(path)
    return src.fileobj()


def _probe(url: str) -> str | None:
    """What ``url`` is: ``"file"``, ``"dir"`` or None (absent); one request, remembered in the session."""
    st = active()
    if st is not None and url in st.probed:
        return st.probed[url]
    from ckptfix.errors import RemoteNotFoundError

    kind: str | None
    try:
        with open_source(url):
            kind = "file"
    except IsADirectoryError:
        kind = "dir"
    except RemoteNotFoundError:
        kind = None
        if not _http(url):  # an object store: a "folder" is a prefix with objects under it
            fs, p = _urls.filesystem(url)
            try:
                kind = "dir" if fs.isdir(p) else None
            except Exception as e:  # noqa: BLE001 - mapped to the typed errors
                raise _remote_map(url, e) from None
    if st is not None:
        st.probed[url] = kind
    return kind


def isfile(path: str | os.PathLike[str]) -> bool:
    """``os.path.isfile`` for local paths; for a URL, whether it names an object (not a folder).

    Returns:
        True for a file.
    """
    if not is_url(path):
        return os.path.isfile(path)
    return _probe(os.fspath(path)) == "file"


# -- folders ----------------------------------------------------------------------------------------


def _remote_map(url: str, e: BaseException) -> BaseException:
    from ckptfix.errors import RemoteAccessDeniedError, RemoteNotFoundError, RemoteUnavailableError

    if isinstance(e, FileNotFoundError):
        return RemoteNotFoundError(f"{url}: no such object or folder; check the URL")
    if isinstance(e, PermissionError):
        return RemoteAccessDeniedError(f"{url}: access denied ({e}); check your credentials and permissions")
    if isinstance(e, CkptfixError):
        return e
    if _urls.scheme(url) == "hf":
        from ckptfix.files.remote.file import hf_bad_url

        bad = hf_bad_url(url, e)
        if bad is not None:
            return bad
    if "Credential" in type(e).__name__ or "NoAuth" in type(e).__name__:
        from ckptfix.files.remote.file import no_credentials

        return no_credentials(url, e)
    return RemoteUnavailableError(f"{url}: the store failed ({type(e).__name__}: {e}); run the command again")


def _http(url: str) -> bool:
    return (_urls.scheme(url) or "") in ("http", "https")


def isdir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder (local, a remote prefix, or an HTTP folder URL).

    Over HTTP a folder is a URL that ends with ``/`` or that the server redirects to one (as Python's
    ``http.server`` and most listings do); nothing is downloaded to decide.

    Returns:
        True for a folder.
    """
    if not is_url(path):
        return os.path.isdir(path)
    url = os.fspath(path)
    if _http(url) and url.split("?", 1)[0].endswith("/"):
        return True
    return _probe(url) == "dir"


def exists(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` exists (a file or a folder, local or remote).

    Returns:
        True when it exists.
    """
    if not is_url(path):
        return os.path.exists(path)
    url = os.fspath(path)
    if _http(url) and url.split("?", 1)[0].endswith("/"):
        return True
    return _probe(url) is not None


def listdir(path: str | os.PathLike[str]) -> list[str]:
    """The names in a folder (local, a remote prefix, or an HTTP folder's link listing), sorted.

    Raises:
        RemoteNotFoundError: no such remote folder.
    """
    return listdir_all(path)[0]


def listdir_all(path: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """:func:`listdir`, and the names the store lists that no URL of this folder can address (``..``, ``#``,
    ``?``, a backslash ...: joined back to the folder's URL they would name another object or none), which
    a folder's scan must count as not read rather than drop."""
    if not is_url(path):
        return sorted(os.listdir(path)), []
    url = os.fspath(path)
    fs, p = _urls.filesystem(url)
    if _http(url):
        p = url if url.endswith("/") else url + "/"
    try:
        if _http(url):  # the page is the server's text: read under a size limit and a deadline
            from ckptfix.files.remote.file import http_links

            entries = http_links(fs, p)
        else:
            entries = fs.ls(p, detail=False)
    except Exception as e:  # noqa: BLE001 - mapped to the typed errors
        raise _remote_map(url, e) from None
    names = set()
    folders = set()
    unaddressable = set()
    base = p.rstrip("/")
    for entry in entries:
        name = str(entry).rstrip("/")
        linked_as_folder = _http(url) and str(entry).split("?", 1)[0].endswith("/")
        if _http(url):
            if not name.startswith(base + "/"):
                continue  # a link out of the folder (parent, other hosts)
            name = name[len(base) + 1 :]
            if "/" in name or not name or name.startswith("?"):
                continue
            name = _unquote(name)
        else:
            name = name.rsplit("/", 1)[-1]
        if remote_name_escapes(name):  # joined back to the folder's URL it would name another object: not a member
            unaddressable.add(name)
            continue
        names.add(name)
        if linked_as_folder:
            folders.add(name)
    st = active()
    if st is not None:  # a listing's `sub/` link is a folder, whatever a HEAD of `sub` answers (404 on some servers)
        for name in folders:
            st.probed.setdefault(join(url, name), "dir")
    return sorted(names), sorted(unaddressable)


def _unquote(name: str) -> str:
    from urllib.parse import unquote

    return unquote(name)


def join(path: str | os.PathLike[str], *names: str) -> str:
    """``os.path.join`` for local paths, ``/``-joined segments for URLs."""
    if is_url(path):
        return _urls.join(os.fspath(path), *names)
    return os.path.join(os.fspath(path), *names)


def basename(path: str | os.PathLike[str]) -> str:
    """The last component of a path or URL."""
    if is_url(path):
        return _urls.basename(os.fspath(path))
    return os.path.basename(os.fspath(path).rstrip(os.sep))


def dirname(path: str | os.PathLike[str]) -> str:
    """The folder holding a path or URL."""
    if is_url(path):
        return _urls.parent(os.fspath(path))
    return os.path.dirname(os.fspath(path))


def getsize(path: str | os.PathLike[str]) -> int:
    """The size of a file or remote object (one request for a URL)."""
    if not is_url(path):
        return pins.fstat(path).st_size
    with open_source(path) as src:
        return src.size
