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
for real because they run no user code.

:func:`dumps` writes such an object graph back as a pickle that torch loads,
emitting placeholders as the globals they stood for.  That is what lets
``strip-prefix`` rename keys in ``data.pkl`` without importing torch.

:func:`scan_globals` lists the globals a pickle references by walking its
opcodes only (no object is built), and :func:`classify_global` says whether
each is safe (what ``torch.load(weights_only=True)`` allows), dangerous or
unknown.
"""

from __future__ import annotations

import codecs
import collections
import copyreg
import io
import pickle
import pickletools
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterable, Iterator

# --------------------------------------------------------------------------- dtypes

#: legacy storage class name -> dtype name
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "QInt8Storage": "qint8",
    "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8",
    "TypedStorage": "uint8",
}

#: dtype name -> bytes per element
ELEMENT_SIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1, "complex128": 16, "complex64": 8, "complex32": 4,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}

#: names of ``torch.<name>`` globals that are dtypes (as pickled: ``GLOBAL torch float32``)
DTYPE_GLOBALS: dict[str, str] = {name: name for name in ELEMENT_SIZE}
DTYPE_GLOBALS.update({
    "float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
    "short": "int16", "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32",
})
for _b in range(1, 8):
    DTYPE_GLOBALS[f"uint{_b}"] = f"uint{_b}"
    DTYPE_GLOBALS[f"int{_b}"] = f"int{_b}"

TENSOR_REBUILDERS = frozenset({
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor",
    "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass",
    "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
})


# --------------------------------------------------------------------------- records

@dataclass(eq=False)
class StorageRecord:
    """One storage as a persistent id names it; where its bytes live is filled in by the container."""

    key: str
    dtype: str
    location: str
    numel: int | None = None
    storage_type: type | None = None  # the Stub class the pickle named, e.g. torch.FloatStorage
    view_metadata: Any = None  # legacy format only
    # filled in by the container reader:
    file_offset: int | None = None  # absolute byte offset of the data in `source`
    nbytes: int | None = None
    source: str | None = None  # the file that holds the bytes

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZE.get(self.dtype, 1)

    def pid(self) -> tuple:
        pid: tuple = ("storage", self.storage_type, self.key, self.location, self.numel)
        if self.view_metadata is not None or self._legacy:
            pid = pid + (self.view_metadata,)
        return pid

    _legacy: bool = False


@dataclass(eq=False)
class TensorRecord:
    """What a torch rebuild call would build, without building it.

    ``offset`` and ``stride`` are in elements of ``dtype``, as in torch.
    ``kind`` is ``"dense"`` for ordinary tensors and parameters, else
    ``"quantized"``, ``"sparse"``, ``"nested"``, ``"meta"``, ``"subclass"``,
    ``"numpy"``.
    """

    storage: StorageRecord | None
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    kind: str = "dense"
    parameter: bool = False
    # how to write it back: the rebuild global and its arguments
    reduce_func: type | None = None
    reduce_args: tuple = ()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZE.get(self.dtype, 1)

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    @property
    def location(self) -> str | None:
        return self.storage.location if self.storage else None

    def is_contiguous(self) -> bool:
        expected = 1
        for size, st in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and st != expected:
                return False
            expected *= size
        return True

    def covers_storage(self) -> bool:
        """True when this tensor is exactly its whole storage, contiguous, from offset 0."""
        if self.storage is None or self.storage.nbytes is None:
            return False
        return self.offset == 0 and self.is_contiguous() and self.nbytes == self.storage.nbytes

    def span(self) -> tuple[int, int]:
        """(first, last+1) element index in the storage that this view touches."""
        if self.numel == 0:
            return (self.offset, self.offset)
        last = self.offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride))
        return (self.offset, last + 1)

    def __repr__(self) -> str:  # compact, used in reports
        loc = self.location or "-"
        return f"TensorRecord({self.dtype}, shape={list(self.shape)}, storage={self.storage.key if self.storage else None}@{loc})"


def is_tensor_like(v: Any) -> bool:
    """A TensorRecord or a real torch.Tensor (checked without importing torch)."""
    if isinstance(v, TensorRecord):
        return True
    t = type(v)
    return t.__module__.startswith("torch") and hasattr(v, "shape") and hasattr(v, "dtype") and hasattr(v, "stride")


# --------------------------------------------------------------------------- stubs

class Stub:
    """Base of the inert placeholders that stand for globals we do not run.

    Every placeholder *class* has ``_ckpt_module`` / ``_ckpt_name``.  Calling it
    (pickle ``REDUCE``) or ``__new__``-ing it (pickle ``NEWOBJ``) only records
    the arguments; ``BUILD`` records the state; list and dict items are kept.
    """

    _ckpt_module = ""
    _ckpt_name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> "Stub":
        self = object.__new__(cls)
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "_kwargs", kwargs)
        object.__setattr__(self, "_state", None)
        object.__setattr__(self, "_listitems", [])
        object.__setattr__(self, "_dictitems", {})
        object.__setattr__(self, "_via_newobj", True)
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Only reached through a plain call (REDUCE), never through NEWOBJ.
        object.__setattr__(self, "_via_newobj", False)

    def __setstate__(self, state: Any) -> None:
        object.__setattr__(self, "_state", state)

    def __setattr__(self, name: str, value: Any) -> None:  # BUILD with slot state
        st = self._state if isinstance(self._state, dict) else {}
        st[name] = value
        object.__setattr__(self, "_state", st)

    def append(self, item: Any) -> None:
        self._listitems.append(item)

    def extend(self, items: Iterable[Any]) -> None:
        self._listitems.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._dictitems[key] = value

    # read access, so that wrapper dicts built from stubbed dict subclasses can be searched
    def __getitem__(self, key: Any) -> Any:
        return self._dictitems[key]

    def keys(self):  # noqa: D401 - mapping protocol
        return self._dictitems.keys()

    def items(self):
        return self._dictitems.items()

    def values(self):
        return self._dictitems.values()

    def __len__(self) -> int:
        return len(self._dictitems) or len(self._listitems)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._dictitems or self._listitems)

    def __contains__(self, key: Any) -> bool:
        return key in self._dictitems

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        bits = [repr(a) for a in self._args[:4]]
        if self._state is not None:
            bits.append(f"state={_short(self._state)}")
        return f"<stub {global_name(type(self))}({', '.join(bits)})>"

    def to_dict(self) -> dict:
        """A JSON-friendly view: the global's name, its arguments and its state."""
        return {"__global__": global_name(type(self)), "args": list(self._args),
                "state": self._state, "items": dict(self._dictitems) or list(self._listitems) or None}


