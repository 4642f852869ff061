"""DeepSpeed ZeRO checkpoints consolidated into safetensors: zero_to_fp32's state dict, bit for bit, streamed.

The reader (where each parameter's bytes sit in the partition files) is :mod:`ckptfix.formats.deepspeed`; this
module plans the output tensors (one byte range copied as is, or several ranges and dtype conversions
streamed in chunks) and writes them with :func:`ckptfix.ops.convert.write.write_outputs`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Iterator

from ckptfix.files.fileio import Fds
from ckptfix.files.outputs import OutputOptions
from ckptfix.formats import stmeta
from ckptfix.formats.deepspeed import (
    ZeroCheckpoint,
    ZeroTensor,
    convert_bytes,
    output_dtype,
    read_pieces,
    read_zero_checkpoint,
)
from ckptfix.ops.convert.items import Item
from ckptfix.ops.convert.options import ConvertKeywords, ConvertOptions, options_of, refuse_inapplicable
from ckptfix.ops.convert.paths import check_outputs, default_st_output
from ckptfix.ops.convert.report import ConvertReport
from ckptfix.ops.convert.write import write_outputs
from ckptfix.pickles import ELEMENT_SIZE
from ckptfix.text import parse_size

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["convert_zero"]


class _ZeroItem(Item):
    """A tensor made of several byte ranges, or converted to another dtype, streamed in chunks."""

    zt: ZeroTensor | None = None

    def chunks(self, fds: Fds) -> Iterator[bytes | bytearray | memoryview]:
        assert self.zt is not None
        src = "float32" if self.zt.upcast else self.zt.dtype
        for b in read_pieces(self.zt, fds):
            if self.zt.upcast:
                b = bytes(convert_bytes(b, self.zt.dtype, "float32"))
            yield convert_bytes(b, src, self.dtype)


def _items(zc: ZeroCheckpoint, dtype: str | None) -> list[Item]:
    items: list[Item] = []
    aliased = zc.aliases()
    for t in zc.tensors:
        if t.name in aliased:  # zero_to_fp32 overwrites it with the shared tensor: stored once, as an alias
            continue
        od = t.out_dtype(dtype)
        nbytes = t.numel * ELEMENT_SIZE[od]
        if od == t.dtype and len(t.pieces) == 1:
            p = t.pieces[0]
            items.append(Item(t.name, od, t.shape, nbytes, path=p.path, offset=p.offset))
        elif od == t.dtype and not t.pieces:
            items.append(Item(t.name, od, t.shape, 0, tensor=None))
        else:
            it = _ZeroItem(t.name, od, t.shape, nbytes)
            it.zt = t
            items.append(it)
    return items


def convert_zero(
    zc: ZeroCheckpoint,
    dst: str | os.PathLike | None = None,
    *,
    outputs: OutputOptions | None = None,
    options: ConvertOptions | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> ConvertReport:
    """Consolidate a ZeRO checkpoint into safetensors: zero_to_fp32's state dict, bit for bit, streamed.

    Tied parameters (``shared_params``) are stored once and recorded as ``ckptfix.aliases``.

    Args:
        zc: from :func:`~ckptfix.formats.deepspeed.find_zero_checkpoint`.
        dst: the output (default: ``<folder>.safetensors`` next to it); overrides ``outputs.output``.
        outputs, options, keywords: :class:`~ckptfix.files.outputs.OutputOptions` and
            :class:`~ckptfix.ops.convert.options.ConvertOptions`, or their fields as keywords; the ones that apply:
        dtype: ``bf16``/``fp16``/``fp32`` (or the long names) for the floating tensors; None keeps fp32.
        verify, force, fsync, progress, max_shard_size, ckptfix_metadata, jobs: as for
            :func:`ckptfix.ops.convert.convert_to_safetensors`.

    Returns:
        A :class:`~ckptfix.ops.convert.report.ConvertReport` (``source_format`` ``deepspeed-zero<stage>``).

    Raises:
        As :func:`~ckptfix.formats.deepspeed.read_zero_checkpoint`; Unsupported for an unknown ``dtype``; OutputError,
        VerificationError as the writer.
    """
    t0 = time.perf_counter()
    o, c = options_of(dst, outputs, options, keywords)
    refuse_inapplicable("zero", o, c)
    max_shard_size, ckptfix_metadata = c.max_shard_size, c.ckptfix_metadata
    out_dtype = output_dtype(c.dtype)
    d = o.output if o.output is not None else default_st_output(zc.path)
    shard_limit = parse_size(max_shard_size) if max_shard_size else None
    if not max_shard_size:
        check_outputs([d], zc.path, o.force)
    read_zero_checkpoint(zc)
    report = ConvertReport(source=zc.path, outputs=[d], source_format=f"deepspeed-zero{zc.stage}")
    report.aliases = zc.aliases()
    if report.aliases:
        report.tied_rule = "DeepSpeed shared_params"
    items = _items(zc, out_dtype)
    metadata = {"format": "pt"}
    if ckptfix_metadata:
        metadata = stmeta.encode(
            source_format=report.source_format,
            key_path=(),
            order=zc.names(),
            aliases=report.aliases,
            extra=zc.extra,
        )
    write_outputs(
        d,
        items,
        metadata,
        max_shard_size=shard_limit,
        verify=o.verify,
        fsync=bool(o.fsync),
        force=o.force,
        src=zc.path,
        progress=o.progress,
        report=report,
        jobs=o.jobs,
    )
    report.seconds = time.perf_counter() - t0
    return report
