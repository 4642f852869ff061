"""Sharded checkpoints: ``*.index.json`` with a ``weight_map`` (``.bin`` or ``.safetensors`` shards).

:func:`load_index` is the one place an index is parsed: every command goes through it, so every
command refuses the same things -- a malformed or oversized index, an empty weight map, and shard
names that leave the index's directory (absolute paths, ``..``, symlinks pointing elsewhere; the
Hugging Face hub cache layout, ``snapshots/<rev>/x -> ../../blobs/<hash>``, is allowed).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ckptfix.errors import (
    CheckpointNotFoundError,
    CkptfixError,
    CorruptCheckpointError,
    ResourceLimitError,
    UnsupportedError,
)
from ckptfix.files import source
from ckptfix.files.containment import allowed_roots, inside, remote_name_escapes
from ckptfix.formats.base import (
    MAX_JSON_ENV,
    CheckpointFile,
    Format,
    ShardedDetails,
    ShardIndex,
    max_json_bytes,
)
from ckptfix.pickles import StorageRecord

__all__ = ["ShardIndex", "check_shard_kind", "index_path", "load_index", "looks_like_index", "read_index", "shard_file"]


def looks_like_index(path: str) -> bool:
    """Whether a JSON file is a sharded index (an object with a ``weight_map``); used by ``sniff``.

    Args:
        path: a file whose content starts with ``{``.

    Returns:
        True for an object with a ``weight_map`` key, and for a file too large to parse that
        mentions one (:func:`load_index` then refuses it with the size limit).
    """
    size = source.getsize(path)
    with source.open_file(path) as f:
        text = f.read(min(size, max_json_bytes()))
    if size > len(text):
        return b'"weight_map"' in text
    try:
        import json  # here, not at the top: start-up of inspect/scan

        doc = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and "weight_map" in doc


def check_shard_kind(idx: ShardIndex, shard: str, kind: Format) -> None:
    """Refuse a shard that is not a checkpoint file (an index or a DCP directory itself).

    Args:
        idx: the index naming the shard.
        shard: the shard's name in the index.
        kind: what :func:`~ckptfix.formats.sniff` says the shard holds.

    Raises:
        CorruptCheckpointError: the shard is a sharded or DCP checkpoint.
    """
    if kind in (Format.SHARDED, Format.DCP):
        raise CorruptCheckpointError(
            f"{idx.path}: shard {shard!r} is a {kind} checkpoint, not a checkpoint file; the index is corrupt"
        )


def index_path(path: str) -> str:
    """The ``*.index.json`` a sharded checkpoint path names (the file, or the only index in a directory).

    Args:
        path: an index file or a directory holding one.

    Returns:
        The index file's path.

    Raises:
        CorruptCheckpointError: the directory holds several indexes.
        CheckpointNotFoundError: the directory holds none.
    """
    if source.isdir(path):
        idx = sorted(n for n in source.listdir(path) if n.endswith(".index.json"))
        if len(idx) > 1:
            raise CorruptCheckpointError(f"{path}: several *.index.json files ({', '.join(idx)}); pass one")
        if not idx:
            raise CheckpointNotFoundError(f"{path}: no *.index.json in this directory; pass the checkpoint file")
        return source.join(path, idx[0])
    return path


_allowed_roots = allowed_roots  # one rule for every container: ckptfix.files.containment
_inside = inside


def shard_file(ipath: str, shard: object) -> str:
    """The path of ``shard`` as named in the index ``ipath``; refused if it leaves the index's directory.

    Args:
        ipath: the index file.
        shard: a shard name from its weight map.

    Returns:
        The shard file's path, next to the index.

    Raises:
        CorruptCheckpointError: not a string, or the index itself.
        UnsupportedError: absolute, with ``..``/NUL, or a symlink resolving outside the index's directory.
        CheckpointNotFoundError: the shard file does not exist.
    """
    base = os.path.dirname(os.path.abspath(ipath))
    if not isinstance(shard, str) or not shard:
        raise CorruptCheckpointError(
            f"{ipath}: a shard name in the weight map is {shard!r}, not a file name; the index is corrupt"
        )
    parts = shard.replace("\\", "/").split("/")
    if "\x00" in shard or os.path.isabs(shard) or shard.startswith(("/", "\\")) or ".." in parts:
        raise UnsupportedError(
            f"{ipath}: shard {shard!r} points outside the index's directory; refused "
            "(shard names must be files next to the index)"
        )
    if source.is_url(ipath):  # next to a remote index: no links to follow, the same name checks
        if remote_name_escapes(shard):  # %2e%2e, a query, a whole URL: joined, it names another object
            raise UnsupportedError(
                f"{ipath}: shard {shard!r} points outside the index's folder; refused "
                "(shard names must be files next to the index)"
            )
        sp = source.join(source.dirname(ipath), shard)
        if shard.endswith(".index.json"):
            raise CorruptCheckpointError(f"{ipath}: shard {shard!r} is an index itself; the index is corrupt")
        if not source.isfile(sp):
            raise CheckpointNotFoundError(
                f"{ipath}: shard {shard!r} is listed in the index but missing next to it ({sp}); "
                "upload every shard next to the index"
            )
        return sp
    sp = os.path.join(base, shard)
    if not os.path.isfile(sp):
        raise CheckpointNotFoundError(
            f"{ipath}: shard {shard!r} is listed in the index but missing from {base}; "
            "download or copy every shard next to the index"
        )
    real = os.path.realpath(sp)
    if not _inside(real, _allowed_roots(base)):
        raise UnsupportedError(
            f"{ipath}: shard {shard!r} is a link to {real}, outside the index's "
            "directory; refused (copy the shard next to the index)"
        )
    if real == os.path.realpath(ipath) or shard.endswith(".index.json"):
        raise CorruptCheckpointError(f"{ipath}: shard {shard!r} is an index itself; the index is corrupt")
    return sp


def load_index(path: str) -> ShardIndex:
    """Parse and validate a sharded index (a ``*.index.json`` or a directory holding one).

    Args:
        path: the index or its directory.

    Returns:
        A :class:`ShardIndex` whose shard paths all exist inside the index's directory.

    Raises:
        CorruptCheckpointError: not JSON, nested too deep, no ``weight_map`` object of names to shard
            names, or an empty weight map.
        UnsupportedError: a shard name leaving the index's directory.
        ResourceLimitError: the index is larger than ``CKPTFIX_MAX_JSON_MB`` (32 MiB).
        CheckpointNotFoundError: a shard is missing.
    """
    ipath = index_path(path)
    try:
        size = source.getsize(ipath)
    except CkptfixError:  # a remote index: its own typed error (not found, access denied ...)
        raise
    except OSError as e:
        raise CheckpointNotFoundError(f"{ipath}: cannot read the index ({e.strerror})") from None
    limit = max_json_bytes()
    if size > limit:
        raise ResourceLimitError(
            f"{ipath}: the index is {size} bytes, over the {limit >> 20} MiB limit for JSON "
            f"metadata (a real index is a few MB); if you trust it, raise {MAX_JSON_ENV}=<MiB>"
        )
    try:
        with source.open_file(ipath) as f:
            import json  # here, not at the top: start-up of inspect/scan

            doc = json.loads(f.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise CorruptCheckpointError(f"{ipath}: not a valid sharded index (not JSON); the file is corrupt") from None
    except RecursionError:
        raise CorruptCheckpointError(
            f"{ipath}: the index JSON is nested too deep; the file is corrupt or hostile"
        ) from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(
            f"{ipath}: not a valid sharded index (needs a 'weight_map' object of tensor names to shard files)"
        )
    if not weight_map:
        raise CorruptCheckpointError(
            f"{ipath}: the index's weight_map is empty (no tensors); the index is corrupt or incomplete"
        )
    shards: dict[str, str] = {}
    for shard in weight_map.values():
        if shard not in shards:
            shards[shard] = shard_file(ipath, shard)
    return ShardIndex(path=ipath, doc=doc, weight_map=dict(weight_map), shards=shards)


def read_index(
    path: str, *, sniff: Callable[[str], Format], read: Callable[[str, Format], CheckpointFile]
) -> CheckpointFile:
    """Read every shard (without torch) and merge the tensors named in the weight map.

    Args:
        path: the ``*.index.json`` or its directory.
        sniff: tells a shard's format (:func:`ckptfix.formats.sniff`).
        read: reads one shard, given its format (:func:`ckptfix.formats.read_checkpoint`): each shard is sniffed once.

    Returns:
        A :class:`CheckpointFile`: tensor name -> record, every shard's storages as
        ``"<shard>:<key>"``, with :class:`ShardedDetails`.

    Raises:
        CorruptCheckpointError, CheckpointNotFoundError, ResourceLimitError, UnsupportedError: see
            :func:`load_index`; also a shard that is not a checkpoint file, or a tensor missing from its shard.
    """
    idx = load_index(path)
    ipath = idx.path
    shards: dict[str, CheckpointFile] = {}
    for shard, sp in idx.shards.items():
        kind = sniff(sp)
        check_shard_kind(idx, shard, kind)
        shards[shard] = read(sp, kind)
    obj: dict[str, Any] = {}
    storages: dict[str, StorageRecord] = {}
    globals_seen: dict[str, int] = {}
    stubbed: set[str] = set()
    for name, shard in idx.weight_map.items():
        cf = shards[shard]
        _, sd = cf.state_dict()
        if name not in sd:
            raise CorruptCheckpointError(f"{ipath}: tensor {name!r} is mapped to {shard!r} but not in it")
        obj[name] = sd[name]
    for shard, cf in shards.items():
        for k, rec in cf.storages.items():
            storages[f"{shard}:{k}"] = rec
        for g, n in cf.globals_seen.items():
            globals_seen[g] = globals_seen.get(g, 0) + n
        stubbed |= cf.stubbed
    total = sum(cf.file_size for cf in shards.values())
    return CheckpointFile(
        path=ipath,
        format=Format.SHARDED,
        obj=obj,
        storages=storages,
        globals_seen=globals_seen,
        stubbed=stubbed,
        file_size=total,
        details=ShardedDetails(
            index=idx, shards=shards, shard_format=next(iter(shards.values())).format if shards else None
        ),
    )
