"""Writing a checkpoint back with a new state dict: torch zip (records copied by range) or safetensors."""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Mapping

from ckptfix.errors import KeyConflictError, UnsupportedError
from ckptfix.files import pins
from ckptfix.files.fileio import FOLIO, copy_range
from ckptfix.formats import CheckpointFile, Format, LegacyDetails, SafetensorsDetails, ZipDetails, stmeta
from ckptfix.formats.safetensors_fmt import DTYPE_TO_ST, st_shape
from ckptfix.formats.zipfmt import AlignedZipWriter, _read_member, rewrite_zip
from ckptfix.ops.rewrite.output import write_atomic
from ckptfix.ops.rewrite.verify import check_written
from ckptfix.pickles import dumps

#: the formats a rewrite can write back
WRITABLE = (Format.TORCH_ZIP, Format.TORCH_LEGACY, Format.SAFETENSORS)


def check_str_keys(src: str, sd: Mapping[Any, Any]) -> None:
    """Refuse a state dict with a key that is not a string (its keys cannot be renamed in the file).

    Args:
        src: the input, for the message.
        sd: the state dict.

    Raises:
        UnsupportedError: naming the key.
    """
    bad = next((k for k in sd.keys() if not isinstance(k, str)), None)
    if bad is not None:
        raise UnsupportedError(
            f"{src}: the state dict has a key that is not a string ({bad!r}, a "
            f"{type(bad).__name__}), so its keys cannot be renamed; pass --key to pick "
            "another mapping, or rename it in Python"
        )


def check_writable(cf: CheckpointFile, what: str = "") -> None:
    """Refuse a format this module cannot write back.

    Args:
        cf: the checkpoint read from disk.
        what: names it in the message (default: its path).

    Raises:
        UnsupportedError: not a torch zip, legacy or safetensors file.
    """
    if cf.format not in WRITABLE:
        raise UnsupportedError(
            f"{what or cf.path}: {cf.format} checkpoints cannot be rewritten here; convert it "
            "first (ckptfix convert) or load it with load_anywhere and save a new file"
        )


def format_out(cf: CheckpointFile) -> str:
    """The format a rewrite of ``cf`` writes: torch zip for torch inputs, else safetensors.

    Args:
        cf: the checkpoint read from disk.

    Returns:
        ``"torch-zip"`` or ``"safetensors"``.
    """
    return Format.TORCH_ZIP if cf.format in (Format.TORCH_ZIP, Format.TORCH_LEGACY) else Format.SAFETENSORS


def _replace_at(obj: Any, path: tuple[str, ...], new: Any) -> Any:
    if not path:
        return new
    obj[path[0]] = _replace_at(obj[path[0]], path[1:], new) if len(path) > 1 else new
    return obj


def write_file(
    cf: CheckpointFile,
    key_path: Any,
    new_sd: Mapping[str, Any],
    dst: str,
    *,
    fsync: bool,
    backup_of: str | None = None,
    rename: Mapping[str, str] | None = None,
    what: str | None = None,
) -> str | None:
    """Write ``cf`` with ``new_sd`` in place of its state dict to ``dst`` atomically; returns the backup path.

    ``rename`` (old name -> new name) also covers names a safetensors file does not store as tensors
    (ckptfix aliases): its metadata follows it.  The written file is read back
    (:func:`~ckptfix.ops.rewrite.verify.check_written`) before it is renamed into place.

    Args:
        cf: the checkpoint read from disk (its ``obj`` gets ``new_sd`` at ``key_path``).
        key_path: where the state dict sits.
        new_sd: the renamed state dict.
        dst: the output path.
        fsync: flush file and directory around the rename.
        backup_of: keep this file as a backup just before it is replaced.
        rename: old name -> new name.
        what: the path named in messages (default ``dst``).

    Returns:
        The backup path, or None.

    Raises:
        VerificationError: the written file does not read back; nothing was replaced.
        OutputError: the output cannot be written.
    """
    old_sd = cf.obj
    cf.obj = _replace_at(cf.obj, tuple(key_path), new_sd)

    def write(f: Any) -> None:
        if cf.format == Format.SAFETENSORS:
            write_safetensors(cf, old_sd, new_sd, f, rename or {})
        else:
            write_checkpoint_zip(cf, cf.obj, f)

    def check(tmp: str) -> None:
        check_written(tmp, cf, expect_obj=cf.obj, what=what or dst)

    return write_atomic(dst, write, check, fsync=fsync, backup_of=backup_of)


