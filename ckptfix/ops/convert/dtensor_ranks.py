"""A folder of FSDP per-rank DTensor files merged into one safetensors file, streamed, torch-free.

The reader (:mod:`ckptfix.formats.dtensor_ranks`) lays out each full tensor as chunks of the rank files, from
the DTensors' placements and mesh coordinates; the chunks are copied run by run through one buffer by the
writer torch's HuggingFaceStorageWriter folders use (:func:`ckptfix.ops.convert.hfstorage.write_chunked`).
The tensors are ``DTensor.full_tensor()``'s, bit for bit, in the state dict's order.  With
``include_optimizer`` the optimizer's rank files are merged too, as ``optimizer.<path>``
(``optimizer.state.0.exp_avg``).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from ckptfix.files.outputs import OutputOptions
from ckptfix.formats.dtensor_ranks import DTensorRanks, read_dtensor_ranks
from ckptfix.formats.hfstorage import _Tensor
from ckptfix.ops.convert.options import ConvertKeywords, ConvertOptions, options_of, refuse_inapplicable
from ckptfix.ops.convert.paths import check_outputs, default_st_output
from ckptfix.ops.convert.report import ConvertReport

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["convert_dtensor_ranks"]


def convert_dtensor_ranks(
    dr: DTensorRanks,
    dst: str | os.PathLike | None = None,
    *,
    outputs: OutputOptions | None = None,
    options: ConvertOptions | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> ConvertReport:
    """Merge the ranks' DTensor shards into one safetensors file: ``full_tensor()`` of each, bit for bit.

    Args:
        dr: from :func:`~ckptfix.formats.dtensor_ranks.find_dtensor_ranks`.
        dst: the output (default ``<folder>.safetensors``); overrides ``outputs.output``.
        outputs, options, keywords: :class:`~ckptfix.files.outputs.OutputOptions` and
            :class:`~ckptfix.ops.convert.options.ConvertOptions`, or their fields as keywords; the ones that apply:
        include_optimizer: merge the optimizer's rank files too, as ``optimizer.<path>`` tensors.
        verify, force, fsync, progress: as for :func:`ckptfix.ops.convert.convert_to_safetensors`.
        ckptfix_metadata, jobs: accepted for the common signature (the header holds ``{"format": "pt"}``).

    Returns:
        A :class:`~ckptfix.ops.convert.report.ConvertReport` (``source_format`` ``fsdp-dtensor-ranks``); other
        models and, without ``include_optimizer``, the optimizer files are in ``not_converted``.

    Raises:
        As :func:`~ckptfix.formats.dtensor_ranks.read_dtensor_ranks`; OutputError, VerificationError as the writer.
    """
    from ckptfix.ops.convert.hfstorage import write_chunked

    t0 = time.perf_counter()
    outs, opts = options_of(dst, outputs, options, keywords)
    refuse_inapplicable("fsdp-ranks", outs, opts)
    d = outs.output if outs.output is not None else default_st_output(dr.path)
    check_outputs([d], dr.path, outs.force)
    kinds = ("model", "optimizer") if opts.include_optimizer else ("model",)
    read_dtensor_ranks(dr, kinds)
    report = ConvertReport(source=dr.path, outputs=[d], source_format="fsdp-dtensor-ranks")
    tensors: list[_Tensor] = list(dr.tensors)
    for g in dr.groups[1:]:
        first = os.path.basename(g.files[min(g.files)])
        if g.kind == "optimizer" and opts.include_optimizer and g.index == dr.model.index:
            opt = [_Tensor("optimizer." + t.name, t.st_dtype, t.shape, t.chunks) for t in g.tensors]
            tensors.extend(opt)
            report.optimizer_tensors = len(opt)
            continue
        how = (
            "the optimizer's rank files; --include-optimizer merges them as optimizer.* tensors"
            if g.kind == "optimizer" and g.index == dr.model.index
            else f"another {g.label}'s rank files; move them to a folder of their own to merge them"
        )
        report.not_converted[f"{first} ({len(g.files)} ranks)"] = how
    write_chunked(tensors, d, outs, report, {"format": "pt"})
    report.seconds = time.perf_counter() - t0
    return report
