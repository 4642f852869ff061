"""Rename a DCP checkpoint's keys (strip-prefix, add-prefix, align) by rewriting ``.metadata`` only.

The tensor data does not change: the new directory gets copies of the source's
data files (a reflink where the file system supports it, else an in-kernel
copy: :func:`ckptfix.files.atomic.copy_file_data`, near ``cp``'s cost), never storage
shared with the input: ``torch.distributed.checkpoint.save`` into the output
reopens ``__0_0.distcp`` with ``"wb"``, which through a hard link would truncate
the input's file too.  Hard links only with ``link=True`` (``--link``).  A new
``.metadata`` in which the keys of ``state_dict_metadata``, the ``fqn`` of
every ``MetadataIndex`` in ``storage_data`` and ``planner_data`` are renamed;
it is pickled with the original DCP globals, so torch's ``dcp.load`` reads it.
The directory is built under a temporary name beside the output, verified
(the new metadata is read back and must describe the same chunks at the same
byte ranges under the new names) and renamed into place.  ``in_place``
replaces only ``.metadata`` (atomically, keeping ``.metadata.bak``).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from ckptfix.display import already_exists, missing_directory, output_is_input
from ckptfix.errors import KeyConflictError, OutputError, UnsupportedError, VerificationError
from ckptfix.files import pins
from ckptfix.files.atomic import copy_file_data, fsync_dir, output_error, replace_directory
from ckptfix.files.containment import check_member
from ckptfix.files.outputs import OutputOptions
from ckptfix.formats import find_state_dict
from ckptfix.formats.dcp.checkpoint import read_dcp
from ckptfix.formats.dcp.meta import (
    METADATA_NAME,
    BytesEntry,
    DcpMetadata,
    dumps_metadata,
    metadata_from_bytes,
    read_metadata,
    rename_metadata,
)
from ckptfix.ops.rewrite.report import RewriteReport
from ckptfix.ops.rewrite.report import detail as report_detail
from ckptfix.pickles import paused_gc


def _link_or_copy(src: str, dst: str, link: bool, fsync: bool = False) -> bool:
    """Copy ``src`` to ``dst`` (reflink or in-kernel copy); hard-link it instead with ``link``.  True when linked."""
    if link:
        try:
            os.link(src, dst)
            return True
        except OSError:
            pass
    copy_file_data(src, dst, fsync=fsync)
    if os.path.getsize(dst) != os.path.getsize(src):
        raise VerificationError(f"{src}: the file changed size while it was copied; nothing was written")
    return False


def _write_file(path: str, data: bytes, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _verify(path: str, data: bytes, old: DcpMetadata, fqn_new: Mapping[str, str]) -> None:
    new = metadata_from_bytes(data, path, ours=True)
    if new.foreign or len(new.entries) != len(old.entries):
        raise VerificationError(f"{path}: the rewritten .metadata does not read back with the same entries")
    for fqn, e in old.entries.items():
        n = new.entries.get(fqn_new[fqn])
        same = type(n) is type(e) and (
            (isinstance(e, BytesEntry) and n.location == e.location)  # type: ignore[union-attr]
            or (
                not isinstance(e, BytesEntry)
                and (n.dtype, n.shape, n.chunks, n.locations)  # type: ignore[union-attr]
                == (e.dtype, e.shape, e.chunks, e.locations)
            )
        )
        if not same:
            raise VerificationError(
                f"{path}: entry {fqn!r} (now {fqn_new[fqn]!r}) reads back differently from the "
                "source; nothing was written"
            )


@paused_gc()  # the records and placeholder trees it builds hold no cycles; collections only cost time
def rewrite_dcp(
    src: str,
    transform: Callable[[Mapping[str, Any]], Any],
    outputs: OutputOptions,
) -> RewriteReport:
    """Apply a key ``transform`` to a DCP directory's state dict (see :func:`ckptfix.ops.rewrite.rewrite_checkpoint`).

    Args:
        src: the DCP directory.
        transform: state dict -> (renamed state dict, report); must rename keys one to one.
        outputs: ``output`` (the new directory, default ``<src>.<suffix>``; ``in_place`` replaces
            ``src/.metadata`` instead, keeping a backup unless ``backup=False``), ``force`` (replace an
            existing output directory: only one that holds a DCP checkpoint, or is empty), ``key`` (where
            the state dict sits in the saved nesting), ``map_location`` (DCP data carries no device tags;
            only ``None``/``"cpu"`` are accepted), ``fsync``, ``suffix``, and ``link``: hard-link the
            data files instead of copying them (instant, no space; but the output then shares them
            with the input, so anything later written *into* the output's data files, such as a
            ``dcp.save`` there, changes the input too).

    Returns:
        RewriteReport

    Raises:
        UnsafePickleError, CorruptCheckpointError: as for reading; KeyConflictError: the rename maps two
        entries to one name; OutputError: the output exists or cannot be written; VerificationError.
    """

    output, in_place, backup, force, key, map_location = (
        outputs.output, outputs.in_place, outputs.backup, outputs.force, outputs.key, outputs.map_location
    )  # fmt: skip
    fsync, suffix, link = outputs.fsync, outputs.suffix or "fixed", outputs.link
    src = os.fspath(src).rstrip(os.sep) or os.sep
    meta = read_metadata(src)
    meta.check_safe()
    if map_location not in (None, "cpu"):
        raise UnsupportedError(
            f"{src}: DCP chunks carry no device tags (they are always loaded where the reader "
            "puts them); --map-location does not apply"
        )
    cf = read_dcp(src, meta)
    key_path, sd = find_state_dict(cf.obj, key)
    key_path = tuple(key_path)
    new_sd, detail = transform(sd)
    if len(new_sd) != len(sd) or any(sd[a] is not new_sd[b] for a, b in zip(sd, new_sd, strict=False)):
        raise UnsupportedError(
            f"{src}: this rename does not map the DCP keys one to one; convert the checkpoint "
            "to a single file first (ckptfix convert)"
        )
    rename = {a: b for a, b in zip(sd, new_sd, strict=False) if a != b}
    paths, fqn_new = _renamed_paths(src, meta, key_path, rename)
    rep = RewriteReport(
        source=src,
        output=None,
        format_in="dcp",
        format_out="dcp",
        key_path=list(key_path),
        changed=bool(rename),
        renamed=len(rename),
        detail=report_detail(detail),
    )
    if not rename:
        rep.notes.append("nothing to change; no file written")
        return rep
    data = dumps_metadata(rename_metadata(meta, paths))
    if in_place:
        return _in_place(src, meta, data, fqn_new, rep, backup=backup, fsync=True if fsync is None else fsync)
    out = _output_dir(src, output, suffix, force)
    linked, copied = _write_directory(src, out, data, meta, fqn_new, bool(fsync), link)
    rep.output = out
    if link:
        rep.notes.append(
            f"rewrote .metadata only; {linked} data file(s) hard-linked (shared with the input: do not save "
            "into the output)" + (f", {copied} copied (the file system cannot link them)" if copied else "")
        )
    else:
        rep.notes.append(f"rewrote .metadata only; {copied} data file(s) copied")
    return rep


def _renamed_paths(
    src: str, meta: DcpMetadata, key_path: tuple, rename: Mapping[Any, Any]
) -> tuple[dict[tuple, tuple], dict[str, str]]:
    """(old key path -> new, fqn -> new fqn) of every entry under the state dict; refuses two entries on one name."""
    paths: dict[tuple, tuple] = {}
    fqn_new: dict[str, str] = {}
    n = len(key_path)
    for fqn in meta.entries:
        p = meta.key_path(fqn)
        if len(p) > n and p[:n] == key_path and p[n] in rename:
            q = key_path + (rename[p[n]],) + p[n + 1 :]
            paths[p] = q
            fqn_new[fqn] = ".".join(map(str, q))
        else:
            fqn_new[fqn] = fqn
    seen: dict[str, str] = {}
    for old, new in fqn_new.items():
        if new in seen:
            raise KeyConflictError(f"{src}: after the rename {old!r} and {seen[new]!r} would both be {new!r}")
        seen[new] = old
    return paths, fqn_new


def _output_dir(src: str, output: str | None, suffix: str, force: bool) -> str:
    """The new directory's path, refused when it is the input, or exists and is not a DCP checkpoint."""
    out = os.path.abspath(output.rstrip(os.sep) if output else f"{src}.{suffix}")
    if out == os.path.abspath(src) or (os.path.exists(out) and os.path.samefile(out, src)):
        raise OutputError(output_is_input(out, in_place="rewrite its .metadata"))
    if os.path.lexists(out):
        if not force:
            raise OutputError(already_exists(out, directory=True))
        if not os.path.isdir(out) or (os.listdir(out) and not os.path.isfile(os.path.join(out, METADATA_NAME))):
            raise OutputError(f"{out} exists and is not a DCP checkpoint directory; refusing to replace it")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise OutputError(missing_directory(parent))
    return out


