"""A read ZeRO checkpoint's tensors: their bytes in chunks, as torch tensors, and described for ``inspect``."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Iterator

from ckptfix.errors import CorruptCheckpointError
from ckptfix.files import pins
from ckptfix.files.fileio import CHUNK, Fds
from ckptfix.formats.deepspeed.layout import ZeroCheckpoint, ZeroTensor
from ckptfix.formats.deepspeed.reader import read_zero_checkpoint
from ckptfix.formats.deepspeed.rounding import convert_bytes, output_dtype
from ckptfix.pickles import ELEMENT_SIZE


def read_pieces(t: ZeroTensor, fds: Fds, chunk: int = CHUNK) -> Iterator[bytes]:
    """The tensor's source bytes in chunks of at most ``chunk`` bytes (whole elements).

    Args:
        t: a tensor of a read :class:`ZeroCheckpoint`.
        fds: the descriptors to read through.
        chunk: the most bytes per piece yielded.

    Yields:
        The bytes of ``t.pieces`` in order.

    Raises:
        CorruptCheckpointError: a partition file ends inside the tensor.
    """
    es = ELEMENT_SIZE[t.dtype]
    chunk -= chunk % es
    for p in t.pieces:
        fd = fds.get(p.path)
        off, left = p.offset, p.nbytes
        while left > 0:
            n = min(left, chunk)
            b = os.pread(fd, n, off)
            if len(b) != n:
                raise CorruptCheckpointError(
                    f"{p.path}: the file ends inside tensor {t.name!r} (truncated?); copy it again from where "
                    "training saved it"
                )
            yield b
            off += n
            left -= n


def zero_state_dict(zc: ZeroCheckpoint, dtype: str | None = None) -> OrderedDict[str, Any]:
    """The consolidated state dict as torch tensors: what ``get_fp32_state_dict_from_zero_checkpoint`` returns.

    Shared parameters are the same tensor object under both names.  Needs torch.

    Args:
        zc: from :func:`find_zero_checkpoint`.
        dtype: as for :func:`ckptfix.ops.convert.zero.convert_zero` (zero_to_fp32's ``to_torch_tensor(..., dtype)``).

    Returns:
        name -> CPU ``torch.Tensor``, in zero_to_fp32's order.

    Raises:
        TorchMissingError: torch is not installed; and as :func:`read_zero_checkpoint`.
    """
    from ckptfix._torch import require_torch

    torch = require_torch("load_anywhere on a DeepSpeed ZeRO checkpoint")
    out_dtype = output_dtype(dtype)
    read_zero_checkpoint(zc)
    fds = Fds()
    sd: OrderedDict[str, Any] = OrderedDict()
    try:
        for t in zc.tensors:
            od = t.out_dtype(out_dtype)
            buf = bytearray(t.numel * ELEMENT_SIZE[od])
            pos = 0
            src = "float32" if t.upcast else t.dtype
            for b in read_pieces(t, fds):
                if t.upcast:
                    b = bytes(convert_bytes(b, t.dtype, "float32"))
                c = convert_bytes(b, src, od)
                buf[pos : pos + len(c)] = c
                pos += len(c)
            tdt = getattr(torch, od)
            sd[t.name] = (torch.frombuffer(buf, dtype=tdt) if buf else torch.empty(0, dtype=tdt)).view(t.shape)
    finally:
        fds.close()
    for alias, target in zc.shared:
        if target in sd:
            sd[alias] = sd[target]
    return sd


# --------------------------------------------------------------------------- describing


def summary(zc: ZeroCheckpoint) -> dict[str, Any]:
    """What ``inspect --json`` shows of a ZeRO checkpoint.

    Args:
        zc: a checkpoint (read on demand).

    Returns:
        framework, stage, world size, training dtype, tag, DeepSpeed version, tensors, parameters and bytes.
    """
    read_zero_checkpoint(zc)
    params = [t for t in zc.tensors if t.kind != "buffer"]
    return {
        "framework": "deepspeed",
        "layout": f"zero{zc.stage}",
        "tag": zc.tag,
        "tag_dir": zc.tag_dir,
        "stage": zc.stage,
        "world_size": zc.world_size,
        "train_dtype": zc.train_dtype,
        "ds_version": zc.ds_version,
        "tensors": len(zc.tensors),
        "aliases": zc.aliases(),
        "params": len(params),
        "param_values": sum(t.numel for t in params),
        "param_bytes": sum(t.nbytes for t in params),
        "frozen": sum(t.kind == "frozen" for t in zc.tensors),
        "buffers": len(zc.tensors) - len(params),
        "files": len(zc.model_files) + len(zc.optim_files),
        "partition_bytes": sum(pins.fstat(f).st_size for f in zc.optim_files),
    }


def describe(zc: ZeroCheckpoint) -> list[tuple[str, str]]:
    """Lines for ``inspect FOLDER``: ``(label, text)`` pairs.

    Args:
        zc: a checkpoint (read on demand).

    Returns:
        The lines: layout, partitions, weights, shared.
    """
    s = summary(zc)
    from ckptfix.text import human_bytes

    shared = ", ".join(f"{a} -> {t}" for a, t in s["aliases"].items()) or "-"
    return [
        ("framework", f"DeepSpeed ZeRO stage {s['stage']} (tag {s['tag']}, deepspeed {s['ds_version'] or '?'})"),
        ("partitions", f"{s['world_size']} rank(s), {s['files']} files, optimizer {human_bytes(s['partition_bytes'])}"),
        ("training", f"{s['train_dtype']} (fp32 master weights in the optimizer partitions)"),
        (
            "weights",
            f"{s['params']} parameters ({s['frozen']} frozen), {s['param_values']:,} values, "
            f"{human_bytes(s['param_bytes'])}; {s['buffers']} buffer(s)",
        ),
        ("shared", shared),
    ]
