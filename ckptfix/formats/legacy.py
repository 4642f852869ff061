"""The legacy (pre-1.6) ``torch.save`` stream, and bare pickles, without torch.

Layout: five pickles back to back -- magic number, protocol version, system
info, the object, the list of storage keys -- then, for each key in that
order, an 8-byte little-endian element count followed by the raw bytes.
The restricted reader records each storage's dtype, which gives its byte size,
so the storage table is built by seeking, never reading tensor data.
"""

from __future__ import annotations

import os
import struct

from ckptfix.errors import CkptfixError, CorruptCheckpointError
from ckptfix.formats import CheckpointFile
from ckptfix.pickles import RecordingUnpickler, StorageRecord

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C


def _load_one(f, path: str, what: str, storages: dict[str, StorageRecord] | None = None):
    up = RecordingUnpickler(f, legacy=True, storages=storages)
    try:
        return up.load(), up
    except EOFError:
        raise CorruptCheckpointError(f"{path}: the file ends inside the {what}; it is truncated") from None
    except CkptfixError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(
            f"{path}: cannot read the {what} ({type(e).__name__}: {e}); the file is corrupt or not a checkpoint"
        ) from None


def read_pickle_stream(path: str) -> CheckpointFile:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        first, up0 = _load_one(f, path, "first pickle")
        if first != MAGIC_NUMBER:
            # a bare pickle (pickle.dump of a dict of tensors is not loadable by torch, but a dict of numbers is)
            return CheckpointFile(
                path=path,
                format="pickle",
                obj=first,
                storages=up0.storages,
                globals_seen=dict(up0.globals_seen),
                stubbed=set(up0.stubbed),
                file_size=size,
                extra={"pickle_end": f.tell()},
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
        pos = f.tell()
        for key in keys:
            rec = up.storages.get(str(key))
            if rec is None:
                raise CorruptCheckpointError(f"{path}: storage {key!r} is listed but never used")
            if pos + 8 > size:
                raise CorruptCheckpointError(f"{path}: the file ends before storage {key!r}; it is truncated")
            f.seek(pos)
            (numel,) = struct.unpack("<q", f.read(8))
            nbytes = numel * rec.element_size
            if numel < 0:
                raise CorruptCheckpointError(
                    f"{path}: storage {key!r} has a negative size ({numel}); the file is corrupt"
                )
            if rec.file_offset is not None:
                raise CorruptCheckpointError(f"{path}: storage {key!r} is listed twice; the file is corrupt")
            rec.file_offset, rec.nbytes, rec.source = pos + 8, nbytes, path
            pos += 8 + nbytes
            if pos > size:
                raise CorruptCheckpointError(f"{path}: the file ends inside storage {key!r}; it is truncated")
    return CheckpointFile(
        path=path,
        format="torch-legacy",
        obj=obj,
        storages=up.storages,
        globals_seen=dict(up.globals_seen),
        stubbed=set(up.stubbed),
        file_size=size,
        extra={"pickle_start": pickle_start, "pickle_end": pickle_end, "storage_keys": keys, "sys_info": sys_info},
    )


def scan_stream(path: str):
    """Scan every pickle in a legacy/bare stream for globals, opcodes only."""
    from ckptfix.pickles import scan_pickle_sequence

    with open(path, "rb") as f:
        return scan_pickle_sequence(f)[0]