def write_checkpoint_zip(
    cf: CheckpointFile,
    obj: Any,
    f: Any,
    *,
    new_storages: Mapping[str, bytes] | None = None,
) -> None:
    """Write ``cf`` as a torch zip archive whose data.pkl pickles ``obj``, every storage record copied by range.

    A legacy input becomes a zip archive.  torch is never imported.

    Args:
        cf: the checkpoint read from disk (its storages give the byte ranges).
        obj: the object graph to pickle as data.pkl (records and placeholders).
        f: the open output file.
        new_storages: storage key -> bytes, added as new records (``sanitize`` turns numpy arrays into
            tensors this way).

    Raises:
        UnsupportedError: legacy storage views.
        OutputError: the disk is full.
    """
    new_storages = dict(new_storages or {})
    if cf.format == Format.TORCH_ZIP and not new_storages:
        rewrite_zip(cf, dumps(obj), f)
        return
    w = AlignedZipWriter(f)
    fd = pins.open_fd(cf.path)
    try:
        if cf.format == Format.TORCH_ZIP:
            data_pkl = dumps(obj)
            zd = cf.details_as(ZipDetails)
            root = zd.root
            for name, m in zd.members.items():
                if name == root + "data.pkl":
                    w.add_bytes(name, data_pkl)
                elif m.compressed:
                    w.add_bytes(name, _read_member(cf.path, name))
                else:
                    w.add_copy(name, fd, m.data_offset, m.size, m.crc)
        else:  # legacy -> zip: storage records named by their keys, bytes copied from the stream
            root = "archive/"
            for st in cf.storages.values():
                if st.view_metadata is not None:
                    raise UnsupportedError(
                        f"{cf.path}: legacy storage views cannot be rewritten; load the file "
                        "with load_anywhere and torch.save it again"
                    )
                st._legacy = False
            data_pkl = dumps(obj)
            w.add_bytes(root + "data.pkl", data_pkl)
            w.add_bytes(root + "byteorder", b"little")
            for key in cf.details_as(LegacyDetails).storage_keys:
                st = cf.storages[str(key)]
                assert st.file_offset is not None and st.nbytes is not None
                w.add_copy(f"{root}data/{key}", fd, st.file_offset, st.nbytes)  # CRC computed on the way
        for key, data in new_storages.items():
            w.add_bytes(f"{root}data/{key}", data)
        if cf.format != Format.TORCH_ZIP:
            w.add_bytes(root + "version", b"3\n")
        w.close()
    finally:
        os.close(fd)


def write_safetensors(
    cf: CheckpointFile, old_sd: Mapping[str, Any], new_sd: Mapping[str, Any], f: Any, rename: Mapping[str, str]
) -> None:
    """The stored tensors of ``old_sd`` under their new names (``new_sd`` order), data copied, metadata renamed.

    The data section is copied whole; the header is padded so the data keeps its offset modulo the
    page-cache folio (a copy as fast as ``cp``).

    Args:
        cf: the safetensors file read from disk.
        old_sd: its tensors under their old names.
        new_sd: the renamed state dict (aliases included).
        f: the open output file.
        rename: old name -> new name.

    Raises:
        KeyConflictError: a tensor renamed to ``__metadata__``.
    """
    if "__metadata__" in new_sd:
        raise KeyConflictError(
            f"{cf.path}: the rename gives a tensor the name '__metadata__', which safetensors "
            "reserves for its metadata; rename it differently"
        )
    sd_details = cf.details_as(SafetensorsDetails)
    start = sd_details.data_start
    header: dict[str, Any] = {}
    meta = stmeta.rename(dict(sd_details.metadata or {}), rename, old_sd)
    if meta:
        header["__metadata__"] = meta
    old_of = {b: a for a, b in rename.items()}
    for name in new_sd:
        old = old_of.get(name, name)
        if old not in old_sd:  # an alias: stored once under its target's name
            continue
        t = old_sd[old]
        st = t.storage
        header[name] = {
            "dtype": DTYPE_TO_ST[t.dtype],
            "shape": st_shape(t.dtype, t.shape),
            "data_offsets": [st.file_offset - start, st.file_offset - start + st.nbytes],
        }
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * ((-len(raw)) % 8)
    if start % 8 == 0:  # trailing spaces (valid JSON) keep the data's offset modulo FOLIO: a copy as fast as cp
        raw += b" " * ((start - 8 - len(raw)) % FOLIO)
    f.write(struct.pack("<Q", len(raw)) + raw)
    f.flush()
    size = cf.file_size - start
    fd = pins.open_fd(cf.path)
    try:
        copy_range(fd, start, f.fileno(), 8 + len(raw), size)
    finally:
        os.close(fd)
    f.seek(8 + len(raw) + size)
