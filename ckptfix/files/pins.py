"""Each local input is opened once per operation: the local twin of the remote ETag pin.

A trainer that saves with an atomic rename can replace a checkpoint while ckptfix reads it.  A command that
opened the path twice (once to sniff, once to copy) would then write one file's header over the other's
bytes.  Inside :func:`scope` (every library entry point enters one, through ``source.session()``), the first
open of a local regular file keeps its descriptor, and every later open of the same path, by any reader,
opens that descriptor's file (``/proc/self/fd/N``): the inode first seen, which stays readable after a
rename.  Where that is not possible (no ``/proc``, or more than :data:`MAX_HELD` files held open), the file's
identity (device, inode, size, mtime) is recorded instead and checked before and after each later open, before
each output is renamed into place (:func:`check_unchanged`) and when the scope ends: a file found replaced is
:class:`~ckptfix.errors.InputChangedError` (exit 16), and nothing mixed is written.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from typing import BinaryIO, Iterator

from ckptfix.errors import InputChangedError

__all__ = ["MAX_HELD", "check_unchanged", "fstat", "open_binary", "open_fd", "path_for", "scope"]

#: descriptors held open at most per scope (a ZeRO folder of 1,024 ranks stays under the usual ulimit of 1,024)
MAX_HELD = 256

_PROC = os.path.isdir("/proc/self/fd")
_lock = threading.RLock()
_depth = 0
_pins: dict[str, tuple[int, tuple[int, int, int, int]]] = {}
_held = 0


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Pin every local input opened in the block (re-entrant: an inner scope shares the outer one's pins)."""
    global _depth, _held
    with _lock:
        _depth += 1
    try:
        yield
        if _depth == 1:
            check_unchanged()
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for fd, _ in _pins.values():
                    if fd >= 0:
                        with contextlib.suppress(OSError):
                            os.close(fd)
                _pins.clear()
                _held = 0


def _pin(path: str) -> tuple[int, tuple[int, int, int, int]] | None:
    """The pin of ``path`` (made on its first open in the scope); None outside a scope or for a non-file."""
    global _held
    if _depth == 0:
        return None
    key = os.path.abspath(path)
    with _lock:
        pin = _pins.get(key)
        if pin is not None:
            return pin
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):  # a folder, a FIFO: opened as asked, nothing to pin
            os.close(fd)
            return None
        if not _PROC or _held >= MAX_HELD:
            os.close(fd)
            fd = -1
        else:
            _held += 1
        pin = _pins[key] = (fd, _identity(st))
        return pin


def path_for(path: str | os.PathLike[str]) -> str:
    """The path to open to read the local input ``path``: its pinned file inside a scope, else ``path``.

    Raises:
        OSError: ``path`` cannot be opened (as ``open`` raises it).
        InputChangedError: another file is under ``path`` now than when it was first opened in this scope.
    """
    p = os.fspath(path)
    pin = _pin(p)
    if pin is None:
        return p
    fd, ident = pin
    if fd >= 0:
        return f"/proc/self/fd/{fd}"
    _check(p, ident, _stat_or_none(p))
    return p


def _stat_or_none(path: str) -> tuple[int, int, int, int] | None:
    try:
        return _identity(os.stat(path))
    except FileNotFoundError:
        return None


def _check(path: str, ident: tuple[int, int, int, int], now: tuple[int, int, int, int] | None) -> None:
    if now != ident:
        raise InputChangedError(
            f"{path}: the file was replaced while it was read (another program saved over it); nothing mixed "
            "was written: run the command again once the writer is done"
        )


def check_unchanged() -> None:
    """Raise :class:`~ckptfix.errors.InputChangedError` if an input whose identity was recorded (not held
    open) is another file now; called before an output is renamed into place.
    """
    with _lock:
        watched = [(k, ident) for k, (fd, ident) in _pins.items() if fd < 0]
    for key, ident in watched:
        _check(key, ident, _stat_or_none(key))


def open_fd(path: str | os.PathLike[str]) -> int:
    """``os.open(path, O_RDONLY)`` of the pinned file (see :func:`path_for`), checked after the open too."""
    p = os.fspath(path)
    fd = os.open(path_for(p), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    pin = _pins.get(os.path.abspath(p)) if _depth else None
    if pin is not None and pin[0] < 0:
        try:
            _check(p, pin[1], _identity(os.fstat(fd)))
        except BaseException:
            os.close(fd)
            raise
    return fd


def open_binary(path: str | os.PathLike[str]) -> BinaryIO:
    """``open(path, "rb")`` of the pinned file, named ``path`` (what messages and ``repr`` show)."""
    fd = open_fd(path)
    try:
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    f.raw.name = os.fspath(path)  # type: ignore[attr-defined]
    return f


def fstat(path: str | os.PathLike[str]) -> os.stat_result:
    """``os.stat(path)`` of the pinned file: the size and times of the file that is read."""
    return os.stat(path_for(path))