def _short(x: Any, n: int = 60) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


def global_name(cls: type) -> str:
    return f"{cls._ckpt_module}.{cls._ckpt_name}" if issubclass(cls, Stub) else f"{cls.__module__}.{cls.__qualname__}"


_STUB_CACHE: dict[tuple[str, str], type] = {}


def stub_class(module: str, name: str) -> type:
    """The (cached) placeholder class for ``module.name``."""
    key = (module, name)
    cls = _STUB_CACHE.get(key)
    if cls is None:
        safe = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name) or "Global"
        cls = type(safe, (Stub,), {"_ckpt_module": module, "_ckpt_name": name, "__module__": "ckptfix.pickles.stubs"})
        _STUB_CACHE[key] = cls
    return cls


def stub_dtype(cls: Any) -> str | None:
    """dtype name if ``cls`` is the placeholder of a ``torch.<dtype>`` global."""
    if isinstance(cls, type) and issubclass(cls, Stub) and cls._ckpt_module == "torch":
        return DTYPE_GLOBALS.get(cls._ckpt_name)
    return None


class _TensorRebuilder(Stub):
    """Placeholder of a torch rebuild function: calling it yields a TensorRecord."""

    def __new__(cls, *args: Any) -> Any:  # type: ignore[override]
        rec = _rebuild(cls._ckpt_name, args)
        rec.reduce_func = cls
        rec.reduce_args = args
        return rec


