"""An opcode-level simulation of CPython's unpickler: which globals a pickle imports, without building anything.

:func:`scan_globals` walks a pickle the way ``_pickle.c`` executes it, on a
stack of *abstract* values: concrete strings (what ``STACK_GLOBAL`` needs),
concrete integers, and markers for everything else.  It keeps the mark stack,
``POP`` / ``POP_MARK`` / ``DUP`` and the memo by CPython's rules (``MEMOIZE``
stores at ``len(memo)``, ``PUT``/``BINPUT``/``LONG_BINPUT`` at explicit
indices), so ``STACK_GLOBAL`` is resolved from the two values actually on the
stack, not from the last strings seen.  Names are resolved as the unpickler
resolves them: for protocol < 3 through ``_compat_pickle`` (``__builtin__
long`` is ``builtins.int``).

Whatever it cannot follow (``STACK_GLOBAL`` operands computed at load time,
``EXT`` codes, memo misses, strings too long to keep) is reported as an
*unresolved* global, which classifies as "unknown", never "safe".

The same walk is the pre-flight check of the restricted reader
(:func:`preflight`): it estimates the memory the unpickled objects take and
refuses absurd memo indices, over-long counted reads, deep immutable nesting
and huge integers *before* the C unpickler allocates anything.

Why this module is over 800 lines (the project's limit, docs/architecture.md): :func:`_scan` is
one function of about 580 lines on purpose.  The opcode loop is inlined (one dispatch over the
opcode byte in a single frame, the stack, mark stack, memo and counters in local variables), so an
opcode costs no Python call; split into a function per opcode, every opcode of a multi-GB pickle
would pay one.  Keep it one function; put new helpers outside the loop.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import io
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ckptfix.errors import ResourceLimitError
from ckptfix.pickles.policy import DCP_ENUM_MEMBERS

HIGHEST_PROTOCOL = 5

#: the first pickle of a legacy (pre-1.6) ``torch.save`` stream
LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C

#: longest string kept as a possible module / attribute name (longer ones stay abstract)
MAX_NAME_CHARS = 1024


# --------------------------------------------------------------------------- limits


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = int(float(raw))
    except ValueError:
        return default
    return v if v > 0 else default


#: default of ``CKPTFIX_MAX_PICKLE_MB``: the pickle bytes inflated from one archive, and the pickle
#: plus the estimated memory of the objects it builds
DEFAULT_MAX_PICKLE_MB = 256


@dataclass(frozen=True)
class PickleLimits:
    """Safety limits of the restricted reader; each has an environment variable that lifts it.

    ``max_bytes``: pickle size plus the estimated memory of the objects it builds
    (``CKPTFIX_MAX_PICKLE_MB``).  ``max_items``: elements a rebuilt ``set`` /
    ``frozenset`` / ``bytearray`` / ``range`` may have before it is kept as a placeholder
    (``CKPTFIX_MAX_PICKLE_ITEMS``).  ``max_globals``: distinct globals one pickle may name
    (``CKPTFIX_MAX_PICKLE_GLOBALS``).  ``max_depth``: nesting of the object graph
    (``CKPTFIX_MAX_PICKLE_DEPTH``).  ``max_int_digits``: decimal digits of one integer.
    ``max_idle``: opcodes that build nothing (a repeated ``PROTO``, ``POP``, ``POP_MARK``, an empty
    ``FRAME`` or ``APPENDS``/``SETITEMS``/``ADDITEMS``, a ``PUT`` over a filled memo slot) allowed
    beyond one per :data:`IDLE_BYTES` bytes of pickle (``CKPTFIX_MAX_PICKLE_IDLE``): picklers emit
    almost none, so a pickle made of them (a deflated bomb of no-ops) is stopped at once, and the
    walk's work stays proportional to what the pickle builds.
    """

    max_bytes: int = DEFAULT_MAX_PICKLE_MB << 20
    max_items: int = 1 << 20
    max_globals: int = 10_000
    max_depth: int = 100
    max_int_digits: int = 4300
    max_idle: int = 1 << 16

    @classmethod
    def from_env(cls) -> "PickleLimits":
        """The limits, with the ``CKPTFIX_MAX_PICKLE_*`` environment variables applied.

        Returns:
            The defaults, each replaced by its variable when that is set to a positive number.
        """
        d = cls()
        return cls(
            max_bytes=_env_int("CKPTFIX_MAX_PICKLE_MB", d.max_bytes >> 20) << 20,
            max_items=_env_int("CKPTFIX_MAX_PICKLE_ITEMS", d.max_items),
            max_globals=_env_int("CKPTFIX_MAX_PICKLE_GLOBALS", d.max_globals),
            max_depth=_env_int("CKPTFIX_MAX_PICKLE_DEPTH", d.max_depth),
            max_int_digits=d.max_int_digits,
            max_idle=_env_int("CKPTFIX_MAX_PICKLE_IDLE", d.max_idle),
        )


# --------------------------------------------------------------------------- name resolution


def resolve_global(module: str, name: str, protocol: int) -> tuple[str, str]:
    """The (module, name) CPython's unpickler imports for ``GLOBAL module name`` at ``protocol``.

    Below protocol 3 the unpickler (``fix_imports=True``, the default) maps Python 2
    names through ``_compat_pickle``: ``__builtin__ long`` -> ``builtins int``,
    ``__builtin__ unicode`` -> ``builtins str``, ``copy_reg`` -> ``copyreg`` ...

    Args:
        module: the module name as written in the pickle.
        name: the attribute name as written in the pickle.
        protocol: the protocol in force when the opcode runs (the last ``PROTO`` seen, 0 without one).

    Returns:
        The resolved ``(module, name)``.
    """
    if protocol < 3:
        mapped = _compat_pickle.NAME_MAPPING.get((module, name))
        if mapped is not None:
            return mapped
        if module in _compat_pickle.IMPORT_MAPPING:
            return _compat_pickle.IMPORT_MAPPING[module], name
    return module, name


# --------------------------------------------------------------------------- abstract values


class _Abs:
    """A value the scan does not hold concretely."""

    __slots__ = ("kind", "depth")

    def __init__(self, kind: str, depth: int = 0) -> None:
        self.kind = kind
        self.depth = depth

    def __repr__(self) -> str:
        return f"<{self.kind}{'/' + str(self.depth) if self.depth else ''}>"


ANY = _Abs("any")  # built at load time (REDUCE, GLOBAL, persistent id ...): may be a str
OBJ = _Abs("obj")  # certainly not a str (list, dict, bytes, float, None ...)
LONGSTR = _Abs("longstr")  # a str we did not keep (too long, or its value depends on the unpickler's encoding)
_EMPTY = _Abs("empty")  # an unused memo slot
_TUPLES: list[_Abs] = [_Abs("tuple", 1)]
_FROZENSETS: list[_Abs] = [_Abs("frozenset", 1)]


# ``builtins.getattr`` on the stack: the scan counts it as a global unless every time it is on the stack
# it is called with one of DCP's enum classes and a member name (Python >= 3.12 pickles an enum member
# as ``getattr(cls, name)``); such a call is recorded as the member's dotted name (policy.DCP_ENUM_LOOKUPS)
_GETATTR = _Abs("getattr")
_ENUM_CLASSES: dict[tuple[str, str], _Abs] = {}  # (module, name) of a DCP enum class -> its marker
_ENUM_ARGS: dict[tuple[_Abs, str], _Abs] = {}  # (class marker, member name) -> the marker of that 2-tuple
_ENUM_LOOKUPS: dict[_Abs, tuple[str, str]] = {}  # 2-tuple marker -> (module, "Enum.MEMBER")
for _cls, _members in DCP_ENUM_MEMBERS.items():
    _mod, _name = _cls.rsplit(".", 1)
    _ENUM_CLASSES[(_mod, _name)] = _marker = _Abs("enum")
    for _m in _members:
        _ENUM_ARGS[(_marker, _m)] = _args = _Abs("tuple", 1)
        _ENUM_LOOKUPS[_args] = (_mod, f"{_name}.{_m}")


def _nested(cache: list[_Abs], kind: str, depth: int) -> _Abs:
    while len(cache) < depth:
        cache.append(_Abs(kind, len(cache) + 1))
    return cache[depth - 1]


def _maybe_str(v: Any) -> bool:
    return type(v) is str or v is ANY or v is LONGSTR


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _depth(v: Any) -> int:
    return v.depth if type(v) is _Abs else 0


# --------------------------------------------------------------------------- result

UNRESOLVED_STACK_GLOBAL = "<STACK_GLOBAL of values computed at load time>"
UNRESOLVED_LONG_NAME = "<STACK_GLOBAL of a string the scan does not keep>"
UNRESOLVED_MEMO = "<memo entry that was never stored>"


@dataclass
class ScanResult:
    """Every global one pickle (or a sequence of pickles, merged) references, found by reading opcodes only.

    ``globals`` counts resolved names (``"builtins.int"``); ``pairs`` the same as
    ``(module, name)``; ``raw`` the names as written with the protocol in force;
    ``unresolved`` what the scan could not follow (each also counted in
    ``globals`` under a ``<...>`` name, which classifies as unknown).
    ``error`` is set when the stream is malformed at a point where CPython's
    unpickler fails too (the scan covers everything before it).
    """

    globals: collections.Counter = field(default_factory=collections.Counter)
    pairs: collections.Counter = field(default_factory=collections.Counter)
    raw: collections.Counter = field(default_factory=collections.Counter)
    unresolved: list[str] = field(default_factory=list)
    error: str | None = None
    end: int = 0  # offset just past the STOP opcode, relative to where the scan started
    protocol: int = 0  # highest PROTO seen
    value: Any = None  # the pickle's result when the scan knows it (an int or str), else None
    value_unknown: bool = True  # the result is built at load time (could be anything)
    est_bytes: int = 0  # estimated memory of the objects the pickle builds
    max_immutable_depth: int = 0
    limit_error: str | None = None  # a resource limit the pickle would exceed when loaded
    straddle: bool = False  # an opcode may run past a FRAME's end (readers may disagree: see _file_reading)
    file_end: int | None = None  # where a reader of a file stops when that differs from ``end``

    def merge(self, other: "ScanResult") -> None:
        """Add another pickle's findings (for multi-pickle files).

        Args:
            other: the next pickle's result; its first error and limit finding are kept only if this has none.
        """
        self.globals.update(other.globals)
        self.pairs.update(other.pairs)
        self.raw.update(other.raw)
        self.unresolved += other.unresolved
        self.protocol = max(self.protocol, other.protocol)
        self.est_bytes += other.est_bytes
        self.max_immutable_depth = max(self.max_immutable_depth, other.max_immutable_depth)
        if other.error and not self.error:
            self.error = other.error
        if other.limit_error and not self.limit_error:
            self.limit_error = other.limit_error

    @property
    def followed(self) -> bool:
        """True when every global was resolved (nothing unknown to the scan, no malformed data)."""
        return not self.unresolved and self.error is None


class _Malformed(Exception):
    pass


class _LimitStop(Exception):
    """A strict scan stops at the first limit crossed (already recorded in ``limit_error``)."""


class _Stop(Exception):
    """The scan cannot go on at a point where CPython's unpickler might: the rest is unknown."""


