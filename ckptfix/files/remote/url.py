"""URLs: which schemes are remote, which fsspec protocol and driver package serve each one.

The scheme table is the one place that knows the drivers: ``s3://`` needs ``s3fs`` (the ``[remote]`` extra
installs it), ``gs://`` ``gcsfs``, ``az://`` ``adlfs``, ``hf://`` ``huggingface_hub``, ``http(s)://``
``aiohttp``.  ``hf://`` honours ``HF_ENDPOINT`` (a mirror, a private Hub, the tests' local one) at each call, not
only as huggingface_hub read it at its import.  A missing driver is
:class:`~ckptfix.errors.RemoteDriverMissingError` with the install line.
``memory://`` (fsspec's in-process store) is there for tests.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any

from ckptfix.errors import RemoteDriverMissingError

#: scheme -> (fsspec protocol, module the driver needs, pip package that brings it)
SCHEMES: dict[str, tuple[str, str | None, str | None]] = {
    "s3": ("s3", "s3fs", "s3fs"),
    "s3a": ("s3", "s3fs", "s3fs"),
    "gs": ("gcs", "gcsfs", "gcsfs"),
    "gcs": ("gcs", "gcsfs", "gcsfs"),
    "az": ("abfs", "adlfs", "adlfs"),
    "abfs": ("abfs", "adlfs", "adlfs"),
    "abfss": ("abfs", "adlfs", "adlfs"),
    "hf": ("hf", "huggingface_hub", "huggingface_hub"),
    "http": ("http", "aiohttp", "aiohttp"),
    "https": ("https", "aiohttp", "aiohttp"),
    "memory": ("memory", None, None),
}

#: drivers the ``[remote]`` extra installs (the others are named by their own package)
_IN_EXTRA = {"s3fs", "aiohttp"}


def scheme(path: str | os.PathLike[str]) -> str | None:
    """The URL scheme of ``path`` when it is a remote URL ckptfix reads, else None.

    Returns:
        The lower-case scheme (``s3``, ``https`` ...) or None for a local path.
    """
    if not isinstance(path, str):
        return None
    head, sep, _ = path.partition("://")
    if not sep:
        return None
    head = head.lower()
    return head if head in SCHEMES else None


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a remote URL (``s3://``, ``gs://``, ``az://``, ``hf://``, ``http(s)://``, ``memory://``).

    Returns:
        True for a URL of a scheme in :data:`SCHEMES`.
    """
    return scheme(path) is not None


def install_hint(module: str) -> str:
    """The pip line that installs a driver.

    Returns:
        ``pip install fsspec s3fs`` (the ``remote`` extra) for the extra's drivers, else ``pip install <package>``.
    """
    if module in _IN_EXTRA:
        return "pip install fsspec s3fs"
    return f"pip install {module.replace('_', '-')}"


def timeout() -> float:
    """Seconds a request may wait for data (``CKPTFIX_REMOTE_TIMEOUT``, default 60); a whole HTTP request may take
    twice that plus its body at :data:`ckptfix.files.remote.file.MIN_RATE`."""
    try:
        return float(os.environ.get("CKPTFIX_REMOTE_TIMEOUT", 60.0))
    except ValueError:
        return 60.0


def filesystem(url: str, *, retried: bool = False) -> tuple[Any, str]:
    """The fsspec file system for ``url`` and the path inside it.

    Args:
        url: a remote URL.
        retried: the caller retries each request itself (:class:`~ckptfix.files.remote.file.RemoteFile`): the
            driver's own retries are turned off (s3fs' and botocore's), so that ``CKPTFIX_REMOTE_RETRIES=N`` is N+1
            requests.  A separate instance from the one without (listings, uploads keep the driver's retries).
            An S3 client's connect and read timeouts are ``CKPTFIX_REMOTE_TIMEOUT`` (default 60 s) either way.

    Returns:
        ``(fs, path)``: ``path`` is what the file system's methods take (the URL itself for http).

    Raises:
        RemoteDriverMissingError: fsspec or the scheme's driver is not installed.
    """
    sch = scheme(url)
    if sch is None:
        raise ValueError(f"not a remote URL: {url}")
    protocol, module, _package = SCHEMES[sch]
    try:
        import fsspec
    except ImportError:
        raise RemoteDriverMissingError(
            f"reading {sch}:// URLs needs fsspec, which is not installed: pip install fsspec s3fs"
        ) from None
    if module is not None:
        try:
            __import__(module)
        except ImportError:
            raise RemoteDriverMissingError(
                f"reading {sch}:// URLs needs the {module} package, which is not installed: {install_hint(module)}"
            ) from None
    kwargs: dict[str, Any] = {}
    if protocol == "hf" and os.environ.get("HF_ENDPOINT"):
        # huggingface_hub reads HF_ENDPOINT once, at its import: read it at each call (a library caller, a test)
        kwargs["endpoint"] = os.environ["HF_ENDPOINT"].rstrip("/")
    if protocol == "s3":
        t = timeout()  # CKPTFIX_REMOTE_TIMEOUT for botocore too (s3fs' own: 5 s to connect, 15 s per read)
        kwargs["config_kwargs"] = {"connect_timeout": t, "read_timeout": t}
        if retried:  # botocore: one attempt per call ("total_max_attempts" counts the first); s3fs' loop: below
            kwargs["config_kwargs"]["retries"] = {"total_max_attempts": 1, "mode": "standard"}
    url = f"{sch}://{url.partition('://')[2]}"  # fsspec knows lower-case protocols only
    try:
        fs, path = fsspec.core.url_to_fs(url, **kwargs)
    except ImportError as e:
        raise RemoteDriverMissingError(
            f"reading {sch}:// URLs needs a driver that is not installed ({e}): {install_hint(module or 'fsspec')}"
        ) from None
    if retried and protocol == "s3":
        fs.retries = 1  # s3fs' _error_wrapper: attempts, not retries (this instance only: its kwargs differ)
    if protocol in ("http", "https"):
        path = url
    return fs, path


def join(url: str, *names: str) -> str:
    """``url`` with ``names`` appended as path segments (``/`` separated, no duplicate slashes)."""
    out = url
    for n in names:
        out = out.rstrip("/") + "/" + n.lstrip("/")
    return out


def basename(url: str) -> str:
    """The last segment of a URL (a query string dropped)."""
    return posixpath.basename(url.split("?", 1)[0].rstrip("/"))


def parent(url: str) -> str:
    """The URL of the folder holding ``url``."""
    base = url.split("?", 1)[0].rstrip("/")
    head, _, _ = base.rpartition("/")
    return head if "://" in head and not head.endswith(":/") else base
