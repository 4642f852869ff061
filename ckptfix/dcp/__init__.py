"""``torch.distributed.checkpoint`` (DCP) directories, read, assembled and rewritten without torch's reader.

A DCP directory holds a pickled ``.metadata`` (global shape, dtype and chunks
of every tensor, and where each chunk's bytes are) and per-rank ``.distcp``
files.  Nothing here hands the directory to torch's ``FileSystemReader``:

* :mod:`ckptfix.dcp.meta` reads ``.metadata`` with the restricted pickle reader
  (an allowlist of exactly the DCP metadata record classes, rebuilt as plain
  records), validates it against the files, and writes it back.
* :mod:`ckptfix.dcp.chunks` locates each chunk's bytes (a small ``torch.save``
  archive at a byte range of a ``.distcp`` file) without torch.
* :mod:`ckptfix.dcp.assemble` builds full torch tensors for ``load_anywhere``.
* :mod:`ckptfix.dcp.consolidate` streams a DCP directory into safetensors.
* :mod:`ckptfix.dcp.rewrite` renames keys by rewriting ``.metadata`` only.
"""

from ckptfix.dcp.meta import DcpMetadata, read_metadata

__all__ = ["DcpMetadata", "read_metadata"]
