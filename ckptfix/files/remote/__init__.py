"""Reading checkpoints where they live: object stores and web servers through fsspec.

* :mod:`ckptfix.files.remote.url`: schemes, drivers, URL joins;
* :mod:`ckptfix.files.remote.file`: :class:`~.file.RemoteFile`, byte ranges with read-ahead, a bounded
  cache, coalescing, parallel ranges, retries and ETag pinning;
* :mod:`ckptfix.files.remote.stats`: :class:`~.stats.Stats`, what a command transferred (``--stats``).

Inputs go through :mod:`ckptfix.files.source` (local or remote); nothing here imports fsspec at module level.
"""

from __future__ import annotations

from ckptfix.files.remote.stats import Stats, collect
from ckptfix.files.remote.url import is_url

__all__ = ["Stats", "collect", "is_url"]
