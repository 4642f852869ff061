"""``torch.distributed.checkpoint`` (DCP) directories, read and assembled without torch's reader.

A DCP directory holds a pickled ``.metadata`` (global shape, dtype and chunks
of every tensor, and where each chunk's bytes are) and per-rank ``.distcp``
files.  Nothing here hands the directory to torch's ``FileSystemReader``:

* :mod:`ckptfix.formats.dcp.meta` reads ``.metadata`` with the restricted pickle reader
  (an allowlist of exactly the DCP metadata record classes, rebuilt as plain
  records), validates it against the files, and writes it back.
* :mod:`ckptfix.formats.dcp.chunks` locates each chunk's bytes (a small ``torch.save``
  archive at a byte range of a ``.distcp`` file) without torch.
* :mod:`ckptfix.formats.dcp.assemble` builds full torch tensors for ``load_anywhere``.

This package is the format's reader only; it imports nothing above :mod:`ckptfix.pickles` and
:mod:`ckptfix.files.fileio`.  The operations on DCP directories live with their kind:
:mod:`ckptfix.ops.convert.dcp_in` streams a DCP directory into safetensors, :mod:`ckptfix.ops.convert.dcp_out`
writes one from safetensors, :mod:`ckptfix.ops.rewrite.dcp` renames keys by rewriting ``.metadata`` only.
"""

from ckptfix.formats.dcp.meta import DcpMetadata, read_metadata

__all__ = ["DcpMetadata", "read_metadata"]
