"""``torch.distributed.checkpoint`` directories as a :class:`CheckpointFile`, read without torch.

``.metadata`` is read by :mod:`ckptfix.dcp.meta` (restricted reader, exact
allowlist of DCP record classes); tensors become :class:`TensorRecord` objects
with their global dtype and shape (their bytes are spread over chunks: see
:mod:`ckptfix.dcp.chunks`), small non-tensor objects (epoch, optimizer
``param_groups``) are unpickled by the restricted reader, larger ones stay a
``"<object: N bytes>"`` marker.  The nesting is the one that was saved
(``planner_data``), so the state dict is found as for any other checkpoint.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptfix.errors import CkptfixError
from ckptfix.formats.base import CheckpointFile, DcpDetails, Format
from ckptfix.pickles import StorageRecord, TensorRecord

#: non-tensor objects up to this size are decoded for ``inspect`` (restricted reader)
DECODE_OBJECTS_UP_TO = 1 << 20

_RANK_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


def read_dcp(path: str, meta: Any = None) -> CheckpointFile:
    """Read a DCP directory's structure (no tensor bytes).

    Args:
        path: the directory.
        meta: its :class:`~ckptfix.dcp.meta.DcpMetadata` when already read.

    Returns:
        A :class:`CheckpointFile` (tensor records with their global dtype and shape, small objects
        decoded) with :class:`DcpDetails`.

    Raises:
        CorruptCheckpointError, CheckpointNotFoundError, UnsafePickleError, UnsupportedError: as
        :func:`ckptfix.dcp.meta.read_metadata`.
    """
    from ckptfix.dcp.assemble import set_element
    from ckptfix.dcp.chunks import Files, read_object
    from ckptfix.dcp.meta import TensorEntry, read_metadata, validate

    meta = meta or read_metadata(path)
    notes: list[str] = []
    try:
        validate(meta)
    except CkptfixError as err:
        notes.append(f"not loadable as is: {err}")
    obj: dict = {}
    storages: dict[str, StorageRecord] = {}
    stubbed = set(meta.foreign)
    globals_seen = dict(meta.globals_seen)
    chunks = 0
    with Files(path) as files:
        for fqn, e in meta.entries.items():
            value: Any
            if isinstance(e, TensorEntry):
                chunks += len(e.chunks)
                stride: list[int] = []
                acc = 1
                for s in reversed(e.shape):
                    stride.insert(0, acc)
                    acc *= s
                src = os.path.join(path, e.locations[0].relative_path) if e.locations else path
                rec = StorageRecord(key=fqn, dtype=e.dtype, location="cpu", numel=e.numel, source=src)
                rec.nbytes = e.nbytes
                storages[fqn] = rec
                value = TensorRecord(rec, 0, e.shape, tuple(stride), e.dtype)
            else:
                value = f"<object: {e.location.length if e.location else 0} bytes>"
                if not meta.foreign and e.location is not None and e.location.length <= DECODE_OBJECTS_UP_TO:
                    try:
                        value, st = read_object(files, e)
                        stubbed |= st
                    except (CkptfixError, OSError) as ex:
                        notes.append(f"object {fqn!r} unreadable: {ex}")
            try:
                set_element(obj, meta.key_path(fqn), value)
            except (TypeError, IndexError, KeyError, AttributeError):
                obj[fqn] = value
    ranks = {m.group(1) for m in map(_RANK_RE.match, meta.files) if m}
    size = 0
    for n in os.listdir(path):
        p = os.path.join(path, n)
        if os.path.isfile(p):
            size += os.path.getsize(p)
    by_top: dict[str, int] = {}
    for te in meta.tensors():
        top = str(meta.key_path(te.fqn)[0])
        by_top[top] = by_top.get(top, 0) + 1
    summary = {
        "tensors_by_top_level_key": by_top,
        "files": len(meta.files),
        "ranks": len(ranks) or len(meta.files),
        "chunks": chunks,
        "tensors": sum(1 for _ in meta.tensors()),
        "objects": len(meta.entries) - sum(1 for _ in meta.tensors()),
        "version": meta.version,
    }
    notes.insert(
        0,
        f"DCP: {summary['tensors']} tensors in {chunks} chunks over {len(meta.files)} data file(s) "
        f"from {summary['ranks']} rank(s), {summary['objects']} non-tensor object(s)"
        + (
            f"; tensors per top-level key: {', '.join(f'{k} {v}' for k, v in by_top.items())}"
            if len(by_top) > 1
            else ""
        ),
    )
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
        globals_seen=globals_seen,
        stubbed=stubbed,
        file_size=size,
        notes=notes,
        details=DcpDetails(files=meta.files, summary=summary, metadata=meta),
    )
