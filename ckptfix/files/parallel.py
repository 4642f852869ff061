"""Run per-shard (or per-tensor) tasks in a bounded pool of threads: ``--jobs N``.

The work that is parallel here is file I/O (``os.pread``/``os.pwrite``, ``mmap``, ``memcmp`` of
large buffers), which releases the GIL, so threads are enough and share the open descriptors.
:func:`run_tasks` keeps at most ``jobs`` tasks in flight, so memory is bounded by ``jobs`` times
what one task holds (its copy buffers); the first error stops the tasks not yet started, waits
for the running ones (so that a caller's cleanup sees every file they wrote) and is re-raised
as it was raised (a :class:`ckptfix.errors.CkptfixError` stays typed).  Each task runs in a copy
of the caller's :mod:`contextvars` context, so :func:`ckptfix.files.progress.advance` inside a worker
reaches the caller's progress callback; :class:`Tally` sums byte counts from several threads
into one ``progress(done, total)``.

``jobs=1`` runs the tasks in order in the calling thread, exactly as a plain loop would.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from ckptfix.files.progress import Progress

T = TypeVar("T")

#: the most threads ``--jobs`` starts, whatever is asked (file I/O saturates long before)
MAX_JOBS = 64


def resolve_jobs(jobs: int | None) -> int:
    """The number of worker threads for ``--jobs``: ``0`` (or ``None``) means one per CPU.

    Args:
        jobs: what the user asked for; ``1`` is sequential.

    Returns:
        A count between 1 and :data:`MAX_JOBS`.

    Raises:
        ValueError: a negative count.
    """
    if jobs is None or jobs == 0:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(MAX_JOBS, n))
    if jobs < 0:
        raise ValueError(f"--jobs {jobs}: pass a positive number of threads, or 0 for one per CPU")
    return min(MAX_JOBS, jobs)


def run_tasks(tasks: Sequence[Callable[[], T]], jobs: int = 1, *, cancel: threading.Event | None = None) -> list[T]:
    """Run ``tasks`` in up to ``jobs`` threads; their results in task order.

    Args:
        tasks: callables taking no arguments (a ``functools.partial`` per shard or tensor).
        jobs: threads at most (``0``: one per CPU); ``1`` runs them in order in this thread.
        cancel: set when a task fails or on Ctrl-C in the caller, before the running tasks are waited for
            (long tasks watch it and stop early).

    Returns:
        ``[task() for task in tasks]``.

    Raises:
        Whatever the first failing task raised (the tasks not yet started are not run; the running
        ones are waited for).  ValueError: a negative ``jobs``.
    """
    n = min(resolve_jobs(jobs), len(tasks))
    if n <= 1:
        return [t() for t in tasks]
    results: list[T | None] = [None] * len(tasks)
    contexts = [contextvars.copy_context() for _ in tasks]  # a context can be entered by one thread at a time
    lock = threading.Lock()
    state = {"next": 0}
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                i = state["next"]
                if errors or i >= len(tasks):
                    return
                state["next"] = i + 1
            try:
                results[i] = contexts[i].run(tasks[i])
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                with lock:
                    errors.append(e)
                if cancel is not None:  # the running tasks need not finish: their work is thrown away
                    cancel.set()
                return

    threads = [threading.Thread(target=worker, name=f"ckptfix-job-{k}", daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:  # Ctrl-C in the caller: start nothing more, let the running tasks end
        with lock:
            state["next"] = len(tasks)
        if cancel is not None:
            cancel.set()
        for t in threads:
            t.join()
        raise
    if errors:
        raise errors[0].with_traceback(errors[0].__traceback__)
    return results  # type: ignore[return-value]


class Tally:
    """Bytes done by several threads, reported as one ``progress(done, total)`` (calls serialized).

    Args:
        progress: the callback, or ``None`` (counting only).
        total: the expected number of bytes.
    """

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        """Count ``n`` more bytes and report the new total.

        Args:
            n: bytes just written (or verified).
        """
        with self._lock:
            self.done += n
            if self.progress is not None:
                self.progress(self.done, self.total)
