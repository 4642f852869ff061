"""Run per-shard (or per-tensor) tasks in a bounded pool of threads (:class:`~concurrent.futures.ThreadPoolExecutor`,
as the remote range requests): ``--jobs N``.

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
from concurrent.futures import FIRST_EXCEPTION, CancelledError, ThreadPoolExecutor, wait
from typing import TypeVar

from ckptfix.files.progress import Progress

T = TypeVar("T")

#: the most threads ``--jobs`` starts, whatever is asked (file I/O saturates long before)
MAX_JOBS = 64


def resolve_jobs(jobs: int | None) -> int:
    """The number of worker threads for ``--jobs``: ``0`` (or ``None``) means one per CPU.

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

    Raises:
        Whatever the first failing task raised (the tasks not yet started are not run; the running
        ones are waited for).  ValueError: a negative ``jobs``.
    """
    n = min(resolve_jobs(jobs), len(tasks))
    if n <= 1:
        return [t() for t in tasks]
    errors: list[BaseException] = []  # in the order they were raised: the first is re-raised
    lock = threading.Lock()
    stop = threading.Event()  # a task failed, or Ctrl-C: the queued tasks are not started

    def run(task: Callable[[], T], context: contextvars.Context) -> T:
        if stop.is_set():
            raise CancelledError()
        try:
            return context.run(task)
        except BaseException as e:
            with lock:
                errors.append(e)
            stop.set()
            if cancel is not None:  # the running tasks need not finish: their work is thrown away
                cancel.set()
            raise

    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="ckptfix-job") as pool:
        # a context per task, copied here: a context can be entered by one thread at a time
        futures = [pool.submit(run, t, contextvars.copy_context()) for t in tasks]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException:  # Ctrl-C in the caller: start nothing more, let the running tasks end
            stop.set()
            if cancel is not None:
                cancel.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        if errors:  # the tasks not yet started are not run; the running ones are waited for
            pool.shutdown(wait=True, cancel_futures=True)
            raise errors[0]
    return [f.result() for f in futures]


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
        """Count ``n`` more bytes and report the new total."""
        with self._lock:
            self.done += n
            if self.progress is not None:
                self.progress(self.done, self.total)
