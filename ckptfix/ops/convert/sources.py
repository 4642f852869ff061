"""What ``convert FILE`` (to safetensors) reads each format with: its entries in the format registry.

:func:`ckptfix.ops.convert.forward.convert_to_safetensors` reads any format :func:`~ckptfix.formats.read_checkpoint`
reads, and hands a DCP directory to :func:`ckptfix.ops.convert.dcp_in.convert_dcp`, which streams its chunks.
``convert_to_safetensors`` routes through these entries of :data:`ckptfix.formats.registry.FORMATS`
(``registry.dispatch(format, "convert", path)``; ``tests/test_registry.py`` pins them): an entry that is not
``convert_to_safetensors`` itself is a format's own converter, called as ``entry(src, dst, outputs, options,
extra_metadata=...)``.  The pre-0.4 tar archive and torch.package archives are refused in their entries (as
their readers refuse).  :mod:`ckptfix.ops.convert` imports this module, so the entries are in place before
``convert_to_safetensors`` runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptfix.formats.base import Format
from ckptfix.formats.registry import implement, implement_all
from ckptfix.ops.convert.forward import convert_to_safetensors

if TYPE_CHECKING:
    from ckptfix.ops.convert.report import ConvertReport


def convert_dcp(*args: Any, **kwargs: Any) -> ConvertReport:
    """:func:`ckptfix.ops.convert.dcp_in.convert_dcp`, imported on first use: the DCP reader and the chunk
    assembly are not on the start-up of ``convert FILE.pth``."""
    from ckptfix.ops.convert.dcp_in import convert_dcp as run

    return run(*args, **kwargs)


#: the formats convert_to_safetensors reads through read_checkpoint
READ_WHOLE = (
    Format.TORCH_ZIP,
    Format.TORCH_LEGACY,
    Format.TORCHSCRIPT,
    Format.SAFETENSORS,
    Format.SHARDED,
    Format.PICKLE,
)

implement_all("convert", dict.fromkeys(READ_WHOLE, convert_to_safetensors))
implement(Format.DCP, "convert", convert_dcp)
