"""The ``ckptfix.*`` entries ckptfix writes into a safetensors file's ``__metadata__``: encode and decode.

safetensors stores one tensor per name and no Python objects, so ``ckptfix convert`` records what
it cannot store as tensors in the header's string metadata (all values are strings; JSON where
noted); this module is the only place that writes or reads those keys:

=========================  ===================================================================
``format``                 ``"pt"``
``ckptfix.source_format``  the input's format (``torch-zip``, ``torch-legacy`` ...)
``ckptfix.key_path``       JSON list: where the state dict was in the checkpoint
``ckptfix.order``          JSON list: every state-dict name in its original order
``ckptfix.aliases``        JSON object ``{alias: stored_name}`` (exact duplicates stored once)
``ckptfix.views``          JSON object ``{name: {"base", "offset", "shape", "stride"}}``
``ckptfix.extra``          JSON object: the representable non-tensor entries (epoch, step ...)
=========================  ===================================================================

Files written by Hugging Face's ``convert.py`` record aliases as plain ``{"removed": "kept"}``
metadata entries; :func:`aliases` understands both.  Pure and torch-free: tensors are only
passed through (:func:`restore` calls ``as_strided`` on the values it is given).

>>> meta = encode(source_format="torch-zip", key_path=("model",), order=["a", "b"], aliases={"b": "a"})
>>> aliases(meta, {"a": 1}), order(meta), key_path(meta)
({'b': 'a'}, ['a', 'b'], ('model',))
>>> rename(meta, {"a": "x.a", "b": "x.b"}, {"a": 1})["ckptfix.aliases"]
'{"x.b": "x.a"}'
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

__all__ = [
    "PREFIX",
    "SOURCE_FORMAT",
    "KEY_PATH",
    "ORDER",
    "ALIASES",
    "VIEWS",
    "EXTRA",
    "MAX_EXTRA_JSON",
    "encode",
    "aliases",
    "order",
    "views",
    "key_path",
    "extra",
    "rename",
    "restore",
    "logical_state_dict",
]

PREFIX = "ckptfix."
SOURCE_FORMAT = "ckptfix.source_format"
KEY_PATH = "ckptfix.key_path"
ORDER = "ckptfix.order"
ALIASES = "ckptfix.aliases"
VIEWS = "ckptfix.views"
EXTRA = "ckptfix.extra"

#: the largest ``ckptfix.extra`` JSON kept (bigger non-tensor state is reported as skipped)
MAX_EXTRA_JSON = 16 << 20


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False)


def encode(
    *,
    source_format: str,
    key_path: Sequence[str],
    order: Sequence[str],
    aliases: Mapping[str, str] | None = None,
    views: Mapping[str, Mapping[str, Any]] | None = None,
    extra: Mapping[str, Any] | None = None,
    skipped: dict[str, str] | None = None,
) -> dict[str, str]:
    """The ``__metadata__`` of a ckptfix-written safetensors file, ``format`` first, keys in a fixed order.

    Args:
        source_format: the input's format name.
        key_path: where the state dict sat in the checkpoint.
        order: every state-dict name in its original order.
        aliases: ``{alias: stored name}`` of tensors stored once.
        views: ``{name: {"base", "offset", "shape", "stride"}}`` of views restorable from a stored base.
        extra: the JSON-representable non-tensor entries of the checkpoint.
        skipped: receives ``"<extra>"`` when ``extra`` is over :data:`MAX_EXTRA_JSON` (then not written).

    Returns:
        name -> string value, ready for the safetensors header.
    """
    meta = {
        "format": "pt",
        SOURCE_FORMAT: source_format,
        KEY_PATH: json.dumps(list(key_path)),
        ORDER: _dumps(list(order)),
    }
    if aliases:
        meta[ALIASES] = _dumps(dict(aliases))
    if views:
        meta[VIEWS] = _dumps(dict(views))
    if extra:
        text = _dumps(extra)
        if len(text) <= MAX_EXTRA_JSON:
            meta[EXTRA] = text
        elif skipped is not None:
            skipped["<extra>"] = f"non-tensor entries are {len(text)} bytes of JSON; too large to keep"
    return meta


def _load(meta: Mapping[str, Any], key: str, kind: type) -> Any:
    """``meta[key]`` decoded as JSON of type ``kind``; an empty ``kind()`` when absent or malformed."""
    try:
        v = json.loads(meta[key])
    except (KeyError, TypeError, ValueError):
        return kind()
    return v if isinstance(v, kind) else kind()


def aliases(meta: Mapping[str, Any] | None, stored: Mapping[str, Any]) -> dict[str, str]:
    """``{alias: stored name}`` a safetensors file's metadata records (ckptfix's or Hugging Face's style).

    Args:
        meta: the file's ``__metadata__`` (or None).
        stored: the tensors the file stores, by name.

    Returns:
        Only string pairs whose alias is not stored and whose target is.
    """
    meta = meta or {}
    if ALIASES in meta:
        amap = _load(meta, ALIASES, dict)
    else:
        amap = {k: v for k, v in meta.items() if k != "format" and not k.startswith(PREFIX)}
    return {
        a: b for a, b in amap.items() if isinstance(a, str) and isinstance(b, str) and a not in stored and b in stored
    }


def order(meta: Mapping[str, Any] | None) -> list[str]:
    """The state dict's original key order (``ckptfix.order``).

    Args:
        meta: the file's ``__metadata__`` (or None).

    Returns:
        The names, or ``[]`` when not recorded.
    """
    return [n for n in _load(meta or {}, ORDER, list) if isinstance(n, str)]


def views(meta: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """``{name: {"base", "offset", "shape", "stride"}}``: views stored through their base (``ckptfix.views``).

    Args:
        meta: the file's ``__metadata__`` (or None).

    Returns:
        The well-formed entries (dict values), or ``{}``.
    """
    return {k: v for k, v in _load(meta or {}, VIEWS, dict).items() if isinstance(v, dict)}


def key_path(meta: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Where the state dict sat in the converted checkpoint (``ckptfix.key_path``).

    Args:
        meta: the file's ``__metadata__`` (or None).

    Returns:
        The path, ``()`` for a top-level state dict or when not recorded.
    """
    return tuple(str(k) for k in _load(meta or {}, KEY_PATH, list))


