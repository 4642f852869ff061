"""Assemble a full state dict from a DCP directory of any sharding, without a process group.

torch is used only where tensors are made: each global tensor is allocated once
(``torch.empty``) and its chunks are read into place, straight into the
tensor's memory when a chunk is a contiguous range of it (row sharding,
replicated), else through a bounded staging buffer copied into the chunk's
slice (column or other sharding).  Peak memory is the state dict plus one
staging buffer (:data:`STAGE_BYTES`), and no numpy is needed.  ``.metadata``
and the chunk pickles are read with the restricted reader
(:mod:`ckptfix.formats.dcp.meta`, :mod:`ckptfix.formats.dcp.chunks`), never by torch's DCP reader.
"""

from __future__ import annotations

import ctypes
import io
import itertools
import os
import warnings
from typing import TYPE_CHECKING, Any

from ckptfix.errors import CkptfixError, CorruptCheckpointError
from ckptfix.formats.dcp.chunks import ChunkData, Files, locate_chunk, raw_object_bytes, read_block, read_object
from ckptfix.formats.dcp.meta import BytesEntry, DcpMetadata, TensorEntry, read_metadata, validate

if TYPE_CHECKING:
    import torch

#: bytes of chunk data staged at a time for chunks that are not a contiguous range of their tensor
STAGE_BYTES = 64 << 20


def _writable_view(t: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no numpy)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def flat_range(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, int] | None:
    """(first, end) element of a chunk in its tensor's row-major layout if the chunk is one contiguous range.

    Args:
        shape: the tensor's shape.
        offsets: the chunk's offsets in it.
        sizes: the chunk's sizes.

    Returns:
        ``(first, end)``, or None when the chunk is not one contiguous range.
    """
    nd = len(shape)
    k = nd
    while k > 0 and sizes[k - 1] == shape[k - 1]:
        k -= 1
    # dims >= k are full; dim k-1 may be partial; all dims before it must be of size 1
    if any(sizes[j] != 1 for j in range(max(0, k - 1))):
        return None
    stride, acc = [0] * nd, 1
    for j in range(nd - 1, -1, -1):
        stride[j] = acc
        acc *= shape[j]
    first = sum(o * s for o, s in zip(offsets, stride, strict=False))
    n = 1
    for s in sizes:
        n *= s
    return first, first + n


def _read_into(fd: Any, view: memoryview, off: int, what: str) -> None:
    done = 0
    if not isinstance(fd, int):  # a remote Source (a DCP folder at a URL): one range read
        data = fd.pread(len(view), off)
        if len(data) != len(view):
            raise CorruptCheckpointError(f"{what}: the file ended inside the chunk (truncated?)")
        view[:] = data
        return
    while done < len(view):
        n = os.preadv(fd, [view[done:]], off + done)
        if n <= 0:
            raise CorruptCheckpointError(f"{what}: the file ended inside the chunk (truncated?)")
        done += n


def assemble_tensor(files: Files, e: TensorEntry, torch_dtype: Any, where: str = "") -> torch.Tensor:
    """One global tensor, built from its chunks (CPU).

    Args:
        files: the open ``.distcp`` files.
        e: the tensor's metadata entry.
        torch_dtype: its torch dtype.
        where: names the checkpoint in messages.

    Returns:
        The torch tensor.

    Raises:
        CorruptCheckpointError, UnsafePickleError, UnsupportedError: from the chunks.
    """
    import torch

    t = torch.empty(e.shape, dtype=torch_dtype)
    mv = _writable_view(t)
    es = e.element_size
    for i, c in enumerate(e.chunks):
        if c.numel == 0:
            continue
        cd: ChunkData = locate_chunk(files, e, i, where)
        what = f"{where}tensor {e.fqn!r} chunk {list(c.offsets)}"
        fr = flat_range(e.shape, c.offsets, c.sizes)
        if fr is not None and cd.contiguous():
            _read_into(files.source(cd.rel) or files.fd(cd.rel), mv[fr[0] * es : fr[1] * es], cd.data_offset, what)
            continue
        row = c.numel // c.sizes[0] * es
        step = max(1, STAGE_BYTES // max(1, row))  # rows per staging block
        for lo in range(0, c.sizes[0], step):
            hi = min(c.sizes[0], lo + step)
            data = bytearray(read_block(files, cd, (), lo, hi, what))
            src = torch.frombuffer(data, dtype=torch_dtype).view((hi - lo,) + c.sizes[1:])
            region = [slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=False)]
            region[0] = slice(c.offsets[0] + lo, c.offsets[0] + hi)
            t[tuple(region)].copy_(src)
    del mv
    return t


