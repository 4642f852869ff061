"""Torch-free access to checkpoint containers.

:func:`read_checkpoint` sniffs a path by content and returns a
:class:`CheckpointFile`: the unpickled object graph (tensors as
:class:`~ckptfix.pickles.TensorRecord`, unknown globals as inert placeholders),
every storage with the byte range that holds it, and what the pickle(s)
referenced.  Nothing here imports torch or reads tensor bytes.

An entry point classifies its input once, :func:`classify` (one :func:`sniff`), and passes the
:class:`Input` down: ``read_checkpoint(input)`` (or ``read_checkpoint(path, fmt)``) does not sniff again.

Formats (:class:`Format`, what :func:`sniff` says and ``CheckpointFile.format`` records):

``torch-zip``     ``torch.save`` since 1.6 (any archive root folder name)
``torch-legacy``  ``torch.save(..., _use_new_zipfile_serialization=False)``
``torchscript``   ``torch.jit.save`` archives
``safetensors``   a ``.safetensors`` file
``sharded``       a ``*.index.json`` with a ``weight_map`` (``.bin`` or ``.safetensors`` shards), or its directory
``dcp``           a ``torch.distributed.checkpoint`` directory
``pickle``        a bare pickle with no torch storages
``torch-package`` a ``torch.package.PackageExporter`` archive (packaged code and pickles): recognised and
                  scanned, never read
``torch-tar``     the pre-0.4 ``torch.save`` tar archive (``sys_info``, ``pickle``, ``storages``,
                  ``tensors``): recognised, never read (only torch's unrestricted loader reads it)

The shared types live in :mod:`ckptfix.formats.base`, state dict discovery in
:mod:`ckptfix.formats.statedict`, each container in its own module; this package re-exports them
and dispatches on the format.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ckptfix.errors import CheckpointNotFoundError, CkptfixError, CorruptCheckpointError
from ckptfix.files import pins, source
from ckptfix.formats import registry, sniffing, zipfmt
from ckptfix.formats.base import (
    DEFAULT_MAX_JSON_MB,
    MAX_JSON_ENV,
    CheckpointFile,
    DcpDetails,
    Details,
    Format,
    Input,
    LegacyDetails,
    Member,
    PickleDetails,
    SafetensorsDetails,
    ShardedDetails,
    ShardIndex,
    TorchScriptDetails,
    ZipDetails,
    env_mib,
    max_json_bytes,
    package_message,
    tar_message,
)
from ckptfix.formats.roles import is_sidecar_name
from ckptfix.formats.statedict import STATE_DICT_KEYS, find_state_dict, is_tensor_dict, iter_tensors
from ckptfix.pickles import StorageRecord, TensorRecord, is_tensor_like

if TYPE_CHECKING:
    from ckptfix.formats import dcp as dcp
    from ckptfix.formats import legacy as legacy
    from ckptfix.formats import safetensors_fmt as safetensors_fmt
    from ckptfix.formats import sharded as sharded

__all__ = [
    "DEFAULT_MAX_JSON_MB",
    "MAX_JSON_ENV",
    "STATE_DICT_KEYS",
    "CheckpointFile",
    "DcpDetails",
    "Details",
    "Format",
    "Input",
    "LegacyDetails",
    "Member",
    "PickleDetails",
    "SafetensorsDetails",
    "ShardIndex",
    "ShardedDetails",
    "StorageRecord",
    "TensorRecord",
    "TorchScriptDetails",
    "ZipDetails",
    "env_mib",
    "find_state_dict",
    "is_tensor_dict",
    "is_tensor_like",
    "iter_tensors",
    "max_json_bytes",
    "classify",
    "classify_or_none",
    "read_checkpoint",
    "sniff",
    "package_message",
    "tar_message",
]

ZIP_MAGIC = b"PK\x03\x04"
ZIP_EMPTY = b"PK\x05\x06"


def sniff(path: str) -> Format:
    """Say which format ``path`` holds, by content, deciding as ``torch.load`` decides and in its order.

    ``PK\x03\x04`` first (a zip: torch, TorchScript or torch.package by member names), then whatever
    ``tarfile`` opens at offset 0 (a tar checkpoint, even when its bytes also start a pickle), then a
    valid safetensors header, then a pickle (``PROTO`` 2..5, or protocol 0/1 with no ``PROTO``).  See
    :mod:`ckptfix.formats.sniffing`; ``scan`` also checks the other readings of a polyglot.

    Args:
        path: a file or directory.

    Returns:
        The :class:`Format`: a directory is :attr:`Format.DCP` or :attr:`Format.SHARDED`; a pickle
        stream is :attr:`Format.TORCH_LEGACY` when its first pickle is torch's magic number, else
        :attr:`Format.PICKLE`.

    Raises:
        CheckpointNotFoundError: the path does not exist, or is a directory with no checkpoint.
        CorruptCheckpointError: an empty file, or one that is no checkpoint (text, JSON without a
            weight map, a zip without ``data.pkl``, a tar archive that is not torch's).
        ResourceLimitError: a zip whose small records inflate past ``CKPTFIX_MAX_PICKLE_MB``.
    """
    if not source.exists(path):
        if source.is_url(path):
            from ckptfix.errors import RemoteNotFoundError

            raise RemoteNotFoundError(f"{path}: no such object or folder; check the URL")
        raise CheckpointNotFoundError(f"{path}: no such file or directory; check the path")
    if source.isdir(path):
        return _dir_kind(path)
    size = source.getsize(path)
    if size == 0:
        raise CorruptCheckpointError(f"{path}: the file is empty (0 bytes); the save was probably interrupted")
    with source.open_file(path) as f:
        head = f.read(16)
    # torch.load's own order (see ckptfix.formats.sniffing): zip magic, then tarfile at offset 0, then a pickle
    if head.startswith(ZIP_MAGIC) or head.startswith(ZIP_EMPTY):
        return zipfmt.zip_kind(path)
    opens = sniffing.tar_opens(path)
    if opens:
        return _tar_kind(path)
    if opens is None:
        raise CorruptCheckpointError(
            f"{path}: starts with a damaged tar header that torch.load's tar reader fails on; not a checkpoint"
        )
    # the JSON is parsed here only where the length's bytes also read as PROTO (else the reader checks it)
    if sniffing.safetensors_header_ok(path, max_json_bytes() if head[:1] == b"\x80" else 0):
        return Format.SAFETENSORS
    if sniffing.zip_where_tar_stopped(path):
        raise CorruptCheckpointError(
            f"{path}: torch.load refuses this file before reading any pickle ('is a zip archive': a zip record "
            "where its tar reader stopped); it is no checkpoint torch can load, pass the file torch.save wrote"
        )
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        from ckptfix.formats import legacy

        return legacy.stream_kind(path)
    if len(head) >= 9 and head[8:9] == b"{" and not head.lstrip()[:1] == b"{":
        return Format.SAFETENSORS  # a header whose length or JSON is wrong: the reader says which
    if head.lstrip()[:1] == b"{":
        from ckptfix.formats import sharded

        if sharded.looks_like_index(path):
            return Format.SHARDED
        raise CorruptCheckpointError(
            f"{path}: a JSON file, not a checkpoint (no 'weight_map'); "
            "pass the checkpoint file or a sharded *.index.json"
        )
    if head.startswith(LFS_POINTER[:16]):
        _refuse_lfs_pointer(path)
    if sniffing.starts_like_pickle(path):  # protocol 0/1: no PROTO opcode, but torch.load unpickles it all the same
        from ckptfix.formats import legacy

        return legacy.stream_kind(path)
    with source.open_file(path) as f:
        block = f.read(512)
    if len(block) >= 262 and block[257:262] == b"ustar":
        return _tar_kind(path)
    if _looks_like_text(block):
        raise CorruptCheckpointError(f"{path}: a text file, not a checkpoint; pass the file torch.save wrote")
    raise CorruptCheckpointError(
        f"{path}: not a checkpoint ckptfix recognises (not a torch zip, legacy pickle, "
        "safetensors, DCP directory or sharded index); is it complete?"
    )


def _dir_kind(path: str) -> Format:
    """A DCP directory (``.metadata``) or a directory holding a ``*.index.json``; refused otherwise."""
    if source.isfile(source.join(path, ".metadata")):
        return Format.DCP
    names = source.listdir(path)
    if any(n.endswith(".index.json") for n in names):
        return Format.SHARDED
    cands = [n for n in names if n.endswith((".pt", ".pth", ".bin", ".ckpt", ".safetensors"))]
    # real checkpoints first; after them framework sidecars (optimizer.pt, scheduler.pt, rng_state.pth ...)
    # and the trainer's probe batches (X.probe.pt)
    cands.sort(key=lambda n: is_sidecar_name(n) or n.endswith(".probe.pt"))
    if source.is_url(path):  # (the framework sub-folder lister reads local folders only)
        if not cands:
            raise CheckpointNotFoundError(
                f"{path}: a folder with no checkpoint in it (no DCP .metadata, no *.index.json); "
                "pass a checkpoint's URL"
            )
        raise CheckpointNotFoundError(
            f"{path}: a folder with no checkpoint in it (no DCP .metadata, no *.index.json){_holds(cands)}, "
            f"e.g. {source.join(path, cands[0])})"
        )
    from ckptfix.formats.layouts import checkpoint_subfolders

    cands = [f"{n}/" for n in checkpoint_subfolders(path)] + cands  # Trainer's output_dir: checkpoint-N/
    hint = f"{_holds(cands)})" if cands else ""
    raise CheckpointNotFoundError(
        f"{path}: a directory with no checkpoint in it (no DCP .metadata, no *.index.json){hint}"
    )


def _holds(cands: list[str]) -> str:
    """`` (it holds a.pt, b.pt, c.pt and 2 more: pass one of them`` (without the closing parenthesis)."""
    more = f" and {len(cands) - 3} more" if len(cands) > 3 else ""
    return f" (it holds {', '.join(cands[:3])}{more}: pass one of them"


def _tar_kind(path: str) -> Format:
    """:attr:`Format.TORCH_TAR` for a tar archive torch's legacy loader opens: a pre-0.4 torch.save archive
    (its first member names), or any tar whose bytes also start a pickle (torch reads it as a tar, other
    readers as a pickle); refused otherwise."""
    import tarfile

    names: set[str] = set()
    try:
        with source.open_file(path) as f, tarfile.open(fileobj=sniffing._Capped(f), mode="r:") as tar:
            for _ in range(16):
                info = tar.next()
                if info is None:
                    break
                names.add(info.name)
    except (tarfile.TarError, OSError, ValueError, EOFError, UnicodeDecodeError, OverflowError):
        pass
    if "pickle" in names and names & {"storages", "tensors", "sys_info"}:
        return Format.TORCH_TAR
    if sniffing.starts_like_pickle(path):
        return Format.TORCH_TAR
    raise CorruptCheckpointError(f"{path}: a tar archive, not a checkpoint; extract it and pass the checkpoint inside")


#: the first line of a Git LFS pointer file (https://github.com/git-lfs/git-lfs/blob/main/docs/spec.md)
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\n"


def _refuse_lfs_pointer(path: str) -> None:
    """A Git LFS pointer (a clone without ``git lfs``, or ``GIT_LFS_SKIP_SMUDGE``): say so and how to fetch it.

    Raises:
        CorruptCheckpointError: the file is a pointer; the message names the object's size and ``git lfs pull``.
    """
    with source.open_file(path) as f:
        text = f.read(1024)
    if not text.startswith(LFS_POINTER):
        return
    fields = dict(line.split(" ", 1) for line in text.decode("utf-8", "replace").splitlines()[1:] if " " in line)
    size = fields.get("size", "").strip()
    what = f" of a {int(size):,}-byte file" if size.isdigit() else ""
    raise CorruptCheckpointError(
        f"{path}: a Git LFS pointer{what}, not the checkpoint (the clone did not download it); "
        f"run `git lfs pull --include={os.path.basename(path)}` (or `git lfs pull`) in the repository"
    )


def _looks_like_text(block: bytes) -> bool:
    if not block:
        return False
    try:
        block.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(b >= 9 for b in block)


def classify(src: str | os.PathLike | Input) -> Input:
    """Open and classify a checkpoint once, at the entry point: the :class:`Input` that is passed down.

    Args:
        src: a path (sniffed here, once), or an :class:`Input` (returned as it is: never sniffed again).

    Returns:
        The :class:`Input`: the path, its :class:`Format`, and a file's size.

    Raises:
        As :func:`sniff`.
    """
    if isinstance(src, Input):
        return src
    path = os.fspath(src)
    fmt = sniff(path)
    several = fmt in (Format.DCP, Format.SHARDED)
    return Input(path, fmt, pins.fstat(path).st_size if not several and os.path.isfile(path) else None)


def classify_or_none(src: str | os.PathLike | Input) -> Input | None:
    """:func:`classify`, or None where it raises: for a router that decides from the format and lets the entry
    point it routes to report the error after its own checks (an existing output, an option it refuses)."""
    try:
        return classify(src)
    except CkptfixError:
        return None


def read_checkpoint(path: str | os.PathLike | Input, fmt: Format | None = None) -> CheckpointFile:
    """Read any supported checkpoint without torch and without running pickle code.

    Args:
        path: a checkpoint file, a sharded index (or its directory) or a DCP directory; or its :class:`Input`
            (:func:`classify`), whose format is not sniffed again.
        fmt: the format, when the caller already knows it (not sniffed again); None: :func:`sniff` it.

    Returns:
        The :class:`CheckpointFile`, its :attr:`~CheckpointFile.details` typed per format.

    Raises:
        CheckpointNotFoundError: missing path or a directory with no checkpoint.
        CorruptCheckpointError: truncated, empty or unrecognised data.
        UnsupportedError: a format ckptfix cannot read without torch (a pre-0.4 tar archive).
        ResourceLimitError: metadata or pickles over the configured limits.
    """
    if isinstance(path, Input):
        fmt = path.format if fmt is None else fmt
    path = os.fspath(path)
    with source.session():  # a remote object is opened once (one pinned version) for the whole read
        if fmt is None:
            fmt = sniff(path)
        cf: CheckpointFile = registry.dispatch(fmt, "read", path)(path)
    return cf


# the readers the format registry names (torch-tar and torch-package: refused in their entries)


def read_torch_zip(path: str) -> CheckpointFile:
    return zipfmt.read_zip(path, Format.TORCH_ZIP)


def read_torchscript(path: str) -> CheckpointFile:
    return zipfmt.read_zip(path, Format.TORCHSCRIPT)


def read_dcp(path: str) -> CheckpointFile:
    from ckptfix.formats.dcp.checkpoint import read_dcp as read  # imported for a DCP directory only

    return read(path)


def read_pickle_stream(path: str) -> CheckpointFile:
    from ckptfix.formats.legacy import read_pickle_stream as read

    return read(path)


def read_safetensors(path: str) -> CheckpointFile:
    from ckptfix.formats.safetensors_fmt import read_safetensors as read

    return read(path)


#: the readers imported on first use (each format's own; a torch zip's inspect/scan needs none of them: start-up)
_LAZY_SUBMODULES = frozenset({"dcp", "legacy", "safetensors_fmt", "sharded"})


def __getattr__(name: str) -> Any:
    """``ckptfix.formats.dcp.checkpoint`` / ``legacy`` / ``safetensors_fmt`` / ``sharded``, imported on first use."""
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"ckptfix.formats.{name}")
    raise AttributeError(f"module 'ckptfix.formats' has no attribute {name!r}")


def read_sharded(path: str) -> CheckpointFile:
    from ckptfix.formats import sharded

    return sharded.read_index(path, sniff=sniff, read=read_checkpoint)
