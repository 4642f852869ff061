"""``convert ... -o s3://bucket/model.safetensors``: write and verify locally, then commit to the store (issue #26).

The conversion runs unchanged into a private local staging folder (same verification as any local output:
:mod:`ckptfix.ops.convert.write`); each file is then committed with :func:`ckptfix.files.remote.upload.commit_file`
(multipart, nothing visible under its name before the upload completes).  Shards and DCP data files go first,
the file that makes the set usable last (the sharded index, DCP's ``.metadata``), so a reader never sees an
index naming a missing shard.  A store has no rename (issue #33): when ``--force`` replaces a set whose shards
or data files have the same names, the new ones are renamed before the upload (``model-00001-of-00003.<tag>
.safetensors``, ``__0_0.<tag>.distcp``; the index or ``.metadata`` rewritten to name them), so no object of
the old version is touched until the new index is committed (one ``PUT``: the switch); the old version's
objects are deleted after it.  Any failure before the switch removes the objects this run already committed
and raises :class:`~ckptfix.errors.RemoteWriteError` (exit 46) saying that the old version is untouched.
The staging folder is in ``$CKPTFIX_TMPDIR`` (else the
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
        if len(files) > 1:
            renamed = _commit_set(files, urls, stage, dst, force)
            report.outputs = [renamed.get(p, p) for p in report.outputs]
        else:
            for f in files:
                commit_file(f, urls[f])
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


def _remove_committed(urls: list[str]) -> list[str]:
    """Delete ``urls`` (best effort); those that could not be deleted."""
    from ckptfix.files.remote.url import filesystem

    left = []
    for u in urls:
        try:
            fs, path = filesystem(u)
            fs.rm_file(path)
        except Exception:  # noqa: BLE001 (best effort: the caller names what is left)
            left.append(u)
    return left


def _commit_set(files: list[str], urls: dict[str, str], stage: str, dst: str, force: bool) -> dict[str, str]:
    """Commit a multi-file output (shards + index, DCP data files + ``.metadata``), the old version kept until the
    switch: new members under names no existing object has, the index last, the old members deleted after.

    Returns:
        The local paths that were renamed (old local path -> new local path).

    Raises:
        RemoteWriteError: an upload before the switch failed; this run's objects are removed (named if not).
    """
    from ckptfix.errors import RemoteWriteError
    from ckptfix.files.remote.upload import commit_file, remote_exists

    last = [f for f in files if f.endswith(_LAST)]
    members = [f for f in files if f not in last]
    dcp = any(f.endswith(".metadata") for f in last)
    old_members: list[str] = []
    renamed: dict[str, str] = {}
    had_old = False
    if force:
        had_old = any(remote_exists(urls[f]) for f in last)
        old_members = _old_members(dst, urls, last, dcp) if had_old else []
        taken = set(old_members) | {urls[f] for f in members if remote_exists(urls[f])}
        if any(urls[f] in taken for f in members):
            renamed = _rename_members(members, last, dcp, {u.rsplit("/", 1)[-1] for u in taken})
            for a, b in renamed.items():
                urls[b] = urls.pop(a).rsplit("/", 1)[0] + "/" + os.path.basename(b)
            files = [renamed.get(f, f) for f in files]
            members = [renamed.get(f, f) for f in members]
    done: list[str] = []
    step = ""
    try:
        for f in sorted(members):
            step = urls[f]
            commit_file(f, urls[f])
            done.append(urls[f])
        for f in last:
            step = urls[f]
            try:
                commit_file(f, urls[f])
            except RemoteWriteError:
                if not _holds(urls[f], f):  # the switch may have landed though its answer was lost
                    raise
    except BaseException as e:
        left = _remove_committed(done)
        if isinstance(e, RemoteWriteError):
            reason = str(e).split(": ", 1)[-1].split(";", 1)[0]
            old = "the old version is untouched and loads as before" if had_old else "no version was there before"
            rest = (
                "this run's new objects were removed"
                if not left
                else f"{len(left)} new object(s) of this run are left, unused ({', '.join(left[:3])})"
            )
            raise RemoteWriteError(
                f"{dst}: the upload failed at {step} ({reason}); {old}, {rest}: run the command again"
            ) from None
        raise
    keep = set(urls.values())
    stale = [u for u in old_members if u not in keep]
    left = _remove_committed(stale)
    if left:
        import warnings

        warnings.warn(
            f"{dst}: the new version is complete; {len(left)} object(s) of the old version could not be deleted "
            f"({', '.join(left[:3])}): delete them by hand",
            RuntimeWarning,
            stacklevel=2,
        )
    return renamed


def _holds(url: str, local: str) -> bool:
    """Whether the object at ``url`` has exactly the bytes of ``local`` (a small file: an index, ``.metadata``)."""
    from ckptfix.files.remote.url import filesystem

    try:
        fs, path = filesystem(url)
        fs.invalidate_cache(path)
        with open(local, "rb") as f:
            return bool(fs.cat_file(path) == f.read())
    except Exception:  # noqa: BLE001 (cannot tell: treated as not committed)
        return False


#: the most bytes of an old index read to find the old version's shards
_MAX_OLD_INDEX = 64 << 20


def _safe_member(name: object, suffix: str) -> bool:
    """A plain object name in the folder (a hostile old index must not make ckptfix delete anything else)."""
    return (
        isinstance(name, str)
        and name.endswith(suffix)
        and "/" not in name
        and "\\" not in name
        and ".." not in name
        and name.isprintable()
        and not any(c in name for c in "?#%")
    )


def _old_members(dst: str, urls: dict[str, str], last: list[str], dcp: bool) -> list[str]:
    """The URLs of the old version's members: the shards the old index names, or a DCP folder's ``.distcp`` files."""
    import json

    from ckptfix.files.remote.url import filesystem

    out: list[str] = []
    try:
        if dcp:
            fs, path = filesystem(dst.rstrip("/"))
            prefix = dst.rstrip("/")
            for p in fs.find(path):
                name = p.rsplit("/", 1)[-1]
                if p.startswith(path.rstrip("/") + "/") and "/" not in p[len(path.rstrip("/")) + 1 :]:
                    if _safe_member(name, ".distcp"):
                        out.append(prefix + "/" + name)
            return out
        for f in last:
            fs, path = filesystem(urls[f])
            if int(fs.info(path).get("size") or 0) > _MAX_OLD_INDEX:
                continue
            doc = json.loads(fs.cat_file(path))
            base = urls[f].rsplit("/", 1)[0]
            names = doc.get("weight_map", {}).values() if isinstance(doc, dict) else []
            out += sorted({base + "/" + n for n in names if _safe_member(n, ".safetensors")})
    except Exception:  # noqa: BLE001 (an unreadable old version: nothing of it is deleted, nothing of it collides)
        return out
    return out


def _rename_members(members: list[str], last: list[str], dcp: bool, taken: set[str]) -> dict[str, str]:
    """Rename the local members to names no existing object has (``stem.<tag>.ext``) and rewrite the index or
    ``.metadata`` to name them; the renames."""
    import json

    while True:
        tag = "v" + os.urandom(4).hex()
        new = {f: _tagged(f, tag) for f in members}
        if not {os.path.basename(b) for b in new.values()} & taken:
            break
    for a, b in new.items():
        os.replace(a, b)
    names = {os.path.basename(a): os.path.basename(b) for a, b in new.items()}
    for f in last:
        if dcp:
            _rename_in_metadata(f, names)
        else:
            with open(f, encoding="utf-8") as fh:
                doc = json.load(fh)
            doc["weight_map"] = {k: names.get(v, v) for k, v in doc["weight_map"].items()}
            with open(f, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=2)
                fh.write("\n")
    return new


def _tagged(path: str, tag: str) -> str:
    d, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    return os.path.join(d, f"{stem}.{tag}{ext}")


def _rename_in_metadata(path: str, names: dict[str, str]) -> None:
    """Point a DCP ``.metadata`` (written by torch's writer in this run, in the private staging folder) at the
    renamed data files; read back to check every item names one of them."""
    import dataclasses
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    folder = os.path.dirname(path)
    md = FileSystemReader(folder).read_metadata()
    storage = md.storage_data or {}
    md.storage_data = {
        k: dataclasses.replace(v, relative_path=names.get(v.relative_path, v.relative_path)) for k, v in storage.items()
    }
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        pickle.dump(md, fh)
    os.replace(tmp, path)
    back = FileSystemReader(folder).read_metadata().storage_data or {}
    missing = {v.relative_path for v in back.values()} - set(os.listdir(folder))
    if missing:
        from ckptfix.errors import VerificationError

        raise VerificationError(f"{path}: the renamed .metadata names missing data files {sorted(missing)[:3]}")
