"""One record per checkpoint format: what ckptfix does with it, capability by capability.

Each :class:`~ckptfix.formats.base.Format` has one :class:`FormatSpec` in :data:`FORMATS`, and each of
its :data:`CAPABILITIES` is either the function that does it or a :class:`Refused` (the reason, and what
to do instead, as the one-line ``Error:`` says it).  Nothing may be left unsaid:
``tests/test_registry.py`` fails while any format has a capability that is neither.

The capabilities sit at different layers (reading here at layer 2, scanning and loading at layer 3,
converting and renaming at layer 4), so the record is filled in from above: each capability's module
registers its function per format when it is imported (:func:`implement`).  ``read``, ``scan`` and
``load`` dispatch through :func:`dispatch` in the module that registers them, so a registration is always
in place before it is used; ``convert`` and ``rewrite`` route in their own packages (the entries name the
function each format takes, and ``tests/test_registry.py`` pins them to the routing).  The refusals that
are decided by the format alone are written here, in the entries.  :data:`CAPABILITY_MODULES` names the
module that fills each capability (the completeness test imports them all).

==========  =====================================================  ==========================
capability  what it is                                             filled in by
==========  =====================================================  ==========================
read        the torch-free reader (``read_checkpoint``)            ``ckptfix.formats``
scan        every global its pickles reference (``scan``)          ``ckptfix.ops.scan``
load        tensors with torch (``load_checkpoint``)               ``ckptfix.ops.load``
convert     to safetensors (``convert FILE``)                      ``ckptfix.ops.convert.sources``
rewrite     keys renamed in place of the file (``strip-prefix``)   ``ckptfix.ops.rewrite``
sanitize    rewritten for ``torch.load(weights_only=True)``        ``ckptfix.ops.sanitize``
==========  =====================================================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

from ckptfix.errors import UnsupportedError
from ckptfix.formats.base import Format, package_message, tar_message

#: every capability a format has or refuses, in the order the docs list them
CAPABILITIES = ("read", "scan", "load", "convert", "rewrite", "sanitize")

#: the module whose import registers each capability's functions
CAPABILITY_MODULES = {
    "read": "ckptfix.formats",
    "scan": "ckptfix.ops.scan",
    "load": "ckptfix.ops.load",
    "convert": "ckptfix.ops.convert.sources",
    "rewrite": "ckptfix.ops.rewrite",
    "sanitize": "ckptfix.ops.sanitize",
}


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


#: a capability's entry: the function that does it, a refusal, or None while nobody said (the test fails)
Capability = Union[Callable[..., Any], Refused, None]


@dataclass
class FormatSpec:
    """What ckptfix does with one format.

    Attributes:
        format: the format.
        what: what it is, in words.
        read, scan, load, convert, rewrite, sanitize: each a function (see :data:`CAPABILITIES` for what it takes)
            or a :class:`Refused`.
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

#: one entry per format; the functions are registered by the modules of :data:`CAPABILITY_MODULES`
FORMATS: dict[Format, FormatSpec] = {
    spec.format: spec
    for spec in [
        FormatSpec(Format.TORCH_ZIP, "torch.save since 1.6"),
        FormatSpec(Format.TORCH_LEGACY, "torch.save(..., _use_new_zipfile_serialization=False)"),
        FormatSpec(
            Format.TORCHSCRIPT,
            "torch.jit.save archive",
            rewrite=_refused_rewrite(Format.TORCHSCRIPT),
            sanitize=_refused_sanitize(Format.TORCHSCRIPT),
        ),
        FormatSpec(Format.SAFETENSORS, "a .safetensors file"),
        FormatSpec(
            Format.SHARDED,
            "a *.index.json with a weight_map, or its directory",
            sanitize=_refused_sanitize(Format.SHARDED),
        ),
        FormatSpec(Format.DCP, "a torch.distributed.checkpoint directory", sanitize=_refused_sanitize(Format.DCP)),
        FormatSpec(
            Format.PICKLE,
            "a bare pickle with no torch storages",
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
            convert=_TAR,
            rewrite=_TAR,
            sanitize=_TAR,
        ),
        FormatSpec(
            Format.TORCH_PACKAGE,
            "a torch.package archive (packaged code and pickles): recognised and scanned, never read",
            read=_PACKAGE,
            load=_PACKAGE,
            convert=_PACKAGE,
            rewrite=_PACKAGE,
            sanitize=_PACKAGE,
        ),
    ]
}


def implement(fmt: Format, capability: str, fn: Callable[..., Any]) -> None:
    """Register ``fn`` as what ``capability`` does for ``fmt`` (called by the module that dispatches it).

    Args:
        fmt: the format.
        capability: one of :data:`CAPABILITIES`.
        fn: the function.

    Raises:
        ValueError: the entry already holds another function, or a refusal (a format's refusal is decided
            once, in :data:`FORMATS`).
    """
    spec = FORMATS[fmt]
    have = spec.get(capability)
    if have is not None and have is not fn:
        raise ValueError(f"{fmt}: {capability} is already {have!r}; one entry per format and capability")
    setattr(spec, capability, fn)


def implement_all(capability: str, table: dict[Format, Callable[..., Any]]) -> None:
    """:func:`implement` for each ``{format: function}`` of ``table``."""
    for fmt, fn in table.items():
        implement(fmt, capability, fn)


def dispatch(fmt: Format, capability: str, path: str) -> Callable[..., Any]:
    """The function that does ``capability`` for ``fmt``.

    Args:
        fmt: the format (what :func:`~ckptfix.formats.sniff` said of ``path``).
        capability: one of :data:`CAPABILITIES`.
        path: the input, for a refusal's message.

    Returns:
        The registered function.

    Raises:
        UnsupportedError: the format refuses the capability (the entry's reason and fix).
        LookupError: nothing registered it (a module of :data:`CAPABILITY_MODULES` was not imported; a bug).
    """
    entry = FORMATS[fmt].get(capability)
    if isinstance(entry, Refused):
        raise entry.error(path)
    if entry is None:
        raise LookupError(f"{fmt}: no {capability} registered (import {CAPABILITY_MODULES[capability]})")
    return entry


def missing() -> list[tuple[Format, str]]:
    """Every ``(format, capability)`` that is neither implemented nor refused (empty once all modules are imported)."""
    return [(f, c) for f in Format for c in CAPABILITIES if FORMATS[f].get(c) is None]
