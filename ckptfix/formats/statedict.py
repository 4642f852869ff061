"""Find the tensors of any checkpoint object and name them, torch-free.

A checkpoint is whatever ``torch.save`` was given: a state dict, a dict holding one
(``{"model": ..., "optimizer": ...}``), a whole pickled ``nn.Module``, a list of tensors.  The
functions here find and name its tensors the way ``module.state_dict()`` would, on the records
and placeholders of the restricted reader (or on real torch objects); the format readers,
convert, rewrite, loading and inspect share them.  Nothing here imports torch.
"""

from __future__ import annotations

import collections
from typing import Any, Iterator, Mapping, Sequence

from ckptfix.errors import CorruptCheckpointError, KeyConflictError, NoTensorsError
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
        parent = "/".join(walked[:-1])
        hint = f"; try --key {parent!r}" if parent else "; leave --key out to find the state dict automatically"
        raise KeyConflictError(f"key {key!r} holds {_describe(node)}, not a state dict{hint}")
    return walked, node


def _describe(node: Any) -> str:
    """What a non-mapping value is, in a user's words (a tensor, a list of 3 items, an int ...)."""
    if is_tensor_like(node):
        shape = getattr(node, "shape", None)
        return f"a tensor (shape {list(shape)})" if shape is not None else "a tensor"
    if isinstance(node, Stub):
        return f"an object of class {node.full_name}"
    if isinstance(node, (list, tuple)):
        return f"a {type(node).__name__} of {len(node)} items"
    return f"a value of type {type(node).__name__}"


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
        if obj.state is not None:
            yield from iter_tensors(obj.state, path, depth - 1, seen)
        if obj.args:
            yield from iter_tensors(list(obj.args), path, depth - 1, seen)


__all__ = [
    "contains_tensors",
    "module_state",
    "module_state_dict",
    "locate_state_dict",
    "flatten_containers",
    "flatten_state_dict",
    "require_tensors",
    "at_path",
]


def contains_tensors(obj: Any, depth: int = 200) -> bool:
    """Is there a tensor (record or torch tensor) anywhere in ``obj``, placeholder state included?

    Args:
        obj: any object graph from the restricted reader or torch.
        depth: how deep to look.

    Returns:
        True at the first tensor found.
    """
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(obj, 0)]
    while todo:
        v, d = todo.pop()
        if is_tensor_like(v):
            return True
        if d > depth or id(v) in seen or isinstance(v, (str, bytes, int, float, type)) or v is None:
            continue
        seen.add(id(v))
        if isinstance(v, Stub):
            todo += [
                (getattr(v, "_state", None), d + 1),
                (list(getattr(v, "_args", ())), d + 1),
                (list(getattr(v, "_listitems", ())), d + 1),
                (list(getattr(v, "_dictitems", {}).values()), d + 1),
            ]
        elif isinstance(v, Mapping):
            todo += [(x, d + 1) for x in v.values()]
        elif isinstance(v, (list, tuple, set, frozenset)):
            todo += [(x, d + 1) for x in v]
        elif hasattr(v, "__dict__"):
            todo.append((vars(v), d + 1))
    return False


def module_state(obj: Any) -> dict | None:
    """The ``__dict__`` of a pickled ``nn.Module`` (a placeholder, a plain dict after sanitize, or a real module).

    Args:
        obj: any object of a checkpoint.

    Returns:
        The module's attribute dict (with ``_parameters`` and ``_modules``), or None when ``obj`` is no module.
    """
    if isinstance(obj, Stub):
        st = getattr(obj, "_state", None)
    elif isinstance(obj, dict):
        st = obj
    elif hasattr(obj, "_parameters") and hasattr(obj, "_modules"):
        st = vars(obj)
    else:
        return None
    return st if isinstance(st, dict) and "_parameters" in st and "_modules" in st else None


def module_state_dict(obj: Any, prefix: str = "", out: dict | None = None, depth: int = 0) -> dict | None:
    """What ``module.state_dict()`` returns, for a whole pickled ``nn.Module`` (``torch.save(model)``), without torch.

    Args:
        obj: the module: a placeholder, a plain dict (after ``sanitize``) or a real ``nn.Module``.
        prefix, out, depth: used by the recursion.

    Returns:
        name -> tensor: parameters, then persistent buffers, then each submodule's, recursively, as
        torch orders them; None when ``obj`` is not a module.
    """
    st = module_state(obj)
    if st is None or depth > 100:
        return None
    out = collections.OrderedDict() if out is None else out
    for name, p in (st.get("_parameters") or {}).items():
        if p is not None and is_tensor_like(p):
            out[prefix + str(name)] = p
    skip = st.get("_non_persistent_buffers_set") or set()
    for name, b in (st.get("_buffers") or {}).items():
        if b is not None and is_tensor_like(b) and name not in skip:
            out[prefix + str(name)] = b
    for name, m in (st.get("_modules") or {}).items():
        if m is not None:
            module_state_dict(m, f"{prefix}{name}.", out, depth + 1)
    return out


#: the name a bare tensor (``torch.save(tensor)``) is given where a name is needed (convert, inspect)
BARE_TENSOR_NAME = "tensor"


