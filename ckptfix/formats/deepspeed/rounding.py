"""Floating dtypes rounded as torch's ``Tensor.to`` rounds them (nearest even), torch-free.

``convert --dtype`` of a ZeRO checkpoint and ``load_anywhere`` of one share it: numpy when it is
installed, else the standard library (the same bytes).
"""

from __future__ import annotations

import sys
from typing import Any

from ckptfix.errors import UnsupportedError

#: ``--dtype`` names -> ckptfix dtype names (zero_to_fp32's ``OUTPUT_DTYPE_NAMES``)
OUTPUT_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def output_dtype(dtype: str | None) -> str | None:
    """The ckptfix dtype name of a ``--dtype`` (``bf16`` -> ``bfloat16``); None keeps each tensor's own.

    Raises:
        UnsupportedError: an unknown name.
    """
    if dtype is None:
        return None
    name = dtype[6:] if dtype.startswith("torch.") else dtype
    try:
        return OUTPUT_DTYPES[name.lower()]
    except KeyError:
        raise UnsupportedError(
            f"--dtype {dtype!r}: choose one of fp32, bf16, fp16 (or float32, bfloat16, float16)"
        ) from None


def _np() -> Any:
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return None


def convert_bytes(data: bytes | bytearray | memoryview, src: str, dst: str) -> bytes | bytearray | memoryview:
    """Elements of dtype ``src`` as ``dst``, rounded as torch's ``Tensor.to`` rounds (nearest even).

    Args:
        data: little-endian elements.
        src: ``float32``, ``bfloat16`` or ``float16``.
        dst: ``float32``, ``bfloat16`` or ``float16``.

    Returns:
        The converted bytes (``data`` itself when the dtypes are equal).

    Raises:
        UnsupportedError: another pair of dtypes.
    """
    if src == dst:
        return data
    np = _np()
    if np is not None:
        return _convert_np(np, data, src, dst)
    return _convert_py(bytes(data), src, dst)


def _convert_np(np: Any, data: Any, src: str, dst: str) -> bytes:
    if src == "bfloat16":
        a = (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view("<f4")
    elif src == "float16":
        a = np.frombuffer(data, dtype="<f2").astype("<f4")
    elif src == "float32":
        a = np.frombuffer(data, dtype="<f4")
    else:
        raise UnsupportedError(f"cannot convert {src} to {dst}")
    if dst == "float32":
        return bytes(a.astype("<f4").tobytes())
    if dst == "float16":
        with np.errstate(over="ignore", invalid="ignore"):
            return bytes(a.astype("<f2").tobytes())
    if dst == "bfloat16":
        u = a.view("<u4")
        r = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16).astype("<u2")
        r[np.isnan(a)] = 0xFFFF  # what torch's (vectorised) CPU kernel writes for any NaN
        return bytes(r.tobytes())
    raise UnsupportedError(f"cannot convert {src} to {dst}")


def _convert_py(data: bytes, src: str, dst: str) -> bytes:
    import array
    import struct

    if src == "bfloat16":
        h = array.array("H", data)
        if sys.byteorder != "little":
            h.byteswap()
        vals = list(struct.unpack(f"<{len(h)}f", array.array("I", (x << 16 for x in h)).tobytes()))
    elif src == "float16":
        vals = list(struct.unpack(f"<{len(data) // 2}e", data))
    elif src == "float32":
        vals = list(struct.unpack(f"<{len(data) // 4}f", data))
    else:
        raise UnsupportedError(f"cannot convert {src} to {dst}")
    if dst == "float32":
        return struct.pack(f"<{len(vals)}f", *vals)
    if dst == "float16":
        out = bytearray()
        for v in vals:
            try:
                out += struct.pack("<e", v)
            except (OverflowError, struct.error):
                out += b"\x00\x7c" if v > 0 else b"\x00\xfc"
        return bytes(out)
    if dst == "bfloat16":
        us = struct.unpack(f"<{len(vals)}I", struct.pack(f"<{len(vals)}f", *vals))
        halves = (
            0xFFFF if v != v else ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF for u, v in zip(us, vals, strict=True)
        )
        return struct.pack(f"<{len(us)}H", *halves)
    raise UnsupportedError(f"cannot convert {src} to {dst}")
