"""Torch-free access to checkpoint containers.

:func:`read_checkpoint` sniffs a path by content and returns a
:class:`CheckpointFile`: the unpickled object graph (tensors as
:class:`~ckptfix.pickles.TensorRecord`, unknown globals as inert placeholders),
every storage with the byte range that holds it, and what the pickle(s)
referenced.  Nothing here imports torch or reads tensor bytes.

Formats (``CheckpointFile.format``):

``torch-zip``     ``torch.save`` since 1.6 (any archive root folder name)
``torch-legacy``  ``torch.save(..., _use_new_zipfile_serialization=False)``
``torchscript``   ``torch.jit.save`` archives
``safetensors``   a ``.safetensors`` file
``sharded``       a ``*.index.json`` with a ``weight_map`` (``.bin`` or ``.safetensors`` shards)
``dcp``           a ``torch.distributed.checkpoint`` directory
``pickle``        a bare pickle with no torch storages
``torch-tar``     the pre-0.4 ``torch.save`` tar archive (``sys_info``, ``pickle``, ``storages``,
                  ``tensors``): recognised, never read (only torch's unrestricted loader reads it)
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from ckptfix.errors import CheckpointNotFoundError, CorruptCheckpointError, KeyConflictError
from ckptfix.pickles import StorageRecord, TensorRecord, is_tensor_like  # noqa: F401 - TensorRecord re-exported

#: environment variable (MiB) that lifts the cap on JSON metadata: safetensors headers, sharded indexes
MAX_JSON_ENV = "CKPTFIX_MAX_JSON_MB"
#: default cap, in MiB: a real index or header for 100k tensors is ~10-15 MB (parsed JSON takes ~10x that)
DEFAULT_MAX_JSON_MB = 32


def env_mib(name: str, default_mib: int) -> int:
    """A size limit in bytes from the environment variable ``name`` (MiB), else ``default_mib`` MiB.

    Raises:
        ResourceLimitError: the variable is set but not a positive number.
    """
    from ckptfix.errors import ResourceLimitError

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
    """The largest safetensors header or sharded index ckptfix parses (``CKPTFIX_MAX_JSON_MB``, default 32 MiB).

    Raises:
        ResourceLimitError: the environment variable is not a positive number.
    """
    return env_mib(MAX_JSON_ENV, DEFAULT_MAX_JSON_MB)


ZIP_MAGIC = b"PK\x03\x04"
ZIP_EMPTY = b"PK\x05\x06"


@dataclass(eq=False)
class CheckpointFile:
    """A checkpoint read without torch: object graph, storages, provenance."""

    path: str
    format: str
    obj: Any
    storages: dict[str, StorageRecord] = field(default_factory=dict)
    globals_seen: dict[str, int] = field(default_factory=dict)
    stubbed: set[str] = field(default_factory=set)
    file_size: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # container specifics (zip prefix, safetensors metadata...)
    notes: list[str] = field(default_factory=list)

    def state_dict(self, key: str | None = None) -> tuple[tuple[str, ...], Mapping[str, Any]]:
        """(path inside the wrapper, the state dict) -- see :func:`find_state_dict`."""
        return find_state_dict(self.obj, key)


def sniff(path: str) -> str:
    """Say which format ``path`` holds, by content. Raises the ckptfix error for bad input."""
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such file or directory; check the path")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, ".metadata")):
            return "dcp"
        idx = [n for n in sorted(os.listdir(path)) if n.endswith(".index.json")]
        if idx:
            return "sharded-dir"
        cands = [n for n in sorted(os.listdir(path)) if n.endswith((".pt", ".pth", ".bin", ".ckpt", ".safetensors"))]
        hint = f" (it holds {', '.join(cands[:3])}: pass one of them)" if cands else ""
        raise CheckpointNotFoundError(
            f"{path}: a directory with no checkpoint in it (no DCP .metadata, no *.index.json){hint}"
        )
    size = os.path.getsize(path)
    if size == 0:
        raise CorruptCheckpointError(f"{path}: the file is empty (0 bytes); the save was probably interrupted")
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(ZIP_MAGIC) or head.startswith(ZIP_EMPTY):
        from ckptfix.formats import zipfmt

        return zipfmt.zip_kind(path)
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        return "pickle-stream"  # legacy torch.save or a bare pickle; told apart by the reader
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if head[8:9] == b"{" and 0 < n <= size - 8:
            return "safetensors"
    if len(head) >= 8 and head[8:9] == b"{":
        return "safetensors"  # header length is wrong: the reader reports it
    if head.lstrip()[:1] == b"{":
        with open(path, "rb") as f:
            text = f.read(min(size, max_json_bytes()))
        if size > len(text) and b'"weight_map"' in text:
            return "sharded"  # too large to parse: the index reader refuses it with the limit
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            doc = None
        if isinstance(doc, dict) and "weight_map" in doc:
            return "sharded"
        raise CorruptCheckpointError(
            f"{path}: a JSON file, not a checkpoint (no 'weight_map'); "
            "pass the checkpoint file or a sharded *.index.json"
        )
    with open(path, "rb") as f:
        block = f.read(512)
    if len(block) >= 262 and block[257:262] == b"ustar":
        return _tar_kind(path)
    if _looks_like_text(block):
        raise CorruptCheckpointError(f"{path}: a text file, not a checkpoint; pass the file torch.save wrote")
    raise CorruptCheckpointError(
        f"{path}: not a checkpoint ckptfix recognises (not a torch zip, legacy pickle, "
        "safetensors, DCP directory or sharded index); is it complete?"
    )


#: the members of a pre-0.4 torch.save tar archive
TAR_MEMBERS = frozenset({"sys_info", "pickle", "storages", "tensors"})


def _tar_kind(path: str) -> str:
    """``"torch-tar"`` for a pre-0.4 torch.save tar archive (its first few member names), else refuse."""
    import tarfile

    names: set[str] = set()
    try:
        with tarfile.open(path, mode="r:") as tar:
            for _ in range(16):
                info = tar.next()
                if info is None:
                    break
                names.add(info.name)
    except (tarfile.TarError, OSError, ValueError, EOFError, UnicodeDecodeError, OverflowError):
        pass
    if "pickle" in names and names & {"storages", "tensors", "sys_info"}:
        return "torch-tar"
    raise CorruptCheckpointError(f"{path}: a tar archive, not a checkpoint; extract it and pass the checkpoint inside")


def _looks_like_text(block: bytes) -> bool:
    if not block:
        return False
    try:
        block.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(b >= 9 for b in block)


def read_checkpoint(path: str | os.PathLike) -> CheckpointFile:
    """Read any supported checkpoint without torch and without running pickle code.

    Raises:
        CheckpointNotFoundError: missing path or a directory with no checkpoint.
        CorruptCheckpointError: truncated, empty or unrecognised data.
        UnsupportedError: a format ckptfix cannot read without torch.
    """
    path = os.fspath(path)
    kind = sniff(path)
    if kind in ("torch-zip", "torchscript"):
        from ckptfix.formats import zipfmt

        return zipfmt.read_zip(path, kind)
    if kind == "pickle-stream":
        from ckptfix.formats import legacy

        return legacy.read_pickle_stream(path)
    if kind == "safetensors":
        from ckptfix.formats import safetensors_fmt

        return safetensors_fmt.read_safetensors(path)
    if kind in ("sharded", "sharded-dir"):
        from ckptfix.formats import sharded

        return sharded.read_index(path)
    if kind == "dcp":
        from ckptfix.formats import dcp

        return dcp.read_dcp(path)
    if kind == "torch-tar":
        from ckptfix.errors import UnsupportedError

        raise UnsupportedError(tar_message(path))
    raise CorruptCheckpointError(f"{path}: unrecognised checkpoint format")


def tar_message(path: str) -> str:
    """Why a pre-0.4 tar checkpoint is refused, and what to do (used by every command)."""
    return (
        f"{path}: a pre-0.4 torch.save tar checkpoint; ckptfix cannot read its pickles without running them, "
        "so it is neither scanned nor loaded. Only if you made the file yourself: load it with "
        "load_anywhere(path, trust=True) (runs any code in it) and save it again"
    )


# --------------------------------------------------------------------------- state dict discovery

STATE_DICT_KEYS = (
    "state_dict",
    "model_state_dict",
    "model",
    "model_state",
    "net",
    "network",
    "module",
    "ema",
    "model_ema",
    "state_dict_ema",
    "ema_state_dict",
    "weights",
    "params",
    "generator",
)


def is_tensor_dict(obj: Any) -> bool:
    """A mapping whose values are all tensors (records or torch tensors), at least one."""
    if not _is_mapping(obj):
        return False
    n = 0
    for v in obj.values():
        if not is_tensor_like(v):
            return False
        n += 1
    return n > 0


def _is_mapping(obj: Any) -> bool:
    return isinstance(obj, Mapping) or (
        hasattr(obj, "items") and hasattr(obj, "keys") and hasattr(obj, "__getitem__") and not isinstance(obj, type)
    )


def _walk(obj: Any, path: tuple[str, ...], depth: int) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, obj
    if depth <= 0 or not _is_mapping(obj):
        return
    for k, v in list(obj.items()):
        if isinstance(k, str) and _is_mapping(v):
            yield from _walk(v, path + (k,), depth - 1)


def find_state_dict(obj: Any, key: str | None = None) -> tuple[tuple[str, ...], Mapping[str, Any]]:
    """Find the state dict inside a checkpoint object.

    Returns ``(path, mapping)`` where ``path`` is the chain of keys from the
    top (``()`` when the object itself is the state dict).  ``key`` picks the
    path explicitly: ``"model"`` or ``"model/state_dict"`` (``.`` is also
    accepted between levels when no key with a dot matches).

    Raises:
        KeyConflictError: ``key`` does not exist or is not a mapping of tensors.
        CorruptCheckpointError: no mapping of tensors anywhere in the object.
    """
    if key is not None:
        node = obj
        parts = key.split("/") if "/" in key else [key]
        walked: tuple[str, ...] = ()
        for part in parts:
            if _is_mapping(node) and part in node.keys():
                node = node[part]
                walked += (part,)
                continue
            if "." in part and _is_mapping(node):
                sub = part.split(".")
                ok = True
                for s in sub:
                    if _is_mapping(node) and s in node.keys():
                        node = node[s]
                        walked += (s,)
                    else:
                        ok = False
                        break
                if ok:
                    continue
            top = list(obj.keys())[:12] if _is_mapping(obj) else []
            raise KeyConflictError(f"key {key!r} not found in the checkpoint; top-level keys: {top}")
        if not _is_mapping(node):
            raise KeyConflictError(f"key {key!r} holds a {type(node).__name__}, not a state dict")
        return walked, node
    if is_tensor_dict(obj):
        return (), obj
    if _is_mapping(obj):
        # preferred names first, breadth first, up to 3 levels down
        frontier: list[tuple[tuple[str, ...], Any]] = [((), obj)]
        for _ in range(3):
            nxt: list[tuple[tuple[str, ...], Any]] = []
            for path, node in frontier:
                for name in STATE_DICT_KEYS:
                    if name in node.keys() and is_tensor_dict(node[name]):
                        return path + (name,), node[name]
                for k, v in list(node.items()):
                    if isinstance(k, str) and _is_mapping(v):
                        nxt.append((path + (k,), v))
            frontier = nxt
        # otherwise the largest mapping of tensors anywhere
        best: tuple[tuple[str, ...], Any] | None = None
        for path, node in _walk(obj, (), 4):
            if is_tensor_dict(node) and (best is None or len(node) > len(best[1])):
                best = (path, node)
        if best is not None:
            return best
        # a mapping with some tensors and some other values at the top (e.g. a bare model dict with extras)
        tensors = {k: v for k, v in obj.items() if is_tensor_like(v)}
        if tensors:
            return (), obj
    raise CorruptCheckpointError(
        "no state dict (a mapping of names to tensors) found in the checkpoint; pass key=... / --key to say where it is"
    )


def iter_tensors(obj: Any, path: str = "", depth: int = 8, seen: set[int] | None = None) -> Iterator[tuple[str, Any]]:
    """Every tensor reachable from ``obj`` with a dotted path (dicts, lists, tuples, placeholder state)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    if is_tensor_like(obj):
        yield path, obj
        return
    seen.add(id(obj))
    if _is_mapping(obj):
        for k, v in list(obj.items()):
            yield from iter_tensors(v, f"{path}.{k}" if path else str(k), depth - 1, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{path}.{i}" if path else str(i), depth - 1, seen)
    else:
        from ckptfix.pickles import Stub

        if isinstance(obj, Stub):
            if obj._state is not None:
                yield from iter_tensors(obj._state, path, depth - 1, seen)
            if obj._args:
                yield from iter_tensors(list(obj._args), path, depth - 1, seen)