_REBUILDER_CACHE: dict[str, type] = {}


def rebuilder_class(module: str, name: str) -> type:
    key = f"{module}.{name}"
    cls = _REBUILDER_CACHE.get(key)
    if cls is None:
        cls = type(name, (_TensorRebuilder,), {"_ckpt_module": module, "_ckpt_name": name,
                                               "__module__": "ckptfix.pickles.stubs"})
        _REBUILDER_CACHE[key] = cls
    return cls


def _as_shape(x: Any) -> tuple[int, ...]:
    if isinstance(x, Stub):  # torch.Size(...) placeholder
        x = x._args[0] if x._args else ()
    return tuple(int(v) for v in x)


def _rebuild(name: str, args: tuple) -> TensorRecord:
    if name in ("_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_tensor_v3"):
        storage, offset, size, stride = args[0], args[1], args[2], args[3]
        requires_grad = bool(args[4]) if len(args) > 4 else False
        dtype = storage.dtype if isinstance(storage, StorageRecord) else "uint8"
        if name == "_rebuild_tensor_v3" and len(args) > 6:
            dtype = stub_dtype(args[6]) or dtype
        if not isinstance(storage, StorageRecord):
            raise pickle.UnpicklingError(f"{name} called without a storage")
        return TensorRecord(storage, int(offset), _as_shape(size), _as_shape(stride), dtype, requires_grad)
    if name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        inner = args[0]
        if isinstance(inner, TensorRecord):
            return TensorRecord(inner.storage, inner.offset, inner.shape, inner.stride, inner.dtype,
                                bool(args[1]) if len(args) > 1 else True, inner.kind, True)
        return TensorRecord(None, 0, (), (), "unknown", kind="subclass", parameter=True)
    if name == "_rebuild_meta_tensor_no_storage":
        return TensorRecord(None, 0, _as_shape(args[1]), _as_shape(args[2]), stub_dtype(args[0]) or "unknown",
                            kind="meta")
    if name == "_rebuild_qtensor":
        storage = args[0]
        return TensorRecord(storage if isinstance(storage, StorageRecord) else None, int(args[1]),
                            _as_shape(args[2]), _as_shape(args[3]),
                            storage.dtype if isinstance(storage, StorageRecord) else "unknown", kind="quantized")
    kind = {"_rebuild_sparse_tensor": "sparse", "_rebuild_nested_tensor": "nested",
            "_rebuild_wrapper_subclass": "subclass", "_rebuild_device_tensor_from_numpy": "numpy",
            "_rebuild_device_tensor_from_cpu_tensor": "subclass"}.get(name, "subclass")
    return TensorRecord(None, 0, (), (), "unknown", kind=kind)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: tuple, state: Any) -> Any:
    return func(*args)


class _RebuildFromType(Stub):
    def __new__(cls, *args: Any) -> Any:  # type: ignore[override]
        inner = args[0](*args[2]) if args and callable(args[0]) else None
        if isinstance(inner, TensorRecord):
            new_type = args[1]
            if isinstance(new_type, type) and issubclass(new_type, Stub) and new_type._ckpt_name == "Parameter":
                inner.parameter = True
            elif not (isinstance(new_type, type) and issubclass(new_type, Stub) and new_type._ckpt_name == "Tensor"):
                inner.kind = "subclass" if inner.kind == "dense" else inner.kind
            outer = TensorRecord(inner.storage, inner.offset, inner.shape, inner.stride, inner.dtype,
                                 inner.requires_grad, inner.kind, inner.parameter, cls, args)
            return outer
        return Stub.__new__(cls, *args)


