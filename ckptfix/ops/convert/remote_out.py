"""``convert ... -o s3://bucket/model.safetensors``: write and verify locally, then commit to the store (issue #26).

The conversion runs unchanged into a private local staging folder (same verification as any local output:
:mod:`ckptfix.ops.convert.write`); each file is then committed with :func:`ckptfix.files.remote.upload.commit_file`
(multipart, nothing visible under its name before the upload completes).  Shards and DCP data files go first,
the file that makes the set usable last (the sharded index, DCP's ``.metadata``), so a reader never sees an
index naming a missing shard.  Any failure removes the objects this run already committed and raises
:class:`~ckptfix.errors.RemoteWriteError` (exit 46).  The staging folder is in ``$CKPTFIX_TMPDIR`` (else the
system temp folder) and is removed in every case.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable

from ckptfix.errors import OutputError
from ckptfix.ops.convert.report import ConvertReport

#: files committed last: what makes a multi-file output usable
_LAST = (".index.json", ".metadata")


def _staging_root() -> str | None:
    return os.environ.get("CKPTFIX_TMPDIR") or None


def convert_to_url(
    run_local: Callable[[str], ConvertReport], dst: str, *, force: bool = False, to: str | None = None
) -> ConvertReport:
    """``run_local(path)`` converts into a local staging folder; its outputs are then uploaded under ``dst``.

    Args:
        run_local: the conversion, given the local output path (it may overwrite it: the folder is private).
        dst: the output URL (a file, or a folder for a DCP output).
        force: replace existing objects.
        to: the conversion's ``to`` (``"dcp"``: a folder output).

    Returns:
        The conversion's report, ``outputs``/``index`` as URLs.

    Raises:
        OutputError: an output object exists and ``force`` is not set (checked before reading the input).
        RemoteWriteError: an upload failed; nothing this run committed is left.
    """
    from ckptfix.files.remote.upload import check_remote_outputs, commit_file
    from ckptfix.files.remote.url import basename, parent

    name = basename(dst)
    if dst.split("://", 1)[0].lower() in ("http", "https"):  # a POST to any server: no all-or-nothing commit
        raise OutputError(
            f"{dst}: http(s) URLs are read-only for ckptfix; write to s3://, gs://, az:// or a local path"
        )
    if not dst.split("://", 1)[-1].strip("/"):  # s3://, memory:// : no bucket, no name
        raise OutputError(f"{dst}: the output URL names no bucket or object; pass e.g. s3://bucket/model.safetensors")
    if dst.endswith("/") and to != "dcp" and not name.endswith(".dcp"):  # as for a local -o DIR/
        raise OutputError(f"{dst}: names a folder (it ends with a slash); pass an object name with -o")
    folder_out = dst.endswith("/") or name.endswith(".dcp") or to == "dcp"
    if not folder_out:
        check_remote_outputs([dst], force)  # fail before any reading
    base = parent(dst) if not dst.endswith("/") else dst.rstrip("/")
    stage = tempfile.mkdtemp(prefix="ckptfix-upload-", dir=_staging_root())
    try:
        local = os.path.join(stage, name)
        report = run_local(local)
        files = _written_files(stage)
        urls = {f: base + "/" + os.path.relpath(f, stage).replace(os.sep, "/") for f in files}
        check_remote_outputs([u for u in urls.values()], force)
        done: list[str] = []
        try:
            for f in sorted(files, key=lambda p: (p.endswith(_LAST), p)):
                commit_file(f, urls[f])
                done.append(urls[f])
        except BaseException:
            _remove_committed(done)
            raise
        report.outputs = [_as_url(p, stage, base) for p in report.outputs]
        if report.index:
            report.index = _as_url(report.index, stage, base)
        return report
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _written_files(stage: str) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(stage):
        for n in names:
            out.append(os.path.join(dirpath, n))
    return sorted(out)


def _as_url(p: str, stage: str, base: str) -> str:
    rel = os.path.relpath(p, stage)
    if rel.startswith(".."):
        return p
    return base + "/" + rel.replace(os.sep, "/")


def _remove_committed(urls: list[str]) -> None:
    from ckptfix.files.remote.url import filesystem

    for u in urls:
        try:
            fs, path = filesystem(u)
            fs.rm_file(path)
        except Exception:  # noqa: BLE001 (best effort: the upload error raised next is what the user sees)
            pass
