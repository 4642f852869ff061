"""torch's ``HuggingFaceStorageWriter`` output (``save_distributed=True``), read torch-free.

Each rank writes ``shard-<rank+1>-model-<i>-of-<n>.safetensors``: a safetensors file whose tensors are that
rank's chunks, with ``__metadata__["DCP_SHARDING_INFO"]`` (JSON ``{fqn: {"saved_offsets": [...]}}``, in
the rank's state-dict order) saying where each chunk sits in the full tensor.  There is no ``.metadata``.

This module is the reader: :func:`find_hf_storage` recognises such a folder, :func:`read_hf_storage` reads
every shard's header and sharding info, :func:`chunk_runs` says where each chunk's contiguous byte runs sit,
and :func:`hf_storage_state_dict` builds torch tensors for ``load_anywhere``.  Consolidating into one
safetensors file is an operation: :mod:`ckptfix.ops.convert.hfstorage`.

The fqn order is the state-dict order the ranks recorded: every shard's ``DCP_SHARDING_INFO`` order merged
(shard 1 first; a replicated tensor only one rank wrote keeps its place).  Each full shape is the largest
``offset + size`` over the chunks.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from ckptfix.errors import CorruptCheckpointError, UnsupportedError
from ckptfix.files import pins
from ckptfix.formats.safetensors_fmt import ST_TO_DTYPE, read_header
from ckptfix.pickles import ELEMENT_SIZE

__all__ = [
    "HfStorageCheckpoint",
    "find_hf_storage",
    "read_hf_storage",
    "describe",
    "refuse_single_shard",
    "chunk_runs",
    "hf_storage_state_dict",
]

_SHARD_RE = re.compile(r"shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
SHARDING_KEY = "DCP_SHARDING_INFO"


@dataclass
class _Chunk:
    path: str
    data_offset: int  # absolute file offset of the chunk's bytes
    offsets: list[int]
    sizes: list[int]


@dataclass
class _Tensor:
    name: str
    st_dtype: str
    shape: list[int]
    chunks: list[_Chunk] = field(default_factory=list)

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZE[ST_TO_DTYPE[self.st_dtype]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.element_size


@dataclass
class HfStorageCheckpoint:
    """A folder of ``HuggingFaceStorageWriter`` shards (:func:`find_hf_storage`).

    Attributes:
        path: the folder.
        files: the shard files, in (shard, model file) order.
        tensors: filled by :func:`read_hf_storage`, in consolidation order.
    """

    path: str
    files: list[str]
    tensors: list[_Tensor] = field(default_factory=list)
    read: bool = False


def find_hf_storage(path: str | os.PathLike) -> HfStorageCheckpoint | None:
    """Recognise a folder written by ``HuggingFaceStorageWriter(save_distributed=True)`` (names only).

    Args:
        path: a directory.

    Returns:
        The checkpoint (not read yet), or None: not a directory, a ``.metadata`` present (a
        FileSystemWriter DCP folder), or no ``shard-*-model-*-of-*.safetensors`` files.

    Raises:
        CorruptCheckpointError: a gap in the shard numbers (a rank's file is missing).
    """
    p = os.fspath(path)
    if not os.path.isdir(p) or os.path.exists(os.path.join(p, ".metadata")):
        return None
    found = []
    for n in os.listdir(p):
        m = _SHARD_RE.match(n)
        if m:
            found.append(((int(m.group(1)), int(m.group(2))), os.path.join(p, n)))
    if not found:
        return None
    shards = sorted({s for (s, _), _ in found})
    if shards != list(range(1, len(shards) + 1)):
        missing = sorted(set(range(1, shards[-1] + 1)) - set(shards))
        raise CorruptCheckpointError(
            f"{p}: shard(s) {', '.join(f'{m:05d}' for m in missing)} of a HuggingFaceStorageWriter checkpoint are "
            "missing (shard-NNNNN-model-*.safetensors, one per rank); copy every file the ranks wrote"
        )
    return HfStorageCheckpoint(p, [f for _, f in sorted(found)])


def refuse_single_shard(path: str | os.PathLike) -> None:
    """Refuse one rank's ``shard-*-model-*.safetensors`` on its own: it holds only that rank's chunks.

    Args:
        path: any input path (only a file named like a shard, with ``DCP_SHARDING_INFO``, is refused).

    Raises:
        UnsupportedError: naming the folder to pass instead.
    """
    p = os.fspath(path)
    if not _SHARD_RE.match(os.path.basename(p)) or not os.path.isfile(p):
        return
    try:
        header, _ = read_header(p)
    except CorruptCheckpointError:
        return
    meta = header.get("__metadata__")
    if isinstance(meta, dict) and SHARDING_KEY in meta:
        raise UnsupportedError(
            f"{p}: one rank's shard of a torch HuggingFaceStorageWriter checkpoint (only its chunks of the tensors); "
            f"pass the folder to get the whole model: {os.path.dirname(os.path.abspath(p))}"
        )


def read_hf_storage(hf: HfStorageCheckpoint) -> HfStorageCheckpoint:
    """Read every shard's header; lay out the full tensors and their chunks.

    Args:
        hf: from :func:`find_hf_storage`.

    Returns:
        ``hf`` with ``tensors`` filled.

    Raises:
        CorruptCheckpointError: a shard without ``DCP_SHARDING_INFO``, chunks that disagree on dtype or
            rank, chunks that do not cover a tensor (a shard file is missing), a truncated shard.
    """
    if hf.read:
        return hf
    tensors: dict[str, _Tensor] = {}
    orders: list[list[str]] = []
    for f in hf.files:
        header, start = read_header(f)
        meta = header.pop("__metadata__", None) or {}
        raw = meta.get(SHARDING_KEY) if isinstance(meta, dict) else None
        if not isinstance(raw, str):
            raise CorruptCheckpointError(
                f"{f}: no {SHARDING_KEY} in its metadata; not written by torch's HuggingFaceStorageWriter"
            )
        try:
            info = json.loads(raw)
        except ValueError:
            raise CorruptCheckpointError(f"{f}: {SHARDING_KEY} is not JSON; the shard is corrupt") from None
        size = pins.fstat(f).st_size
        if not isinstance(info, dict):
            raise CorruptCheckpointError(f"{f}: {SHARDING_KEY} is not a JSON object; the shard is corrupt")
        orders.append([str(n) for n in info])
        for name, ent in info.items():
            h = header.get(name)
            if not isinstance(h, dict) or not isinstance(ent, dict):
                raise CorruptCheckpointError(f"{f}: {SHARDING_KEY} names {name!r}, which the file does not hold")
            dtype, shape, offs = h.get("dtype"), list(h.get("shape", ())), list(ent.get("saved_offsets", ()))
            if dtype not in ST_TO_DTYPE or ST_TO_DTYPE[dtype] not in ELEMENT_SIZE:
                raise UnsupportedError(f"{f}: tensor {name!r} has dtype {dtype!r}, which ckptfix cannot consolidate")
            if len(offs) != len(shape) or not all(isinstance(x, int) and x >= 0 for x in offs + shape):
                raise CorruptCheckpointError(f"{f}: tensor {name!r}: offsets {offs} do not fit shape {shape}")
            b, e = h.get("data_offsets", (0, 0))
            if start + e > size:
                raise CorruptCheckpointError(f"{f}: tensor {name!r} runs past the end of the file (truncated?)")
            t = tensors.get(name)
            if t is None:
                t = tensors[name] = _Tensor(name, dtype, [s + o for s, o in zip(shape, offs, strict=True)])
            elif t.st_dtype != dtype or len(t.shape) != len(shape):
                raise CorruptCheckpointError(f"{f}: chunks of {name!r} disagree on dtype or rank")
            else:
                t.shape = [max(a, s + o) for a, s, o in zip(t.shape, shape, offs, strict=True)]
            t.chunks.append(_Chunk(f, start + b, offs, shape))
    from ckptfix.formats.dcp.meta import Chunk, TensorEntry, check_tiling

    for t in tensors.values():  # (a missing *last* shard cannot be told from the files: torch has no index)
        # by positions, not summed sizes: a rank's file copied over another's still adds up (issue 39)
        entry = TensorEntry(
            t.name, t.st_dtype, tuple(t.shape), [Chunk(tuple(c.offsets), tuple(c.sizes)) for c in t.chunks]
        )
        check_tiling(
            entry,
            f"{hf.path}: tensor {t.name!r} ({t.shape}); a shard file is missing or copied from another rank's "
            "(copy every shard-*-model-*.safetensors the ranks wrote)",
        )
    hf.tensors = [tensors[n] for n in _merged_order(orders)]
    hf.read = True
    return hf


def _merged_order(orders: list[list[str]]) -> list[str]:
    """One order that keeps every shard's order: a name first seen in a later shard goes right after its
    predecessor there, else right before its successor (a replicated tensor is written by one rank only,
    and sits in that rank's list at its state-dict place)."""
    out: list[str] = []
    pos: dict[str, int] = {}
    for seq in orders:
        for i, n in enumerate(seq):
            if n in pos:
                continue
            at = len(out)
            if i > 0:
                at = pos[seq[i - 1]] + 1
            else:
                nxt = next((m for m in seq if m in pos), None)
                if nxt is not None:
                    at = pos[nxt]
            out.insert(at, n)
            if at == len(out) - 1:
                pos[n] = at
            else:
                pos = {m: k for k, m in enumerate(out)}
    return out


def describe(hf: HfStorageCheckpoint) -> list[tuple[str, str]]:
    """Lines for ``inspect FOLDER``: ``(label, text)`` pairs (reads the headers on demand).

    Args:
        hf: from :func:`find_hf_storage`.

    Returns:
        framework, shards, weights.
    """
    from ckptfix.text import human_bytes

    read_hf_storage(hf)
    dtypes: dict[str, int] = {}
    for t in hf.tensors:
        dtypes[ST_TO_DTYPE[t.st_dtype]] = dtypes.get(ST_TO_DTYPE[t.st_dtype], 0) + 1
    n = sum(math.prod(t.shape) for t in hf.tensors)
    return [
        ("framework", "torch DCP, HuggingFaceStorageWriter(save_distributed=True): one shard per rank"),
        ("shards", f"{len(hf.files)} file(s), {human_bytes(sum(pins.fstat(f).st_size for f in hf.files))}"),
        (
            "weights",
            f"{len(hf.tensors)} tensors, {n:,} values, {human_bytes(sum(t.nbytes for t in hf.tensors))}; "
            + ", ".join(f"{d} x{c}" for d, c in sorted(dtypes.items())),
        ),
    ]


def chunk_runs(t: _Tensor, c: _Chunk) -> Iterator[tuple[int, int, int]]:
    """(source byte offset, destination byte offset in the tensor, bytes) of the chunk's contiguous runs."""
    es = t.element_size
    full, sizes, offs = t.shape, c.sizes, c.offsets
    nd = len(full)
    if nd == 0 or math.prod(sizes) == 0:
        if nd == 0:
            yield c.data_offset, 0, es
        return
    # j: the first dim from which the chunk is contiguous in the full tensor
    j = nd - 1
    while j > 0 and sizes[j:] == full[j:]:
        j -= 1
    if sizes[j + 1 :] != full[j + 1 :]:
        j += 1  # pragma: no cover - defensive
    stride = [math.prod(full[d + 1 :]) for d in range(nd)]
    run = math.prod(sizes[j:])
    outer = sizes[:j]
    n_runs = math.prod(outer)
    idx = [0] * j
    for r in range(n_runs):
        dst = sum((idx[d] + offs[d]) * stride[d] for d in range(j)) + offs[j] * stride[j]
        yield c.data_offset + r * run * es, dst * es, run * es
        for d in range(j - 1, -1, -1):
            idx[d] += 1
            if idx[d] < outer[d]:
                break
            idx[d] = 0


def hf_storage_state_dict(hf: HfStorageCheckpoint) -> dict[str, Any]:
    """The consolidated tensors as torch tensors (for ``load_anywhere``).  Needs torch.

    Args:
        hf: from :func:`find_hf_storage`.

    Returns:
        name -> CPU tensor, in consolidation order.
    """
    read_hf_storage(hf)
    return tensors_of(hf.tensors, "load_anywhere on a HuggingFaceStorageWriter folder")


def tensors_of(tensors: Iterable[_Tensor], purpose: str) -> dict[str, Any]:
    """Each tensor assembled from its chunks' byte runs as a CPU torch tensor (``purpose`` names what needs
    torch, for its install message)."""
    from ckptfix._torch import require_torch

    torch = require_torch(purpose)
    sd: dict[str, Any] = {}
    fds: dict[str, int] = {}
    try:
        for t in tensors:
            buf = bytearray(t.nbytes)
            view = memoryview(buf)
            for c in t.chunks:
                src = fds.get(c.path)
                if src is None:
                    src = fds[c.path] = pins.open_fd(c.path)
                for s_off, d_off, n in chunk_runs(t, c):
                    if os.preadv(src, [view[d_off : d_off + n]], s_off) != n:
                        raise CorruptCheckpointError(f"{c.path}: ends inside tensor {t.name!r} (truncated?)")
            dt = getattr(torch, ST_TO_DTYPE[t.st_dtype])
            flat = torch.frombuffer(buf, dtype=dt) if buf else torch.empty(0, dtype=dt)
            sd[t.name] = flat.view(t.shape)
    finally:
        for x in fds.values():
            os.close(x)
    return sd
