"""What a command transferred: bytes read and requests made (``--stats``).

A :class:`Stats` is shared by every :class:`~ckptfix.files.source.Source` a command opens (threads included);
:func:`collect` makes one the *active* collector, so library calls deep below a command count into it
without a parameter on every function: :func:`ckptfix.files.source.open_source` picks it up when its own
``stats`` argument is None.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class Stats:
    """Counters of one command's reads (thread-safe)."""

    #: payload bytes received from remote stores (local files are not counted)
    bytes_read: int = 0
    #: requests made to remote stores (the size/ETag request at open, range requests, retries)
    requests: int = 0
    #: requests repeated after a transient failure (5xx, connection reset, short read, throttling)
    retries: int = 0
    #: remote objects opened
    files: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    #: the session's open remote files by URL (:func:`ckptfix.files.source.open_source` shares them) and what
    #: probing a URL found ("file", "dir" or None): one request per URL and command, one pinned version
    files_open: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    probed: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def add(self, *, nbytes: int = 0, requests: int = 0, retries: int = 0, files: int = 0) -> None:
        """Add to the counters."""
        with self._lock:
            self.bytes_read += nbytes
            self.requests += requests
            self.retries += retries
            self.files += files

    def line(self) -> str:
        """The ``--stats`` line: ``read 412,345 bytes in 5 requests`` (plus retries when there were any)."""
        if not self.files and not self.requests:
            return "read 0 bytes in 0 requests (local input: nothing went over the network)"
        req = "request" if self.requests == 1 else "requests"
        out = f"read {self.bytes_read:,} bytes in {self.requests:,} {req}"
        if self.retries:
            out += f" ({self.retries:,} {'retry' if self.retries == 1 else 'retries'})"
        return out

    def to_json(self) -> dict[str, Any]:
        """The ``"stats"`` object of ``--json``."""
        return {"bytes_read": self.bytes_read, "requests": self.requests, "retries": self.retries, "files": self.files}


_ACTIVE: list[Stats] = []
_ACTIVE_LOCK = threading.Lock()


def active() -> Stats | None:
    """The innermost collector :func:`collect` made active (any thread), or None.

    Returns:
        The active :class:`Stats` or None.
    """
    with _ACTIVE_LOCK:
        return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def collect(stats: Stats | None = None) -> Iterator[Stats]:
    """Make ``stats`` (a new one by default) the active collector for the ``with`` block.

    Args:
        stats: the collector, or None for a new one.
    """
    st = stats if stats is not None else Stats()
    with _ACTIVE_LOCK:
        _ACTIVE.append(st)
    try:
        yield st
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.remove(st)
            last = st not in _ACTIVE
        if last:  # forget the shared files (not closed: a thread of this command may still read one; they go with it)
            st.files_open.clear()
            st.probed.clear()


@contextlib.contextmanager
def session() -> Iterator[Stats]:
    """The active collector if there is one, else a new one for the block (library entry points use it, so
    that one call opens each remote object once, whoever else opens it below).
    """
    st = active()
    if st is not None:
        yield st
        return
    with collect() as st:
        yield st
