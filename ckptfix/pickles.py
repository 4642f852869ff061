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
is :mod:`ckptfix.policy`'s table.

:func:`dumps` writes such an object graph back as a pickle that torch loads,
emitting placeholders as the globals they stood for.  That is what lets
``strip-prefix`` rename keys in ``data.pkl`` without importing torch.

:func:`~ckptfix.scanner.scan_globals` (in :mod:`ckptfix.scanner`) lists the
globals a pickle references by walking its opcodes only (no object is built),
and :func:`~ckptfix.policy.classify_global` says whether each is safe (what
``torch.load(weights_only=True)`` allows), dangerous or unknown.
"""

from __future__ import annotations

import collections
import contextlib
import copyreg
import gc
import io
import itertools
import os
import pickle
import sys
import threading
import types
from dataclasses import dataclass
from typing import (
    Any,
    BinaryIO,
    Callable,
    ClassVar,
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    Mapping,
    Sequence,
    TypeVar,
    ValuesView,
)

from ckptfix.policy import (  # noqa: F401 - classify_global, DTYPE_GLOBALS: also imported from here
    DTYPE_GLOBALS,
    REBUILD_FROM_TYPE,
    SAFE_CODECS,
    TENSOR_REBUILDERS,
    classify_global,
    classify_pair,
    codecs_encode,
    known_global,
)
from ckptfix.scanner import (  # noqa: F401 - re-exported: the opcode scan lives in its own module
    LEGACY_MAGIC_NUMBER,
    PickleLimits,
    ScanResult,
    resolve_global,
    scan_globals,
    scan_pickle_sequence,
)

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
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "float4_e2m1fn_x2": 1,
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
}


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
    crc: int | None = None  # CRC-32 of exactly these bytes, when the container stores one (a zip member's)

    @property
    def element_size(self) -> int:
        """Bytes per element of ``dtype`` (1 for a dtype ckptfix does not know)."""
        return ELEMENT_SIZE.get(self.dtype, 1)

    def pid(self) -> tuple[Any, ...]:
        """The persistent id torch.save writes for this storage.

        Returns:
            ``("storage", storage class, key, location, numel)``, plus the view metadata in legacy files.
        """
        pid: tuple[Any, ...] = ("storage", self.storage_type, self.key, self.location, self.numel)
        if self.view_metadata is not None or self._legacy:
            pid = pid + (self.view_metadata,)
        return pid

    _legacy: bool = False


def is_c_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` is that of a C-contiguous tensor of ``shape`` (as ``Tensor.is_contiguous``).

    Args:
        shape: the sizes.
        stride: the strides, in elements.

    Returns:
        True when contiguous (size-1 dimensions may have any stride).

    >>> is_c_contiguous((2, 3), (3, 1)), is_c_contiguous((2, 3), (1, 2)), is_c_contiguous((1, 4), (99, 1))
    (True, False, True)
    """
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride), strict=False):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


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
        """Number of elements (the product of ``shape``)."""
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def element_size(self) -> int:
        """Bytes per element of ``dtype`` (1 for a dtype ckptfix does not know)."""
        return ELEMENT_SIZE.get(self.dtype, 1)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements (``numel * element_size``), not of its storage."""
        return self.numel * self.element_size

    @property
    def location(self) -> str | None:
        """The storage's device tag as saved (``"cpu"``, ``"cuda:0"``); None without a storage."""
        return self.storage.location if self.storage else None

    def is_contiguous(self) -> bool:
        """Whether the strides are those of a C-contiguous tensor of this shape (as ``Tensor.is_contiguous``).

        Returns:
            True when contiguous (size-1 dimensions may have any stride).
        """
        return is_c_contiguous(self.shape, self.stride)

    def covers_storage(self) -> bool:
        """Whether this tensor is exactly its whole storage, contiguous, from offset 0.

        Returns:
            True when so; False too when the storage's size is not known.
        """
        if self.storage is None or self.storage.nbytes is None:
            return False
        return self.offset == 0 and self.is_contiguous() and self.nbytes == self.storage.nbytes

    def span(self) -> tuple[int, int]:
        """The range of storage elements this view touches.

        Returns:
            ``(first, last + 1)`` element indices in the storage (``(offset, offset)`` when empty).
        """
        if self.numel == 0:
            return (self.offset, self.offset)
        last = self.offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=False))
        return (self.offset, last + 1)

    def __repr__(self) -> str:  # compact, used in reports
        loc = self.location or "-"
        key = self.storage.key if self.storage else None
        return f"TensorRecord({self.dtype}, shape={list(self.shape)}, storage={key}@{loc})"


def is_tensor_like(v: Any) -> bool:
    """Whether ``v`` is a :class:`TensorRecord` or a real ``torch.Tensor`` (checked without importing torch).

    Args:
        v: anything.

    Returns:
        True for a tensor record or a tensor.
    """
    if isinstance(v, TensorRecord):
        return True
    t = type(v)
    return t.__module__.startswith("torch") and hasattr(v, "shape") and hasattr(v, "dtype") and hasattr(v, "stride")


# --------------------------------------------------------------------------- stubs


_object_new = object.__new__

