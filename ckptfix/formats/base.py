"""The types every format module shares: the :class:`Format` vocabulary, :class:`CheckpointFile`
and its typed per-format details, and the size limits and messages all readers apply.

Format modules import this module, never the :mod:`ckptfix.formats` package (which imports them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Mapping, TypeVar, Union

from ckptfix.errors import ResourceLimitError
from ckptfix.formats.statedict import find_state_dict
from ckptfix.pickles import StorageRecord

if TYPE_CHECKING:
    from ckptfix.formats.dcp.meta import DcpMetadata


class Format(str, Enum):
    """What a checkpoint holds, as :func:`~ckptfix.formats.sniff` tells it and as
    :attr:`CheckpointFile.format` records it.  A ``str``: ``Format.DCP == "dcp"`` and JSON writes
    ``"dcp"``.
    """

    TORCH_ZIP = "torch-zip"  # torch.save since 1.6 (any archive root folder name)
    TORCH_LEGACY = "torch-legacy"  # torch.save(..., _use_new_zipfile_serialization=False)
    TORCHSCRIPT = "torchscript"  # torch.jit.save archives
    SAFETENSORS = "safetensors"
    SHARDED = "sharded"  # a *.index.json with a weight_map (or the directory holding one)
    DCP = "dcp"  # a torch.distributed.checkpoint directory
    PICKLE = "pickle"  # a bare pickle with no torch storages
    TORCH_TAR = "torch-tar"  # pre-0.4 torch.save tar archive: recognised, never read
    TORCH_PACKAGE = "torch-package"  # torch.package.PackageExporter archive (code + pickles): scanned, never read

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: environment variable (MiB) that lifts the cap on JSON metadata: safetensors headers, sharded indexes
MAX_JSON_ENV = "CKPTFIX_MAX_JSON_MB"
#: default cap, in MiB: a real index or header for 100k tensors is ~10-15 MB (parsed JSON takes ~10x that)
DEFAULT_MAX_JSON_MB = 32


def env_mib(name: str, default_mib: int) -> int:
    """A size limit in bytes from the environment variable ``name`` (MiB), else ``default_mib`` MiB.

    Args:
        name: the environment variable, read in MiB (fractions allowed).
        default_mib: the limit, in MiB, when the variable is unset or empty.

    Returns:
        The limit in bytes.

    Raises:
        ResourceLimitError: the variable is set but not a positive number.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default_mib << 20
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise ResourceLimitError(f"{name}={raw!r} is not a positive number of MiB; set it like {name}=1024 or unset it")
    return int(mb * (1 << 20))


def max_json_bytes() -> int:
    """The largest safetensors header or sharded index ckptfix parses.

    Returns:
        ``CKPTFIX_MAX_JSON_MB`` in bytes (default 32 MiB).

    Raises:
        ResourceLimitError: the environment variable is not a positive number.
    """
    return env_mib(MAX_JSON_ENV, DEFAULT_MAX_JSON_MB)


def package_message(path: str) -> str:
    """What a ``torch.package`` archive is and how to load it (used by every command that reads it).

    Args:
        path: the archive.

    Returns:
        The one-line message for the :class:`~ckptfix.errors.UnsupportedError`.
    """
    return (
        f"{path}: a torch.package archive (torch.package.PackageExporter): a packaged model with its own "
        "Python code, not a torch.save checkpoint; `ckptfix scan` checks its pickles. Only if you trust it: "
        "torch.package.PackageImporter(path).load_pickle(package, resource) (runs the packaged code), then "
        "save the state dict with torch.save"
    )


