"""Reading checkpoints where they live: object stores and web servers through fsspec (issue #26).

* :mod:`ckptfix.remote.url`: schemes, drivers, URL joins;
* :mod:`ckptfix.remote.file`: :class:`~ckptfix.remote.file.RemoteFile`, byte ranges with read-ahead, a bounded
  cache, coalescing, parallel ranges, retries and ETag pinning;
* :mod:`ckptfix.remote.stats`: :class:`~ckptfix.remote.stats.Stats`, what a command transferred (``--stats``).

Inputs go through :mod:`ckptfix.source` (local or remote); nothing here imports fsspec at module level.
"""

from __future__ import annotations

from ckptfix.remote.stats import Stats, collect
from ckptfix.remote.url import is_url

__all__ = ["Stats", "collect", "is_url"]