# plain-data constructors that run no user code: rebuilt for real
def _codecs_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    if isinstance(obj, str):
        return codecs.encode(obj, encoding, errors)
    raise pickle.UnpicklingError("_codecs.encode on a non-string")


_REAL: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "range"): range,
    ("_codecs", "encode"): _codecs_encode,
    ("__builtin__", "set"): set,
    ("__builtin__", "frozenset"): frozenset,
    ("copy_reg", "_reconstructor"): None,  # stubbed like everything else
}


# --------------------------------------------------------------------------- classification

_DANGEROUS_MODULES = {
    "os", "posix", "nt", "subprocess", "sys", "runpy", "importlib", "pickle", "_pickle", "cPickle",
    "marshal", "shutil", "socket", "ctypes", "pty", "code", "codeop", "commands", "webbrowser",
    "multiprocessing", "asyncio", "platform", "signal", "tempfile", "io", "_io",
    "urllib", "http", "requests", "ftplib", "smtplib", "telnetlib", "types", "inspect", "pdb",
    "timeit", "cProfile", "profile", "trace", "dill", "cloudpickle", "joblib", "bdb", "_posixsubprocess",
    "torch.hub", "torch._C", "torch.jit", "torch.package", "torch._dynamo", "torch.utils.cpp_extension",
    "numpy.testing", "numpy.f2py", "numpy.distutils", "_ctypes", "operator", "functools", "builtins.getattr",
}
_PATHS = {"pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath", "pathlib.PureWindowsPath",
          "pathlib.Path"}
_DANGEROUS_BUILTINS = {
    "eval", "exec", "compile", "open", "getattr", "setattr", "delattr", "__import__", "globals", "locals",
    "vars", "input", "breakpoint", "apply", "execfile", "file", "reload", "memoryview", "help", "exit", "quit",
    "object", "type", "super", "classmethod", "staticmethod", "property", "callable", "map", "filter",
}
_SAFE_EXTRA = {
    "collections.OrderedDict", "collections.Counter", "torch.nn.parameter.Parameter", "torch.serialization._get_layout",
    "torch.Size", "torch.Tensor", "torch.device", "_codecs.encode", "builtins.bytearray", "builtins.set",
    "builtins.complex", "torch._tensor._rebuild_from_type_v2", "torch.per_tensor_affine",
    "torch.per_tensor_symmetric", "torch.per_channel_affine", "torch.per_channel_symmetric",
    "torch.per_channel_affine_float_qparams",
    # what torch.save writes for dtypes without a legacy typed storage class (uint16, float8 ...)
    "torch.storage.UntypedStorage", "torch.storage.TypedStorage",
}


def classify_global(name: str, context: str | None = None) -> str:
    """``"safe"`` (torch's weights-only loader allows it), ``"dangerous"`` or ``"unknown"``.

    ``context`` widens "safe" for pickles that are not ``torch.load`` files: ``"dcp"`` (a DCP
    ``.metadata`` file: torch.distributed.checkpoint's dataclasses and paths) and ``"torchscript"``
    (``__torch__.*`` classes are TorchScript types, resolved by the TorchScript runtime, not Python).
    """
    if name in _SAFE_EXTRA:
        return "safe"
    if context == "dcp":
        from ckptfix.dcp.allowlist import DCP_METADATA_GLOBALS  # exact names: no module prefix is trusted

        if name in DCP_METADATA_GLOBALS:
            return "safe"
    if context == "torchscript" and name.startswith("__torch__."):
        return "safe"
    module, _, attr = name.rpartition(".")
    if module == "torch._utils" and attr in TENSOR_REBUILDERS:
        return "safe"
    if module == "torch" and (attr in DTYPE_GLOBALS or attr.endswith("Storage") or attr.endswith("Tensor")):
        return "safe"
    if module in ("torch.cuda",) and (attr.endswith("Storage") or attr.endswith("Tensor")):
        return "safe"
    if module in ("torch.sparse", "torch.cuda.sparse") and attr.endswith("Tensor"):
        return "safe"
    if module in ("builtins", "__builtin__"):
        return "dangerous" if attr in _DANGEROUS_BUILTINS else "unknown"
    root = module.split(".")[0]
    if module in _DANGEROUS_MODULES or root in _DANGEROUS_MODULES:
        return "dangerous"
    if module.startswith("numpy") and attr in ("load", "loads", "fromfile", "memmap", "save"):
        return "dangerous"
    return "unknown"


