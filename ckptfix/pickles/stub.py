"""Placeholders (:class:`Stub`) for the globals a pickle names, and the classes and factories that build them.

Each global a pickle names becomes an inert placeholder class that records its name, arguments and state
and calls nothing; torch's tensor rebuild calls become :class:`~ckptfix.pickles.records.TensorRecord`s;
a few bounded plain-data constructors are rebuilt for real.
"""

from __future__ import annotations

import contextlib
import gc
import pickle
import threading
import types
from typing import (
    Any,
    ClassVar,
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    Mapping,
    Sequence,
    ValuesView,
)

from ckptfix.pickles.opcodes import (
    PickleLimits,
)
from ckptfix.pickles.policy import (
    DTYPE_GLOBALS,
    SAFE_CODECS,
)
from ckptfix.pickles.records import StorageRecord, TensorRecord

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
    def state(self) -> object:
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
        name: one of :data:`~ckptfix.pickles.policy.TENSOR_REBUILDERS`.

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
        if inner is not None and getattr(args[0], "_ckpt_name", None) == "_rebuild_wrapper_subclass" and len(args) > 3:
            from ckptfix.pickles.subclass import build_record  # torchao's tensors, read as their parts

            sub = build_record(args[1], args[2], args[3])
            if sub is not None:
                sub.reduce_func = cls
                sub.reduce_args = args
                return sub
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
