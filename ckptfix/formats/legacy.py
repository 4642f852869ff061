"""The legacy (pre-1.6) ``torch.save`` stream, and bare pickles, without torch.

Layout: five pickles back to back -- magic number, protocol version, system
info, the object, the list of storage keys -- then, for each key in that
order, an 8-byte little-endian element count followed by the raw bytes.
The restricted reader records each storage's dtype, which gives its byte size,
so the storage table is built by seeking, never reading tensor data.
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

from ckptfix.errors import CkptfixError, CorruptCheckpointError
from ckptfix.files import source
from ckptfix.formats.base import CheckpointFile, Format, LegacyDetails, PickleDetails
from ckptfix.pickles import RecordingUnpickler, StorageRecord

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
#: the longest pickle of the magic number (protocol 4/5: PROTO, FRAME, LONG1 with 10 bytes, STOP is 24)
_MAGIC_PICKLE_MAX = 64


def stream_kind(path: str) -> Format:
    """Tell a legacy ``torch.save`` stream from a bare pickle by its first pickle (torch's magic number).

    Only the first few bytes are read, with the restricted reader.

    Args:
        path: a file that starts with a pickle.

    Returns:
        :attr:`Format.TORCH_LEGACY` when the first pickle is the magic number, else :attr:`Format.PICKLE`
        (whose reader reports a damaged pickle).
    """
    with source.open_file(path) as f:
        head = f.read(_MAGIC_PICKLE_MAX)
    try:
        first = RecordingUnpickler.for_bytes(head, legacy=True).load()
    except Exception:  # noqa: BLE001 - anything but the magic number is a bare pickle, read and judged later
        return Format.PICKLE
    return Format.TORCH_LEGACY if first == MAGIC_NUMBER and type(first) is int else Format.PICKLE


def _load_one(
    f: BinaryIO, path: str, what: str, storages: dict[str, StorageRecord] | None = None
) -> tuple[Any, RecordingUnpickler]:
    up = RecordingUnpickler(f, legacy=True, storages=storages)
    try:
        return up.load(), up
    except EOFError:
        raise CorruptCheckpointError(f"{path}: the file ends inside the {what}; it is truncated") from None
    except CkptfixError:
        raise
    except Exception as e:  # noqa: BLE001 - any other failure of the unpickler is corruption
        raise CorruptCheckpointError(
            f"{path}: cannot read the {what} ({type(e).__name__}: {e}); the file is corrupt or not a checkpoint"
        ) from None


def _place_storages(f: BinaryIO, path: str, size: int, keys: list[Any], storages: dict[str, StorageRecord]) -> None:
    """Give each storage its byte range: after the key list, in its order, a count then the bytes."""
    pos = f.tell()
    counts = _remote_counts(f, path, size, pos, keys, storages)
    for key in keys:
        rec = storages.get(str(key))
        if rec is None:
            raise CorruptCheckpointError(f"{path}: storage {key!r} is listed but never used")
        if pos + 8 > size:
            raise CorruptCheckpointError(f"{path}: the file ends before storage {key!r}; it is truncated")
        if counts is not None and pos in counts:
            (numel,) = struct.unpack("<q", counts[pos])
        else:
            f.seek(pos)
            (numel,) = struct.unpack("<q", f.read(8))
        nbytes = numel * rec.element_size
        if numel < 0:
            raise CorruptCheckpointError(f"{path}: storage {key!r} has a negative size ({numel}); the file is corrupt")
        if rec.file_offset is not None:
            raise CorruptCheckpointError(f"{path}: storage {key!r} is listed twice; the file is corrupt")
        rec.file_offset, rec.nbytes, rec.source = pos + 8, nbytes, path
        pos += 8 + nbytes
        if pos > size:
            raise CorruptCheckpointError(f"{path}: the file ends inside storage {key!r}; it is truncated")


def _remote_counts(
    f: BinaryIO, path: str, size: int, pos: int, keys: list[Any], storages: dict[str, StorageRecord]
) -> dict[int, bytes] | None:
    """For a remote file, the 8-byte counts where the pickle's sizes say the storages start, read in a few
    coalesced parallel requests (each is checked again by the caller; a count elsewhere is read alone);
    None for a local file."""
    if not getattr(f, "remote", False):
        return None
    offs: list[tuple[int, int]] = []
    for key in keys:
        rec = storages.get(str(key))
        numel = rec.numel if rec is not None else None
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0 or pos + 8 > size:
            break
        offs.append((pos, 8))
        pos += 8 + numel * rec.element_size  # type: ignore[union-attr]
    if source.is_metadata_only(path):  # inspect of a URL: the counts the pickle declares, not read
        return {o: struct.pack("<q", storages[str(k)].numel) for (o, _), k in zip(offs, keys, strict=False)}
    with source.open_source(path) as src:
        return dict(src.read_ranges(offs, jobs=16))


def read_pickle_stream(path: str) -> CheckpointFile:
    """Read a legacy ``torch.save`` stream or a bare pickle, without torch and without running its code.

    Args:
        path: the file.

    Returns:
        A :class:`CheckpointFile` of format ``torch-legacy`` (with :class:`LegacyDetails`) or
        ``pickle`` (with :class:`PickleDetails`).

    Raises:
        CorruptCheckpointError: truncated or damaged pickles or storages, an unsupported legacy
            protocol, a big-endian file.
        UnsafePickleError, ResourceLimitError: as the restricted reader.
    """
    size = source.getsize(path)
    with source.open_file(path) as f:
        first, up0 = _load_one(f, path, "first pickle")
        if first != MAGIC_NUMBER:
            # a bare pickle (pickle.dump of a dict of tensors is not loadable by torch, but a dict of numbers is)
            return CheckpointFile(
                path=path,
                format=Format.PICKLE,
                obj=first,
                storages=up0.storages,
                globals_seen=dict(up0.globals_seen),
                stubbed=set(up0.stubbed),
                file_size=size,
                details=PickleDetails(pickle_end=f.tell()),
            )
        protocol, _ = _load_one(f, path, "protocol version")
        sys_info, _ = _load_one(f, path, "system info")
        if protocol != 1001:
            raise CorruptCheckpointError(f"{path}: legacy protocol {protocol!r} is not supported")
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            raise CorruptCheckpointError(f"{path}: saved on a big-endian machine; re-save it on little-endian")
        pickle_start = f.tell()
        obj, up = _load_one(f, path, "checkpoint object")
        pickle_end = f.tell()
        keys, _ = _load_one(f, path, "storage key list")
        if not isinstance(keys, list):
            raise CorruptCheckpointError(f"{path}: the storage key list is damaged")
        _place_storages(f, path, size, keys, up.storages)
    notes = []
    if up.module_sources:
        names = sorted({n for n, _ in up.module_sources})
        notes.append(
            f"{len(names)} module class(es) saved with their source (a legacy torch.save of a whole module: "
            f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}); read as placeholders, the source never run"
        )
    return CheckpointFile(
        path=path,
        format=Format.TORCH_LEGACY,
        obj=obj,
        storages=up.storages,
        globals_seen=dict(up.globals_seen),
        stubbed=set(up.stubbed),
        file_size=size,
        details=LegacyDetails(pickle_start=pickle_start, pickle_end=pickle_end, storage_keys=keys, sys_info=sys_info),
        notes=notes,
    )
