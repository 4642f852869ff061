"""torch's ``HuggingFaceStorageWriter`` output consolidated into one safetensors file, streamed, torch-free.

Each rank writes ``shard-<rank+1>-model-<i>-of-<n>.safetensors``: a safetensors file whose tensors are that
rank's chunks, with ``__metadata__["DCP_SHARDING_INFO"]`` (JSON ``{fqn: {"saved_offsets": [...]}}``, in
the rank's state-dict order) saying where each chunk sits in the full tensor.  There is no ``.metadata``.

:func:`convert_hf_storage` writes what ``torch.distributed.checkpoint._consolidate_hf_safetensors.
consolidate_safetensors_files`` writes for a one-file mapping (``model-00001-of-00001.safetensors``),
byte for byte: its header is ``json.dumps`` of ``{fqn: {"shape", "dtype", "data_offsets"}}`` in the mapping's
order (no ``__metadata__``, no padding), each full shape the largest ``offset + size`` over the chunks,
elements no chunk covers zero.  The fqn order is the state-dict order the ranks recorded: every shard's
``DCP_SHARDING_INFO`` order merged (shard 1 first; a replicated tensor only one rank wrote keeps its place),
i.e. ``consolidate_safetensors_files(dir, out, {fqn: 1 for fqn in state_dict})``.  (The writer's own
``enable_consolidation=True`` orders by its global metadata instead, which can put such a tensor last; the
tensors are the same.)  Each chunk's bytes are copied in the
largest runs that are contiguous in both files (whole chunks for row-wise sharding); memory is one
8 MiB buffer.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ckptfix.errors import CorruptCheckpointError, VerificationError
from ckptfix.files import pins
from ckptfix.files.atomic import fsync_dir, output_error
from ckptfix.files.fileio import pwrite_all
from ckptfix.files.outputs import OutputOptions
from ckptfix.formats.hfstorage import HfStorageCheckpoint, chunk_runs, read_hf_storage
from ckptfix.ops.convert.options import ConvertKeywords, ConvertOptions, options_of, refuse_inapplicable
from ckptfix.ops.convert.paths import check_outputs, default_st_output, temp_for
from ckptfix.ops.convert.report import ConvertReport
from ckptfix.ops.convert.write import _written_equal

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["convert_hf_storage", "write_chunked"]

_BUF = 8 << 20


def _header(tensors: Sequence[Any], metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[int]]:
    meta: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    begins = []
    pos = 0
    for t in tensors:
        meta[t.name] = {"shape": t.shape, "dtype": t.st_dtype, "data_offsets": [pos, pos + t.nbytes]}
        begins.append(pos)
        pos += t.nbytes
    body = json.dumps(meta).encode("utf-8")
    return len(body).to_bytes(8, "little") + body, begins


def convert_hf_storage(
    hf: HfStorageCheckpoint,
    dst: str | os.PathLike | None = None,
    *,
    outputs: OutputOptions | None = None,
    options: ConvertOptions | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> ConvertReport:
    """Consolidate into one safetensors file, byte-identical to torch's ``consolidate_safetensors_files``.

    Args:
        hf: from :func:`~ckptfix.formats.hfstorage.find_hf_storage`.
        dst: the output (default ``<folder>.safetensors``); overrides ``outputs.output``.
        outputs, options, keywords: :class:`~ckptfix.files.outputs.OutputOptions` and
            :class:`~ckptfix.ops.convert.options.ConvertOptions`, or their fields as keywords; the ones that apply:
        verify: compare every run read back, and re-read the header, before the rename.
        force: replace an existing output.
        fsync: flush the file and its directory.
        progress: ``progress(done_bytes, total_bytes)``.
        ckptfix_metadata, jobs: accepted for the common signature; torch's header has no metadata.
        (``max_shard_size`` is refused: torch's layout is one file here.)

    Returns:
        A :class:`~ckptfix.ops.convert.report.ConvertReport` (``source_format`` ``hf-storage-dcp``).
    """
    t0 = time.perf_counter()
    outs, opts = options_of(dst, outputs, options, keywords)
    refuse_inapplicable("hfstorage", outs, opts)
    d = outs.output if outs.output is not None else default_st_output(hf.path)
    check_outputs([d], hf.path, outs.force)
    read_hf_storage(hf)
    report = ConvertReport(source=hf.path, outputs=[d], source_format="hf-storage-dcp")
    write_chunked(hf.tensors, d, outs, report)
    report.seconds = time.perf_counter() - t0
    return report


def write_chunked(
    tensors: Sequence[Any],
    d: str,
    outs: OutputOptions,
    report: ConvertReport,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write full tensors laid out as chunks of source files (:func:`~ckptfix.formats.hfstorage.chunk_runs`) as one
    safetensors file: each chunk's contiguous runs copied through one 8 MiB buffer, verified, renamed into place.

    Args:
        tensors: ``name``, ``st_dtype``, ``shape``, ``nbytes``, ``element_size`` and ``chunks`` (``path``,
            ``data_offset``, ``offsets``, ``sizes``) each, in output order.
        d: the output file.
        outs: ``verify``, ``fsync``, ``progress`` (``force`` was checked by the caller).
        report: filled with the tensors and bytes written, ``verified``.
        metadata: the header's ``__metadata__`` (None: none, as torch's consolidation writes).
    """
    verify, fsync, progress = outs.verify, bool(outs.fsync), outs.progress
    header, begins = _header(tensors, metadata)
    total = sum(t.nbytes for t in tensors)
    tmp = temp_for(d)
    fds: dict[str, int] = {}
    buf = bytearray(_BUF)
    view = memoryview(buf)
    done = 0
    try:
        fd = os.open(tmp, os.O_RDWR)
        try:
            pwrite_all(fd, header, 0)
            os.ftruncate(fd, len(header) + total)  # elements no chunk covers read as zeros, as torch's bytearray
            for t, begin in zip(tensors, begins, strict=True):
                base = len(header) + begin
                for c in t.chunks:
                    src = fds.get(c.path)
                    if src is None:
                        src = fds[c.path] = pins.open_fd(c.path)
                    for s_off, d_off, n in chunk_runs(t, c):
                        while n > 0:
                            k = min(n, _BUF)
                            if os.preadv(src, [view[:k]], s_off) != k:
                                raise CorruptCheckpointError(f"{c.path}: ends inside tensor {t.name!r} (truncated?)")
                            pwrite_all(fd, view[:k], base + d_off)
                            if verify and not _written_equal(fd, base + d_off, buf, k):
                                raise VerificationError(f"{d}: tensor {t.name!r} does not read back as written")
                            s_off, d_off, n = s_off + k, d_off + k, n - k
                            done += k
                            if progress:
                                progress(done, total)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if verify:
            with open(tmp, "rb") as f:
                if f.read(len(header)) != header or os.path.getsize(tmp) != len(header) + total:
                    raise VerificationError(f"{d}: the written header does not read back; the output was removed")
            report.verified = True
        pins.check_unchanged()
        try:
            os.replace(tmp, d)
        except OSError as e:
            raise output_error(e, d) from None
        tmp = ""
        if fsync:
            fsync_dir(d)
    finally:
        for x in fds.values():
            os.close(x)
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    report.tensors = len(tensors)
    report.bytes = total
