"""One record per checkpoint format: what ckptfix does with it, capability by capability.

Each :class:`~ckptfix.formats.base.Format` has one :class:`FormatSpec` in :data:`FORMATS`, and each of its
:data:`CAPABILITIES` is either the function that does it, named ``"module:function"`` and imported when it
is dispatched (:func:`dispatch`), or a :class:`Refused` (the reason and the fix, as the one-line ``Error:``
says it).  The functions live at several layers (reading here, scanning, loading, converting and rewriting
in ``ops/``); naming them keeps this table in one place without importing upwards.  ``tests/test_registry.py``
fails while any format has a capability that is neither, or names a function that does not exist.

==========  =====================================================
capability  what it is
==========  =====================================================
read        the torch-free reader (``read_checkpoint``)
scan        every global its pickles reference (``scan``)
load        tensors with torch (``load_checkpoint``)
convert     to safetensors (``convert FILE``)
rewrite     keys renamed in place of the file (``strip-prefix``)
sanitize    rewritten for ``torch.load(weights_only=True)``
==========  =====================================================
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Union

from ckptfix.errors import UnsupportedError
from ckptfix.formats.base import Format, package_message, tar_message

#: every capability a format has or refuses, in the order the docs list them
CAPABILITIES = ("read", "scan", "load", "convert", "rewrite", "sanitize")


@dataclass(frozen=True)
class Refused:
    """A capability a format does not have, on purpose.

    Attributes:
        message: ``message(path)`` -> the one-line reason and fix (``"{path}: ...; do X instead"``).
    """

    message: Callable[[str], str]

    def error(self, path: str) -> UnsupportedError:
        """The :class:`~ckptfix.errors.UnsupportedError` a command raises for ``path``."""
        return UnsupportedError(self.message(path))


#: a capability's entry: ``"module:function"``, a refusal, or None while nobody said (the test fails)
Capability = Union[str, Refused, None]


@dataclass
class FormatSpec:
    """What ckptfix does with one format.

    Attributes:
        format: the format.
        what: what it is, in words.
        read, scan, load, convert, rewrite, sanitize: each ``"module:function"`` or a :class:`Refused`.
    """

    format: Format
    what: str
    read: Capability = None
    scan: Capability = None
    load: Capability = None
    convert: Capability = None
    rewrite: Capability = None
    sanitize: Capability = None

    def get(self, capability: str) -> Capability:
        """The entry for ``capability`` (one of :data:`CAPABILITIES`)."""
        if capability not in CAPABILITIES:
            raise KeyError(f"no capability {capability!r}; one of {', '.join(CAPABILITIES)}")
        entry: Capability = getattr(self, capability)
        return entry


def _refused_rewrite(fmt: Format) -> Refused:
    return Refused(
        lambda path: (
            f"{path}: {fmt} checkpoints cannot be rewritten here; convert it "
            "first (ckptfix convert) or load it with load_anywhere and save a new file"
        )
    )


def _refused_sanitize(fmt: Format) -> Refused:
    return Refused(
        lambda path: (
            f"{path}: {fmt} checkpoints cannot be sanitized; sanitize a single torch.save "
            "file (convert sharded/DCP inputs with ckptfix convert instead)"
        )
    )


_TAR = Refused(tar_message)
_PACKAGE = Refused(package_message)

_READ = "ckptfix.formats:"
_SCAN = "ckptfix.ops.scan:"
_LOAD = "ckptfix.ops.load:"
_CONVERT = "ckptfix.ops.convert.forward:convert_to_safetensors"
_REWRITE = "ckptfix.ops.rewrite:rewrite_file"
_SANITIZE = "ckptfix.ops.sanitize:sanitize_file"

#: one entry per format
FORMATS: dict[Format, FormatSpec] = {
    spec.format: spec
    for spec in [
        FormatSpec(
            Format.TORCH_ZIP,
            "torch.save since 1.6",
            read=_READ + "read_torch_zip",
            scan=_SCAN + "scan_archive",
            load=_LOAD + "load_zip",
            convert=_CONVERT,
            rewrite=_REWRITE,
            sanitize=_SANITIZE,
        ),
        FormatSpec(
            Format.TORCH_LEGACY,
            "torch.save(..., _use_new_zipfile_serialization=False)",
            read=_READ + "read_pickle_stream",
            scan=_SCAN + "scan_legacy",
            load=_LOAD + "load_legacy",
            convert=_CONVERT,
            rewrite=_REWRITE,
            sanitize=_SANITIZE,
        ),
        FormatSpec(
            Format.TORCHSCRIPT,
            "torch.jit.save archive",
            read=_READ + "read_torchscript",
            scan=_SCAN + "scan_torchscript",
            load=_LOAD + "load_torchscript",
            convert=_CONVERT,
            rewrite=_refused_rewrite(Format.TORCHSCRIPT),
            sanitize=_refused_sanitize(Format.TORCHSCRIPT),
        ),
        FormatSpec(
            Format.SAFETENSORS,
            "a .safetensors file",
            read=_READ + "read_safetensors",
            scan=_SCAN + "scan_safetensors",
            load=_LOAD + "load_safetensors",
            convert=_CONVERT,
            rewrite=_REWRITE,
            sanitize="ckptfix.ops.sanitize:refuse_safetensors",
        ),
        FormatSpec(
            Format.SHARDED,
            "a *.index.json with a weight_map, or its directory",
            read=_READ + "read_sharded",
            scan=_SCAN + "scan_sharded",
            load=_LOAD + "load_sharded",
            convert=_CONVERT,
            rewrite="ckptfix.ops.rewrite:rewrite_index",
            sanitize=_refused_sanitize(Format.SHARDED),
        ),
        FormatSpec(
            Format.DCP,
            "a torch.distributed.checkpoint directory",
            read=_READ + "read_dcp",
            scan=_SCAN + "scan_dcp",
            load=_LOAD + "load_dcp_directory",
            convert="ckptfix.ops.convert.dcp_in:convert_dcp",
            rewrite="ckptfix.ops.rewrite:rewrite_directory",
            sanitize=_refused_sanitize(Format.DCP),
        ),
        FormatSpec(
            Format.PICKLE,
            "a bare pickle with no torch storages",
            read=_READ + "read_pickle_stream",
            scan=_SCAN + "scan_legacy",
            load=_LOAD + "load_pickle",
            convert=_CONVERT,
            rewrite=_refused_rewrite(Format.PICKLE),
            sanitize=Refused(
                lambda path: (
                    f"{path}: a bare pickle, not a torch.save file; load it with load_anywhere and torch.save what "
                    "you need"
                )
            ),
        ),
        FormatSpec(
            Format.TORCH_TAR,
            "the pre-0.4 torch.save tar archive: recognised and scanned, never read",
            read=_TAR,
            scan=_SCAN + "scan_tar",
            load=_LOAD + "load_tar",
            convert=_TAR,
            rewrite=_TAR,
            sanitize=_TAR,
        ),
        FormatSpec(
            Format.TORCH_PACKAGE,
            "a torch.package archive (packaged code and pickles): recognised and scanned, never read",
            read=_PACKAGE,
            scan=_SCAN + "scan_package",
            load=_PACKAGE,
            convert=_PACKAGE,
            rewrite=_PACKAGE,
            sanitize=_PACKAGE,
        ),
    ]
}


def resolve(name: str) -> Callable[..., Any]:
    """The function ``"module:function"`` names (the module imported now, if it was not).

    Raises:
        LookupError: no such module or function (a bug in :data:`FORMATS`).
    """
    module, _, attr = name.partition(":")
    try:
        fn: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise LookupError(f"the format registry names {name!r}, which does not exist ({e})") from None
    return fn


def dispatch(fmt: Format, capability: str, path: str) -> Callable[..., Any]:
    """The function that does ``capability`` for ``fmt``.

    Args:
        fmt: the format (what :func:`~ckptfix.formats.sniff` said of ``path``).
        capability: one of :data:`CAPABILITIES`.
        path: the input, for a refusal's message.

    Returns:
        The function its entry names.

    Raises:
        UnsupportedError: the format refuses the capability (the entry's reason and fix).
        LookupError: the entry is empty or names nothing (a bug).
    """
    entry = FORMATS[fmt].get(capability)
    if isinstance(entry, Refused):
        raise entry.error(path)
    if entry is None:
        raise LookupError(f"{fmt}: no {capability} in the format registry")
    return resolve(entry)


def missing() -> list[tuple[Format, str]]:
    """Every ``(format, capability)`` that is neither named nor refused."""
    return [(f, c) for f in Format for c in CAPABILITIES if FORMATS[f].get(c) is None]
