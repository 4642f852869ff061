"""Start-up of the ``ckptfix`` process without the garbage collector walking what imports make.

Importing click and a command's modules creates tens of thousands of objects (functions, classes, code,
dicts), and CPython's cyclic collector runs a pass every 700 new objects: dozens of passes, the later ones
walking most of what was imported, and none of it is garbage (a module's objects live as long as the
process).  :func:`imports_quietly` pauses the collector while modules are imported; in the ``ckptfix``
process itself (:func:`command_process`: the console script, ``python -m ckptfix``) it then moves everything
alive to the permanent generation (:func:`gc.freeze`), so that no later pass walks it again.  The collector
then resumes: a command's own work, however long, runs with it as usual.  Measured on ``ckptfix inspect``
(``benchmarks/bench_startup.py``): 47 -> 38 ms, against 30 ms for ``python -c "import click"``.

A program that calls :func:`ckptfix.cli.main` itself (tests, embedding) is not frozen: its own objects
alive at that moment could otherwise never be collected.  Only the pause applies there (harmless).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

_FREEZE = [False]


def command_process() -> None:
    """Say that this process is the ``ckptfix`` command (its entry point calls this first)."""
    _FREEZE[0] = True


@contextlib.contextmanager
def imports_quietly() -> Iterator[None]:
    """Within the block (imports only), no collection; after it, in the ``ckptfix`` process, what is alive is
    frozen; the collector is then back as it was (left off where the caller had turned it off)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _FREEZE[0]:
            gc.freeze()
        if was:
            gc.enable()