def _write_directory(
    src: str, out: str, data: bytes, meta: DcpMetadata, fqn_new: Mapping[str, str], fsync: bool, link: bool
) -> tuple[int, int]:
    """A new directory at ``out``: data files copied (hard-linked with ``link``), the new ``.metadata``, renamed in.

    A file of ``src`` that is a symlink resolving outside it is refused (exit 8), never copied or linked.

    Returns ``(linked, copied)``.
    """
    parent = os.path.dirname(out)
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise output_error(e, out) from None
    linked = copied = 0
    try:
        os.chmod(tmp, stat.S_IMODE(os.stat(src).st_mode))  # mkdtemp makes 0700; the output gets the source's mode
        for fname in sorted(os.listdir(src)):
            fpath = os.path.join(src, fname)
            if fname == METADATA_NAME or fname.endswith((".bak", ".tmp")) or not os.path.isfile(fpath):
                continue
            check_member(src, fname, src)
            if _link_or_copy(fpath, os.path.join(tmp, fname), link, fsync):
                linked += 1
            else:
                copied += 1
        _write_file(os.path.join(tmp, METADATA_NAME), data, bool(fsync))
        _verify(out, data, meta, fqn_new)
        if fsync:
            fsync_dir(os.path.join(tmp, METADATA_NAME))
        replace_directory(tmp, out, fsync=fsync)
        tmp = ""
    except OSError as e:
        raise output_error(e, out) from None
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return linked, copied


def _in_place(
    src: str,
    meta: DcpMetadata,
    data: bytes,
    fqn_new: Mapping[str, str],
    rep: RewriteReport,
    *,
    backup: bool,
    fsync: bool,
) -> RewriteReport:
    mpath = os.path.join(src, METADATA_NAME)
    _verify(src, data, meta, fqn_new)
    fd, tmp = tempfile.mkstemp(prefix=".metadata.", suffix=".tmp", dir=src)
    os.close(fd)
    os.unlink(tmp)
    try:
        _write_file(tmp, data, fsync)
        if backup:
            bak = mpath + ".bak"
            if os.path.lexists(bak):
                os.unlink(bak)
            os.link(mpath, bak)  # shares nothing once .metadata is replaced by the rename below
            rep.backup = bak
        pins.check_unchanged()
        os.replace(tmp, mpath)
        tmp = ""
        if fsync:
            fsync_dir(mpath)
    except OSError as e:
        raise OutputError(f"cannot rewrite {mpath}: {e.strerror or e}") from None
    finally:
        if tmp and os.path.lexists(tmp):
            os.unlink(tmp)
    rep.output = src
    rep.notes.append("rewrote .metadata in place (data files untouched)")
    return rep
