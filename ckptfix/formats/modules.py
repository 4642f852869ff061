"""The ``nn.Module`` objects inside a pickled object graph, and the state dict they make, torch-free.

``torch.save(agent)`` of a reinforcement-learning agent (a plain object whose ``actor`` / ``critic`` /
``critic_target`` attributes are modules), ``torch.save({"model": DetectionModel, "ema": ...})`` of
ultralytics, a list of modules: the weights are the modules' ``state_dict()``, each under the path that
reaches the module (``actor.fc1.weight``).  :func:`find_modules` walks the placeholders' attributes, the
mappings and the sequences of the graph (or real objects' ``__dict__``), stops at each module (its
submodules are part of its own state dict) and gives each module once, under the first path that reaches it;
:func:`modules_state_dict` names the tensors as :func:`~ckptfix.formats.statedict.module_state_dict` does
(parameters and persistent buffers in ``_parameters`` / ``_buffers`` order, then submodules in ``_modules``
order, non-persistent buffers left out).  :func:`follow` steps through object attributes too, so
``--key actor`` finds an attribute of a pickled object.  Nothing here imports torch or runs the pickle's code.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ckptfix.pickles import Stub, is_tensor_like

#: how deep the walk goes, and how many objects it visits at most (real graphs: a few levels, hundreds of objects)
MAX_DEPTH = 32
MAX_NODES = 200_000

_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), range, slice, type)


@dataclass(frozen=True)
class FoundModule:
    """One module of the graph.

    Attributes:
        path: the attribute / key / index names that reach it from the top (``("actor",)``).
        cls: its class as the pickle names it (``pickled_models.Actor``).
        obj: the module (a placeholder, a plain dict after sanitize, or a real module).
        tensors: how many tensors its ``state_dict()`` holds.
    """

    path: tuple[str, ...]
    cls: str
    obj: Any
    tensors: int

    @property
    def name(self) -> str:
        """The path dotted (``critic.q``), ``""`` at the top."""
        return ".".join(self.path)


def _class_name(obj: Any) -> str:
    if isinstance(obj, Stub):
        return obj.full_name
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _attrs(obj: Any) -> Mapping[str, Any] | None:
    """An object's attributes: a placeholder's ``__setstate__`` dict (or the dict of ``(dict, slots)``), a real
    object's ``__dict__``; None for anything else."""
    if isinstance(obj, Stub):
        st = obj.state
        if isinstance(st, tuple) and len(st) == 2 and isinstance(st[1], dict):
            merged = dict(st[0]) if isinstance(st[0], dict) else {}
            merged.update(st[1])
            return merged
        return st if isinstance(st, dict) else None
    if isinstance(obj, (Mapping, list, tuple, set, frozenset)) or isinstance(obj, _LEAVES) or is_tensor_like(obj):
        return None
    d = getattr(obj, "__dict__", None)
    return d if isinstance(d, dict) else None


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """(name, child) of one node: attributes, a mapping's items (string and integer keys), a sequence's items."""
    attrs = _attrs(obj)
    if attrs is not None and "_modules" in attrs and "_parameters" in attrs:  # a module: getattr's order
        for slot in ("_parameters", "_buffers", "_modules"):
            sub = attrs.get(slot)
            if isinstance(sub, Mapping):
                for k, v in sub.items():
                    if isinstance(k, str) and v is not None:
                        yield k, v
    if attrs is not None:
        for k, v in attrs.items():
            if isinstance(k, str):
                yield k, v
    if isinstance(obj, Stub):
        for i, v in enumerate(obj.listitems):
            yield str(i), v
        for k, v in obj.dictitems.items():
            if isinstance(k, (str, int)) and not isinstance(k, bool):
                yield str(k), v
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            if isinstance(k, (str, int)) and not isinstance(k, bool):
                yield str(k), v
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield str(i), v


def find_modules(obj: Any, *, top: bool = True) -> list[FoundModule]:
    """Every module reachable from ``obj`` that holds tensors, each once, in the graph's own order.

    Args:
        obj: the unpickled checkpoint (records and placeholders, or torch objects).
        top: count ``obj`` itself when it is a module (else only what it holds).

    Returns:
        The modules, depth first in attribute / key order; a module reached by two paths is given under the
        first; a module inside another is part of the outer one's state dict, not given again.
    """
    from ckptfix.formats.statedict import module_state, module_state_dict

    found: list[FoundModule] = []
    seen: set[int] = set()
    stack: list[tuple[tuple[str, ...], Any]] = [((), obj)]
    visited = 0
    while stack and visited < MAX_NODES:
        path, node = stack.pop()
        if isinstance(node, _LEAVES) or is_tensor_like(node) or id(node) in seen:
            continue
        seen.add(id(node))
        visited += 1
        if (path or top) and module_state(node) is not None and not isinstance(node, dict):
            msd = module_state_dict(node) or {}
            if msd:
                found.append(FoundModule(path, _class_name(node), node, len(msd)))
            continue
        if len(path) >= MAX_DEPTH:
            continue
        kids = list(_children(node))
        stack.extend((path + (k,), v) for k, v in reversed(kids))
    return found


def modules_state_dict(mods: list[FoundModule]) -> dict[str, Any]:
    """The state dict of several modules: each one's ``state_dict()`` under its path (``actor.fc1.weight``).

    Args:
        mods: as :func:`find_modules` gives them.

    Returns:
        name -> tensor, module after module.
    """
    from ckptfix.formats.statedict import module_state_dict

    out: dict[str, Any] = collections.OrderedDict()
    for m in mods:
        module_state_dict(m.obj, f"{m.name}." if m.path else "", out)
    return out


def describe(mods: list[FoundModule], limit: int = 6) -> str:
    """``actor (pickled_models.Actor, 5 tensors), critic (...)``: where a state dict's tensors came from."""
    parts = [f"{m.name or '(top)'} ({m.cls}, {m.tensors} tensor{'s' if m.tensors != 1 else ''})" for m in mods]
    more = f" and {len(parts) - limit} more" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


_MISSING = object()


def follow(obj: Any, key: str) -> tuple[tuple[str, ...], Any] | None:
    """The object at ``key`` (``actor``, ``agent/actor``, ``agent.actor``), stepping through mappings and object
    attributes; None where the key leads nowhere.

    Args:
        obj: the unpickled checkpoint.
        key: levels split on ``/``, or on ``.`` where no name with the dot exists.

    Returns:
        ``(path walked, the object there)``.
    """
    parts = key.split("/") if "/" in key else [key]
    node = obj
    walked: tuple[str, ...] = ()
    for part in parts:
        nxt = _child(node, part)
        if nxt is not _MISSING:
            node, walked = nxt, walked + (part,)
            continue
        for sub in part.split(".") if "." in part else ():
            nxt = _child(node, sub)
            if nxt is _MISSING:
                return None
            node, walked = nxt, walked + (sub,)
        if "." not in part:
            return None
    return walked, node


def _child(node: Any, name: str) -> Any:
    for k, v in _children(node):
        if k == name:
            return v
    return _MISSING


def names_at(obj: Any, limit: int = 12) -> list[str]:
    """The names one level below ``obj`` (keys or attributes), for a message."""
    return [k for k, _ in _children(obj)][:limit]
