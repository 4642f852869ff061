"""Writing to object storage: a verified local file committed under a URL, all or nothing.

Every output ckptfix writes is verified in a local temp file first (:mod:`ckptfix.files.atomic`,
:mod:`ckptfix.ops.convert.write`); :func:`commit_file` then uploads it (the S3 client checksums every part
it sends).  S3 (s3fs) uploads a big file as a multipart upload (parts of :data:`PART_SIZE` read from the file,
:data:`UPLOAD_JOBS` at a time: memory flat whatever the size), which the store makes visible under the
key only when it is *completed*; any failure aborts it, so no part and no partial object is ever left
under the final name.  A small file is one ``PUT``, atomic too.  After the upload the object's size is
compared with the local file's (its ETag is not: with SSE-KMS it is no MD5): a mismatch removes the
object and raises :class:`~ckptfix.errors.RemoteWriteError` (exit 46).

fsspec is imported inside functions only (``import ckptfix`` never needs it).
"""

from __future__ import annotations

import os
from typing import Any

from ckptfix.errors import CkptfixError, OutputError, RemoteWriteError

#: bytes per part of a multipart upload (S3: at least 5 MiB but the last; at most 10,000 parts)
PART_SIZE = 8 << 20
#: parts read from the file and in flight at once: what an upload holds in memory is about this many parts
#: (s3fs' default, 10, held 10 parts: 2 MiB of memory per MiB of a file up to 640 MiB)
UPLOAD_JOBS = 2


def _part_size(size: int) -> int:
    """The part size for ``size`` bytes: :data:`PART_SIZE`, grown so that no upload needs over 10,000 parts."""
    part = PART_SIZE
    while size > part * 10_000:
        part *= 2
    return part


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]


def remote_exists(url: str) -> bool:
    """Whether an object (or a folder's objects) exists at ``url``.

    Returns:
        True when the store has it.

    Raises:
        RemoteDriverMissingError: the scheme's driver is not installed.
    """
    from ckptfix.files.remote.url import filesystem

    fs, path = filesystem(url)
    try:
        return bool(fs.exists(path))
    except (OSError, ValueError):
        return False
    except CkptfixError:
        raise
    except Exception as e:  # noqa: BLE001 - no credentials, a client's own errors: typed, one line
        if "Credential" in type(e).__name__ or "NoAuth" in type(e).__name__:
            from ckptfix.files.remote.file import no_credentials

            raise no_credentials(url, e) from None
        raise RemoteWriteError(
            f"{url}: cannot tell whether the object exists ({_reason(e)}); nothing was written: check the "
            "bucket, credentials and network, then run the command again"
        ) from None


def check_remote_outputs(urls: list[str], force: bool) -> None:
    """Refuse to replace existing objects without ``force`` (before anything is read or written).

    Raises:
        OutputError: one exists and ``force`` is not set.
    """
    if force:
        return
    for u in urls:
        if remote_exists(u):
            raise OutputError(f"{u} already exists; pass --force to overwrite it, or -o to choose another path")


def commit_file(local_tmp: str, url: str, *, stats: Any = None) -> None:
    """Upload the verified local file ``local_tmp`` as ``url``: all of it, or nothing under that name.

    Args:
        local_tmp: the written and verified local file (left in place; the caller removes it).
        url: the object to create or replace (``s3://bucket/key``, ``gs://...``, ``memory://...``).
        stats: a :class:`~ckptfix.files.remote.stats.Stats` that counts the requests (parts) made, or None.

    Raises:
        RemoteWriteError: the upload failed or the object does not match the file; nothing is left under
            ``url`` (a multipart upload is aborted, a mismatching object removed).
        RemoteDriverMissingError: the scheme's driver is not installed.
    """
    from ckptfix.files.remote.url import filesystem

    fs, path = filesystem(url)
    _forget(url)  # this process replaces the object: a version of it read before is no longer the one to expect
    size = os.path.getsize(local_tmp)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    is_s3 = protocol in ("s3", "s3a")
    part = _part_size(size)
    kwargs: dict[str, Any] = {}
    multipart = False
    if is_s3:
        # s3fs: one PUT below two parts, else a multipart upload completed at the end (aborted on any error)
        kwargs["chunksize"] = part
        kwargs["max_concurrency"] = UPLOAD_JOBS
        multipart = not size < min(5 * 2**30, 2 * part)
    before = _pending(fs, path) if multipart else set()  # uploads of this key not ours (aborted on Ctrl-C: ours only)
    try:
        fs.put_file(local_tmp, path, **kwargs)
    except CkptfixError:
        raise
    except Exception as e:  # noqa: BLE001 (any driver error: botocore, aiohttp, OSError ... is one typed error)
        raise RemoteWriteError(
            f"{url}: the upload failed ({_reason(e)}); nothing was written under that name: check the "
            "bucket, credentials and network, then run the command again"
        ) from None
    except BaseException:  # Ctrl-C, SystemExit: s3fs aborts its multipart upload on errors only; abort it here
        if multipart:
            _abort_pending(fs, path, before)
        raise
    if stats is not None:
        stats.add(requests=(-(-size // part) + 2) if multipart else 1)
    _check_uploaded(fs, path, url, size)
    _forget(url)


def _check_uploaded(fs: Any, path: str, url: str, size: int) -> None:
    """Compare the object's size with the local file's; remove it and raise on a mismatch."""
    try:
        fs.invalidate_cache(path)
        info = fs.info(path)
    except Exception as e:  # noqa: BLE001 (the driver's own errors: the object cannot be checked)
        _remove(fs, path)
        raise RemoteWriteError(
            f"{url}: the uploaded object cannot be checked ({_reason(e)}); it was removed: run the command again"
        ) from None
    got_size = info.get("size")
    problem = None
    if got_size is not None and int(got_size) != size:
        problem = f"it holds {got_size} bytes, the verified file {size}"
    if problem is not None:
        _remove(fs, path)
        raise RemoteWriteError(f"{url}: the uploaded object does not match ({problem}); it was removed: run again")


def _pending(fs: Any, path: str) -> set[str]:
    """The upload ids of the multipart uploads of ``path`` in progress (empty when the store cannot say)."""
    bucket, _, key = path.partition("/")
    try:
        found = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", [])
    except Exception:  # noqa: BLE001 (best effort: only used to tell this process's upload from others')
        return set()
    return {str(up["UploadId"]) for up in found if up.get("Key") == key}


def _abort_pending(fs: Any, path: str, others: set[str]) -> None:
    """Abort this process's interrupted multipart upload of ``path`` (those pending now, less ``others``)."""
    bucket, _, key = path.partition("/")
    for upload_id in _pending(fs, path) - others:
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 (best effort while interrupted: the store's lifecycle rules are the backstop)
            pass


def _forget(url: str) -> None:
    from ckptfix.files.remote.file import forget_version

    forget_version(url)


def _remove(fs: Any, path: str) -> None:
    try:
        fs.rm_file(path)
    except Exception:  # noqa: BLE001 (best effort: the error raised next says what happened)
        pass
