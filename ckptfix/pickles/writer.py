"""The writing pickler: :class:`RecordPickler`, :func:`dumps`, and the write-back check :func:`globals_resolvable`."""

from __future__ import annotations

import copyreg
import io
import itertools
import os
import pickle
import sys
import types
from typing import (
    Any,
    BinaryIO,
    Callable,
    Iterable,
)

from ckptfix.pickles.opcodes import (
    scan_globals,
)
from ckptfix.pickles.policy import (
    classify_pair,
    codecs_encode,
)
from ckptfix.pickles.records import StorageRecord, TensorRecord
from ckptfix.pickles.stub import Stub

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
    :func:`~ckptfix.pickles.policy.codecs_encode` in its own module), the pickler writes and memoizes that ``GLOBAL`` as
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
