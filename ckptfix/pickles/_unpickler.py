"""The unpickler and its error, without ``pickle.py``.

``pickle.Unpickler`` and ``pickle.UnpicklingError`` are the C module's (``pickle.py`` re-exports
``_pickle``'s), but importing ``pickle`` executes its 1,800 lines of Python (about 1.3 ms of every
``inspect`` and ``scan``, which only read).  The same objects come from ``_pickle`` itself; an
interpreter without it gets ``pickle``'s.
"""

from __future__ import annotations

try:
    from _pickle import Unpickler, UnpicklingError
except ImportError:  # pragma: no cover - not CPython
    from pickle import Unpickler, UnpicklingError

__all__ = ["Unpickler", "UnpicklingError"]
