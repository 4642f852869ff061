"""The safetensors container without torch: 8-byte header length, JSON header, raw data."""

from __future__ import annotations

import struct
from typing import Any

from ckptfix.errors import CorruptCheckpointError, ResourceLimitError
from ckptfix.files import source
from ckptfix.formats.base import (
    MAX_JSON_ENV,
    CheckpointFile,
    Format,
    SafetensorsDetails,
    contiguous_stride,
    max_json_bytes,
)
from ckptfix.pickles import StorageRecord, TensorRecord

MAX_HEADER = 100_000_000  # the limit safetensors itself enforces

#: safetensors dtype code -> torch dtype name
ST_TO_DTYPE: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    # two 4-bit values a byte: safetensors counts the values (its last dimension is twice torch's)
    "F4": "float4_e2m1fn_x2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
}
DTYPE_TO_ST: dict[str, str] = {v: k for k, v in ST_TO_DTYPE.items()}

#: safetensors dtypes whose values are smaller than a byte: values per byte (torch's dtype packs them)
PACKED: dict[str, int] = {"F4": 2}


def st_shape(dtype: str, shape: Any) -> list[int]:
    """The shape a safetensors header records for a tensor of torch dtype ``dtype`` and ``shape``: torch's,
    except for packed sub-byte dtypes (``float4_e2m1fn_x2``: ``F4``, the last dimension counts the values).

    Args:
        dtype: the torch dtype name.
        shape: the torch shape.

    Returns:
        The header's shape.
    """
    out = [int(d) for d in shape]
    k = PACKED.get(DTYPE_TO_ST.get(dtype, ""), 1)
    if k > 1 and out:
        out[-1] *= k
    return out


def read_header(path: str, max_bytes: int | None = None) -> tuple[dict[str, Any], int]:
    """Read and check a safetensors header's size and JSON.

    Args:
        path: the file.
        max_bytes: cap on the header (default ``CKPTFIX_MAX_JSON_MB``; a file ckptfix just wrote is
            re-read with safetensors' own limit).

    Returns:
        ``(header dict, data start offset)``.

    Raises:
        CorruptCheckpointError: a header that is truncated, not JSON, nested too deep or not an object.
        ResourceLimitError: a header over ``CKPTFIX_MAX_JSON_MB`` (default 32 MiB).
    """
    size = source.getsize(path)
    with source.open_file(path) as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise CorruptCheckpointError(
                f"{path}: safetensors header claims {n} bytes (limit {MAX_HEADER}); the file is corrupt or hostile"
            )
        if n + 8 > size:
            raise CorruptCheckpointError(
                f"{path}: safetensors header ({n} bytes) runs past the end of the file "
                f"({size} bytes); the file is truncated"
            )
        limit = max_json_bytes() if max_bytes is None else max_bytes
        if n > limit:
            raise ResourceLimitError(
                f"{path}: safetensors header is {n} bytes, over the {limit >> 20} MiB "
                "limit for JSON metadata (a real header is a few MB); if you trust the file, "
                f"raise {MAX_JSON_ENV}=<MiB>"
            )
        raw = f.read(n)
    try:
        import json  # here, not at the top: start-up of inspect/scan

        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(
            f"{path}: safetensors header is not valid JSON ({e}); the file is corrupt"
        ) from None
    except RecursionError:
        raise CorruptCheckpointError(
            f"{path}: safetensors header JSON is nested too deep; the file is corrupt or hostile"
        ) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


def _uint(x: Any) -> int:
    """A JSON non-negative integer (not a bool or a float), as the safetensors header requires."""
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ValueError(x)
    return x


def _tensor_record(path: str, name: str, info: Any, start: int, size: int) -> tuple[StorageRecord, TensorRecord]:
    """The record of one header entry, checked: known dtype, possible shape, bytes inside the file."""
    try:
        dt = ST_TO_DTYPE.get(info["dtype"])
        shape = tuple(_uint(s) for s in info["shape"])
        begin, end = (_uint(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CorruptCheckpointError(f"{path}: malformed header entry for {name!r}") from None
    if dt is None:
        raise CorruptCheckpointError(f"{path}: tensor {name!r} has unknown dtype {info.get('dtype')!r}")
    k = PACKED.get(info["dtype"], 1)
    if k > 1:  # values smaller than a byte: torch's shape packs k of them in its last dimension
        if not shape or shape[-1] % k:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} of dtype {info['dtype']} has shape {list(shape)}: its last dimension "
                f"must be a multiple of {k} (whole bytes); the file is corrupt"
            )
        shape = (*shape[:-1], shape[-1] // k)
    n = 1
    for d in shape:  # multiplied in order, as safetensors checks it: an overflow is a corrupt header
        n *= d
        if n >= 1 << 64:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} has an impossible shape {list(shape)}; the file is corrupt"
            )
    if begin < 0 or end < begin or start + end > size:
        raise CorruptCheckpointError(f"{path}: tensor {name!r} points outside the file; it is truncated or corrupt")
    rec = StorageRecord(
        key=name, dtype=dt, location="cpu", numel=None, file_offset=start + begin, nbytes=end - begin, source=path
    )
    t = TensorRecord(rec, 0, shape, contiguous_stride(shape), dt)
    if t.nbytes != rec.nbytes:
        raise CorruptCheckpointError(
            f"{path}: tensor {name!r}: shape {list(shape)} of {dt} needs {t.nbytes} "
            f"bytes but the header gives {rec.nbytes}"
        )
    return rec, t


def _check_tiling(path: str, storages: dict[str, StorageRecord], start: int, size: int) -> None:
    """As the safetensors library requires: the byte ranges tile the data section exactly, in some order.

    A file with overlaps, gaps or trailing bytes does not load there, nor would a rewrite of it.
    """
    pos = 0
    for rec in sorted(storages.values(), key=lambda r: (r.file_offset or 0, r.nbytes or 0)):
        off, nbytes = rec.file_offset or 0, rec.nbytes or 0  # both set by _tensor_record
        if off - start != pos:
            raise CorruptCheckpointError(
                f"{path}: tensor {rec.key!r} starts at byte {off - start} of "
                f"the data, expected {pos} (overlapping or gapped offsets); the file is "
                "corrupt"
            )
        pos += nbytes
    if start + pos != size:
        raise CorruptCheckpointError(
            f"{path}: the tensors cover {pos} bytes of data but the file holds "
            f"{size - start}; the file is truncated or corrupt"
        )


def read_safetensors(path: str) -> CheckpointFile:
    """Read a ``.safetensors`` file's header: every tensor's dtype, shape and byte range, checked.

    Args:
        path: the file.

    Returns:
        A :class:`CheckpointFile` (tensor records by name) with :class:`SafetensorsDetails`.

    Raises:
        CorruptCheckpointError: a malformed header, unknown dtypes, impossible shapes, byte ranges
            that do not tile the data section exactly.
        ResourceLimitError: a header over ``CKPTFIX_MAX_JSON_MB``.
    """
    header, start = read_header(path)
    size = source.getsize(path)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{path}: __metadata__ must be a str->str object; the file is corrupt")
    obj: dict[str, TensorRecord] = {}
    storages: dict[str, StorageRecord] = {}
    for name, info in header.items():
        storages[name], obj[name] = _tensor_record(path, name, info, start, size)
    _check_tiling(path, storages, start, size)
    return CheckpointFile(
        path=path,
        format=Format.SAFETENSORS,
        obj=obj,
        storages=storages,
        file_size=size,
        details=SafetensorsDetails(metadata=meta, data_start=start),
    )