def locate_state_dict(obj: Any, key: str | None = None) -> tuple[tuple[str, ...], Mapping[str, Any], str]:
    """Find the tensors of any checkpoint object and name them.

    Args:
        obj: the unpickled checkpoint (records and placeholders, or torch objects).
        key: where the state dict sits (``"model"``, ``"model/state_dict"``); found automatically otherwise.

    Returns:
        ``(key path, state dict, kind)``.  ``kind`` ``"mapping"``: a state dict (as
        :func:`ckptfix.formats.find_state_dict` finds it); ``"module"``: a whole pickled ``nn.Module``
        (at the top or under a top-level key), its ``state_dict()`` computed from the placeholders;
        ``"sequence"``: a top-level list/tuple holding tensors (nested lists, tuples and dicts too),
        each named by its path: ``"0"``, ``"1.2"`` ...; ``"optimizer"``: an optimizer's state
        (:func:`is_optimizer_state`), every tensor named by its path (``"state.0.exp_avg"``); ``"tensor"``:
        one bare tensor (``torch.save(tensor)``), named ``"tensor"``.

    Raises:
        KeyConflictError: ``key`` does not exist.  CorruptCheckpointError: no tensors found.
    """
    if key is None and is_tensor_like(obj):  # torch.save(tensor): one tensor, no name
        return (), {BARE_TENSOR_NAME: obj}, "tensor"
    if key is not None:
        held = _modules_at_key(obj, key)
        if held is not None:
            return held
    if key is None:
        if module_state(obj) is not None and not isinstance(obj, dict):
            msd = module_state_dict(obj)
            if msd:
                return (), msd, "module"
        if isinstance(obj, Mapping) and not is_tensor_like(obj):
            for k, v in obj.items():
                if isinstance(k, str) and not isinstance(v, dict) and module_state(v) is not None:
                    msd = module_state_dict(v)
                    if msd:
                        return (k,), msd, "module"
    if key is None and not isinstance(obj, Mapping):
        held = _held_modules(obj, ())
        if held is not None:  # an object holding modules (an RL agent's actor / critic, a list of modules)
            return held
    if key is None and is_optimizer_state(obj) is not None:
        # torch.optim / accelerate / DeepSpeed optimizer states: int-keyed "state", tensors in lists
        return (), flatten_containers(obj), "optimizer"
    try:
        kp, sd = find_state_dict(obj, key)
    except CorruptCheckpointError:
        if key is not None:
            raise
        held = _held_modules(obj, ())
        if held is not None:
            return held
        mixed = _mixed_state_dict(obj)
        if mixed is not None:
            return mixed[0], mixed[1], "mapping"
        flat = flatten_containers(obj) if isinstance(obj, (list, tuple)) else {}
        if not flat:
            raise
        return (), flat, "sequence"
    return tuple(kp), sd, "mapping"


def _held_modules(obj: Any, path: tuple[str, ...]) -> tuple[tuple[str, ...], Mapping[str, Any], str] | None:
    """``(path, state dict, "modules")`` of the modules ``obj`` holds (each under its attribute path), or None."""
    from ckptfix.formats.modules import find_modules, modules_state_dict

    mods = find_modules(obj, top=False)
    sd = modules_state_dict(mods) if mods else {}
    return (path, sd, "modules") if sd else None


def _modules_at_key(obj: Any, key: str) -> tuple[tuple[str, ...], Mapping[str, Any], str] | None:
    """What ``--key`` names when it is a module, or an object (not a mapping) holding modules: through object
    attributes too (``--key actor`` of a pickled agent); None to look the key up as a mapping path."""
    from ckptfix.formats.modules import follow

    hit = follow(obj, key)
    if hit is None:
        if not _is_mapping(obj) or isinstance(obj, Stub):
            from ckptfix.formats.modules import names_at

            raise KeyConflictError(
                f"key {key!r} not found in the checkpoint ({_describe(obj)}); the names at its top: {names_at(obj)}"
            )
        return None
    walked, node = hit
    if module_state(node) is not None and not isinstance(node, dict):
        msd = module_state_dict(node)
        if msd:
            return walked, msd, "module"
    if not _is_mapping(node) or (isinstance(node, Stub) and not node.dictitems):
        return _held_modules(node, walked)
    return None


#: keys of DeepSpeed's ZeRO optimizer partitions (``*_optim_states.pt``: ``optimizer_state_dict``)
_ZERO_KEYS = ("fp32_flat_groups", "single_partition_of_fp32_groups", "base_optimizer_state")


def is_optimizer_state(obj: Any) -> str | None:
    """Whether ``obj`` is an optimizer's saved state, and whose.

    ``optimizer.state_dict()`` (``{"state": {0: {...}}, "param_groups": [...]}``: Trainer's
    ``optimizer.pt``, accelerate's ``optimizer.bin``) holds its tensors under integer keys, which no
    state-dict search follows; DeepSpeed's ``*_optim_states.pt`` holds ``{"optimizer_state_dict":
    {"fp32_flat_groups" | "single_partition_of_fp32_groups": [tensor, ...], ...}}``.

    Args:
        obj: the unpickled checkpoint.

    Returns:
        ``"torch"``, ``"deepspeed"`` or None.
    """
    if not isinstance(obj, Mapping) or not contains_tensors(obj):
        return None
    if "param_groups" in obj and "state" in obj and isinstance(obj["state"], Mapping):
        return "torch"
    inner = obj.get("optimizer_state_dict")
    if isinstance(inner, Mapping) and any(k in inner for k in _ZERO_KEYS):
        return "deepspeed"
    return None