def set_element(root: dict, path: tuple, value: Any) -> None:
    """Put ``value`` at ``path`` of a nested dict/list tree, creating dicts and lists as torch's planner does.

    Args:
        root: the tree (changed in place).
        path: keys (str) and list indices (int) from the root.
        value: what to put there.
    """
    node: Any = root
    for k, nxt in itertools.pairwise(path):
        child = (
            node[k] if (isinstance(node, list) and k < len(node)) or (isinstance(node, dict) and k in node) else None
        )
        if child is None:
            child = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                node.extend([None] * (k + 1 - len(node)))
            node[k] = child
        node = child
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


def load_dcp(
    path: str,
    *,
    pickle_module: Any,
    device: str = "cpu",
    meta: DcpMetadata | None = None,
) -> dict:
    """The whole checkpoint a DCP directory holds, as the nested dict that was saved.

    Args:
        path: the DCP directory.
        device: where the tensors go (each is assembled on the CPU, then moved).
        pickle_module: how non-tensor objects (``torch.save``'d pickles) are unpickled: the caller's
            restricted pickle module (:func:`ckptfix.ops.load.restricted_pickle_module`), or None to
            unpickle them fully (only for a trusted checkpoint).  ``.metadata`` itself is always read
            with the restricted reader.
        meta: the directory's metadata, when already read.

    Returns:
        dict: the nested state dict (``{"model": {...}, "optim": {...}}`` as it was passed to ``dcp.save``).

    Raises:
        CorruptCheckpointError, UnsafePickleError, UnsupportedError, CheckpointNotFoundError.
    """
    import torch

    meta = meta or read_metadata(path)
    meta.check_safe()
    validate(meta)
    out: dict = {}
    with Files(path) as files:
        for fqn, e in meta.entries.items():
            if isinstance(e, TensorEntry):
                try:
                    dt = getattr(torch, e.dtype)
                except AttributeError:
                    from ckptfix.errors import UnsupportedError

                    raise UnsupportedError(f"tensor {fqn!r}: dtype {e.dtype} does not exist in this torch") from None
                value: Any = assemble_tensor(files, e, dt)
                if device != "cpu":
                    value = value.to(device)
            else:
                value = _load_object(files, e, pickle_module)
            try:
                set_element(out, meta.key_path(fqn), value)
            except (TypeError, IndexError, KeyError, AttributeError):
                raise CorruptCheckpointError(
                    f"{path}: entry {fqn!r} has a nesting path that clashes with another "
                    "entry's; the metadata is corrupt"
                ) from None
    return out


def _refuse_partial(files: Files, e: BytesEntry) -> None:
    """An object torch could not rebuild that is one rank's DTensor shards: that refusal, not "corrupt"."""
    from ckptfix.errors import PartitionedCheckpointError

    try:
        read_object(files, e)
    except PartitionedCheckpointError:
        raise
    except (CkptfixError, OSError):
        pass


def _load_object(files: Files, e: BytesEntry, pmod: Any) -> Any:
    import torch

    data = raw_object_bytes(files, e)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if pmod is None:
                return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")
            return torch.load(io.BytesIO(data), weights_only=False, pickle_module=pmod, map_location="cpu")
    except CkptfixError:
        raise
    except Exception as ex:  # noqa: BLE001 - any failure of torch.load on stored bytes is corruption
        _refuse_partial(files, e)
        raise CorruptCheckpointError(
            f"object {e.fqn!r} cannot be read ({type(ex).__name__}: "
            f"{str(ex).splitlines()[0][:200] if str(ex) else ''}); the chunk is corrupt"
        ) from None
    except BaseException as ex:  # torch's CheckpointException and friends are BaseExceptions
        if isinstance(ex, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise CorruptCheckpointError(f"object {e.fqn!r} cannot be read ({type(ex).__name__})") from None
