"""Start-up without the garbage collector walking what imports make (issue 25: a fifth of the start-up).

Importing click and a command's modules creates tens of thousands of objects (functions, classes, code,
dicts), and CPython's cyclic collector runs a pass every 700 new objects: dozens of passes, each walking
the young objects, the later ones most of what was imported.  None of it is garbage: a module's objects live
as long as the process.  :func:`imports_quietly` pauses the collector while modules are imported, then
:func:`gc.freeze` moves everything alive to the permanent generation (no later pass walks it again) and the
collector resumes, so a command's own work, however long, runs with it as usual.  Measured on
``ckptfix inspect`` (``benchmarks/bench_startup.py``): about 6 ms of 47 ms.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def imports_quietly() -> Iterator[None]:
    """Within the block (imports only), no collection; after it, what is alive is frozen and the collector
    is back as it was (left off where the caller had turned it off)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()
