"""Builders of hostile and malformed checkpoints, generated inside the tests (nothing binary is committed).

Every code-execution payload runs ``touch <canary>``: a test proves ckptfix never ran it by checking
that the canary file does not exist afterwards (and proves the file really is hostile by letting
plain ``torch.load(weights_only=False)`` / ``pickle.load`` create it).
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path

import torch

# --------------------------------------------------------------------------- raw pickle opcodes


def _str_arg(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b  # BINUNICODE


def global_reduce(module: str, name: str, *args: str, proto: int = 2) -> bytes:
    """``module.name(*args)`` with GLOBAL + TUPLE + REDUCE."""
    body = b"c" + module.encode() + b"\n" + name.encode() + b"\n" + b"(" + b"".join(_str_arg(a) for a in args) + b"tR"
    return (b"\x80" + bytes([proto]) if proto >= 2 else b"") + body


def stack_global_reduce(module: str, name: str, *args: str) -> bytes:
    """``module.name(*args)`` with STACK_GLOBAL (protocol 4), the strings memoized first."""
    return (
        b"\x80\x04"
        + _str_arg(module)
        + b"\x94"
        + _str_arg(name)
        + b"\x94\x93"
        + b"("
        + b"".join(_str_arg(a) for a in args)
        + b"tR"
    )


def inst(module: str, name: str, *args: str) -> bytes:
    """Protocol 0 INST: ``(`` args ``i module\\nname\\n``."""
    return b"(" + b"".join(_str_arg(a) for a in args) + b"i" + module.encode() + b"\n" + name.encode() + b"\n"


def obj_opcode(module: str, name: str, *args: str) -> bytes:
    """Protocol 1 OBJ: ``(`` class args ``o``."""
    return b"(c" + module.encode() + b"\n" + name.encode() + b"\n" + b"".join(_str_arg(a) for a in args) + b"o"


def wrap_dict(payload: bytes, proto: int = 2, key: str = "w") -> bytes:
    """A whole pickle ``{"evil": <payload>, key: 1}`` from an expression's opcodes."""
    head = b"\x80" + bytes([proto]) if proto >= 2 else b""
    return head + b"}(" + _str_arg("evil") + payload + _str_arg(key) + b"K\x01u."


def expressions(canary: str) -> dict[str, bytes]:
    """Pickle opcodes of one expression (no PROTO, no STOP) per code-execution route, each touching ``canary``."""
    return {k: v[len(_HEAD) : -len(_TAIL)] for k, v in payloads(canary).items()}


_HEAD = b"\x80\x02}(" + b"X\x04\x00\x00\x00evil"
_TAIL = b"X\x01\x00\x00\x00wK\x01u."


def payloads(canary: str) -> dict[str, bytes]:
    """Complete pickles (``{"evil": <route>, "w": 1}``) per code-execution route, each touching ``canary``."""
    cmd = f"touch {canary}"
    py = f"__import__('os').system({cmd!r})"
    out: dict[str, bytes] = {
        "os.system": wrap_dict(global_reduce("os", "system", cmd, proto=0)),
        "posix.system": wrap_dict(global_reduce("posix", "system", cmd, proto=0)),
        "stack_global": wrap_dict(stack_global_reduce("os", "system", cmd)[2:]),
        "inst": wrap_dict(inst("os", "system", cmd)),
        "obj": wrap_dict(obj_opcode("os", "system", cmd)),
        "builtins.eval": wrap_dict(global_reduce("builtins", "eval", py, proto=0)),
        "builtins.exec": wrap_dict(global_reduce("builtins", "exec", py, proto=0)),
        "__builtin__.eval": wrap_dict(global_reduce("__builtin__", "eval", py, proto=0)),
        "code.InteractiveInterpreter": wrap_dict(
            b"cbuiltins\ngetattr\n(ccode\nInteractiveInterpreter\n)R"
            + _str_arg("runsource")
            + b"tR("
            + _str_arg(py)
            + b"tR"
        ),
        "subprocess.call": wrap_dict(
            b"csubprocess\ncall\n(" + _str_arg("sh") + _str_arg("-c") + _str_arg(cmd) + b"l\x85R"
        ),
        # getattr(__import__('os'), 'system')(cmd)
        "getattr": wrap_dict(
            b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n("
            + _str_arg("os")
            + b"tR"
            + _str_arg("system")
            + b"tR("
            + _str_arg(cmd)
            + b"tR"
        ),
        "runpy": wrap_dict(b"crunpy\n_run_code\n(" + _str_arg(f"import os; os.system({cmd!r})") + b"}tR"),
        "functools.partial": wrap_dict(b"cfunctools\npartial\n(cos\nsystem\n" + _str_arg(cmd) + b"tR)R"),
    }
    # routes found in scanner bypass reports (picklescan / modelscan): indirection through resolvers
    out["importlib.import_module"] = wrap_dict(reduce_expr(_Call(getattr, _Call(_import_module, "os"), "system"), cmd))
    out["pkgutil.resolve_name"] = wrap_dict(reduce_expr(_Call(_resolve_name, "os:system"), cmd))
    out["cProfile.run"] = wrap_dict(reduce_expr(_cprofile_run, f"import os; os.system({cmd!r})"))
    inner = global_reduce("os", "system", cmd, proto=2) + b"."
    out["pickle.loads"] = wrap_dict(b"cpickle\nloads\n(C" + bytes([len(inner)]) + inner + b"tR")
    out["_pickle.loads"] = wrap_dict(b"c_pickle\nloads\n(C" + bytes([len(inner)]) + inner + b"tR")
    # torch.storage._load_from_bytes runs torch.load(weights_only=False) on attacker bytes
    buf = io.BytesIO()
    torch.save({"x": _Evil(cmd)}, buf)
    nested = buf.getvalue()
    assert all(v.startswith(_HEAD) and v.endswith(_TAIL) for v in out.values())
    out["torch.storage._load_from_bytes"] = wrap_dict(
        b"ctorch.storage\n_load_from_bytes\n(B" + struct.pack("<I", len(nested)) + nested + b"tR"
    )
    return out


def _import_module(name: str):
    import importlib

    return importlib.import_module(name)


def _resolve_name(name: str):
    import pkgutil

    return pkgutil.resolve_name(name)


def _cprofile_run(stmt: str):
    import cProfile

    return cProfile.run(stmt)


class _Call:
    """Pickles as ``func(*args)`` (REDUCE); ``func`` may itself be a _Call."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)

    def __call__(self, *args):  # pickle wants a callable as the reduce function; never called here
        raise TypeError("only pickled")


def reduce_expr(func, *args) -> bytes:
    """Opcodes of one expression ``func(*args)``, without PROTO/STOP and without memo writes.

    The helper functions above stand for the real module functions: their pickled references are
    renamed to ``importlib.import_module``, ``pkgutil.resolve_name`` and ``cProfile.run``.
    """
    import pickletools

    data = pickletools.optimize(pickle.dumps(_Call(func, *args), protocol=2))
    for local, real in (
        (b"_import_module", b"importlib\nimport_module"),
        (b"_resolve_name", b"pkgutil\nresolve_name"),
        (b"_cprofile_run", b"cProfile\nrun"),
    ):
        data = data.replace(b"c" + __name__.encode() + b"\n" + local, b"c" + real)
    assert data.startswith(b"\x80\x02") and data.endswith(b".") and __name__.encode() not in data
    return data[2:-1]


class _Evil:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


# --------------------------------------------------------------------------- torch-format builders


class _Storage:
    def __init__(self, key: str, cls: type, numel: int) -> None:
        self.key, self.cls, self.numel = key, cls, numel


class RecTensor:
    """Pickles as ``torch._utils._rebuild_tensor_v2`` over a persistent storage, with any offset/size/stride."""

    def __init__(
        self, key: str, numel: int, offset: int, size: tuple, stride: tuple, cls: type = torch.FloatStorage
    ) -> None:
        self.storage = _Storage(key, cls, numel)
        self.args = (offset, tuple(size), tuple(stride))

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, (self.storage, *self.args, False, collections.OrderedDict()))


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None


def torch_pickle(obj) -> bytes:
    """data.pkl bytes for ``obj`` (RecTensor values become torch tensor rebuild calls)."""
    buf = io.BytesIO()
    _TorchPickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def write_zip(path: Path | str, members: list[tuple[str, bytes]], compress: frozenset[str] = frozenset()) -> None:
    """A zip with exactly these members in this order (duplicates allowed), stored unless named in ``compress``."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about duplicate names: that is the point
        with zipfile.ZipFile(path, "w") as zf:
            for name, data in members:
                zf.writestr(
                    zipfile.ZipInfo(name),
                    data,
                    compress_type=zipfile.ZIP_DEFLATED if name in compress else zipfile.ZIP_STORED,
                )


def torch_zip(
    path: Path | str,
    data_pkl: bytes,
    records: dict[str, bytes],
    root: str = "archive",
    extra: list[tuple[str, bytes]] | None = None,
) -> Path:
    """A torch.save-layout archive (data.pkl first, byteorder, data/<key>..., version)."""
    members = [(f"{root}/data.pkl", data_pkl), (f"{root}/byteorder", b"little")]
    members += [(f"{root}/data/{k}", v) for k, v in records.items()]
    members += list(extra or []) + [(f"{root}/version", b"3\n")]
    write_zip(path, members)
    return Path(path)


def zip_members(path: Path | str) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()]


def replace_member(path: Path | str, name: str, data: bytes, out: Path | str | None = None) -> Path:
    """Rewrite a zip with one member's bytes replaced (CRC recomputed)."""
    members = [(n, data if n == name else d) for n, d in zip_members(path)]
    write_zip(out or path, members)
    return Path(out or path)


def legacy_file(
    path: Path | str,
    sys_info_pickle: bytes | None = None,
    obj_pickle: bytes | None = None,
    magic_pickle: bytes | None = None,
) -> Path:
    """A legacy torch.save stream of ``{"w": zeros(2)}`` with any of its pickles replaced."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    f = io.BytesIO(data)
    spans = []
    for _ in range(5):
        start = f.tell()
        pickle.load(f) if _ != 3 else _skip_pickle(f)
        spans.append((start, f.tell()))
    parts = [data[a:b] for a, b in spans]
    if magic_pickle is not None:
        parts[0] = magic_pickle
    if sys_info_pickle is not None:
        parts[2] = sys_info_pickle
    if obj_pickle is not None:
        parts[3] = obj_pickle
    Path(path).write_bytes(b"".join(parts) + data[spans[-1][1] :])
    return Path(path)


def _skip_pickle(f) -> None:
    import pickletools

    for op, _, _ in pickletools.genops(f):
        if op.name == "STOP":
            return


def tar_checkpoint(path: Path | str, pickle_bytes: bytes = b"\x80\x02}q\x00.") -> Path:
    """A pre-0.4 torch.save tar archive (sys_info, pickle, tensors, storages)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (
            ("sys_info", pickle.dumps({"little_endian": True}, protocol=2)),
            ("pickle", pickle_bytes),
            ("tensors", pickle.dumps(0, protocol=2)),
            ("storages", pickle.dumps(0, protocol=2)),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return Path(path)


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


MARKER = "EVILMARKER"
_MARKER_OPS = b"X" + struct.pack("<I", len(MARKER)) + MARKER.encode()


def splice(data: bytes, expr: bytes) -> bytes:
    """Replace the pickled string ``MARKER`` in ``data`` by the expression opcodes ``expr``."""
    assert data.count(_MARKER_OPS) == 1, "marker not found once"
    return data.replace(_MARKER_OPS, expr)


def write_raw_zip(path: Path | str, entries: list[tuple[str, bytes, int, int, int]]) -> Path:
    """A zip from ``(name, payload, method, crc, uncompressed size)`` entries: payload written as given.

    Lets a test declare any uncompressed size (a deflate bomb) without inflating anything.
    """
    out = bytearray()
    central = bytearray()
    for name, payload, method, crc, usize in entries:
        bname = name.encode()
        off = len(out)
        out += (
            struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(payload), usize, len(bname), 0)
            + bname
            + payload
        )
        central += (
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                20,
                20,
                0,
                method,
                0,
                0x21,
                crc,
                len(payload),
                usize,
                len(bname),
                0,
                0,
                0,
                0,
                0,
                off,
            )
            + bname
        )
    cd = len(out)
    out += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(central), cd, 0)
    Path(path).write_bytes(bytes(out))
    return Path(path)


def deflated_zeros(size: int) -> tuple[bytes, int]:
    """(raw deflate stream, CRC-32) of ``size`` zero bytes, built in 1 MiB steps."""
    import zlib

    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    zero = b"\0" * (1 << 20)
    parts, crc = [], 0
    for _ in range(size >> 20):
        parts.append(comp.compress(zero))
        crc = zlib.crc32(zero, crc)
    parts.append(comp.flush())
    return b"".join(parts), crc