# --------------------------------------------------------------------------- opcode table


def _as_buffer(data: Any) -> tuple[Any, int, BinaryIO | None, Any]:
    """(buffer, start offset, file to reposition, resource to close) for bytes or a binary file."""
    if isinstance(data, (bytes, bytearray)):
        return data, 0, None, None
    if isinstance(data, memoryview):
        return data.tobytes(), 0, None, None
    f = data
    start = f.tell()
    try:
        fd = f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        fd = None
    if fd is not None:
        size = os.fstat(fd).st_size
        if size == 0 or start >= size:
            return b"", 0, f, None
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, MemoryError):  # no address space for the file (ulimit -v, 32-bit): read what is needed
            f.seek(start)
            return f.read(min(size - start, _NO_MAP_READ)), 0, f, None
        return mm, start, f, mm
    return f.read(), 0, f, None


#: without a memory map (the file does not fit the address space), at most this much of it is scanned
_NO_MAP_READ = 256 << 20

#: the first window a pickle in a remote file is scanned in; it grows 4x while the scan runs off its end
_REMOTE_WINDOW = 64 << 10


def _scan_remote(f: Any, limits: PickleLimits, scan: Any) -> ScanResult:
    """Scan one pickle of a remote file (:class:`ckptfix.files.remote.file.RemoteFileObj`) at its position.

    No memory map there: the bytes from the position are fetched in a window that grows 4x while the
    scan runs off its end (a linear scan, so at most ~1.3x the work of one pass), up to the pickle
    limit (``CKPTFIX_MAX_PICKLE_MB``): what is transferred is about the pickle, not the file.  The file
    is left just past ``STOP``.
    """
    start = f.tell()
    left = max(0, f.size - start)
    w = _REMOTE_WINDOW
    while True:
        n = min(w, left, limits.max_bytes + 1)
        f.seek(start)
        res: ScanResult = scan(f.read(n))
        if res.error and "truncated" in res.error and n < left and n <= limits.max_bytes:
            w *= 4
            continue
        f.seek(start + res.end)
        return res


