"""Reading a rewritten file back, torch-free, before it replaces anything."""

from __future__ import annotations

import os
from typing import Any, Mapping

from ckptfix.errors import CkptfixError, VerificationError
from ckptfix.formats import CheckpointFile, Format, iter_tensors, read_checkpoint
from ckptfix.pickles import TensorRecord, classify_global
from ckptfix.pickles.opcodes import resolve_global


def pickle_globals(data: bytes) -> list[str]:
    """The globals a pickle names, resolved as Python's unpickler resolves them for the pickle's protocol.

    A protocol < 3 pickle's ``__builtin__ long`` is ``builtins.int`` (``_compat_pickle``); a
    ``builtins long`` stays ``builtins.long`` -- which does not exist.  Reads opcodes only.

    Args:
        data: one pickle.

    Returns:
        ``module.name`` of every global, in order, repeats included.

    Raises:
        ValueError: a malformed stream (from pickletools).
    """
    import _compat_pickle
    import pickletools

    proto = 0
    strings: list[str] = []
    memo: dict[int, Any] = {}
    n_memo = 0
    last: Any = None
    out: list[str] = []

    def resolve(mod: str, name: str) -> str:
        if proto < 3:
            if (mod, name) in _compat_pickle.NAME_MAPPING:
                mod, name = _compat_pickle.NAME_MAPPING[(mod, name)]
            elif mod in _compat_pickle.IMPORT_MAPPING:
                mod = _compat_pickle.IMPORT_MAPPING[mod]
        return f"{mod}.{name}"

    for op, arg, _ in pickletools.genops(data):
        name = op.name
        prev, last = last, None
        if name == "PROTO":
            proto = _int(arg)
        elif name in (
            "SHORT_BINUNICODE",
            "BINUNICODE",
            "BINUNICODE8",
            "UNICODE",
            "SHORT_BINSTRING",
            "BINSTRING",
            "STRING",
        ):
            last = arg.decode("latin-1") if isinstance(arg, bytes) else str(arg)
            strings.append(last)
        elif name in ("GLOBAL", "INST"):
            mod, _, nm = str(arg).partition(" ")
            out.append(resolve(mod, nm))
        elif name == "STACK_GLOBAL":
            out.append(f"{strings[-2]}.{strings[-1]}" if len(strings) >= 2 else "<unresolved STACK_GLOBAL>")
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[_int(arg)] = prev
            last = prev
        elif name == "MEMOIZE":
            memo[n_memo] = prev
            n_memo += 1
            last = prev
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            v = memo.get(_int(arg))
            if isinstance(v, str):
                strings.append(v)
                last = v
        elif name in ("EXT1", "EXT2", "EXT4"):
            out.append(f"<extension {arg}>")
    return out


def _resolves(name: str) -> bool:
    """False for a ``builtins`` name that does not exist (``builtins.long``); other modules are not imported."""
    import builtins

    module, _, attr = name.rpartition(".")
    return module != "builtins" or hasattr(builtins, attr)


def check_written(
    path: str,
    source: CheckpointFile,
    *,
    expect_obj: Any,
    what: str,
    weights_only: bool = False,
    new_storages: Mapping[str, bytes] | None = None,
) -> set[str]:
    """Read a rewritten file back (torch-free) before it replaces anything; raise if torch could not load it.

    Checks: the file reads back with ckptfix's restricted reader; every global its pickle names
    resolves (as Python resolves it for the pickle's protocol) and is a global the input named
    (after the same normalisation) or one torch's weights-only loader allows -- with
    ``weights_only``, only the latter; every tensor of ``expect_obj`` reads back with the same dtype,
    shape, stride, offset and storage, and every storage record has the size of the one it was
    copied from (or of its ``new_storages`` bytes) and lies inside the file.

    Args:
        path: the written (temp) file.
        source: the checkpoint it was written from.
        expect_obj: the object graph that was written.
        what: the path the user asked for, for messages.
        weights_only: only globals torch's weights-only loader allows may remain.
        new_storages: storages added by the writer (key -> bytes).

    Returns:
        The globals outside the weights-only allowlist that the output names.

    Raises:
        VerificationError: naming what is wrong (``what`` is the path the user asked for).
    """
    import zipfile

    def fail(why: str) -> VerificationError:
        return VerificationError(f"{what}: the rewritten file {why}; nothing was replaced")

    try:
        out = read_checkpoint(path)
    except CkptfixError as e:
        raise fail(f"does not read back ({e})") from None
    if out.format == Format.SAFETENSORS:  # its header was written from the source's records and read back above
        return set()
    with zipfile.ZipFile(path) as zf:
        pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise fail("has no data.pkl")
        names = pickle_globals(zf.read(pkl))
    inputs = {_py3_global(g) for g in source.globals_seen}
    unsafe: set[str] = set()
    for g in dict.fromkeys(names):
        if not _resolves(g):
            raise fail(
                f"would name the global {g}, which does not exist in Python 3 (torch.load would raise AttributeError)"
            )
        safe = classify_global(g) == "safe"
        if not safe:
            unsafe.add(g)
        if weights_only and not safe:
            raise fail(f"still names {g}, outside torch's weights-only allowlist")
        if not safe and g not in inputs:
            raise fail(f"names the global {g}, which the input did not name")
    new_storages = new_storages or {}
    size = os.path.getsize(path)
    for key, st in out.storages.items():
        want = (
            len(new_storages[key])
            if key in new_storages
            else (source.storages[key].nbytes if key in source.storages else None)
        )
        if want is None:
            raise fail(f"holds a storage {key!r} that the input does not")
        if st.nbytes != want or st.file_offset is None or st.file_offset + (st.nbytes or 0) > size:
            raise fail(f"storage {key!r} reads back as {st.nbytes} bytes, expected {want}")
    exp = list(iter_tensors(expect_obj, depth=64))
    got = list(iter_tensors(out.obj, depth=64))
    if len(exp) != len(got):
        raise fail(f"holds {len(got)} tensors, expected {len(exp)}")
    for (pa, a), (pb, b) in zip(exp, got, strict=False):
        if not isinstance(a, TensorRecord) or not isinstance(b, TensorRecord):
            continue
        if (
            pa != pb
            or a.dtype != b.dtype
            or tuple(a.shape) != tuple(b.shape)
            or a.offset != b.offset
            or (a.numel and tuple(a.stride) != tuple(b.stride))
            or (a.storage.key if a.storage else None) != (b.storage.key if b.storage else None)
        ):
            raise fail(f"tensor {pa or '/'} reads back as {pb}: {b!r}, expected {a!r}")
    return unsafe


def _py3_global(name: str) -> str:
    """``module.Name`` as Python 3 resolves it (``builtins.long`` -> ``builtins.int``, ``copy_reg`` -> ``copyreg``)."""
    module, _, attr = name.rpartition(".")
    for mod in (module, "__builtin__") if module == "builtins" else (module,):
        m, a = resolve_global(mod, attr, 2)
        if (m, a) != (mod, attr):
            return f"{m}.{a}"
    return name


def _int(arg: Any) -> int:
    """An opcode's integer argument."""
    return int(arg)
