"""``torch.distributed.checkpoint`` directories as a :class:`CheckpointFile`, read without torch.

``.metadata`` is read by :mod:`ckptfix.formats.dcp.meta` (restricted reader, exact
allowlist of DCP record classes); tensors become :class:`TensorRecord` objects
with their global dtype and shape (their bytes are spread over chunks: see
:mod:`ckptfix.formats.dcp.chunks`), small non-tensor objects (epoch, optimizer
``param_groups``) are unpickled by the restricted reader, larger ones stay a
``"<object: N bytes>"`` marker.  The nesting is the one that was saved
(``planner_data``), so the state dict is found as for any other checkpoint.
"""

from __future__ import annotations

import re
from typing import Any

from ckptfix.errors import CkptfixError, PartitionedCheckpointError
from ckptfix.files import source
from ckptfix.formats.base import CheckpointFile, DcpDetails, Format, contiguous_stride
from ckptfix.formats.dcp.assemble import set_element
from ckptfix.formats.dcp.chunks import Files, read_object
from ckptfix.formats.dcp.meta import DcpMetadata, TensorEntry, read_metadata, validate
from ckptfix.pickles import StorageRecord, TensorRecord

#: non-tensor objects up to this size are decoded for ``inspect`` (restricted reader)
DECODE_OBJECTS_UP_TO = 1 << 20

_RANK_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


def read_dcp(path: str, meta: Any = None) -> CheckpointFile:
    """Read a DCP directory's structure (no tensor bytes).

    Args:
        path: the directory.
        meta: its :class:`~ckptfix.formats.dcp.meta.DcpMetadata` when already read.

    Returns:
        A :class:`CheckpointFile` (tensor records with their global dtype and shape, small objects
        decoded) with :class:`DcpDetails`.

    Raises:
        CorruptCheckpointError, CheckpointNotFoundError, UnsafePickleError, UnsupportedError: as
        :func:`ckptfix.formats.dcp.meta.read_metadata`.
    """
    meta = meta or read_metadata(path)
    notes: list[str] = []
    try:
        validate(meta)
    except CkptfixError as err:
        notes.append(f"not loadable as is: {err}")
    obj: dict[str, Any] = {}
    storages: dict[str, StorageRecord] = {}
    stubbed = set(meta.foreign)
    with Files(path) as files:
        for fqn, e in meta.entries.items():
            if isinstance(e, TensorEntry):
                value = _tensor_record(path, fqn, e, storages)
            else:
                value = _object_value(files, meta, fqn, e, stubbed, notes)
            try:
                set_element(obj, meta.key_path(fqn), value)
            except (TypeError, IndexError, KeyError, AttributeError):
                obj[fqn] = value
    summary = _summary(meta)
    notes.insert(0, _summary_note(summary, len(meta.files)))
    if meta.foreign:
        notes.append(
            f".metadata references foreign globals ({', '.join(sorted(meta.foreign)[:3])}); loaders refuse "
            "this directory"
        )
    return CheckpointFile(
        path=path,
        format=Format.DCP,
        obj=obj,
        storages=storages,
        globals_seen=dict(meta.globals_seen),
        stubbed=stubbed,
        file_size=_dir_size(path),
        notes=notes,
        details=DcpDetails(files=meta.files, summary=summary, metadata=meta),
    )


def _tensor_record(path: str, fqn: str, e: TensorEntry, storages: dict[str, StorageRecord]) -> TensorRecord:
    """A record for a DCP tensor (global dtype and shape, contiguous); its storage is added to ``storages``."""
    src = source.join(path, e.locations[0].relative_path) if e.locations else path
    rec = StorageRecord(key=fqn, dtype=e.dtype, location="cpu", numel=e.numel, source=src)
    rec.nbytes = e.nbytes
    storages[fqn] = rec
    return TensorRecord(rec, 0, e.shape, contiguous_stride(e.shape), e.dtype)


def _object_value(files: Files, meta: DcpMetadata, fqn: str, e: Any, stubbed: set[str], notes: list[str]) -> Any:
    """A small non-tensor object, decoded by the restricted reader; a larger one, a size marker."""
    value: Any = f"<object: {e.location.length if e.location else 0} bytes>"
    if not meta.foreign and e.location is not None and e.location.length <= DECODE_OBJECTS_UP_TO:
        try:
            value, st = read_object(files, e)
            stubbed |= st
        except PartitionedCheckpointError:
            raise  # one rank's DTensor shards: nothing here is the entry's value
        except (CkptfixError, OSError) as ex:
            notes.append(f"object {fqn!r} unreadable: {ex}")
    return value


def _dir_size(path: str) -> int:
    """Bytes of the files directly in ``path``."""
    files = (source.join(path, n) for n in source.listdir(path))
    return sum(source.getsize(p) for p in files if source.isfile(p))


def _summary(meta: DcpMetadata) -> dict[str, Any]:
    """The counts ``inspect --json`` reports under ``dcp``."""
    ranks = {m.group(1) for m in map(_RANK_RE.match, meta.files) if m}
    by_top: dict[str, int] = {}
    for te in meta.tensors():
        top = str(meta.key_path(te.fqn)[0])
        by_top[top] = by_top.get(top, 0) + 1
    tensors = sum(1 for _ in meta.tensors())
    return {
        "tensors_by_top_level_key": by_top,
        "files": len(meta.files),
        "ranks": len(ranks) or len(meta.files),
        "chunks": sum(len(te.chunks) for te in meta.tensors()),
        "tensors": tensors,
        "objects": len(meta.entries) - tensors,
        "version": meta.version,
    }


def _summary_note(summary: dict[str, Any], files: int) -> str:
    by_top: dict[str, int] = summary["tensors_by_top_level_key"]
    return (
        f"DCP: {summary['tensors']} tensors in {summary['chunks']} chunks over {files} data file(s) "
        f"from {summary['ranks']} rank(s), {summary['objects']} non-tensor object(s)"
        + (
            f"; tensors per top-level key: {', '.join(f'{k} {v}' for k, v in by_top.items())}"
            if len(by_top) > 1
            else ""
        )
    )