# --------------------------------------------------------------------------- unpickler

class RecordingUnpickler(pickle.Unpickler):
    """Unpickle into records and placeholders; calls nothing from the pickle.

    ``storages`` maps storage key -> :class:`StorageRecord` (one object per key,
    so shared storages stay shared).  ``globals_seen`` counts each global the
    pickle asked for; ``stubbed`` holds the ones turned into placeholders.
    """

    def __init__(self, file: BinaryIO, *, legacy: bool = False, storages: dict[str, StorageRecord] | None = None):
        super().__init__(file, encoding="utf-8")
        self.storages: dict[str, StorageRecord] = {} if storages is None else storages
        self.globals_seen: collections.Counter[str] = collections.Counter()
        self.stubbed: set[str] = set()
        self.legacy = legacy

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401 - pickle hook
        if module == "__builtin__":
            module = "builtins"
        full = f"{module}.{name}"
        self.globals_seen[full] += 1
        real = _REAL.get((module, name))
        if real is not None:
            return real
        if module == "torch._utils" and name in TENSOR_REBUILDERS:
            return rebuilder_class(module, name)
        if full == "torch._tensor._rebuild_from_type_v2":
            return _rebuild_from_type_class()
        if classify_global(full) != "safe":
            self.stubbed.add(full)
        return stub_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            storage_type, key, location, numel = pid[1], str(pid[2]), str(pid[3]), pid[4]
            rec = self.storages.get(key)
            if rec is None:
                type_name = getattr(storage_type, "_ckpt_name", "") or ""
                dtype = STORAGE_DTYPES.get(type_name) or stub_dtype(storage_type) or "uint8"
                rec = StorageRecord(key=key, dtype=dtype, location=location, numel=numel,
                                    storage_type=storage_type,
                                    view_metadata=pid[5] if len(pid) > 5 else None)
                rec._legacy = len(pid) > 5
                self.storages[key] = rec
            if len(pid) > 5 and pid[5] is not None:  # legacy storage view: (view_key, offset, view_size)
                view_key, off, size = pid[5]
                return _LegacyView(rec, str(view_key), int(off), int(size))
            return rec
        raise pickle.UnpicklingError(f"unsupported persistent id {str(pid)[:80]}")


@dataclass(eq=False)
class _LegacyView:
    base: StorageRecord
    view_key: str
    offset: int
    size: int


_RFT_CLASS: list[type] = []


def _rebuild_from_type_class() -> type:
    if not _RFT_CLASS:
        _RFT_CLASS.append(type("_rebuild_from_type_v2", (_RebuildFromType,),
                               {"_ckpt_module": "torch._tensor", "_ckpt_name": "_rebuild_from_type_v2",
                                "__module__": "ckptfix.pickles.stubs"}))
    return _RFT_CLASS[0]


def loads_records(data: bytes | BinaryIO, **kw: Any) -> tuple[Any, RecordingUnpickler]:
    """Unpickle ``data`` into records/placeholders. Returns (object, unpickler)."""
    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    up = RecordingUnpickler(f, **kw)
    return up.load(), up


# --------------------------------------------------------------------------- writer

