"""TorchScript's Enum values in ``data.pkl``, made readable by a standard unpickler.

torch's TorchScript pickler writes an Enum attribute (torchvision's ``InterpolationMode``, any scripted
``enum.Enum``) as ``GLOBAL <the enum class>; <its value>; REDUCE``: the REDUCE's argument is the bare value
(a str, int or float), not a tuple, which torch's own unpickler special-cases and CPython's refuses
("argument list must be a tuple").  :func:`tuple_enum_reduces` rewrites exactly those REDUCEs to take a
one-tuple (a ``TUPLE1`` before each), so the enum becomes a placeholder whose argument is its value.
Nothing else in the pickle changes: a pickle without frames has no offsets to shift, and memo indices are
numbers, not positions.  Nothing is imported or called.
"""

from __future__ import annotations

import pickle
import pickletools

#: opcodes that push one scalar (an Enum value torch writes) onto the stack
_SCALARS = frozenset(
    {
        "BINUNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE8",
        "UNICODE",
        "BININT",
        "BININT1",
        "BININT2",
        "INT",
        "LONG",
        "LONG1",
        "LONG4",
        "BINFLOAT",
        "FLOAT",
    }
)
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_GLOBALS = frozenset({"GLOBAL", "STACK_GLOBAL"})


def tuple_enum_reduces(data: bytes) -> bytes | None:
    """``data`` with a ``TUPLE1`` before each ``REDUCE`` whose callable is a global and whose argument one scalar.

    Args:
        data: a TorchScript ``data.pkl`` (protocol 2, no frames).

    Returns:
        The rewritten pickle, or None when there is no such REDUCE, the pickle has frames (offsets would
        shift), or it cannot be parsed.
    """
    memo_kind: dict[int, str] = {}  # memo index -> "scalar" / "global" / "other"
    ops: list[tuple[str, int]] = []  # (kind of push, position) of the recent opcodes, memo puts left out
    inserts: list[int] = []
    n_memo = 0
    try:
        for op, arg, maybe_pos in pickletools.genops(data):
            pos = int(maybe_pos or 0)
            name = op.name
            if name == "FRAME":
                return None
            if name in _PUTS:
                idx = n_memo if name == "MEMOIZE" else int(arg)  # type: ignore[arg-type]
                n_memo += name == "MEMOIZE"
                memo_kind[idx] = ops[-1][0] if ops else "other"
                continue
            if name in _GETS:
                ops.append((memo_kind.get(int(arg), "other"), pos))  # type: ignore[arg-type]
            elif name in _SCALARS:
                ops.append(("scalar", pos))
            elif name in _GLOBALS:
                ops.append(("global", pos))
            elif name == "REDUCE":
                if len(ops) >= 2 and ops[-1][0] == "scalar" and ops[-2][0] == "global":
                    inserts.append(pos)
                ops.append(("other", pos))
            else:
                ops.append(("other", pos))
            if len(ops) > 8:
                del ops[:-4]
    except Exception:  # noqa: BLE001 - a damaged pickle: the caller reports the unpickler's own error
        return None
    if not inserts:
        return None
    out = bytearray()
    last = 0
    for pos in inserts:
        out += data[last:pos]
        out += pickle.TUPLE1
        last = pos
    out += data[last:]
    return bytes(out)
