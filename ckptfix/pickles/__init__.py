"""A restricted pickle reader and writer that never runs code from the pickle.

torch checkpoints are pickles in which tensors appear as calls to torch's
rebuild functions (``torch._utils._rebuild_tensor_v2(storage, offset, size,
stride, ...)``) with storages supplied through persistent ids
(``('storage', torch.FloatStorage, key, location, numel)``).

:class:`RecordingUnpickler` reads such a pickle *without torch*: rebuild calls
become :class:`TensorRecord` objects (storage key, dtype, offset, shape,
stride), storages become :class:`StorageRecord` objects, and every other
global becomes an inert placeholder class (:class:`Stub`) that records its
name, arguments and state and calls nothing.  A handful of plain-data
constructors (``collections.OrderedDict``, ``builtins.set`` ...) are rebuilt
for real because they run no user code: which ones, and which globals are safe,
is :mod:`ckptfix.pickles.policy`'s table.

:func:`dumps` writes such an object graph back as a pickle that torch loads,
emitting placeholders as the globals they stood for.  That is what lets
``strip-prefix`` rename keys in ``data.pkl`` without importing torch.

:func:`~ckptfix.pickles.opcodes.scan_globals` (in :mod:`ckptfix.pickles.opcodes`) lists the
globals a pickle references by walking its opcodes only (no object is built),
and :func:`~ckptfix.pickles.policy.classify_global` says whether each is safe (what
``torch.load(weights_only=True)`` allows), dangerous or unknown.

The package, one concern per module: :mod:`~ckptfix.pickles.records` (tensor and storage records,
dtype tables), :mod:`~ckptfix.pickles.stub` (placeholders for globals, their factories, the bounded
plain-data constructors, :func:`paused_gc`), :mod:`~ckptfix.pickles.reader` (the reading unpickler)
and :mod:`~ckptfix.pickles.writer` (the writing pickler and the write-back check).  Every name is
re-exported here; import from ``ckptfix.pickles``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptfix.pickles.opcodes import (
    LEGACY_MAGIC_NUMBER,
    PickleLimits,
    ScanResult,
    resolve_global,
    scan_globals,
    scan_pickle_sequence,
)
from ckptfix.pickles.policy import (
    DTYPE_GLOBALS,
    REBUILD_FROM_TYPE,
    SAFE_CODECS,
    TENSOR_REBUILDERS,
    classify_global,
    classify_pair,
    codecs_encode,
    known_global,
)
from ckptfix.pickles.reader import (
    RecordingUnpickler,
    check_depth,
    loads_records,
)
from ckptfix.pickles.records import (
    ELEMENT_SIZE,
    STORAGE_DTYPES,
    StorageRecord,
    TensorRecord,
    is_c_contiguous,
    is_tensor_like,
)
from ckptfix.pickles.stub import (
    MAX_TENSOR_BYTES,
    Stub,
    global_name,
    global_pair,
    paused_gc,
    rebuilder_class,
    stub_class,
    stub_dtype,
    validate_tensor_record,
)

if TYPE_CHECKING:
    from ckptfix.pickles.writer import (
        _WRITING,
        RESOLVE_CHECK_MODULES,
        RecordPickler,
        dumps,
        globals_resolvable,
    )

#: the names of :mod:`~ckptfix.pickles.writer`, imported on first use (the readers never write: start-up)
_WRITER = frozenset({"_WRITING", "RESOLVE_CHECK_MODULES", "RecordPickler", "dumps", "globals_resolvable"})

__all__ = [
    "ELEMENT_SIZE",
    "is_c_contiguous",
    "is_tensor_like",
    "STORAGE_DTYPES",
    "StorageRecord",
    "TensorRecord",
    "global_name",
    "global_pair",
    "MAX_TENSOR_BYTES",
    "paused_gc",
    "rebuilder_class",
    "Stub",
    "stub_class",
    "stub_dtype",
    "validate_tensor_record",
    "check_depth",
    "loads_records",
    "RecordingUnpickler",
    "_WRITING",
    "dumps",
    "globals_resolvable",
    "RecordPickler",
    "RESOLVE_CHECK_MODULES",
    "DTYPE_GLOBALS",
    "REBUILD_FROM_TYPE",
    "SAFE_CODECS",
    "TENSOR_REBUILDERS",
    "classify_global",
    "classify_pair",
    "codecs_encode",
    "known_global",
    "LEGACY_MAGIC_NUMBER",
    "PickleLimits",
    "ScanResult",
    "resolve_global",
    "scan_globals",
    "scan_pickle_sequence",
]


def __getattr__(name: str) -> Any:
    if name in _WRITER:
        from ckptfix.pickles import writer

        value = getattr(writer, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptfix.pickles' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _WRITER)