def extra(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """The non-tensor entries of the converted checkpoint (``ckptfix.extra``), still JSON-encoded inside.

    Args:
        meta: the file's ``__metadata__`` (or None).

    Returns:
        The JSON object, or ``{}``.
    """
    return dict(_load(meta or {}, EXTRA, dict))


def rename(meta: dict[str, Any], mapping: Mapping[str, str], stored: Mapping[str, Any]) -> dict[str, Any]:
    """``meta`` with the tensor names it holds (ckptfix aliases, order, views; Hugging Face aliases) renamed.

    Args:
        meta: the file's ``__metadata__`` (updated in place for ckptfix keys).
        mapping: old name -> new name.
        stored: the tensors the file stores under their old names.

    Returns:
        The renamed metadata.
    """
    if not mapping or all(a == b for a, b in mapping.items()):
        return meta

    def r(n: Any) -> Any:
        return mapping.get(n, n) if isinstance(n, str) else n

    def load(k: str) -> Any:
        try:
            return json.loads(meta[k])
        except (TypeError, ValueError):
            return None

    if ALIASES in meta:
        amap = load(ALIASES)
        if isinstance(amap, dict):
            meta[ALIASES] = _dumps({r(a): r(b) for a, b in amap.items()})
    else:
        hf = aliases(meta, stored)
        meta = {(r(k) if k in hf else k): (r(v) if k in hf else v) for k, v in meta.items()}
    if ORDER in meta:
        names = load(ORDER)
        if isinstance(names, list):
            meta[ORDER] = _dumps([r(n) for n in names])
    if VIEWS in meta:
        vs = load(VIEWS)
        if isinstance(vs, dict):
            meta[VIEWS] = _dumps(
                {r(n): ({**v, "base": r(v.get("base"))} if isinstance(v, dict) else v) for n, v in vs.items()}
            )
    return meta


def logical_state_dict(stored: Mapping[str, Any], meta: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The stored tensors plus the aliases the metadata records (an alias's value is its target's).

    Args:
        stored: the tensors (or records) the file stores, by name.
        meta: the file's ``__metadata__`` (or None).

    Returns:
        A new dict in the original order when ``ckptfix.order`` gives it; ``stored`` itself when
        there are no aliases.
    """
    amap = aliases(meta, stored)
    if not amap:
        return stored
    out: dict[str, Any] = {}
    for n in [*order(meta), *stored, *amap]:
        if n not in out:
            if n in stored:
                out[n] = stored[n]
            elif n in amap:
                out[n] = stored[amap[n]]
    return out


def restore(state_dict: Mapping[str, Any], meta: Mapping[str, str] | None) -> dict[str, Any]:
    """Re-create the tensors a ckptfix-written safetensors file stored once.

    Aliases become the same tensor object as their stored name; ``ckptfix.views`` entries become
    ``as_strided`` views of their base; keys follow ``ckptfix.order`` when recorded.  Files written
    by Hugging Face's ``convert.py`` (``{"removed_name": "kept_name"}`` in the metadata) are
    understood too.

    Args:
        state_dict: the tensors the file stores (torch tensors).
        meta: the file's ``__metadata__`` (or None).

    Returns:
        A new dict; the input is not modified.
    """
    out: dict[str, Any] = dict(state_dict)
    amap = aliases(meta, out)
    for name, spec in views(meta).items():
        b = spec.get("base")
        base = out.get(b) if isinstance(b, str) else None
        if base is None or not hasattr(base, "as_strided"):
            continue
        try:
            out[name] = base.as_strided(
                tuple(spec["shape"]), tuple(spec["stride"]), base.storage_offset() + int(spec["offset"])
            )
        except (RuntimeError, KeyError, TypeError, ValueError):
            continue
    for alias, target in amap.items():
        out[alias] = out[target]
    names = order(meta)
    if names:
        ordered = {n: out[n] for n in names if n in out}
        ordered.update((k, v) for k, v in out.items() if k not in ordered)
        out = ordered
    return out
