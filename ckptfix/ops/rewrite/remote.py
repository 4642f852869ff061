"""Rewrites (``strip-prefix``, ``add-prefix``, ``align``, ``sanitize``) of a checkpoint at a URL, or into one.

A rewrite writes a whole new file of the input's size, so every byte of the input is read whatever the
route; the rewriters copy tensor data between file descriptors (``fileio``), so a remote input is first
streamed, byte for byte, into a private staging folder (``$CKPTFIX_TMPDIR``, else the output's folder; the
object's version pinned for the whole read: a changed object is exit 44), the local rewrite runs on that
copy (the same reading, verification and atomic rename as for a local file), and the copy is deleted.  A
URL output (``-o s3://...``) is written and verified locally, then committed like ``convert``'s
(:mod:`ckptfix.ops.convert.remote_out`: nothing visible under the name before the upload completes).

Only single files are staged: a sharded index or a DCP folder at a URL is refused with the two-step fix
(``convert`` reads them remotely).  ``--in-place`` on a URL is refused (an object store has no atomic
replace of an object by a rewritten copy that this tool could verify first).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from typing import Callable, Protocol, TypeVar

from ckptfix.errors import OutputError, UnsupportedError
from ckptfix.files.outputs import OutputOptions

#: bytes per request while staging (the remote layer splits larger reads into parallel parts)
PIECE = 8 << 20


class _Report(Protocol):
    source: str
    output: str | None


R = TypeVar("R", bound=_Report)


def is_remote(*paths: object) -> bool:
    """Whether any of ``paths`` is a URL (cheap for local paths: no import of the remote layer)."""
    for p in paths:
        if isinstance(p, (str, os.PathLike)) and "://" in os.fspath(p):
            from ckptfix.files.source import is_url

            if is_url(os.fspath(p)):
                return True
    return False


def rewrite_remote(src: str, o: OutputOptions, run: Callable[[str, OutputOptions], R]) -> R:
    """Run the local rewrite ``run(local_src, outputs)`` for a URL input and/or a URL output.

    Args:
        src: the input (a path or a URL).
        o: the rewrite's output options (``o.suffix`` names the default output: ``<stem>.<suffix><ext>``
            in the current directory for a URL input).
        run: the local rewrite.

    Returns:
        Its report, with the URL as ``source`` (and ``output`` for a URL output).

    Raises:
        UnsupportedError: ``in_place`` on a URL, or a folder/index at a URL.
        OutputError: the output exists (without ``force``).  The remote layer's typed errors (40-46).
    """
    from ckptfix.files import source

    src_url = source.is_url(src)
    if o.in_place and src_url:
        raise UnsupportedError(f"{src}: --in-place on a URL; pass -o with a local path or a URL instead")
    dst = o.output
    if src_url and dst is None:
        stem, ext = os.path.splitext(source.basename(src.rstrip("/")) or "checkpoint")
        dst = f"{stem}.{o.suffix or 'fixed'}{ext or '.pt'}"
    dst_url = dst is not None and source.is_url(dst)
    if dst_url:
        from ckptfix.files.remote.upload import check_remote_outputs

        check_remote_outputs([str(dst)], o.force)  # before any reading
    elif dst is not None and os.path.exists(dst) and not o.force:
        raise OutputError(f"{dst}: already exists; pass --force to overwrite it, or -o to choose another path")
    stage = tempfile.mkdtemp(
        prefix="ckptfix-stage-", dir=os.environ.get("CKPTFIX_TMPDIR") or _local_dir(None if dst_url else dst)
    )
    try:
        local_src = _stage(src, stage) if src_url else src
        local_dst = os.path.join(stage, "out-" + source.basename(str(dst))) if dst_url else str(dst)
        report = run(local_src, dataclasses.replace(o, output=local_dst, force=True if dst_url else o.force))
        if dst_url and report.output is not None:
            from ckptfix.files.remote.upload import commit_file

            commit_file(report.output, str(dst))
            report.output = str(dst)
        report.source = src
        return report
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _local_dir(dst: str | None) -> str | None:
    """The folder the staging copy goes in: the local output's (same file system), else the temp folder."""
    if dst is None:
        return None
    d = os.path.dirname(os.path.abspath(dst))
    return d if os.path.isdir(d) else None


def _stage(url: str, stage: str) -> str:
    """Stream the object at ``url`` into ``stage`` (one pinned version); its local path."""
    from ckptfix.files import source

    if source.isdir(url) or url.endswith(".index.json"):
        raise UnsupportedError(
            f"{url}: a sharded or DCP checkpoint at a URL is rewritten from a local copy; run "
            "`ckptfix convert URL -o model.safetensors` (it reads the URL in ranges), then rewrite that file"
        )
    path = os.path.join(stage, source.basename(url) or "checkpoint")
    with source.session(), source.open_source(url) as src, open(path, "wb") as out:
        for off in range(0, src.size, PIECE):
            out.write(src.pread(min(PIECE, src.size - off), off))
    return path
