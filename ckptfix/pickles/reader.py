"""The reading unpickler: :class:`RecordingUnpickler` and :func:`loads_records`.

It resolves every global as :mod:`ckptfix.pickles.policy` says, without importing it, and bounds what a pickle
may build (:class:`~ckptfix.pickles.opcodes.PickleLimits`).
"""

from __future__ import annotations

import collections
import io
import pickle
from dataclasses import dataclass
from typing import (
    Any,
    BinaryIO,
    ClassVar,
    Iterable,
    TypeVar,
)

from ckptfix.pickles.opcodes import (
    PickleLimits,
    ScanResult,
    resolve_global,
    scan_globals,
)
from ckptfix.pickles.policy import (
    REBUILD_FROM_TYPE,
    TENSOR_REBUILDERS,
    classify_pair,
    known_global,
)
from ckptfix.pickles.records import STORAGE_DTYPES, StorageRecord, TensorRecord
from ckptfix.pickles.stub import (
    Stub,
    _BoundedCtor,
    _RebuildFromType,
    global_name,
    paused_gc,
    rebuilder_class,
    stub_class,
    stub_dtype,
)

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

    Before the C unpickler runs, :func:`~ckptfix.pickles.opcodes.scan_globals` walks the
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
        #: (class, source file) of each ``('module', ...)`` persistent id of a legacy whole-module save
        self.module_sources: list[tuple[str, str | None]] = []
        self.legacy = legacy
        self.limits = limits or PickleLimits.from_env()
        self._py2_names: set[tuple[str, str]] = set()
        self._bounded: dict[tuple[str, str], type[_BoundedCtor]] = {}
        self.preflight = preflight
        self._built_bytes = 0  # what bounded calls built for real (their shared byte budget: limits.max_bytes)
        self._bytes: bytes | bytearray | memoryview | None = None  # set by for_bytes
        self.scanned: ScanResult | None = None  # the pre-flight's opcode scan, before the C unpickler runs

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
            self.scanned = r
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
        """Resolve a global without importing it (the pickle hook), as :data:`~.policy.KNOWN_GLOBALS` says.

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
        if self.legacy and isinstance(pid, tuple) and len(pid) == 4 and pid[0] == "module" and isinstance(pid[1], type):
            # the legacy torch.save of a whole module: ('module', <class>, <source file>, <source>) in place of
            # the class, for torch to compare sources; the class stays a placeholder, the source is never run
            self.module_sources.append((global_name(pid[1]), pid[2] if isinstance(pid[2], str) else None))
            return pid[1]
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
    """A legacy storage view, the persistent id's ``(view_key, offset, view_size)`` over ``base``."""

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