def scan_globals(
    data: bytes | bytearray | memoryview | BinaryIO, *, limits: PickleLimits | None = None, strict_limits: bool = False
) -> ScanResult:
    """Simulate CPython's unpickler on one pickle and list every global it would import.

    Never raises on arbitrary bytes: a malformed stream is reported in ``error``;
    what cannot be followed is listed in ``unresolved``.  With a file, the scan
    starts at the current position and leaves the file just past ``STOP``.

    Args:
        data: the pickle bytes, or a binary file positioned at a pickle.
        limits: resource limits to check (default: :meth:`PickleLimits.from_env`).
        strict_limits: stop at the first limit the pickle would exceed when loaded and raise
            :class:`~ckptfix.errors.ResourceLimitError` (the restricted reader's pre-flight);
            otherwise the finding is only recorded in ``limit_error`` and the scan goes on.

    Returns:
        A :class:`ScanResult`.

    Raises:
        ResourceLimitError: only with ``strict_limits``.
    """
    limits = limits or PickleLimits.from_env()
    if getattr(data, "remote", False):  # a remote file: growing windows, not the whole object
        res = _scan_remote(data, limits, lambda b: _scan(b, 0, limits, strict_limits))
        if strict_limits and res.limit_error:
            raise ResourceLimitError(res.limit_error)
        return res
    buf, start, f, closer = _as_buffer(data)
    try:
        res = _scan(buf, start, limits, strict_limits)
    finally:
        if closer is not None:
            closer.close()
    if f is not None:
        try:
            f.seek(start + res.end)
        except (OSError, ValueError):
            pass
    if strict_limits and res.limit_error:
        raise ResourceLimitError(res.limit_error)
    return res


_U16 = struct.Struct("<H").unpack_from
_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U64 = struct.Struct("<Q").unpack_from

#: one opcode that builds nothing is allowed per this many bytes of pickle (beyond ``max_idle``)
IDLE_BYTES = 16

_UNDERFLOW = "unpickling stack underflow"
_NO_FRAME = 1 << 62  # no FRAME being read
CHECK_STEP = 16 << 20  # the stack/memo sizes are checked each time the estimate grows by this much


