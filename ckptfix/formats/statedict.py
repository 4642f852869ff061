"""Finding the state dict inside a checkpoint's object graph, and every tensor in it.

Works on what the torch-free reader returns (tensor records, placeholders) and on torch objects
alike; nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from ckptfix.errors import CorruptCheckpointError, KeyConflictError
from ckptfix.pickles import Stub, is_tensor_like

#: the keys a wrapper dict keeps its state dict under, in the order they are preferred
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
    """Whether ``obj`` is a mapping whose values are all tensors (records or torch tensors), at least one.

    Args:
        obj: any object.

    Returns:
        True for a non-empty mapping of tensors.
    """
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

    Without ``key``: the object itself when it is a mapping of tensors, else a mapping of tensors
    under a preferred name (:data:`STATE_DICT_KEYS`, breadth first, 3 levels), else the largest
    mapping of tensors anywhere (4 levels), else a top-level mapping holding some tensors.

    Args:
        obj: the unpickled checkpoint.
        key: the path explicitly: ``"model"`` or ``"model/state_dict"`` (``.`` is also accepted
            between levels when no key with a dot matches).

    Returns:
        ``(path, mapping)`` where ``path`` is the chain of keys from the top (``()`` when the object
        itself is the state dict).

    Raises:
        KeyConflictError: ``key`` does not exist or is not a mapping of tensors.
        CorruptCheckpointError: no mapping of tensors anywhere in the object.
    """
    if key is not None:
        return _follow_key(obj, key)
    if is_tensor_dict(obj):
        return (), obj
    if _is_mapping(obj):
        found = _preferred(obj) or _largest(obj)
        if found is not None:
            return found
        # a mapping with some tensors and some other values at the top (e.g. a bare model dict with extras)
        if any(is_tensor_like(v) for v in obj.values()):
            return (), obj
    raise CorruptCheckpointError(
        "no state dict (a mapping of names to tensors) found in the checkpoint; pass key=... / --key to say where it is"
    )


def _follow_key(obj: Any, key: str) -> tuple[tuple[str, ...], Mapping[str, Any]]:
    """The mapping at ``key`` (levels split on ``/``, or on ``.`` where no key with the dot exists)."""
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


def _preferred(obj: Any) -> tuple[tuple[str, ...], Mapping[str, Any]] | None:
    """A mapping of tensors under one of :data:`STATE_DICT_KEYS`, breadth first, up to 3 levels down."""
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
    return None


def _largest(obj: Any) -> tuple[tuple[str, ...], Mapping[str, Any]] | None:
    """The largest mapping of tensors anywhere, up to 4 levels down."""
    best: tuple[tuple[str, ...], Any] | None = None
    for path, node in _walk(obj, (), 4):
        if is_tensor_dict(node) and (best is None or len(node) > len(best[1])):
            best = (path, node)
    return best


def iter_tensors(obj: Any, path: str = "", depth: int = 8, seen: set[int] | None = None) -> Iterator[tuple[str, Any]]:
    """Every tensor reachable from ``obj`` (dicts, lists, tuples, placeholder state and arguments).

    Args:
        obj: the object graph.
        path: the dotted path of ``obj`` itself.
        depth: how many levels to descend.
        seen: ids already visited (shared across the recursion).

    Yields:
        ``(dotted path, tensor)``; a tensor reached twice through one container is yielded once.
    """
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
    elif isinstance(obj, Stub):
        if obj._state is not None:
            yield from iter_tensors(obj._state, path, depth - 1, seen)
        if obj._args:
            yield from iter_tensors(list(obj._args), path, depth - 1, seen)