def tar_message(path: str) -> str:
    """Why a pre-0.4 tar checkpoint is refused, and what to do (used by every command).

    Args:
        path: the tar checkpoint.

    Returns:
        The one-line message for the :class:`~ckptfix.errors.UnsupportedError`.
    """
    return (
        f"{path}: a pre-0.4 torch.save tar checkpoint; ckptfix cannot read its pickles without running them, "
        "so it is neither scanned nor loaded. Only if you made the file yourself: load it with "
        "load_anywhere(path, trust=True) (runs any code in it) and save it again"
    )


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``.

    Args:
        shape: the tensor's shape.

    Returns:
        One stride per dimension, in elements.

    >>> contiguous_stride((2, 3, 4))
    (12, 4, 1)
    """
    stride: list[int] = []
    acc = 1
    for s in reversed(shape):
        stride.insert(0, acc)
        acc *= s
    return tuple(stride)


# --------------------------------------------------------------------------- per-format details


@dataclass
class Member:
    """One zip archive member: its name, where its data starts in the file, size, CRC-32."""

    name: str
    data_offset: int
    size: int
    crc: int
    compressed: bool


@dataclass
class ZipDetails:
    """A torch zip archive (``torch.save`` since 1.6).

    Attributes:
        root: the archive folder holding ``data.pkl`` (with its trailing ``/``, or ``""``).
        members: member name -> :class:`Member`, in archive order.
        data_pkl: the bytes of ``<root>data.pkl``.
        byteorder: ``"little"`` or ``"big"`` (the ``byteorder`` record; little when absent).
    """

    root: str
    members: dict[str, Member]
    data_pkl: bytes
    byteorder: str


@dataclass
class TorchScriptDetails(ZipDetails):
    """A ``torch.jit.save`` archive: a zip archive plus the state dict derived from its code.

    Attributes:
        state_dict: what ``torch.jit.load(f).state_dict()`` returns, as tensor records; None when it
            could not be derived (a note on the file says why).
    """

    state_dict: dict[str, Any] | None = None


@dataclass
class PickleDetails:
    """A bare pickle (``pickle.dump``): where the pickle ends in the file."""

    pickle_end: int


@dataclass
class LegacyDetails:
    """A legacy (pre-1.6) ``torch.save`` stream.

    Attributes:
        pickle_start: file offset of the checkpoint object's pickle.
        pickle_end: file offset just past it.
        storage_keys: the storage keys, in the order their bytes follow in the file.
        sys_info: the system-info pickle (``little_endian``, type sizes).
    """

    pickle_start: int
    pickle_end: int
    storage_keys: list[Any]
    sys_info: Any


@dataclass
class SafetensorsDetails:
    """A ``.safetensors`` file.

    Attributes:
        metadata: the header's ``__metadata__`` (str -> str; empty when absent).
        data_start: file offset of the data section (8 + header length).
    """

    metadata: dict[str, str]
    data_start: int


@dataclass
class ShardIndex:
    """A parsed, validated ``*.index.json``.

    Attributes:
        path: the index file.
        doc: the whole JSON document.
        weight_map: tensor name -> shard name, as written in the index.
        shards: shard name -> absolute path of the shard file (index order, each once).
    """

    path: str
    doc: dict[str, Any]
    weight_map: dict[str, str]
    shards: dict[str, str]


@dataclass
class ShardedDetails:
    """A sharded checkpoint: its index and every shard, read.

    Attributes:
        index: the parsed index (:func:`ckptfix.formats.sharded.load_index`).
        shards: shard name -> the shard read as a :class:`CheckpointFile`.
        shard_format: the first shard's format (None for no shards).
    """

    index: ShardIndex
    shards: dict[str, CheckpointFile]
    shard_format: Format | None


@dataclass
class DcpDetails:
    """A ``torch.distributed.checkpoint`` directory.

    Attributes:
        files: the data files (``.distcp``) the metadata names.
        summary: counts for ``inspect``: tensors per top-level key, files, ranks, chunks, tensors,
            objects, version (the ``dcp`` entry of ``inspect --json``).
        metadata: the parsed ``.metadata`` (:class:`~ckptfix.formats.dcp.meta.DcpMetadata`).
    """

    files: list[str]
    summary: dict[str, Any]
    metadata: DcpMetadata


Details = Union[
    ZipDetails, TorchScriptDetails, PickleDetails, LegacyDetails, SafetensorsDetails, ShardedDetails, DcpDetails
]
D = TypeVar("D", bound=Details)


@dataclass(frozen=True)
class Input:
    """A checkpoint path classified once, at the entry point, and passed down: nothing below re-sniffs it.

    :func:`ckptfix.formats.classify` builds it (one :func:`~ckptfix.formats.sniff`); every function that takes
    a checkpoint path also takes an ``Input`` (it is an ``os.PathLike``), and the ones that would sniff use
    its :attr:`format` instead.  ``str(input)`` is the path, so messages read as for a path.

    Attributes:
        path: the file or directory, as given.
        format: what it holds (what :func:`~ckptfix.formats.sniff` said, or the reader read).
        size: the file's size in bytes; None for a directory or a sharded checkpoint (several files).
    """

    path: str
    format: Format
    size: int | None = None

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path


@dataclass(eq=False)
class CheckpointFile:
    """A checkpoint read without torch: object graph, storages, provenance.

    Attributes:
        path: the file or directory read (for a sharded checkpoint, the index file).
        format: what it holds.
        obj: the unpickled object graph (tensors as records, unknown globals as placeholders).
        storages: storage key -> record with the byte range that holds it.
        globals_seen: every global the pickle(s) referenced -> how often.
        stubbed: the globals that became placeholders.
        file_size: bytes on disk (every file, for a directory or a sharded checkpoint).
        details: what the container adds, typed per format (None where it adds nothing).
        notes: remarks for ``inspect`` (byte order, DCP summary, what could not be derived).
    """

    path: str
    format: Format
    obj: Any
    storages: dict[str, StorageRecord] = field(default_factory=dict)
    globals_seen: dict[str, int] = field(default_factory=dict)
    stubbed: set[str] = field(default_factory=set)
    file_size: int = 0
    details: Details | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def input(self) -> Input:
        """This checkpoint as an :class:`Input` (its path and format, as read: nothing to sniff again)."""
        return Input(self.path, self.format, None if self.format in (Format.DCP, Format.SHARDED) else self.file_size)

    @property
    def state_root(self) -> Any:
        """The object the state dict is looked up in.

        Returns:
            The object graph; for TorchScript, the state dict derived from the archive's code
            (empty when it could not be derived), which is what ``torch.jit.load(f).state_dict()`` gives.
        """
        if self.format == Format.TORCHSCRIPT:
            sd = self.details.state_dict if isinstance(self.details, TorchScriptDetails) else None
            return sd or {}
        return self.obj

    def state_dict(self, key: str | None = None) -> tuple[tuple[str, ...], Mapping[str, Any]]:
        """Find the state dict (TorchScript included: see :attr:`state_root`).

        Args:
            key: where it sits (``"model"``, ``"model/state_dict"``); found automatically otherwise.

        Returns:
            ``(path inside the wrapper, the state dict)``, as :func:`find_state_dict`.

        Raises:
            KeyConflictError: ``key`` does not exist or is not a mapping.
            CorruptCheckpointError: no mapping of tensors anywhere.
        """
        return find_state_dict(self.state_root, key)

    def details_as(self, kind: type[D]) -> D:
        """The typed details, checked to be of ``kind``.

        Args:
            kind: the details class the caller needs, e.g. :class:`ZipDetails`.

        Returns:
            :attr:`details`.

        Raises:
            TypeError: the file's details are of another kind (the caller did not check the format).
        """
        if not isinstance(self.details, kind):
            raise TypeError(f"{self.path}: a {self.format} checkpoint has no {kind.__name__}")
        return self.details