_GC_LOCK = threading.Lock()
_gc_pauses = 0  # paused_gc contexts open, in all threads
_gc_was_enabled = False  # the collector's state when the first of them opened


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while a large acyclic graph is built (restored on exit).

    Unpickling allocates an object per opcode; each allocation counts towards a collection, and
    each collection walks every object built so far, so a big pickle spends more time collecting
    than loading.  The graphs built here hold no cycles the collector could free.

    Pauses may overlap (threads): the first one in reads the collector's state, the last one out
    restores it.

    Yields:
        None.
    """
    global _gc_pauses, _gc_was_enabled
    with _GC_LOCK:
        if not _gc_pauses:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _gc_pauses -= 1
            if not _gc_pauses and _gc_was_enabled:
                gc.enable()


class Stub:
    """Base of the inert placeholders that stand for globals the reader does not run.

    Each placeholder *class* stands for one global (:func:`global_pair` / :func:`global_name`
    read which).  Calling it (pickle ``REDUCE``) or ``__new__``-ing it (pickle ``NEWOBJ``) only
    records the arguments; ``BUILD`` records the state; ``APPEND(S)`` / ``SETITEM(S)`` items are
    kept.  An instance exposes what the pickle recorded: :attr:`module`, :attr:`name`,
    :attr:`full_name`, :attr:`args`, :attr:`kwargs`, :attr:`state`, :attr:`listitems`,
    :attr:`dictitems`, :attr:`via_newobj`; :meth:`with_state` copies it with another state.
    """

    # the global this placeholder class stands for (set on each generated subclass)
    _ckpt_module: ClassVar[str] = ""
    _ckpt_name: ClassVar[str] = ""
    # what the pickle recorded, in the instance __dict__ (__setattr__ records BUILD state instead);
    # the class defaults stand until the pickle sets them: most placeholders have no state, no items
    _args: tuple[Any, ...]
    _kwargs: dict[str, Any]
    _state: Any = None
    _listitems: Sequence[Any] = ()
    _dictitems: Mapping[Any, Any] = types.MappingProxyType({})
    _via_newobj: bool = True

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        self = _object_new(cls)
        d = self.__dict__
        d["_args"] = args
        d["_kwargs"] = kwargs
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Only reached through a plain call (REDUCE), never through NEWOBJ.
        self.__dict__["_via_newobj"] = False

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state

    def __setattr__(self, name: str, value: Any) -> None:  # BUILD with slot state
        st = self._state if isinstance(self._state, dict) else {}
        st[name] = value
        self.__dict__["_state"] = st

    def _items_list(self) -> list[Any]:
        items = self.__dict__.get("_listitems")
        if items is None:
            items = self.__dict__["_listitems"] = []
        return items

    def _items_dict(self) -> dict[Any, Any]:
        items = self.__dict__.get("_dictitems")
        if items is None:
            items = self.__dict__["_dictitems"] = {}
        return items

    # ---------------------------------------------------------------- what the pickle recorded

    @property
    def module(self) -> str:
        """The module of the global this placeholder stands for (``"argparse"``)."""
        return type(self)._ckpt_module

    @property
    def name(self) -> str:
        """The attribute name of the global (``"Namespace"``; dotted for a protocol-4 attribute path)."""
        return type(self)._ckpt_name

    @property
    def full_name(self) -> str:
        """``module.name`` as the pickle spelled it (``"argparse.Namespace"``)."""
        return global_name(type(self))

    @property
    def args(self) -> tuple[Any, ...]:
        """The positional arguments of the ``REDUCE`` / ``NEWOBJ`` call."""
        return self._args

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of a ``NEWOBJ_EX`` call (usually empty)."""
        return self._kwargs

    @property
    def state(self) -> Any:
        """What ``BUILD`` passed (``__setstate__``'s argument, a ``__dict__``, ...); None without ``BUILD``."""
        return self._state

    @property
    def listitems(self) -> Sequence[Any]:
        """Items ``APPEND`` / ``APPENDS`` added (a stubbed list subclass's elements)."""
        return self._listitems

    @property
    def dictitems(self) -> Mapping[Any, Any]:
        """Items ``SETITEM`` / ``SETITEMS`` added (a stubbed dict subclass's entries)."""
        return self._dictitems

    @property
    def via_newobj(self) -> bool:
        """True when the pickle built it with ``cls.__new__(cls, *args)`` rather than ``cls(*args)``."""
        return self._via_newobj

    def with_state(self, state: Any) -> Stub:
        """A copy of this placeholder (same global, arguments and items) with another state.

        Args:
            state: the new ``BUILD`` state.

        Returns:
            The new placeholder; this one is unchanged.
        """
        new: Stub = Stub.__new__(type(self), *self._args, **self._kwargs)
        d = new.__dict__
        d["_via_newobj"] = self._via_newobj
        d["_state"] = state
        if self._listitems:
            d["_listitems"] = list(self._listitems)
        if self._dictitems:
            d["_dictitems"] = dict(self._dictitems)
        return new

    # ---------------------------------------------------------------- container protocol

    def append(self, item: Any) -> None:
        """Record an ``APPEND`` item.

        Args:
            item: the item.
        """
        self._items_list().append(item)

    def extend(self, items: Iterable[Any]) -> None:
        """Record ``APPENDS`` items.

        Args:
            items: the items.
        """
        self._items_list().extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._items_dict()[key] = value

    # read access, so that wrapper dicts built from stubbed dict subclasses can be searched
    def __getitem__(self, key: Any) -> Any:
        return self._dictitems[key]

    def keys(self) -> KeysView[Any]:
        """The keys ``SETITEM(S)`` recorded.

        Returns:
            A view of :attr:`dictitems`' keys.
        """
        return self._dictitems.keys()

    def items(self) -> ItemsView[Any, Any]:
        """The entries ``SETITEM(S)`` recorded.

        Returns:
            A view of :attr:`dictitems`' items.
        """
        return self._dictitems.items()

    def values(self) -> ValuesView[Any]:
        """The values ``SETITEM(S)`` recorded.

        Returns:
            A view of :attr:`dictitems`' values.
        """
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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view: the global's name, its arguments and its state.

        Returns:
            ``{"__global__": "module.name", "args": [...], "state": ..., "items": ...}``.
        """
        return {
            "__global__": global_name(type(self)),
            "args": list(self._args),
            "state": self._state,
            "items": dict(self._dictitems) or list(self._listitems) or None,
        }


def _short(x: Any, n: int = 60) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


def global_pair(cls: type) -> tuple[str, str]:
    """The ``(module, name)`` a class stands for: a placeholder's global, else the class's own.

    Args:
        cls: a placeholder class (``type(stub)`` or a global the pickle named) or any class.

    Returns:
        ``("argparse", "Namespace")`` for the placeholder of ``argparse.Namespace``.
    """
    if issubclass(cls, Stub):
        return cls._ckpt_module, cls._ckpt_name
    return cls.__module__, cls.__qualname__


def global_name(cls: type) -> str:
    """``module.name`` of :func:`global_pair`.

    Args:
        cls: a placeholder class or any class.

    Returns:
        ``"argparse.Namespace"`` for the placeholder of ``argparse.Namespace``.
    """
    module, name = global_pair(cls)
    return f"{module}.{name}"


_STUB_CACHE: dict[tuple[str, str], type[Stub]] = {}


def stub_class(module: str, name: str) -> type[Stub]:
    """The placeholder class for ``module.name`` (one class per global, cached).

    Args:
        module: the global's module.
        name: the global's name.

    Returns:
        A :class:`Stub` subclass; calling it records arguments, as the reader does.
    """
    key = (module, name)
    cls = _STUB_CACHE.get(key)
    if cls is None:
        safe = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name) or "Global"
        cls = type(safe, (Stub,), {"_ckpt_module": module, "_ckpt_name": name, "__module__": "ckptfix.pickles.stubs"})
        _STUB_CACHE[key] = cls
    return cls


def stub_dtype(cls: Any) -> str | None:
    """The dtype a ``torch.<dtype>`` placeholder stands for.

    Args:
        cls: anything (typically a ``GLOBAL torch float32`` placeholder class).

    Returns:
        The canonical dtype name (``"float32"`` for ``torch.float``), or None when ``cls`` is not a dtype global.
    """
    if isinstance(cls, type) and issubclass(cls, Stub) and global_pair(cls)[0] == "torch":
        return DTYPE_GLOBALS.get(global_pair(cls)[1])
    return None


class _TensorRebuilder(Stub):
    """Placeholder of a torch rebuild function: calling it yields a TensorRecord."""

    def __new__(cls, *args: Any) -> Any:
        rec = _rebuild(cls._ckpt_name, args)
        rec.reduce_func = cls
        rec.reduce_args = args
        return rec


_REBUILDER_CACHE: dict[str, type[Stub]] = {}


def rebuilder_class(module: str, name: str) -> type[Stub]:
    """The placeholder class of a torch rebuild function (``torch._utils._rebuild_tensor_v2``): calls build records.

    Args:
        module: ``"torch._utils"``.
        name: one of :data:`~ckptfix.policy.TENSOR_REBUILDERS`.

    Returns:
        A :class:`Stub` subclass whose call returns a :class:`TensorRecord` (which writes back as that call).
    """
    key = f"{module}.{name}"
    cls = _REBUILDER_CACHE.get(key)
    if cls is None:
        cls = type(
            name,
            (_TensorRebuilder,),
            {"_ckpt_module": module, "_ckpt_name": name, "__module__": "ckptfix.pickles.stubs"},
        )
        _REBUILDER_CACHE[key] = cls
    return cls


def _as_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise pickle.UnpicklingError(f"a tensor {what} is {type(v).__name__}, not an integer")
    return v


def _as_shape(x: Any) -> tuple[int, ...]:
    if isinstance(x, Stub):  # torch.Size(...) placeholder
        x = x._args[0] if x._args else ()
    if not isinstance(x, (tuple, list)) or len(x) > 64:
        raise pickle.UnpicklingError("a tensor shape/stride is not a short tuple of integers")
    for v in x:
        if type(v) is not int:
            _as_int(v, "dimension")
    return tuple(x)


#: the largest byte size a tensor may have (torch sizes are int64)
MAX_TENSOR_BYTES = (1 << 63) - 1


def validate_tensor_record(t: TensorRecord) -> None:
    """Check one tensor record the way torch would before building it.

    Shape and stride have the same length, no negative size, stride or offset, the
    byte size fits in int64, and (when the storage's size is known) every element
    the view touches lies inside the storage.

    Args:
        t: the record (its storage's ``numel`` or ``nbytes`` is used when set).

    Raises:
        CorruptCheckpointError: the record is impossible; the message says which field.
    """
    from ckptfix.errors import CorruptCheckpointError

    def bad(why: str) -> CorruptCheckpointError:
        key = t.storage.key if t.storage is not None else "?"
        return CorruptCheckpointError(
            f"tensor record on storage {key!r} is invalid: {why}; the checkpoint is corrupt (torch.load refuses it too)"
        )

    shape, stride = t.shape, t.stride
    if len(shape) != len(stride):
        raise bad(f"shape {list(shape)} and stride {list(stride)} differ in length")
    numel, last = 1, t.offset
    for size, step in zip(shape, stride, strict=False):
        if size < 0:
            raise bad(f"negative size in shape {list(shape)}")
        if step < 0:
            raise bad(f"negative stride {list(stride)}")
        numel *= size
        if size:
            last += (size - 1) * step
    if t.offset < 0:
        raise bad(f"negative storage offset {t.offset}")
    es = t.element_size
    if numel * es > MAX_TENSOR_BYTES:
        raise bad(f"shape {list(shape)} is {numel:,} elements, more than a tensor can hold")
    end = last + 1
    if end * es > MAX_TENSOR_BYTES:
        raise bad(f"offset and strides reach element {end:,}, beyond any storage")
    st = t.storage
    if st is None or numel == 0:
        return
    cap = st.nbytes if st.nbytes is not None else (st.numel * st.element_size if st.numel is not None else None)
    if cap is not None and end * es > cap:
        raise bad(
            f"the view (offset {t.offset}, shape {list(t.shape)}, stride {list(t.stride)}) needs "
            f"{end * es:,} bytes of a {cap:,}-byte storage"
        )


def _rebuild(name: str, args: tuple) -> TensorRecord:
    if name in ("_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_tensor_v3"):
        storage, offset, size, stride = args[0], args[1], args[2], args[3]
        requires_grad = bool(args[4]) if len(args) > 4 else False
        dtype = storage.dtype if isinstance(storage, StorageRecord) else "uint8"
        if name == "_rebuild_tensor_v3" and len(args) > 6:
            dtype = stub_dtype(args[6]) or dtype
        if not isinstance(storage, StorageRecord):
            raise pickle.UnpicklingError(f"{name} called without a storage")
        rec = TensorRecord(
            storage, _as_int(offset, "storage offset"), _as_shape(size), _as_shape(stride), dtype, requires_grad
        )
        validate_tensor_record(rec)
        return rec
    if name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        inner = args[0]
        if isinstance(inner, TensorRecord):
            return TensorRecord(
                inner.storage,
                inner.offset,
                inner.shape,
                inner.stride,
                inner.dtype,
                bool(args[1]) if len(args) > 1 else True,
                inner.kind,
                True,
            )
        return TensorRecord(None, 0, (), (), "unknown", kind="subclass", parameter=True)
    if name == "_rebuild_meta_tensor_no_storage":
        return TensorRecord(
            None, 0, _as_shape(args[1]), _as_shape(args[2]), stub_dtype(args[0]) or "unknown", kind="meta"
        )
    if name == "_rebuild_qtensor":
        storage = args[0]
        return TensorRecord(
            storage if isinstance(storage, StorageRecord) else None,
            int(args[1]),
            _as_shape(args[2]),
            _as_shape(args[3]),
            storage.dtype if isinstance(storage, StorageRecord) else "unknown",
            kind="quantized",
        )
    kind = {
        "_rebuild_sparse_tensor": "sparse",
        "_rebuild_nested_tensor": "nested",
        "_rebuild_wrapper_subclass": "subclass",
        "_rebuild_device_tensor_from_numpy": "numpy",
        "_rebuild_device_tensor_from_cpu_tensor": "subclass",
    }.get(name, "subclass")
    return TensorRecord(None, 0, (), (), "unknown", kind=kind)


class _RebuildFromType(Stub):
    """Placeholder of ``torch._tensor._rebuild_from_type_v2``: a tensor record marked parameter or subclass."""

    def __new__(cls, *args: Any) -> Any:
        inner = args[0](*args[2]) if args and callable(args[0]) else None
        if isinstance(inner, TensorRecord):
            new_type = args[1]
            if isinstance(new_type, type) and issubclass(new_type, Stub) and new_type._ckpt_name == "Parameter":
                inner.parameter = True
            elif not (isinstance(new_type, type) and issubclass(new_type, Stub) and new_type._ckpt_name == "Tensor"):
                inner.kind = "subclass" if inner.kind == "dense" else inner.kind
            outer = TensorRecord(
                inner.storage,
                inner.offset,
                inner.shape,
                inner.stride,
                inner.dtype,
                inner.requires_grad,
                inner.kind,
                inner.parameter,
                cls,
                args,
            )
            return outer
        return Stub.__new__(cls, *args)


def _range_len(r: range) -> int:
    """len(r) without OverflowError for ranges longer than sys.maxsize."""
    lo, hi, step = r.start, r.stop, r.step
    if step > 0:
        return max(0, (hi - lo + step - 1) // step)
    return max(0, (lo - hi - step - 1) // -step)


def _size_of(x: Any) -> int | None:
    if isinstance(x, range):
        return _range_len(x)
    if isinstance(x, Stub):
        return None  # iterating a placeholder yields only what the pickle itself held
    try:
        return len(x)
    except (TypeError, OverflowError):
        return None


class _BoundedCtor(Stub):
    """``set`` / ``frozenset`` / ``bytearray`` / ``range`` / ``bytes`` / ``_codecs.encode``: built for real when small.

    Over the unpickler's limit the call is kept as a placeholder recording its arguments, so a
    rewrite writes the same call back (``frozenset(range(10**12))`` stays that, costing nothing).
    """

    _real: Any = None
    _limits: PickleLimits = PickleLimits()
    _owner: Any = None  # the RecordingUnpickler, for notes

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        size = cls._materialised_size(args)
        if size is not None and size <= cls._budget() and not kwargs and cls._afford(size):
            try:
                return cls._real(*args)
            except (TypeError, ValueError, OverflowError, LookupError, pickle.UnpicklingError):
                pass
        if cls._owner is not None:
            cls._owner._note_placeholder(cls, size)
        return Stub.__new__(cls, *args, **kwargs)

    @classmethod
    def _afford(cls, size: int) -> bool:
        """Count a call's bytes against its unpickler's byte budget, shared by all its bounded calls (False: over)."""
        owner = cls._owner
        if owner is None or cls._ckpt_name == "range":  # a range is three integers, however long
            return True
        cost = size if cls._ckpt_name in ("bytearray", "bytes", "encode") else 64 * size
        if owner._built_bytes + cost > cls._limits.max_bytes:
            return False
        owner._built_bytes += cost
        return True

    @classmethod
    def _budget(cls) -> int:
        return cls._limits.max_items * (16 if cls._ckpt_name in ("bytearray", "bytes", "encode") else 1)

    @classmethod
    def _materialised_size(cls, args: tuple) -> int | None:
        name = cls._ckpt_name
        if name == "range":
            try:
                return _range_len(range(*args))
            except (TypeError, ValueError):
                return None
        if not args:
            return 0
        a = args[0]
        if isinstance(a, Stub) or isinstance(a, type):
            return None  # a placeholder stands for something not built: never iterate it as if it were
        if (
            name in ("bytearray", "bytes")
            and len(args) > 1
            and not (isinstance(args[1], str) and args[1].lower() in SAFE_CODECS)
        ):
            return None  # only plain text codecs: a codec lookup may import modules
        if name in ("bytearray", "bytes") and isinstance(a, int) and not isinstance(a, bool):
            return a if a >= 0 else None
        if name == "encode":
            return 4 * len(a) if isinstance(a, str) else None
        return _size_of(a)


# --------------------------------------------------------------------------- unpickler


_U = TypeVar("_U", bound="RecordingUnpickler")


class RecordingUnpickler(pickle.Unpickler):
    """Unpickle into records and placeholders; calls nothing from the pickle, and stays within limits.

    ``storages`` maps storage key -> :class:`StorageRecord` (one object per key,
    so shared storages stay shared).  ``globals_seen`` counts each global the
    pickle asked for (resolved as CPython resolves it for the pickle's protocol:
    ``__builtin__ long`` is ``builtins.int``); ``stubbed`` holds the ones turned
    into placeholders; ``notes`` says what was kept as a placeholder because it
    was too big to build.

    Before the C unpickler runs, :func:`~ckptfix.scanner.scan_globals` walks the
    opcodes and refuses (``ResourceLimitError``) a pickle whose memo indices,
    object count, nesting or integers would exceed :class:`PickleLimits`.  After
    it, the object graph's depth is checked, so no later recursive walk can fail.

    Args:
        file: the pickle, a binary file positioned at its start.
        legacy: the pickle is the object pickle of a legacy (pre-1.6) ``torch.save`` stream.
        storages: storage records already known (shared with the container's other pickles).
        limits: resource limits (default: :meth:`PickleLimits.from_env`).
        preflight: check the limits (opcodes before, nesting after); False only for bytes this process
            just wrote from a graph that was read with the checks.
    """

    #: check the object graph's depth after loading (a subclass whose graph is only read through a
    #: fixed schema, and written back by the C pickler, whose recursion is bounded, may skip it)
    check_nesting: ClassVar[bool] = True

    def __init__(
        self,
        file: BinaryIO,
        *,
        legacy: bool = False,
        storages: dict[str, StorageRecord] | None = None,
        limits: PickleLimits | None = None,
        preflight: bool = True,
    ):
        super().__init__(file, encoding="utf-8")
        self._file = file
        self.storages: dict[str, StorageRecord] = {} if storages is None else storages
        self.globals_seen: collections.Counter[str] = collections.Counter()
        self.stubbed: set[str] = set()
        self.notes: list[str] = []
        self.legacy = legacy
        self.limits = limits or PickleLimits.from_env()
        self._py2_names: set[tuple[str, str]] = set()
        self._bounded: dict[tuple[str, str], type[_BoundedCtor]] = {}
        self.preflight = preflight
        self._built_bytes = 0  # what bounded calls built for real (their shared byte budget: limits.max_bytes)
        self._bytes: bytes | bytearray | memoryview | None = None  # set by for_bytes

    @classmethod
    def for_bytes(cls: type[_U], data: bytes | bytearray | memoryview, **kw: Any) -> _U:
        """An unpickler of pickle bytes held in memory.

        Args:
            data: the pickle.
            **kw: the constructor's keywords.

        Returns:
            The unpickler, reading through a buffered reader: with its ``peek()`` the C unpickler
            prefetches, instead of calling ``read()`` once per opcode of an unframed pickle.
        """
        u = cls(io.BufferedReader(io.BytesIO(data)), **kw)
        u._bytes = data  # the pre-flight walks these bytes in place (no second copy of a large pickle)
        return u

    def load(self) -> Any:
        """Pre-flight the opcodes, unpickle, then check the object graph's depth.

        Returns:
            The unpickled object graph of records, placeholders and plain data.

        Raises:
            ResourceLimitError: the pickle would exceed a limit (the message names the variable that lifts it).
            pickle.UnpicklingError: the pickle is malformed (callers turn it into CorruptCheckpointError).
        """
        f = self._file
        try:
            start = f.tell()
        except (AttributeError, OSError, ValueError):
            start = None
        if start is not None and self.preflight:
            try:
                whole = self._bytes if self._bytes is not None and start == 0 else None
                r = scan_globals(f if whole is None else whole, limits=self.limits, strict_limits=True)
            finally:
                f.seek(start)
            if r.error:
                raise pickle.UnpicklingError(r.error)
            self._py2_names = {(m, n) for (m, n, p) in r.raw if p < 3}
        try:
            with paused_gc():
                obj = super().load()
        finally:
            for cls in self._bounded.values():
                cls._owner = None  # placeholders outlive the unpickler; notes were taken
        if self.preflight and self.check_nesting:
            check_depth(obj, self.limits.max_depth)
        return obj

    def _note_placeholder(self, cls: type, size: int | None) -> None:
        full = global_name(cls)
        self.stubbed.add(full)
        what = f"{size:,} elements" if size is not None else "unknown size"
        note = (
            f"{full}(...) with {what} was not built (over the limit of {self.limits.max_items:,}, or of "
            f"{self.limits.max_bytes >> 20} MiB for all such values; CKPTFIX_MAX_PICKLE_ITEMS / CKPTFIX_MAX_PICKLE_MB "
            "lift them): kept as a placeholder, written back unchanged"
        )
        if note not in self.notes and len(self.notes) < 100:
            self.notes.append(note)

    def find_class(self, module: str, name: str) -> Any:
        """Resolve a global without importing it (the pickle hook), as :data:`~ckptfix.policy.KNOWN_GLOBALS` says.

        Args:
            module: the module as written in the pickle.
            name: the attribute name as written in the pickle.

        Returns:
            A plain-data constructor (``collections.OrderedDict``), a bounded one, a tensor rebuilder's
            placeholder, or the inert placeholder class of the global.
        """
        if (module, name) in self._py2_names:
            module, name = resolve_global(module, name, 2)
        full = f"{module}.{name}"
        self.globals_seen[full] += 1
        known = known_global(module, name)
        if known is not None and known.build is not None:
            if not known.bounded:
                return known.build
            cls = self._bounded.get((module, name))
            if cls is None:
                cls = type(
                    name,
                    (_BoundedCtor,),
                    {
                        "_ckpt_module": module,
                        "_ckpt_name": name,
                        "_real": staticmethod(known.build),
                        "_limits": self.limits,
                        "_owner": self,
                        "__module__": "ckptfix.pickles.stubs",
                    },
                )
                self._bounded[(module, name)] = cls
            return cls
        if module == "torch._utils" and name in TENSOR_REBUILDERS:
            return rebuilder_class(module, name)
        if (module, name) == REBUILD_FROM_TYPE:
            return _rebuild_from_type_class()
        if classify_pair(module, name) != "safe":
            self.stubbed.add(full)
        return stub_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        """Turn a ``('storage', type, key, location, numel[, view])`` persistent id into a :class:`StorageRecord`.

        Args:
            pid: the persistent id.

        Returns:
            The storage record of ``key`` (one per key), or a legacy storage view of it.

        Raises:
            pickle.UnpicklingError: not a storage id, or an invalid size.
        """
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            storage_type, key, location, numel = pid[1], str(pid[2]), str(pid[3]), pid[4]
            if numel is not None and (not isinstance(numel, int) or isinstance(numel, bool) or numel < 0):
                raise pickle.UnpicklingError(f"storage {key!r} has an invalid size {str(numel)[:40]}")
            rec = self.storages.get(key)
            if rec is None:
                type_name = getattr(storage_type, "_ckpt_name", "") or ""
                dtype = STORAGE_DTYPES.get(type_name) or stub_dtype(storage_type) or "uint8"
                rec = StorageRecord(
                    key=key,
                    dtype=dtype,
                    location=location,
                    numel=numel,
                    storage_type=storage_type,
                    view_metadata=pid[5] if len(pid) > 5 else None,
                )
                rec._legacy = len(pid) > 5
                self.storages[key] = rec
            if len(pid) > 5 and pid[5] is not None:  # legacy storage view: (view_key, offset, view_size)
                view_key, off, size = pid[5]
                return _LegacyView(rec, str(view_key), int(off), int(size))
            return rec
        raise pickle.UnpicklingError(f"unsupported persistent id {str(pid)[:80]}")


def _children(x: Any) -> Iterable[Any]:
    t = type(x)
    if t is dict or t is collections.OrderedDict or isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield v
    elif t in (list, tuple, set, frozenset) or isinstance(x, (list, tuple, set, frozenset)):
        yield from x
    elif isinstance(x, Stub):
        yield from x._args
        yield from x._kwargs.values()
        yield x._state
        yield from x._listitems
        for k, v in x._dictitems.items():
            yield k
            yield v


_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), range, slice, TensorRecord, StorageRecord)


def check_depth(obj: Any, limit: int) -> None:
    """Refuse an object graph nested deeper than ``limit`` (iterative: never a RecursionError).

    Args:
        obj: what the unpickler returned.
        limit: the deepest nesting allowed (containers inside containers).

    Raises:
        ResourceLimitError: the graph is deeper than ``limit``.
    """
    if isinstance(obj, _LEAVES) or isinstance(obj, type):
        return
    from ckptfix.errors import ResourceLimitError

    def too_deep() -> ResourceLimitError:
        return ResourceLimitError(
            f"the checkpoint's objects are nested more than {limit} levels deep; set "
            "CKPTFIX_MAX_PICKLE_DEPTH=N to allow it for a file you trust"
        )

    height: dict[int, int] = {}
    on_path: set[int] = set()
    frames: list[list] = [[obj, iter(_children(obj)), 1]]
    on_path.add(id(obj))
    while frames:
        frame = frames[-1]
        node, it, best = frame
        for child in it:
            if isinstance(child, _LEAVES) or isinstance(child, type):
                continue
            cid = id(child)
            if cid in height:
                if height[cid] + 1 > best:
                    frame[2] = best = height[cid] + 1
                    if best + len(frames) - 1 > limit:
                        raise too_deep()
                continue
            if cid in on_path:
                continue  # a cycle (the pickle memo allows them): no deeper than what is on the path
            if len(frames) >= limit:
                raise too_deep()
            on_path.add(cid)
            frames.append([child, iter(_children(child)), 1])
            break
        else:
            frames.pop()
            on_path.discard(id(node))
            height[id(node)] = best
            if frames:
                parent = frames[-1]
                if best + 1 > parent[2]:
                    parent[2] = best + 1


@dataclass(eq=False)
class _LegacyView:
    base: StorageRecord
    view_key: str
    offset: int
    size: int


_RFT_CLASS: list[type] = []


def _rebuild_from_type_class() -> type:
    if not _RFT_CLASS:
        _RFT_CLASS.append(
            type(
                "_rebuild_from_type_v2",
                (_RebuildFromType,),
                {
                    "_ckpt_module": "torch._tensor",
                    "_ckpt_name": "_rebuild_from_type_v2",
                    "__module__": "ckptfix.pickles.stubs",
                },
            )
        )
    return _RFT_CLASS[0]


def loads_records(data: bytes | BinaryIO, **kw: Any) -> tuple[Any, RecordingUnpickler]:
    """Unpickle ``data`` into records and placeholders with a :class:`RecordingUnpickler`.

    Args:
        data: the pickle bytes, or a binary file positioned at it.
        **kw: passed to :class:`RecordingUnpickler` (``legacy``, ``storages``, ``limits``).

    Returns:
        ``(object, unpickler)``: the unpickler holds ``storages``, ``globals_seen``, ``stubbed`` and ``notes``.

    Raises:
        ResourceLimitError: the pickle would exceed a limit.
        pickle.UnpicklingError: the pickle is malformed.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        up = RecordingUnpickler.for_bytes(data, **kw)
    else:
        up = RecordingUnpickler(data, **kw)
    return up.load(), up


# --------------------------------------------------------------------------- writer

#: what the pickler writes as ``NEWOBJ`` (typeshed does not declare it)
_NEWOBJ: Callable[..., Any] = copyreg.__newobj__  # type: ignore[attr-defined]  # not in typeshed


#: where the pickler finds placeholder globals while it writes (see :class:`RecordPickler`); never imported
_WRITING = types.ModuleType("ckptfix.pickles.stubs")
sys.modules.setdefault(_WRITING.__name__, _WRITING)
_WRITING_NAMES = itertools.count()


class RecordPickler(pickle.Pickler):
    """Write an object graph of records and placeholders back as a torch-loadable pickle (CPython's C pickler).

    The C pickler writes a global only after finding it by name (it imports the module and
    compares), and a placeholder's module is never imported.  So while :meth:`dump` runs,
    each placeholder class is put under a unique random name in an in-memory module (and
    :func:`~ckptfix.policy.codecs_encode` in its own module), the pickler writes and memoizes that ``GLOBAL`` as
    usual, and :meth:`finish` replaces each such ``GLOBAL`` (once per class, a byte string
    nothing else in the stream can contain) by the global it stands for.  Protocols 2 and 3
    only: protocol 4's frames carry lengths the replacement would change.
    """

    def __init__(self, file: BinaryIO, protocol: int = 2, *, storages: bool = True) -> None:
        if protocol not in (2, 3):
            raise ValueError(f"RecordPickler writes protocol 2 or 3, not {protocol}")
        super().__init__(file, protocol=protocol)
        if storages:  # only then: the C pickler calls persistent_id for every object it writes
            self.persistent_id = self._storage_id  # type: ignore[method-assign]
        self._nonce = os.urandom(8).hex()
        #: GLOBAL bytes as written -> GLOBAL bytes as they must read
        self._globals: dict[bytes, bytes] = {}
        self._lent: list[tuple[types.ModuleType, str]] = []  # (module, name) of each object lent a name

    @staticmethod
    def _storage_id(obj: Any) -> Any:
        return obj.pid() if isinstance(obj, StorageRecord) else None

    def _placeholder_global(self, module: str, name: str, obj: Any) -> str:
        try:
            if "\n" in module or "\n" in name:
                raise ValueError("a newline")
            real = pickle.GLOBAL + f"{module}\n{name}\n".encode("utf-8")
        except (ValueError, UnicodeEncodeError):  # a STACK_GLOBAL may name any string; GLOBAL is two UTF-8 lines
            from ckptfix.errors import UnsupportedError

            raise UnsupportedError(
                f"the checkpoint names the global {module + '.' + name!r}, which a protocol-2 pickle cannot "
                "write (a newline or an invalid character in the name); it is no global torch can load: "
                "load the checkpoint with load_anywhere and save what you need again"
            ) from None
        home = sys.modules[obj.__module__]  # where the C pickler finds it: _WRITING for placeholder classes
        alias = f"g{next(_WRITING_NAMES)}_{self._nonce}"
        written = pickle.GLOBAL + f"{home.__name__}\n{alias}\n".encode()
        self._globals[written] = real
        self._lent.append((home, alias))
        setattr(home, alias, obj)
        return alias

    def reducer_override(self, obj: Any) -> Any:
        """The pickle hook: a tensor record is written as its rebuild call, a placeholder as what it recorded.

        Args:
            obj: the object about to be pickled (once: the pickler memoizes what it wrote).

        Returns:
            A reduce tuple, the name under which a placeholder class is found while writing, or
            ``NotImplemented`` for anything else (pickled as usual).

        Raises:
            pickle.PicklingError: a tensor record without a rebuild call.
            UnsupportedError: a placeholder's global name that a ``GLOBAL`` opcode cannot hold.
        """
        if isinstance(obj, Stub):
            cls = type(obj)
            listitems = iter(obj._listitems) if obj._listitems else None
            dictitems = iter(obj._dictitems.items()) if obj._dictitems else None
            if obj._via_newobj:
                return (_NEWOBJ, (cls,) + tuple(obj._args), obj._state, listitems, dictitems)
            return (cls, tuple(obj._args), obj._state, listitems, dictitems)
        if isinstance(obj, type) and issubclass(obj, Stub):
            return self._placeholder_global(obj._ckpt_module, obj._ckpt_name, obj)
        if isinstance(obj, TensorRecord):
            if obj.reduce_func is None:
                raise pickle.PicklingError(f"cannot write {obj!r}: it has no rebuild call")
            return (obj.reduce_func, tuple(obj.reduce_args))
        if obj is codecs_encode:
            return self._placeholder_global("_codecs", "encode", obj)
        return NotImplemented

    def finish(self, data: bytes) -> bytes:
        """Name the globals :meth:`reducer_override` put aside as what they stand for, and forget them.

        Args:
            data: what :meth:`dump` wrote.

        Returns:
            The pickle bytes.
        """
        for written, real in self._globals.items():
            data = data.replace(written, real, 1)
        for home, alias in self._lent:
            delattr(home, alias)
        self._globals.clear()
        self._lent.clear()
        return data


def dumps(obj: Any, protocol: int = 2, *, storages: bool = True) -> bytes:
    """Pickle an object graph that may contain records and placeholders.

    Args:
        obj: the object graph (from :func:`loads_records`, possibly edited).
        protocol: the pickle protocol, 2 (torch.save's default) or 3.
        storages: write storage records as persistent ids (torch's ``data.pkl``); False is faster.

    Returns:
        The pickle bytes; placeholders are written as the globals they stand for.

    Raises:
        UnsupportedError: the graph is nested too deeply to write, or names a global no ``GLOBAL`` can hold.
    """
    buf = io.BytesIO()
    pickler = RecordPickler(buf, protocol=protocol, storages=storages)
    data = b""
    try:
        pickler.dump(obj)
        data = buf.getvalue()
    except RecursionError:
        from ckptfix.errors import UnsupportedError

        raise UnsupportedError(
            "the checkpoint object is nested too deeply to be written back (thousands of "
            "levels of lists/dicts); load it with load_anywhere, flatten the nesting and "
            "torch.save it again"
        ) from None
    finally:
        data = pickler.finish(data)  # also when dump failed: the names put aside are forgotten
    return data


# --------------------------------------------------------------------------- write-back check

#: modules whose attributes :func:`globals_resolvable` may look up, and only when already imported
RESOLVE_CHECK_MODULES = frozenset(
    {
        "builtins",
        "collections",
        "copyreg",
        "_codecs",
        "torch",
        "torch._utils",
        "torch._tensor",
        "torch.nn.parameter",
        "torch.serialization",
        "torch.storage",
    }
)


def globals_resolvable(
    data: bytes | bytearray | memoryview,
    reference: bytes | bytearray | memoryview | Iterable[tuple[str, str]] | None = None,
) -> list[str]:
    """Check that every global a pickle names resolves, before a rewritten file replaces anything.

    Each global is resolved as CPython's unpickler resolves it at the protocol in force
    (``_compat_pickle`` below protocol 3).  A name in an already-imported module of
    :data:`RESOLVE_CHECK_MODULES` is looked up with ``getattr`` (``builtins.long`` does not
    exist: a problem); nothing is ever imported.  Any other name must be one the
    ``reference`` (the input pickle, or its resolved ``(module, name)`` pairs) also names,
    so a rewrite can never introduce a global the input did not resolve to.  Without a
    reference, names that cannot be checked are accepted when torch's weights-only
    allowlist holds them.

    Args:
        data: the pickle about to be written (e.g. the new ``data.pkl``).
        reference: the input's pickle bytes or resolved pairs, when there is an input.

    Returns:
        A list of problems, one sentence each; empty when every global resolves.
    """
    import sys

    r = scan_globals(data)
    problems: list[str] = []
    if r.error:
        problems.append(f"the written pickle is malformed ({r.error})")
    problems += [f"the written pickle holds {u} (cannot be checked)" for u in r.unresolved]
    ref: set[tuple[str, str]] | None = None
    if isinstance(reference, (bytes, bytearray, memoryview)):
        ref = set(scan_globals(reference).pairs)
    elif reference is not None:
        ref = set(reference)
    for module, name in r.pairs:
        full = f"{module}.{name}"
        mod = sys.modules.get(module) if module in RESOLVE_CHECK_MODULES else None
        if mod is not None and "." not in name:
            if not hasattr(mod, name):
                problems.append(
                    f"{full} does not exist: torch.load would fail with AttributeError "
                    f"(the unpickler resolves {module}.{name} at protocol {r.protocol})"
                )
            continue
        if ref is not None:
            if (module, name) not in ref:
                problems.append(f"{full} is named by the written pickle but not by the input, so it may not resolve")
        elif classify_pair(module, name) != "safe":
            problems.append(f"{full} cannot be checked without importing {module}")
    return problems