def _mixed_state_dict(obj: Any) -> tuple[tuple[str, ...], Mapping[str, Any]] | None:
    """A nested state dict that also holds non-tensor values (``{"w": tensor, "kind": int}``, ``_extra_state``).

    Preferred names (``state_dict``, ``model`` ...) first, else the mapping with the most tensors, three levels
    down at most.  None when no mapping holds a tensor directly.
    """
    best: tuple[int, int, tuple[str, ...], Any] | None = None
    todo: list[tuple[tuple[str, ...], Any]] = [((), obj)]
    while todo:
        path, node = todo.pop(0)
        if not isinstance(node, Mapping) or len(path) > 3:
            continue
        n = sum(1 for v in node.values() if is_tensor_like(v))
        if n and path:
            rank = (1 if path[-1] in STATE_DICT_KEYS else 0, n)
            if best is None or rank > best[:2]:
                best = (rank[0], rank[1], path, node)
        todo += [(path + (k,), v) for k, v in node.items() if isinstance(k, str) and isinstance(v, Mapping)]
    return (best[2], best[3]) if best else None


def flatten_containers(obj: Any, prefix: str = "", out: dict | None = None, depth: int = 0) -> dict[str, Any]:
    """``{"0.1": tensor, ...}``: every tensor in nested lists, tuples and dicts, named by its path.

    Args:
        obj: the container.
        prefix, out, depth: used by the recursion.

    Returns:
        name -> tensor, in container order (32 levels deep at most); a key that is no string is named by
        ``str`` (``0.5``, ``None``) or, for other types, ``repr`` (``(0, 1)``).

    Raises:
        KeyConflictError: two tensors get one name (keys ``1`` and ``"1"``; ``"a.b"`` and ``"a"`` + ``"b"``).
    """
    out = {} if out is None else out
    if depth > 32:
        return out
    if is_tensor_like(obj):
        name = prefix.rstrip(".")
        if name in out:
            raise KeyConflictError(
                f"two tensors are both named {name!r} (keys that differ only in type or in dots); "
                "use load_checkpoint(path).checkpoint for the object itself"
            )
        out[name] = obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flatten_containers(v, f"{prefix}{i}.", out, depth + 1)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            kk = k if isinstance(k, str) else str(k) if isinstance(k, (int, float)) or k is None else repr(k)
            flatten_containers(v, f"{prefix}{kk}.", out, depth + 1)
    return out


def require_tensors(cf: Any, src: str, what: str) -> None:
    """Refuse a valid checkpoint that holds no tensors anywhere (``training_args.bin``, ``scheduler.pt``).

    Args:
        cf: the :class:`~ckptfix.formats.CheckpointFile` read from ``src``.
        src: the path, for the message.
        what: the operation, for the message (``"convert"``, ``"rename"``).

    Raises:
        NoTensorsError: naming the file and what to do instead.
    """
    if not contains_tensors(cf.state_root):
        raise NoTensorsError(
            f"{src}: a valid {cf.format} file with no tensors in it (arguments, scheduler or "
            f"other state), so there is nothing to {what}; `ckptfix inspect` summarises it and "
            "`ckptfix sanitize` makes it load with weights_only=True"
        )


def flatten_state_dict(sd: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """The ``(name, tensor)`` pairs of a state dict; a nested one (DCP's ``{"model": {...}}``) is dotted.

    Args:
        sd: the state dict.
        prefix: used by the recursion.

    Returns:
        The pairs in state-dict order; non-tensor values are left out.
    """
    out: list[tuple[str, Any]] = []
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if is_tensor_like(v):
            out.append((name, v))
        elif isinstance(v, Mapping) and prefix == "" and any(is_tensor_like(x) for x in v.values()):
            out.extend(flatten_state_dict(v, name + "."))  # DCP nested state dicts
    return out


def at_path(obj: Any, path: Sequence[str]) -> Any:
    """``obj[path[0]][path[1]]...``.

    Args:
        obj: a nested mapping.
        path: the keys to follow.

    Returns:
        The value at ``path`` (``obj`` itself for an empty path).

    Raises:
        KeyError, TypeError: ``path`` does not exist in ``obj``.
    """
    for part in path:
        if isinstance(obj, Mapping) or (isinstance(obj, Stub) and part in obj.dictitems):
            obj = obj[part]
            continue
        from ckptfix.formats.modules import _MISSING, _child

        nxt = _child(obj, part)  # an object's attribute, a module's submodule (pickled agents, --key actor)
        if nxt is _MISSING:
            raise KeyError(part)
        obj = nxt
    return obj
