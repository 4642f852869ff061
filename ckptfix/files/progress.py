"""Progress of long byte copies, reported to whoever asked (a CLI progress bar, a script's callback).

The copy loops deep inside the writers (:func:`ckptfix.files.fileio.copy_range`) call
:func:`advance` after each step; :func:`reporting` routes those calls, for the duration of one
library call, to a ``progress(done_bytes, total_bytes)`` callback.  Nothing is reported (and
nothing costs more than one context-variable lookup per step) when no one asked.  The count is
thread-safe: the worker threads of :func:`ckptfix.files.parallel.run_tasks` run in a copy of the
caller's context, so their steps add up in one callback, called by one thread at a time.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Callable, Iterator

#: ``progress(done_bytes, total_bytes)``
Progress = Callable[[int, int], None]

_SINK: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar("ckptfix_progress", default=None)


@contextlib.contextmanager
def reporting(progress: Progress | None, total: int) -> Iterator[None]:
    """Report the bytes :func:`advance` counts inside this block to ``progress(done, total)``.

    Args:
        progress: the callback, or ``None`` (nothing is reported).
        total: the expected number of bytes (``done`` is capped at it); the block ends with
            ``progress(total, total)`` when it completes.

    Example:
        >>> seen = []
        >>> with reporting(lambda d, t: seen.append((d, t)), 10):
        ...     advance(4); advance(4)
        >>> seen
        [(4, 10), (8, 10), (10, 10)]
    """
    if progress is None:
        yield
        return
    done = [0]
    lock = threading.Lock()

    def sink(n: int) -> None:
        with lock:
            done[0] = min(total, done[0] + n)
            progress(done[0], total)

    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)
    progress(total, total)


def advance(n: int) -> None:
    """Count ``n`` more bytes copied (a no-op unless inside :func:`reporting`).

    Args:
        n: bytes just copied; zero or less is ignored.
    """
    sink = _SINK.get()
    if sink is not None and n > 0:
        sink(n)
