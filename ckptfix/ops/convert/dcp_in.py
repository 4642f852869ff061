"""Consolidate a DCP directory into safetensors, streaming, without torch.

A tensor whose chunks are whole row blocks (FSDP's ``Shard(0)``, replication) is
the chunks' bytes end to end: :meth:`DcpItem.ranges` hands them to the writer as
byte ranges of the ``.distcp`` files, copied and verified like any other range
(:mod:`ckptfix.files.fileio`).  Any other tensor is produced in output order from its
chunks, through a bounded buffer (:data:`BLOCK_BYTES`): a chunk that covers whole trailing
dimensions (row sharding, replication) is a contiguous range of the tensor
and is copied in row groups; otherwise (column sharding, any chunk offsets)
a group of rows is assembled from the chunks' runs and written at once.  No
tensor is ever held whole.  The safetensors writer of :mod:`ckptfix.ops.convert.write`
writes and verifies every block against the bytes just read from the
sources, and lays the file out exactly as ``safetensors.torch.save_file``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Mapping

from ckptfix.errors import CkptfixError, CorruptCheckpointError, NoTensorsError
from ckptfix.files.outputs import OutputOptions
from ckptfix.formats import stmeta
from ckptfix.formats.dcp.checkpoint import read_dcp
from ckptfix.formats.dcp.chunks import ChunkData, Files, locate_chunk, ndindex, read_block
from ckptfix.formats.dcp.meta import Chunk, DcpMetadata, TensorEntry, read_metadata, validate
from ckptfix.ops.convert.extras import split_checkpoint
from ckptfix.ops.convert.forward import drop_named, refuse_unwritten
from ckptfix.ops.convert.items import Item, Range, check_dtype
from ckptfix.ops.convert.options import ConvertOptions
from ckptfix.ops.convert.plan import output_names
from ckptfix.ops.convert.report import ConvertReport
from ckptfix.ops.convert.write import write_outputs
from ckptfix.pickles import TensorRecord
from ckptfix.text import parse_size

#: bytes assembled at a time
BLOCK_BYTES = 8 << 20


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


class TensorStream:
    """The C-order bytes of one global tensor, produced from its chunks in bounded blocks."""

    def __init__(self, files: Files, e: TensorEntry, block: int | None = None) -> None:
        self.files, self.e, self.block = files, e, block or BLOCK_BYTES
        self.es = e.element_size
        self._pool: dict[str, list[bytearray]] = {}

    def _buf(self, role: str, n: int) -> bytearray:
        """A reused buffer of exactly ``n`` bytes (each is consumed before the next is asked for).

        The two most recent sizes are kept per role (full blocks and the last, shorter one), so memory
        stays at a few blocks however many chunk widths there are.
        """
        pool = self._pool.setdefault(role, [])
        for i, b in enumerate(pool):
            if len(b) == n:
                if i:
                    pool.insert(0, pool.pop(i))
                return b
        b = bytearray(n)
        pool.insert(0, b)
        del pool[2:]
        return b

    def __iter__(self) -> Iterator[bytes | bytearray]:
        e = self.e
        if e.numel == 0:
            return
        parts = [(c, locate_chunk(self.files, e, i)) for i, c in enumerate(e.chunks) if c.numel]
        yield from self._emit(parts, (), 0)

    def _what(self, c: Chunk) -> str:
        return f"tensor {self.e.fqn!r} chunk {list(c.offsets)}"

    def _emit(
        self, parts: list[tuple[Chunk, ChunkData]], prefix: tuple[int, ...], d: int
    ) -> Iterator[bytes | bytearray]:
        shape, es = self.e.shape, self.es
        nd = len(shape)
        if d == nd:  # one element (a 0-d tensor, or a fully fixed prefix)
            c, cd = parts[0]
            local = tuple(i - o for i, o in zip(prefix, c.offsets, strict=False))
            yield (
                read_block(self.files, cd, local[:-1], local[-1], local[-1] + 1, self._what(c))
                if nd
                else read_block(self.files, cd, (), 0, 0, self._what(c))
            )
            return
        row = _prod(shape[d + 1 :]) * es
        full_rows = all(c.sizes[j] == shape[j] for c, _ in parts for j in range(d + 1, nd))
        if row > self.block and d + 1 < nd:  # one row is too big: go down a dimension, row by row
            for r in range(shape[d]):
                sub = [(c, cd) for c, cd in parts if c.offsets[d] <= r < c.offsets[d] + c.sizes[d]]
                yield from self._emit(sub, prefix + (r,), d + 1)
            return
        per = max(1, self.block // max(1, row))
        if full_rows:  # each chunk is a contiguous range of this sub-tensor: copy it in row groups
            for c, cd in sorted(parts, key=lambda p: p[0].offsets[d]):
                local = tuple(i - o for i, o in zip(prefix, c.offsets, strict=False))
                for lo in range(0, c.sizes[d], per):
                    yield read_block(
                        self.files,
                        cd,
                        local,
                        lo,
                        min(c.sizes[d], lo + per),
                        self._what(c),
                        lambda n: self._buf("out", n),
                    )
            return
        for r0 in range(0, shape[d], per):  # assemble groups of rows from the chunks' runs
            r1 = min(shape[d], r0 + per)
            buf = self._buf("out", (r1 - r0) * row)  # every byte is overwritten: the chunks tile the rows
            dst = memoryview(buf)
            dshape = (r1 - r0,) + tuple(shape[d + 1 :])
            dstride = [0] * len(dshape)
            acc = 1
            for j in range(len(dshape) - 1, -1, -1):
                dstride[j] = acc
                acc *= dshape[j]
            for c, cd in parts:
                lo, hi = max(r0, c.offsets[d]), min(r1, c.offsets[d] + c.sizes[d])
                if lo >= hi:
                    continue
                local = tuple(i - o for i, o in zip(prefix, c.offsets, strict=False))
                src = memoryview(
                    read_block(
                        self.files,
                        cd,
                        local,
                        lo - c.offsets[d],
                        hi - c.offsets[d],
                        self._what(c),
                        lambda n: self._buf("in", n),
                    )
                )
                pshape = (hi - lo,) + tuple(c.sizes[d + 1 :])
                # dims m.. of the piece are full in the tensor: a run covers dim m-1 and everything after it
                m = len(pshape)
                while m > 1 and pshape[m - 1] == dshape[m - 1]:
                    m -= 1
                run = _prod(pshape[m - 1 :]) * es
                pstride = [0] * len(pshape)
                acc = 1
                for j in range(len(pshape) - 1, -1, -1):
                    pstride[j] = acc
                    acc *= pshape[j]
                pos = (lo - r0,) + tuple(c.offsets[d + 1 :])
                base = (
                    sum(p * st for p, st in zip(pos, dstride, strict=False)) * es
                )  # where the piece's first element goes
                if m == 1:  # the whole piece is one run
                    dst[base : base + run] = src[:run]
                    continue
                k = m - 2  # the innermost iterated dim: a tight loop; the dims before it, generic
                s_step, d_step, count = pstride[k] * es, dstride[k] * es, pshape[k]
                for idx in ndindex(pshape[:k]):
                    s0 = sum(i * st for i, st in zip(idx, pstride, strict=False)) * es
                    d0 = base + sum(i * st for i, st in zip(idx, dstride, strict=False)) * es
                    for _ in range(count):
                        dst[d0 : d0 + run] = src[s0 : s0 + run]
                        s0 += s_step
                        d0 += d_step
            yield buf


@dataclass
class DcpItem(Item):
    """A DCP tensor to write: its bytes come from :class:`TensorStream`."""

    entry: Any = None
    files: Any = None
    _ranges: Any = None

    def ranges(self) -> list[Range] | None:
        """The tensor as byte ranges of the ``.distcp`` files, when its chunks are whole row blocks in C order.

        Row sharding (FSDP, DDP replication, any chunk that spans every dimension but the first)
        makes the global tensor the chunks' bytes end to end, in order of their first offset:
        each is then copied in the kernel like any other range.

        Returns:
            ``[(path, offset, nbytes, crc)]`` or None (the chunks are assembled block by block).
        """
        if self._ranges is None:
            self._ranges = _row_ranges(self.files, self.entry) or []
        return self._ranges or None

    def chunks(self, fds: Any) -> Iterator[bytes | bytearray | memoryview]:
        """The tensor's bytes, C-contiguous, assembled block by block from its chunks.

        Args:
            fds: unused (the chunks' files are ``self.files``).

        Returns:
            An iterator of blocks of at most :data:`BLOCK_BYTES`.
        """
        yield from TensorStream(self.files, self.entry)


def _row_ranges(files: Files, e: TensorEntry) -> list[Range] | None:
    """The byte ranges of ``e``'s chunks, when they are whole C-order row blocks tiling dimension 0."""
    if e.numel == 0:
        return None
    shape = tuple(e.shape)
    parts = [(c, i) for i, c in enumerate(e.chunks) if c.numel]
    if any(tuple(c.sizes[1:]) != shape[1:] for c, _ in parts):
        return None
    parts.sort(key=lambda p: p[0].offsets[0] if shape else 0)
    out: list[Range] = []
    row = 0
    for c, i in parts:
        if shape and c.offsets[0] != row:
            return None
        cd = locate_chunk(files, e, i)
        if not cd.contiguous() or "\x00" in cd.rel:  # (a decompressed item is no byte range of a data file)
            return None
        n = c.numel * e.element_size
        out.append((_data_path(files.root, cd.rel), cd.data_offset, n, cd.crc))
        row += c.sizes[0] if shape else 1
    if (shape and row != shape[0]) or (not shape and len(out) != 1):
        return None
    return out


def _prefetch_archives(files: Files, meta: DcpMetadata, jobs: int) -> None:
    """A folder at a URL: the head and tail of every tensor chunk's archive (its zip records, ``data.pkl``, central
    directory) fetched in a few parallel, coalesced requests, before the chunks are located one by one."""
    if "://" not in files.root:
        return
    per: dict[str, list[tuple[int, int]]] = {}
    for e in meta.tensors():
        for loc in e.locations:
            n = min(loc.length, 4096)
            per.setdefault(loc.relative_path, []).extend([(loc.offset, n), (loc.offset + loc.length - n, n)])
    for rel, ranges in per.items():
        src = files.source(rel)
        if src is not None and hasattr(src, "prefetch"):
            src.prefetch(ranges, jobs=max(4, jobs))


def _data_path(root: str, rel: str) -> str:
    """A data file's path: joined as a URL for a DCP folder in object storage (its ranges are then read remotely)."""
    if "://" in root:
        from ckptfix.files import source

        if source.is_url(root):
            return source.join(root, rel)
    return os.path.join(root, rel)


def convert_dcp(
    src: str,
    dst: str,
    outputs: OutputOptions,
    options: ConvertOptions,
    *,
    meta: DcpMetadata | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
) -> ConvertReport:
    """Write a DCP directory's state dict as safetensors (called by :func:`ckptfix.ops.convert.convert_to_safetensors`).

    ``drop``: tensors to leave out, as for :func:`ckptfix.ops.convert.convert_to_safetensors`; any other
    tensor entry outside the state dict (and outside an included optimizer) is refused (exit 8).

    Args:
        src: the DCP directory.
        dst: the output file (the shards' base name when sharded).
        outputs: ``key`` (where the state dict sits in the saved nesting), ``verify`` (compare every
            block as written and re-read every header before the rename), ``force``, ``fsync``,
            ``progress``, ``jobs`` (see below).
        options: ``strip_prefix``, ``max_shard_size``, ``include_optimizer``, ``ckptfix_metadata``
            (write the ``ckptfix.*`` metadata, :mod:`ckptfix.formats.stmeta`), ``drop``.
        meta: the directory's metadata, when already read.
        extra_metadata: plain data to keep in the metadata beside the checkpoint's own (a Lightning
            ``meta.pt``: epoch, global_step, hyper_parameters); the checkpoint's entries win.
        jobs: tensors assembled, written and verified at a time (memory: ``jobs`` x 4 x :data:`BLOCK_BYTES`).

    Returns:
        ConvertReport

    Raises:
        UnsafePickleError: foreign globals in ``.metadata`` or a chunk's pickle, data file names leaving the
            directory.
        CorruptCheckpointError: overlapping chunks or holes, truncated chunks, byte ranges past their file,
            unreferenced ``.distcp`` files.  CheckpointNotFoundError: a missing ``.distcp`` file.
        KeyConflictError, UnsupportedError, OutputError, VerificationError: as for other inputs.
    """

    t0 = time.perf_counter()
    key, verify, force, fsync, progress, jobs = (
        outputs.key, outputs.verify, outputs.force, bool(outputs.fsync), outputs.progress, outputs.jobs
    )  # fmt: skip
    strip_prefix, include_optimizer, ckptfix_metadata, drop = (
        options.strip_prefix, options.include_optimizer, options.ckptfix_metadata, options.drop
    )  # fmt: skip
    max_shard_size = parse_size(options.max_shard_size) if options.max_shard_size else None
    meta = meta or read_metadata(src)
    meta.check_safe()
    validate(meta)
    cf = read_dcp(src, meta)
    report = ConvertReport(source=src, outputs=[dst], source_format="dcp")
    report.stubbed_globals = sorted(g for g in cf.stubbed if not g.endswith("Storage"))
    key_path, sd = cf.state_dict(key)
    report.key_path = tuple(key_path)
    named = [(str(k), v) for k, v in sd.items() if isinstance(v, TensorRecord)]
    unwritten: list[tuple[str, Any]] = []
    extra, opt_named = split_checkpoint(cf.obj, key_path, sd, include_optimizer, report, unwritten=unwritten)
    if extra_metadata:
        extra = {**extra_metadata, **extra}

    named = drop_named(named, drop, report)
    strict = options.strict and key is None
    refuse_unwritten(src, unwritten, drop, report, tuple(key_path), strict, cf.obj)  # named, or refused
    named, _ = output_names(named, opt_named, strip_prefix, report)
    if not named:
        raise NoTensorsError(f"{src}: the DCP checkpoint holds no tensors at {'/'.join(key_path) or 'top level'}")
    files = Files(src)
    items = []
    try:
        for rel in meta.files:  # opened once, before any worker thread asks (errors are reported where used)
            with contextlib.suppress(OSError):
                if files.source(rel) is None:  # a remote folder: its Source, opened (ETag pinned) here
                    files.fd(rel)
        _prefetch_archives(files, meta, jobs)
        for name, rec in named:
            assert rec.storage is not None
            e = meta.entries[rec.storage.key]
            assert isinstance(e, TensorEntry)
            check_dtype(name, e.dtype)
            items.append(DcpItem(name, e.dtype, tuple(e.shape), e.nbytes, entry=e, files=files))
        metadata: dict[str, str] = {"format": "pt"}
        if ckptfix_metadata:
            metadata = stmeta.encode(
                source_format="dcp",
                key_path=key_path,
                order=[n for n, _ in named],
                extra=extra,
                skipped=report.skipped,
            )
        write_outputs(
            dst,
            items,
            metadata,
            max_shard_size=max_shard_size,
            verify=verify,
            fsync=fsync,
            force=force,
            src=src,
            progress=progress,
            report=report,
            jobs=jobs,
        )
    except OSError as e:
        if isinstance(e, CkptfixError):
            raise
        raise CorruptCheckpointError(f"{src}: cannot read the DCP directory ({e})") from None
    finally:
        files.close()
    report.seconds = time.perf_counter() - t0
    return report