class RecordPickler(pickle._Pickler):  # type: ignore[name-defined]
    """Write an object graph of records and placeholders back as a torch-loadable pickle."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRecord):
            return obj.pid()
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, TensorRecord):
            if obj.reduce_func is None:
                raise pickle.PicklingError(f"cannot write {obj!r}: it has no rebuild call")
            return (obj.reduce_func, tuple(obj.reduce_args))
        if isinstance(obj, Stub):
            cls = type(obj)
            listitems = iter(obj._listitems) if obj._listitems else None
            dictitems = iter(obj._dictitems.items()) if obj._dictitems else None
            if obj._via_newobj:
                return (copyreg.__newobj__, (cls,) + tuple(obj._args), obj._state, listitems, dictitems)
            return (cls, tuple(obj._args), obj._state, listitems, dictitems)
        return NotImplemented

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and issubclass(obj, Stub):
            mod, nm = obj._ckpt_module, obj._ckpt_name
            self.write(pickle.GLOBAL + mod.encode("utf-8") + b"\n" + nm.encode("utf-8") + b"\n")
            self.memoize(obj)
            return
        if obj is _codecs_encode:
            self.write(pickle.GLOBAL + b"_codecs\nencode\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


def dumps(obj: Any, protocol: int = 2) -> bytes:
    """Pickle an object graph that may contain records and placeholders."""
    buf = io.BytesIO()
    try:
        RecordPickler(buf, protocol=protocol).dump(obj)
    except RecursionError:
        from ckptfix.errors import UnsupportedError

        raise UnsupportedError("the checkpoint object is nested too deeply to be written back (thousands of "
                               "levels of lists/dicts); load it with load_anywhere, flatten the nesting and "
                               "torch.save it again") from None
    return buf.getvalue()


# --------------------------------------------------------------------------- scanning

_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
               "STRING", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"}


@dataclass
class ScanResult:
    """Every global a pickle references, found by reading opcodes only."""

    globals: collections.Counter = field(default_factory=collections.Counter)
    error: str | None = None  # set when the opcode stream is malformed (the scan covers what came before)
    end: int = 0  # offset just past the STOP opcode

    def merge(self, other: "ScanResult") -> None:
        self.globals.update(other.globals)
        if other.error and not self.error:
            self.error = other.error


def scan_globals(data: bytes | BinaryIO) -> ScanResult:
    """List the globals one pickle references (GLOBAL, STACK_GLOBAL, INST, OBJ-by-name), never building anything.

    Never raises on arbitrary bytes: a malformed stream is reported in ``error``.
    """
    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    res = ScanResult()
    strings: list[str] = []
    memo: dict[int, Any] = {}
    memo_count = 0
    prev_str: str | None = None
    try:
        for op, arg, pos in pickletools.genops(f):
            name = op.name
            last, prev_str = prev_str, None
            if name in _STRING_OPS:
                prev_str = arg.decode("latin-1") if isinstance(arg, bytes) else str(arg)
                strings.append(arg.decode("latin-1") if isinstance(arg, bytes) else str(arg))
            elif name in ("GLOBAL", "INST"):
                mod, _, nm = str(arg).partition(" ")
                res.globals[f"{'builtins' if mod == '__builtin__' else mod}.{nm}"] += 1
            elif name == "STACK_GLOBAL":
                if len(strings) >= 2:
                    res.globals[f"{strings[-2]}.{strings[-1]}"] += 1
                else:
                    res.globals["<unresolved STACK_GLOBAL>"] += 1
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = last
                prev_str = last
            elif name == "MEMOIZE":
                memo[memo_count] = last
                memo_count += 1
                prev_str = last
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                v = memo.get(int(arg))
                if isinstance(v, str):
                    strings.append(v)
                    prev_str = v
            elif name in ("EXT1", "EXT2", "EXT4"):
                res.globals[f"<extension {arg}>"] += 1
            if name == "STOP":
                res.end = f.tell() if hasattr(f, "tell") else 0
                break
            if len(strings) > 64:
                del strings[:-8]
    except Exception as e:  # malformed stream: report, never crash
        res.error = f"{type(e).__name__}: {e}"
    return res