def _scan_linear(buf: Any, start: int, limits: PickleLimits, strict: bool = False) -> ScanResult:
    """The opcode walk of the bytes in order (``pickle.loads``). ``strict``: stop at the first limit crossed."""
    res = ScanResult()
    n = len(buf)
    pos = start
    stack: list[Any] = []
    push = stack.append
    marks: list[int] = []
    fence = 0  # stack length at the innermost MARK: nothing below it can be popped
    memo: list[Any] = []
    memo_len = 0
    proto = 0
    est = 0
    max_idepth = 0
    max_bytes = limits.max_bytes
    next_check = min(CHECK_STEP, max_bytes)  # est is compared with this once per opcode
    max_entries = max(max_bytes // 64, 1 << 16)  # stack and memo slots (8 bytes each in the C unpickler too)
    budget_hit = False
    max_digits_bytes = limits.max_int_digits * 415 // 1000  # bytes of a LONG4 whose value has that many digits
    idle = 0  # opcodes so far that build nothing (see PickleLimits.max_idle)
    idle_cap = limits.max_idle
    protos = 0
    globals_ = res.globals
    pairs = res.pairs
    raw = res.raw
    EMPTY = _EMPTY
    frame_end = _NO_FRAME  # where the FRAME being read ends (a reader of a file drops what is left of it)
    GA = _GETATTR
    ga_raw: list[tuple[str, str, int]] = []  # the builtins.getattr globals read, counted at the end (_GETATTR)
    ga_pushed = 0  # times _GETATTR was put on the stack
    ga_used = 0  # times it was called with a DCP enum class and one of its member names

    def readline() -> bytes:
        nonlocal pos
        i = buf.find(b"\n", pos)
        if i < 0:
            raise _Malformed("pickle data was truncated (no newline)")
        line = buf[pos:i]
        pos = i + 1
        return line

    def pop_mark() -> list:
        nonlocal fence
        if not marks:
            raise _Malformed("could not find MARK")
        k = marks.pop()
        fence = marks[-1] if marks else 0
        items = stack[k:]
        del stack[k:]
        return items

    def drop_mark() -> int:
        """POP_MARK-like: drop the frame, return how many values it held (no copy)."""
        nonlocal fence
        if not marks:
            raise _Malformed("could not find MARK")
        k = marks.pop()
        fence = marks[-1] if marks else 0
        count = len(stack) - k
        del stack[k:]
        return count

    def add_global(module: str, name: str, called: bool = False) -> Any:
        """Count a global; the value the unpickler pushes for it (``called``: INST, called at once)."""
        rm, rn = resolve_global(module, name, proto)
        if rn == "getattr" and rm == "builtins" and not called:
            ga_raw.append((module, name, proto))
            return GA
        raw[(module, name, proto)] += 1
        pairs[(rm, rn)] += 1
        globals_[f"{rm}.{rn}"] += 1
        if len(pairs) > limits.max_globals:
            limit(
                f"the pickle names more than {limits.max_globals} distinct globals; set "
                "CKPTFIX_MAX_PICKLE_GLOBALS=N to allow more"
            )
        return _ENUM_CLASSES.get((rm, rn), ANY)

    def limit(message: str) -> None:
        """Record the first limit crossed; in strict mode stop there."""
        if not res.limit_error:
            res.limit_error = message
        if strict:
            raise _LimitStop

    def unresolved(what: str) -> None:
        res.unresolved.append(what)
        globals_[what] += 1

    def idled() -> None:
        """Count an opcode that builds nothing; stop once they outnumber what the pickle's size allows."""
        nonlocal idle, idle_cap
        idle += 1
        if idle > idle_cap:
            idle_cap = limits.max_idle + (pos - start) // IDLE_BYTES
            if idle > idle_cap:
                msg = (
                    f"the pickle spends more than {idle:,} opcodes building nothing (repeated PROTO, POP, "
                    f"POP_MARK, empty FRAME ...) in its first {pos - start:,} bytes, which no pickler writes; "
                    "set CKPTFIX_MAX_PICKLE_IDLE=N to read it for a file you trust"
                )
                if strict:
                    res.limit_error = res.limit_error or msg
                    raise _LimitStop
                raise _Stop(msg)

    def memo_put(idx: int) -> None:
        nonlocal memo_len, est
        if len(stack) <= fence:
            raise _Malformed(_UNDERFLOW)
        if idx >= len(memo):
            if idx > 2 * memo_len + 1024:
                raise _Stop(
                    f"the pickle stores a memo entry at index {idx} after only {memo_len} entries (no "
                    "pickler writes that; the C unpickler would allocate memory for every index below it)"
                )
            est += 16 * (idx + 1 - len(memo))
            memo.extend([EMPTY] * (idx + 1 - len(memo)))
        if memo[idx] is EMPTY:
            memo_len += 1
        else:
            idled()
        memo[idx] = stack[-1]

    def memo_get(idx: int) -> Any:
        if 0 <= idx < len(memo):
            v = memo[idx]
            if v is not EMPTY:
                return v
        unresolved(UNRESOLVED_MEMO)
        raise _Malformed(f"memo value not found at index {idx}")

    def push_tuple(items: list) -> None:
        """Push the abstract tuple of ``items``, one level deeper than its deepest item (limit checked)."""
        nonlocal max_idepth
        if len(items) == 2 and type(items[1]) is str:
            a = _ENUM_ARGS.get((items[0], items[1]))
            if a is not None:  # (DCP enum class, member name): getattr's arguments
                push(a)
                return
        d = 0
        for v in items:
            if type(v) is _Abs and v.depth > d:
                d = v.depth
        d += 1
        if d > max_idepth:
            max_idepth = d
            if d > limits.max_depth:
                limit(
                    f"the pickle nests tuples more than {limits.max_depth} deep; set "
                    "CKPTFIX_MAX_PICKLE_DEPTH=N to allow it"
                )
        push(_TUPLES[0] if d == 1 else _nested(_TUPLES, "tuple", min(d, limits.max_depth + 1)))

    def push_str(s: str) -> None:
        push(s if len(s) <= MAX_NAME_CHARS else LONGSTR)

    def truncated() -> _Malformed:
        return _Malformed("pickle data was truncated")

    try:
        while True:
            if est > next_check:
                next_check = est + CHECK_STEP
                if len(stack) > max_entries or len(memo) > max_entries:
                    raise _Stop(
                        f"the pickle keeps more than {max_entries:,} values on the unpickler's stack or "
                        "memo; set CKPTFIX_MAX_PICKLE_MB=N (MiB) to allow it for a file you trust"
                    )
                if est > max_bytes:
                    if not budget_hit:
                        budget_hit = True
                        res.limit_error = res.limit_error or (
                            f"the pickle would build more than {max_bytes >> 20} MiB of objects; set "
                            "CKPTFIX_MAX_PICKLE_MB=N (MiB) to allow it for a file you trust"
                        )
                        if strict:
                            break
                    elif est > 2 * max_bytes:
                        raise _Stop(
                            f"the pickle holds more than {2 * max_bytes >> 20} MiB of values; set "
                            "CKPTFIX_MAX_PICKLE_MB=N (MiB) to scan it"
                        )
            if pos >= frame_end:  # the first opcode at or past the end of the last FRAME
                if pos > frame_end:  # the last one ran past it: a file reader may read other opcodes
                    res.straddle = True
                frame_end = _NO_FRAME
            op = buf[pos]  # past the end: IndexError, reported as truncated below
            pos += 1
            # ---- in order of frequency in torch pickles (protocol 2) and DCP .metadata (protocol 4)
            if op == 0x72 or op == 0x94:  # LONG_BINPUT MEMOIZE (the next free index, as CPython counts)
                if op == 0x72:
                    if pos + 4 > n:
                        raise truncated()
                    idx = _U32(buf, pos)[0]
                    pos += 4
                else:
                    idx = memo_len
                if idx == memo_len == len(memo) and len(stack) > fence:  # the next slot, no holes: append
                    memo.append(stack[-1])
                    memo_len += 1
                    est += 16
                else:
                    memo_put(idx)
            elif op == 0x68:  # BINGET
                if pos >= n:
                    raise truncated()
                idx = buf[pos]
                pos += 1
                v = memo[idx] if idx < len(memo) else EMPTY
                push(v if v is not EMPTY else memo_get(idx))
                if v is GA:
                    ga_pushed += 1
                est += 8
            elif op == 0x6A:  # LONG_BINGET
                if pos + 4 > n:
                    raise truncated()
                idx = _U32(buf, pos)[0]
                pos += 4
                v = memo[idx] if idx < len(memo) else EMPTY
                push(v if v is not EMPTY else memo_get(idx))
                if v is GA:
                    ga_pushed += 1
                est += 8
            elif op == 0x4B:  # BININT1
                if pos >= n:
                    raise truncated()
                push(buf[pos])
                pos += 1
                est += 8
            elif op == 0x28:  # MARK
                fence = len(stack)
                marks.append(fence)
                est += 8
            elif op == 0x29:  # EMPTY_TUPLE
                push(_TUPLES[0])
                est += 8
            elif op == 0x52:  # REDUCE
                if len(stack) - 2 < fence:
                    raise _Malformed(_UNDERFLOW)
                if stack[-2] is GA:
                    hit = _ENUM_LOOKUPS.get(stack[-1])
                    if hit is not None:  # getattr(DCP enum class, member): the member, by its dotted name
                        ga_used += 1
                        pairs[hit] += 1
                        globals_[f"{hit[0]}.{hit[1]}"] += 1
                del stack[-1]
                stack[-1] = ANY
                est += 200
            elif op == 0x74:  # TUPLE
                items = pop_mark()
                push_tuple(items)
                est += 48 + 8 * len(items)
            elif op == 0x85 or op == 0x86 or op == 0x87:  # TUPLE1 TUPLE2 TUPLE3
                k = op - 0x84
                if len(stack) - k < fence:
                    raise _Malformed(_UNDERFLOW)
                items = stack[-k:]
                del stack[-k:]
                push_tuple(items)
                est += 48 + 8 * k
            elif op == 0x58 or op == 0x8C or op == 0x8D:  # BINUNICODE SHORT_BINUNICODE BINUNICODE8
                if op == 0x58:
                    if pos + 4 > n:
                        raise truncated()
                    size = _U32(buf, pos)[0]
                    pos += 4
                elif op == 0x8C:
                    if pos >= n:
                        raise truncated()
                    size = buf[pos]
                    pos += 1
                else:
                    if pos + 8 > n:
                        raise truncated()
                    size = _U64(buf, pos)[0]
                    pos += 8
                if pos + size > n:
                    raise truncated()
                if size <= MAX_NAME_CHARS * 4:
                    try:
                        s = str(buf[pos : pos + size], "utf-8", "surrogatepass")
                    except UnicodeDecodeError:
                        raise _Malformed("invalid UTF-8 in a string") from None
                    push(s if len(s) <= MAX_NAME_CHARS else LONGSTR)
                else:
                    push(LONGSTR)
                pos += size
                est += 57 + size
            elif op == 0x81:  # NEWOBJ
                if len(stack) - 2 < fence:
                    raise _Malformed(_UNDERFLOW)
                del stack[-1]
                stack[-1] = ANY
                est += 200
            elif op == 0x62:  # BUILD
                if len(stack) - 2 < fence:
                    raise _Malformed(_UNDERFLOW)
                del stack[-1]
            elif op == 0x75 or op == 0x65 or op == 0x90:  # SETITEMS APPENDS ADDITEMS
                count = drop_mark()
                if len(stack) <= fence:
                    raise _Malformed(_UNDERFLOW)
                if not count:
                    idled()
                if op == 0x75 and count & 1:
                    raise _Malformed("odd number of items for SETITEMS")
                est += (50 if op != 0x65 else 8) * count
            elif op == 0x7D or op == 0x5D or op == 0x8F:  # EMPTY_DICT EMPTY_LIST EMPTY_SET
                push(OBJ)
                est += 64 if op == 0x7D else 56 if op == 0x5D else 216
            elif op == 0x4E or op == 0x88 or op == 0x89:  # NONE NEWTRUE NEWFALSE
                push(OBJ)
                est += 8
            elif op == 0x51:  # BINPERSID
                if len(stack) <= fence:
                    raise _Malformed(_UNDERFLOW)
                stack[-1] = ANY
                est += 100
            elif op == 0x4D:  # BININT2
                if pos + 2 > n:
                    raise truncated()
                push(_U16(buf, pos)[0])
                pos += 2
                est += 8
            elif op == 0x71:  # BINPUT
                if pos >= n:
                    raise truncated()
                memo_put(buf[pos])
                pos += 1
            elif op == 0x4A:  # BININT
                if pos + 4 > n:
                    raise truncated()
                push(_I32(buf, pos)[0])
                pos += 4
                est += 40
            elif op == 0x73:  # SETITEM
                if len(stack) - 3 < fence:
                    raise _Malformed(_UNDERFLOW)
                del stack[-2:]
                est += 100
            elif op == 0x61:  # APPEND
                if len(stack) - 2 < fence:
                    raise _Malformed(_UNDERFLOW)
                del stack[-1]
                est += 8
            elif op == 0x93:  # STACK_GLOBAL
                if len(stack) - 2 < fence:
                    raise _Malformed(_UNDERFLOW)
                name = stack.pop()
                module = stack[-1]
                g = ANY
                if type(name) is str and type(module) is str:
                    if not (module.isascii() and name.isascii()) and not _utf8(module + name):
                        # a lone surrogate (BINUNICODE decodes with surrogatepass): no module or attribute has it
                        raise _Malformed("STACK_GLOBAL names must be valid UTF-8 (a lone surrogate)")
                    g = add_global(module, name)
                    if g is GA:
                        ga_pushed += 1
                elif not _maybe_str(name) or not _maybe_str(module):
                    raise _Malformed("STACK_GLOBAL requires str")
                elif name is LONGSTR or module is LONGSTR:
                    unresolved(UNRESOLVED_LONG_NAME)
                else:
                    unresolved(UNRESOLVED_STACK_GLOBAL)
                stack[-1] = g
            elif op == 0x63 or op == 0x69:  # GLOBAL INST
                # pickle.py reads both lines leniently (a line cut by EOF loses its last character) and
                # imports the module even when the attribute is empty; _pickle.c needs both lines whole.
                enc = "utf-8" if op == 0x63 else "ascii"
                lines = []
                complete = True
                for _ in range(2):
                    i = buf.find(b"\n", pos) if complete else -1
                    if complete and i >= 0:
                        lines.append(buf[pos:i])
                        pos = i + 1
                    else:
                        lines.append(buf[pos:n][:-1] if complete else b"")
                        pos = n
                        complete = False
                try:
                    module, name = str(lines[0], enc), str(lines[1], enc)
                except UnicodeDecodeError:
                    raise _Malformed(f"{'GLOBAL' if op == 0x63 else 'INST'} names must be {enc}") from None
                g = ANY
                if module:
                    g = add_global(module, name, op == 0x69)
                if not complete or not module or not name:
                    raise _Malformed("pickle data was truncated (GLOBAL/INST needs two whole lines)")
                if op == 0x69:
                    drop_mark()
                    est += 200
                    g = ANY
                elif g is GA:
                    ga_pushed += 1
                push(g)
                est += 8
            elif op == 0x92:  # NEWOBJ_EX
                if len(stack) - 3 < fence:
                    raise _Malformed(_UNDERFLOW)
                del stack[-2:]
                stack[-1] = ANY
                est += 200
            elif op == 0x6F:  # OBJ
                if not drop_mark():
                    raise _Malformed(_UNDERFLOW)
                push(ANY)
                est += 200
            elif op == 0x8A or op == 0x8B:  # LONG1 LONG4
                if op == 0x8A:
                    if pos >= n:
                        raise truncated()
                    size = buf[pos]
                    pos += 1
                else:
                    if pos + 4 > n:
                        raise truncated()
                    size = _I32(buf, pos)[0]
                    pos += 4
                    if size < 0:
                        raise _Malformed("LONG pickle has negative byte count")
                if pos + size > n:
                    raise truncated()
                if size > max_digits_bytes:
                    limit(
                        f"the pickle holds an integer of about {size * 2408 // 1000} decimal "
                        f"digits (over Python's {limits.max_int_digits}-digit limit); not a "
                        "value a checkpoint holds"
                    )
                    push(OBJ)
                else:
                    push(int.from_bytes(buf[pos : pos + size], "little", signed=True) if size else 0)
                pos += size
                est += 40 + size
            elif op == 0x80:  # PROTO
                if pos >= n:
                    raise truncated()
                p = buf[pos]
                pos += 1
                if p > HIGHEST_PROTOCOL:
                    raise _Malformed(f"unsupported pickle protocol: {p}")
                proto = p
                if p > res.protocol:
                    res.protocol = p
                protos += 1
                if protos > 1:
                    idled()
            elif op == 0x95:  # FRAME
                if pos + 8 > n:
                    raise truncated()
                size = _U64(buf, pos)[0]
                pos += 8
                if pos + size > n:  # the C unpickler only checks that the whole frame is there
                    raise truncated()
                if frame_end != _NO_FRAME:  # a FRAME opening before the last one's end
                    res.straddle = True
                frame_end = pos + size
                if size < 4096:  # picklers frame at least 64 KiB (the last frame of a pickle aside)
                    idled()
            elif op == 0x2E:  # STOP
                if len(stack) <= fence:
                    raise _Malformed(_UNDERFLOW)
                if frame_end != _NO_FRAME and pos < frame_end:  # a frame goes on past STOP
                    res.straddle = True
                v = stack.pop()
                res.value = v if type(v) in (int, str) else None
                res.value_unknown = v is ANY or v is GA or type(v) is _Abs and v.kind == "enum"
                break
            elif op == 0x30:  # POP: of an empty frame, pops the MARK itself
                idled()
                if marks and marks[-1] == len(stack):
                    marks.pop()
                    fence = marks[-1] if marks else 0
                elif len(stack) <= fence:
                    raise _Malformed(_UNDERFLOW)
                else:
                    del stack[-1]
            elif op == 0x31:  # POP_MARK
                idled()
                drop_mark()
            elif op == 0x32:  # DUP
                if len(stack) <= fence:
                    raise _Malformed(_UNDERFLOW)
                push(stack[-1])
                if stack[-1] is GA:
                    ga_pushed += 1
                est += 8
            elif op == 0x6C or op == 0x64:  # LIST DICT
                count = drop_mark()
                if op == 0x64 and count & 1:
                    raise _Malformed("odd number of items for DICT")
                push(OBJ)
                est += 64 + 50 * count
            elif op == 0x91:  # FROZENSET
                items = pop_mark()
                d = 1 + max((_depth(v) for v in items), default=0)
                max_idepth = max(max_idepth, d)
                if d > limits.max_depth:
                    limit(
                        f"the pickle nests frozensets more than {limits.max_depth} deep; set "
                        "CKPTFIX_MAX_PICKLE_DEPTH=N to allow it"
                    )
                push(_nested(_FROZENSETS, "frozenset", min(d, limits.max_depth + 1)))
                est += 216 + 32 * len(items)
            elif op == 0x47:  # BINFLOAT
                if pos + 8 > n:
                    raise truncated()
                pos += 8
                push(OBJ)
                est += 32
            elif op in (0x43, 0x42, 0x8E, 0x96, 0x55, 0x54):  # (SHORT_)BINBYTES BINBYTES8 BYTEARRAY8 (SHORT_)BINSTRING
                w = 1 if op in (0x43, 0x55) else 4 if op in (0x42, 0x54) else 8
                if pos + w > n:
                    raise truncated()
                size = int.from_bytes(buf[pos : pos + w], "little", signed=(op == 0x54))
                pos += w
                if size < 0:
                    raise _Malformed("BINSTRING pickle has negative byte count")
                if pos + size > n:
                    raise truncated()
                if op in (0x55, 0x54):  # str under the default encodings, bytes with encoding="bytes"
                    raw_s = buf[pos : pos + size] if size <= MAX_NAME_CHARS else None
                    if raw_s is not None and raw_s.isascii():
                        push_str(raw_s.decode("ascii"))
                    else:
                        push(LONGSTR)
                else:
                    push(OBJ)
                pos += size
                est += 48 + size
            elif op == 0x56:  # UNICODE (protocol 0)
                line = readline()
                try:
                    push_str(line.decode("raw-unicode-escape"))
                except UnicodeDecodeError:
                    raise _Malformed("invalid raw-unicode-escape string") from None
                est += 57 + len(line)
            elif op == 0x53:  # STRING (protocol 0, quoted)
                line = readline()
                if len(line) < 2 or line[:1] != line[-1:] or line[:1] not in (b"'", b'"'):
                    raise _Malformed("the STRING opcode argument must be quoted")
                try:
                    body = codecs.escape_decode(line[1:-1])[0]
                except (ValueError, UnicodeDecodeError):
                    raise _Malformed("invalid escape in STRING") from None
                if body.isascii() and len(body) <= MAX_NAME_CHARS:
                    push(body.decode("ascii"))
                else:
                    push(LONGSTR)
                est += 57 + len(body)
            elif op == 0x49:  # INT
                line = readline()
                push(_parse_int(line, limits, res) if line not in (b"00", b"01") else OBJ)
                if strict and res.limit_error:
                    raise _LimitStop
                est += 40 + len(line)
            elif op == 0x4C:  # LONG
                line = readline()
                push(_parse_int(line[:-1] if line.endswith(b"L") else line, limits, res))
                if strict and res.limit_error:
                    raise _LimitStop
                est += 40 + len(line)
            elif op == 0x46:  # FLOAT
                readline()  # a bad literal fails in CPython; going on only reports more
                push(OBJ)
                est += 32
            elif op == 0x67 or op == 0x70:  # GET PUT (text)
                line = readline()
                try:
                    idx = int(line)
                except ValueError:
                    raise _Malformed("invalid memo index") from None
                if op == 0x67:
                    v = memo_get(idx)
                    push(v)
                    if v is GA:
                        ga_pushed += 1
                    est += 8
                else:
                    if idx < 0:
                        raise _Malformed("negative PUT argument")
                    memo_put(idx)
            elif op == 0x50:  # PERSID
                line = readline()
                if not line.isascii():
                    raise _Malformed("persistent id is not ASCII")
                push(ANY)
                est += 100
            elif op == 0x82 or op == 0x83 or op == 0x84:  # EXT1 EXT2 EXT4
                w = 1 if op == 0x82 else 2 if op == 0x83 else 4
                if pos + w > n:
                    raise truncated()
                code = int.from_bytes(buf[pos : pos + w], "little", signed=(op == 0x84))
                pos += w
                if code <= 0:
                    raise _Malformed("EXT specifies code <= 0")
                unresolved(f"<extension code {code} (copyreg registry)>")
                push(ANY)
            elif op == 0x97:  # NEXT_BUFFER
                push(ANY)
            elif op == 0x98:  # READONLY_BUFFER
                if len(stack) <= fence:
                    raise _Malformed(_UNDERFLOW)
            else:
                raise _Malformed(
                    f"invalid load key, {chr(op)!r}" if 32 <= op < 127 else f"invalid load key, '\\x{op:02x}'"
                )
    except _Malformed as e:
        res.error = f"at byte {pos - start}: {e}"
    except _Stop as e:
        unresolved(f"<scan stopped at byte {pos - start}: the rest of the pickle is not checked ({e})>")
        res.limit_error = res.limit_error or str(e)
    except _LimitStop:
        pass
    except IndexError as e:
        res.error = f"at byte {pos - start}: " + (
            "pickle data was truncated (no STOP)" if pos >= n else f"{type(e).__name__}: {e}"
        )
    except (MemoryError, RecursionError, OverflowError, ValueError) as e:
        res.error = f"at byte {pos - start}: {type(e).__name__}: {e}"
    if res.error and frame_end != _NO_FRAME:  # stopped inside a frame: another reader may go on
        res.straddle = True
    if ga_raw and (ga_used == 0 or ga_used != ga_pushed):  # getattr on the stack for anything else: counted
        for module, name, p in ga_raw:
            rm, rn = resolve_global(module, name, p)
            raw[(module, name, p)] += 1
            pairs[(rm, rn)] += 1
            globals_[f"{rm}.{rn}"] += 1
    res.end = pos - start
    res.est_bytes = est + (pos - start)
    res.max_immutable_depth = max_idepth
    return res


UNRESOLVED_FRAMES = (
    "<opcodes that run past the end of a FRAME: CPython's unpickler reading a file drops the rest of the "
    "frame and reads other opcodes than a reader of the bytes (both readings scanned; others may exist)>"
)


def _scan(buf: Any, start: int, limits: PickleLimits, strict: bool = False) -> ScanResult:
    """The opcode walk of every reading CPython's unpickler may make of the pickle at ``start``.

    The bytes in order (``pickle.loads``, :func:`_scan_linear`); and, when an opcode runs past the end of a
    ``FRAME``, the reading of the C unpickler given a file (:func:`_file_reading`): the globals of both count,
    and the pickle is never "safe" (a buffered file's reading depends on its buffer: :data:`UNRESOLVED_FRAMES`).
    """
    res = _scan_linear(buf, start, limits, strict)
    if not res.straddle:
        return res
    other, file_end, dropped = _file_reading(buf, start)
    if not dropped:
        return res
    alt = _scan_linear(other, 0, limits, strict)
    res.globals.update(alt.globals)
    res.pairs.update(alt.pairs)
    res.raw.update(alt.raw)
    res.unresolved += alt.unresolved
    res.unresolved.append(UNRESOLVED_FRAMES)
    res.globals[UNRESOLVED_FRAMES] += 1
    res.value, res.value_unknown = None, True
    res.limit_error = res.limit_error or alt.limit_error
    if file_end - start != res.end:
        res.file_end = file_end - start
    return res


# argument reads of each opcode as _pickle.c does them: fixed _Unpickler_Read sizes, counted reads
# (width of the count, signed count, data read with _Unpickler_ReadInto), and lines (_Unpickler_Readline)
_FIXED = {0x4A: 4, 0x4B: 1, 0x4D: 2, 0x47: 8, 0x68: 1, 0x6A: 4, 0x71: 1, 0x72: 4, 0x82: 1, 0x83: 2, 0x84: 4, 0x80: 1}
_COUNTED = {  # op: (count width, signed, data via ReadInto)
    0x8A: (1, False, False),  # LONG1
    0x8B: (4, True, False),  # LONG4
    0x55: (1, False, False),  # SHORT_BINSTRING
    0x54: (4, True, False),  # BINSTRING
    0x8C: (1, False, False),  # SHORT_BINUNICODE
    0x58: (4, False, False),  # BINUNICODE
    0x8D: (8, False, False),  # BINUNICODE8
    0x43: (1, False, True),  # SHORT_BINBYTES
    0x42: (4, False, True),  # BINBYTES
    0x8E: (8, False, True),  # BINBYTES8
    0x96: (8, False, True),  # BYTEARRAY8
}
_LINES = {0x49: 1, 0x4C: 1, 0x46: 1, 0x53: 1, 0x56: 1, 0x67: 1, 0x70: 1, 0x50: 1, 0x63: 2, 0x69: 2}
_NO_ARG = frozenset(b"().0129NRabdeloistu}]\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94\x97\x98\x81")


class _Eof(Exception):
    pass


def _file_reading(buf: Any, start: int) -> tuple[bytes, int, bool]:
    """The opcodes the C unpickler reads from a file object without ``peek`` (``io.BytesIO``: what torch.load
    hands it for a zip's ``data.pkl``), as one unframed byte string.

    It reads exactly what each opcode asks from the file, except a ``FRAME``, read whole into a buffer; an
    ``_Unpickler_Read`` or ``_Unpickler_Readline`` that does not fit in what is left of that buffer drops the
    rest and reads on from the file (after the frame); ``_Unpickler_ReadInto`` (the data of BINBYTES*,
    BYTEARRAY8) takes the rest first.  Returns (the opcodes read, without FRAMEs; the file offset where the
    reader stops; whether any byte was dropped, i.e. the reading differs from the bytes in order).
    """
    n = len(buf)
    out = bytearray()
    fpos = idx = bend = start  # file position; next byte and end of the buffer
    dropped = False

    def read(k: int) -> bytes:
        nonlocal fpos, idx, bend, dropped
        if idx + k <= bend:
            idx += k
            return bytes(buf[idx - k : idx])
        if idx < bend:
            dropped = True
        if fpos + k > n:
            raise _Eof
        fpos += k
        idx = bend = fpos
        return bytes(buf[fpos - k : fpos])

    def read_into(k: int) -> bytes:
        nonlocal fpos, idx
        take = min(max(0, bend - idx), k)
        head = bytes(buf[idx : idx + take])
        idx += take
        rest = k - take
        if fpos + rest > n:
            raise _Eof
        fpos += rest
        return head + bytes(buf[fpos - rest : fpos])

    def readline() -> bytes:
        nonlocal fpos, idx, bend, dropped
        i = buf.find(b"\n", idx, bend) if idx < bend else -1
        if i >= 0:
            line = bytes(buf[idx : i + 1])
            idx = i + 1
            return line
        if idx < bend:
            dropped = True
        j = buf.find(b"\n", fpos)
        if j < 0:
            raise _Eof
        line = bytes(buf[fpos : j + 1])
        fpos = idx = bend = j + 1
        return line

    try:
        while True:
            op = read(1)[0]
            if op == 0x95:  # FRAME: read whole, then rewound
                size = int.from_bytes(read(8), "little")
                if idx + size <= bend:
                    continue
                if idx < bend:
                    dropped = True
                if fpos + size > n:
                    raise _Eof
                idx, bend = fpos, fpos + size
                fpos = bend
                continue
            out.append(op)
            if op == 0x2E:  # STOP
                break
            if op in _NO_ARG:
                continue
            w = _FIXED.get(op)
            if w is not None:
                out += read(w)
                continue
            c = _COUNTED.get(op)
            if c is not None:
                raw = read(c[0])
                out += raw
                size = int.from_bytes(raw, "little", signed=c[1])
                if size < 0 or size > n:
                    break
                out += read_into(size) if c[2] else read(size)
                continue
            lines = _LINES.get(op)
            if lines is None:
                break  # an invalid opcode: the unpickler fails here
            for _ in range(lines):
                out += readline()
    except _Eof:
        pass
    return bytes(out), fpos, dropped


def _parse_int(line: bytes, limits: PickleLimits, res: ScanResult) -> Any:
    """An INT/LONG literal's value when it is short and plain; OBJ otherwise (CPython may still accept it)."""
    if len(line) > limits.max_int_digits:
        if not res.limit_error:
            res.limit_error = (
                f"the pickle holds an integer literal of {len(line)} characters (over Python's "
                f"{limits.max_int_digits}-digit limit); not a value a checkpoint holds"
            )
        return OBJ
    try:
        return int(line, 0)
    except ValueError:
        return OBJ


#: pickles at most scanned in a bare pickle file (``pickle.load`` called again reads each one after the first)
MAX_BARE_PICKLES = 1000
_MORE_PICKLES = f"<more than {MAX_BARE_PICKLES} pickles back to back: the rest of the file is not checked>"


def scan_pickle_sequence(
    data: bytes | bytearray | memoryview | BinaryIO, *, max_pickles: int = 5, limits: PickleLimits | None = None
) -> tuple[ScanResult, list[ScanResult]]:
    """Scan the pickles a legacy ``torch.save`` stream holds (or the one a bare pickle file holds).

    ``torch.load`` of a non-zip file unpickles a magic number, then (only if it
    matches) the protocol version, the system info, the object and the storage
    key list: five pickles back to back.  A first pickle whose value is not known to be
    the magic number is a bare pickle: ``pickle.load`` called again on the file
    unpickles what follows, so every pickle after it is scanned too, to the end of the
    data (up to :data:`MAX_BARE_PICKLES`; more is an unknown global).

    Args:
        data: bytes or a binary file positioned at the first pickle.
        max_pickles: how many pickles at most to scan.
        limits: resource limits (default from the environment).

    Returns:
        (merged result, the result of each pickle scanned, in order).
    """
    limits = limits or PickleLimits.from_env()
    if getattr(data, "remote", False):  # a remote file: each pickle in growing windows
        rf: Any = data
        merged, found = ScanResult(), list[ScanResult]()
        cap = max_pickles
        while len(found) < cap and rf.tell() < rf.size:
            r = _scan_remote(rf, limits, lambda b: _scan(b, 0, limits))
            found.append(r)
            merged.merge(r)
            merged.end += r.end
            if r.error:
                break
            if len(found) == 1 and (r.value_unknown or r.value != LEGACY_MAGIC_NUMBER):
                cap = MAX_BARE_PICKLES  # a bare pickle: pickle.load called again reads what follows
        if len(found) >= cap and rf.tell() < rf.size and cap == MAX_BARE_PICKLES:
            found[-1].unresolved.append(_MORE_PICKLES)
            merged.unresolved.append(_MORE_PICKLES)
            merged.globals[_MORE_PICKLES] += 1
        return merged, found
    buf, start, f, closer = _as_buffer(data)
    total = ScanResult()
    parts: list[ScanResult] = []
    count = 0
    pos = start
    cap = max_pickles
    try:
        while count < cap and pos < len(buf):
            r = _scan(buf, pos, limits)
            count += 1
            parts.append(r)
            total.merge(r)
            pos += r.end
            if r.error:
                break
            if count == 1 and (r.value_unknown or r.value != LEGACY_MAGIC_NUMBER):
                cap = MAX_BARE_PICKLES  # a bare pickle: pickle.load called again reads what follows
        if count >= cap == MAX_BARE_PICKLES and pos < len(buf):
            parts[-1].unresolved.append(_MORE_PICKLES)
            total.unresolved.append(_MORE_PICKLES)
            total.globals[_MORE_PICKLES] += 1
        total.end = pos - start
    finally:
        if closer is not None:
            closer.close()
    if f is not None:
        try:
            f.seek(pos)
        except (OSError, ValueError):
            pass
    return total, parts
