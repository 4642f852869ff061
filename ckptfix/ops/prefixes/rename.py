"""Detect, strip, add and rename key prefixes: the pure functions of key names (see :mod:`ckptfix.ops.prefixes`)."""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ckptfix.errors import KeyConflictError

__all__ = [
    "INNER_WRAPPER_SEGMENTS",
    "KNOWN_PREFIXES",
    "PrefixReport",
    "StripReport",
    "add_prefix",
    "detect_prefixes",
    "rename_keys",
    "strip_prefix",
    "strip_prefix_report",
]

KNOWN_PREFIXES: tuple[str, ...] = ("module.", "_orig_mod.", "_forward_module.", "model.")
"""Leading wrapper layers: DP/DDP, ``torch.compile``, Lightning Fabric, Lightning."""

INNER_WRAPPER_SEGMENTS: tuple[str, ...] = (
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
    "_fpw_module.",
    "_orig_mod.",
)
"""Wrapper segments removed anywhere inside a key (FSDP, activation checkpointing,
FSDP's old FlattenParamsWrapper, a compiled submodule).  ``module.`` is deliberately
absent: mid-key it is usually a real submodule name."""

SUBMODULE_LIKE_PREFIXES: tuple[str, ...] = ("model.",)
"""Known prefixes that are also common real submodule names: never stripped from
only some keys unless named explicitly."""

_INNER_NAMES = frozenset(s[:-1] for s in INNER_WRAPPER_SEGMENTS)
_KNOWN_NAMES = frozenset(p[:-1] for p in KNOWN_PREFIXES)
_SENTINEL = "\x00ckptfix-leaf\x00"  # a leaf name no real key has, for re-keying _metadata

M = TypeVar("M", bound=Mapping[str, Any])
KeyFn = Callable[[str], str]


# --------------------------------------------------------------------------- core


def rename_keys(state_dict: M, fn: KeyFn | Mapping[str, str]) -> M:
    """Return a new state dict with every key ``k`` renamed to ``fn(k)``.

    ``fn`` may also be a mapping ``old -> new`` (keys it lacks keep their name).
    Values are the same objects, in the same order.  The hidden ``_metadata`` is
    re-keyed by renaming ``"<module path>.<leaf>"`` with ``fn``; an entry whose
    path ``fn`` does not rename cleanly keeps its path.  When two entries land on
    the same path the deeper (inner, real) module's entry wins, and a root entry
    ``""`` is kept if nothing else lands there.

    Args:
        state_dict: mapping of key -> anything (tensors, records, ...).
        fn: the renaming.

    Returns:
        A new mapping of the same type (a plain ``dict`` for non-dict mappings).

    Raises:
        KeyConflictError: two keys would get the same name; names both source
            keys and the target.  Nothing is returned and the input is untouched.
        TypeError: ``fn`` returned something other than a ``str``.

    >>> rename_keys({"a.w": 1, "b.w": 2}, lambda k: k.replace("a.", "enc."))
    {'enc.w': 1, 'b.w': 2}
    >>> rename_keys({"a.w": 1, "b.w": 2}, lambda k: "w")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ckptfix.errors.KeyConflictError: renaming 'a.w' and 'b.w' would give both the key 'w'; ...
    """
    if isinstance(fn, Mapping):
        table = fn

        def fn(key: str) -> str:
            return table.get(key, key)

    old_keys = list(state_dict.keys())
    new_keys = []
    for key in old_keys:
        new = fn(key)
        if not isinstance(new, str):
            raise TypeError(f"the renaming function returned {type(new).__name__} for {key!r}; it must return str")
        new_keys.append(new)
    _check_collisions(old_keys, new_keys)

    out = _empty_like(state_dict)
    for old, new in zip(old_keys, new_keys, strict=False):
        out[new] = state_dict[old]
    metadata = getattr(state_dict, "_metadata", None)
    if isinstance(metadata, Mapping):
        try:
            out._metadata = rekey_metadata(metadata, fn)  # type: ignore[attr-defined]
        except AttributeError:  # a mapping type that cannot carry attributes
            pass
    return out  # type: ignore[return-value]


def _check_collisions(old_keys: list[str], new_keys: list[str]) -> None:
    seen: dict[str, str] = {}
    for old, new in zip(old_keys, new_keys, strict=False):
        if new in seen:
            raise KeyConflictError(
                f"renaming {seen[new]!r} and {old!r} would give both the key {new!r}; nothing was changed. "
                "The checkpoint holds the same name with and without the prefix: strip an explicit prefix, "
                "or drop one of the two keys first."
            )
        seen[new] = old


def _empty_like(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    kind = type(state_dict)
    if kind is dict:
        return {}
    if kind is OrderedDict:
        return OrderedDict()
    if isinstance(state_dict, dict):
        try:  # a dict subclass: keep its class and attributes, not its items
            out: dict[str, Any] = copy.copy(state_dict)
            out.clear()
            return out
        except Exception:  # noqa: BLE001 - an exotic subclass: fall back to a dict
            return {}
    return {}


def rekey_metadata(metadata: Mapping[str, Any], fn: KeyFn) -> OrderedDict[str, Any]:
    """A state dict's hidden ``_metadata`` (module path -> version info) re-keyed as ``fn`` renames the keys.

    Each module path is renamed by probing ``fn`` with a leaf under it; where two paths meet, the
    deeper one's entry is kept.

    Args:
        metadata: ``state_dict._metadata``.
        fn: the key renaming.

    Returns:
        The re-keyed copy, in the original order.
    """
    chosen: dict[str, tuple[int, int, Any]] = {}  # new path -> (depth, position, value)
    for position, (path, value) in enumerate(metadata.items()):
        new_path = path
        probe = f"{path}.{_SENTINEL}" if path else _SENTINEL
        try:
            renamed = fn(probe)
        except Exception:  # noqa: BLE001 - a user renaming that cannot take the probe: keep the path
            renamed = probe
        if isinstance(renamed, str) and renamed.endswith(_SENTINEL):
            head = renamed[: -len(_SENTINEL)]
            if head == "":
                new_path = ""
            elif head.endswith("."):
                new_path = head[:-1]
        depth = path.count(".") + 1 if path else 0
        current = chosen.get(new_path)
        if current is None or depth > current[0]:
            chosen[new_path] = (depth, position, _copy_meta_value(value))
    if "" in metadata and "" not in chosen:
        chosen[""] = (0, -1, _copy_meta_value(metadata[""]))
    ordered = sorted(chosen.items(), key=lambda item: item[1][1])
    return OrderedDict((path, value) for path, (_, _, value) in ordered)


def _copy_meta_value(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value


def _normalize_prefix(prefix: str) -> str:
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
    if prefix == "" or prefix.endswith("."):
        return prefix
    return prefix + "."


def _carries(key: str, prefix: str) -> bool:
    return key.startswith(prefix) and len(key) > len(prefix)


def _remove_inner(key: str) -> tuple[str, tuple[str, ...]]:
    """Drop inner wrapper segments (never the last segment; ``_orig_mod`` only past the leading run)."""
    parts = key.split(".")
    if len(parts) < 2:
        return key, ()
    kept: list[str] = []
    removed: list[str] = []
    in_leading_run = True  # '_orig_mod' in the leading run of wrapper layers is a leading prefix
    for part in parts[:-1]:
        in_leading_run = in_leading_run and part in _KNOWN_NAMES
        if part in _INNER_NAMES and not (in_leading_run and part in _KNOWN_NAMES):
            removed.append(part + ".")
        else:
            kept.append(part)
    if not removed:
        return key, ()
    kept.append(parts[-1])
    return ".".join(kept), tuple(removed)


def _top_segments(keys: Iterable[str], limit: int = 5) -> str:
    counts = Counter(k.split(".", 1)[0] + "." for k in keys if "." in k)
    if not counts:
        return "none"
    return ", ".join(f"{p!r} ({n})" for p, n in counts.most_common(limit))


# --------------------------------------------------------------------------- detect


@dataclass(frozen=True)
class PrefixReport:
    """Which wrapper prefixes a set of keys carries.

    Attributes:
        total_keys: number of keys looked at.
        leading: known prefix -> number of keys carrying it in their leading run
            of wrapper layers (``module._orig_mod.x`` counts for both).
        stacks: the whole leading run -> number of keys, e.g. ``{"module._orig_mod.": 12}``.
        inner: inner wrapper segment -> number of keys containing it after the leading run.
        default_strip: the leading prefixes ``strip_prefix(sd)`` would remove, in order.
    """

    total_keys: int
    leading: dict[str, int] = field(default_factory=dict)
    stacks: dict[str, int] = field(default_factory=dict)
    inner: dict[str, int] = field(default_factory=dict)
    default_strip: tuple[str, ...] = ()
    own: dict[str, int] = field(default_factory=dict)  # leading prefixes that are the model's own (never stripped)

    @property
    def has_wrappers(self) -> bool:
        """True when any known wrapper prefix or inner segment is present."""
        return bool(self.leading or self.inner)

    @property
    def partial(self) -> dict[str, int]:
        """Leading prefixes carried by some keys but not all (a mixed checkpoint)."""
        return {p: n for p, n in self.leading.items() if n < self.total_keys}

    def summary(self) -> str:
        """One line for humans.

        Returns:
            The prefixes with their key counts, or ``"no wrapper prefixes in N keys"``.
        """
        if not self.has_wrappers:
            return f"no wrapper prefixes in {self.total_keys} keys"
        parts = [f"{p!r} on {n} of {self.total_keys} keys" for p, n in self.leading.items()]
        parts += [f"inner {s!r} in {n} keys" for s, n in self.inner.items()]
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form.

        Returns:
            The fields, ``partial`` and ``has_wrappers`` as plain values.
        """
        return {
            "total_keys": self.total_keys,
            "leading": dict(self.leading),
            "stacks": dict(self.stacks),
            "inner": dict(self.inner),
            "partial": self.partial,
            "default_strip": list(self.default_strip),
            "has_wrappers": self.has_wrappers,
            "own": dict(self.own),
        }


def detect_prefixes(keys: Iterable[str], own: Iterable[str] = ()) -> PrefixReport:
    """Report the wrapper prefixes present in ``keys`` (a state dict or any iterable of keys).

    Args:
        keys: key names; a mapping's keys are used.
        own: leading prefixes that are the model's own names, not wrappers (a Hugging Face model's
            base-model prefix, ``"model."`` for Llama: :func:`ckptfix.formats.hfarch.own_prefixes`); reported in
            ``own`` instead of ``leading`` and never in ``default_strip``.

    Returns:
        A :class:`PrefixReport`.

    Raises:
        TypeError: ``keys`` is a single string.

    >>> r = detect_prefixes(["module._orig_mod.fc.weight", "module._orig_mod.fc.bias"])
    >>> r.leading, r.stacks, r.default_strip
    ({'module.': 2, '_orig_mod.': 2}, {'module._orig_mod.': 2}, ('module.', '_orig_mod.'))
    >>> detect_prefixes(["enc.layer._fsdp_wrapped_module.w", "head.w"]).inner
    {'_fsdp_wrapped_module.': 1}
    """
    if isinstance(keys, str):
        raise TypeError("detect_prefixes takes an iterable of keys, not a single string")
    key_list = list(keys)
    own_set = tuple(_normalize_prefix(p) for p in own)
    leading: Counter[str] = Counter()
    stacks: Counter[str] = Counter()
    inner: Counter[str] = Counter()
    for key in key_list:
        parts = key.split(".")
        run = 0
        while run < len(parts) - 1 and parts[run] in _KNOWN_NAMES:
            run += 1
        if run:
            stacks[".".join(parts[:run]) + "."] += 1
            for name in dict.fromkeys(parts[:run]):
                leading[name + "."] += 1
        for name in dict.fromkeys(p for p in parts[run:-1] if p in _INNER_NAMES):
            inner[name + "."] += 1
    plan = _plan_strip(key_list, partial=False, own=own_set)
    own_counts = {p: sum(1 for k in plan_keys(plan, key_list) if _carries(k, p)) for p in own_set}
    return PrefixReport(
        total_keys=len(key_list),
        leading={p: n for p, n in _ordered_counts(leading, KNOWN_PREFIXES).items() if not own_counts.get(p)},
        stacks=dict(stacks.most_common()),
        inner=_ordered_counts(inner, INNER_WRAPPER_SEGMENTS),
        default_strip=tuple(p for p, _ in plan.stripped),
        own={p: n for p, n in own_counts.items() if n},
    )


def plan_keys(plan: "_StripPlan", keys: list[str]) -> list[str]:
    """The keys after ``plan``'s default strip (the prefixes left at their front are the model's own)."""
    return [plan.apply(k) for k in keys]


def _ordered_counts(counts: Mapping[str, int], order: tuple[str, ...]) -> dict[str, int]:
    return {p: counts[p] for p in order if counts.get(p)}


# --------------------------------------------------------------------------- strip / add


@dataclass(frozen=True)
class StripReport:
    """What :func:`strip_prefix_report` did.

    Attributes:
        total_keys: number of keys in the state dict.
        renamed_keys: number of keys whose name changed.
        stripped: ``(prefix, number of keys)`` for each leading layer removed, in order
            (``module.module.`` gives two entries).
        inner_removed: inner wrapper segment -> number of keys it was removed from.
        skipped: known leading prefixes left in place because only some keys carry
            them (prefix -> number of keys); use ``partial=True`` or an explicit prefix.
    """

    total_keys: int
    renamed_keys: int
    stripped: tuple[tuple[str, int], ...] = ()
    inner_removed: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    own: dict[str, str] = field(default_factory=dict)  # prefix left because it is the model's own -> whose

    @property
    def changed(self) -> bool:
        """True when at least one key was renamed."""
        return self.renamed_keys > 0

    def summary(self) -> str:
        """One line for humans, saying what was stripped and what was not.

        Returns:
            The stripped prefixes and removed segments with key counts, then what was left in place and why.
        """
        parts = [f"stripped {p!r} from {n} of {self.total_keys} keys" for p, n in self.stripped]
        parts += [f"removed inner {s!r} from {n} keys" for s, n in self.inner_removed.items()]
        if not parts:
            parts = [f"nothing stripped from {self.total_keys} keys"]
        for p, n in self.skipped.items():
            how = "an explicit prefix" if p in SUBMODULE_LIKE_PREFIXES else "partial=True or an explicit prefix"
            parts.append(f"left {p!r} in place: it is on {n} of {self.total_keys} keys only (strip it with {how})")
        for p, whose in self.own.items():
            parts.append(f"left {p!r} in place: it is {whose}'s own base-model prefix (config.json), not a wrapper")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form.

        Returns:
            The fields, ``changed`` and ``summary`` as plain values.
        """
        return {
            "total_keys": self.total_keys,
            "renamed_keys": self.renamed_keys,
            "changed": self.changed,
            "stripped": [{"prefix": p, "keys": n} for p, n in self.stripped],
            "inner_removed": dict(self.inner_removed),
            "skipped": dict(self.skipped),
            "own": dict(self.own),
            "summary": self.summary(),
        }


@dataclass(frozen=True)
class _StripPlan:
    """The renames to apply, in order, and what each removed."""

    steps: tuple[tuple[str, str], ...]  # ("inner", "") or ("strip", prefix)
    stripped: tuple[tuple[str, int], ...]
    inner_removed: dict[str, int]
    skipped: dict[str, int]

    def apply(self, key: str) -> str:
        for kind, prefix in self.steps:
            if kind == "inner":
                key = _remove_inner(key)[0]
            elif _carries(key, prefix):
                key = key[len(prefix) :]
        return key


def _strip_layer(keys: list[str], *, need_all: bool, allowed: tuple[str, ...]) -> tuple[str, int] | None:
    for prefix in allowed:
        carrying = sum(1 for k in keys if _carries(k, prefix))
        if carrying and (carrying == len(keys) or not need_all):
            return prefix, carrying
    return None


def _plan_strip(keys: list[str], *, partial: bool, own: tuple[str, ...] = ()) -> _StripPlan:
    """Work out, on key names only, the steps the default strip takes (``own`` prefixes are never stripped)."""
    current = list(keys)
    steps: list[tuple[str, str]] = []
    stripped: list[tuple[str, int]] = []
    inner: Counter[str] = Counter()
    partial_ok = tuple(p for p in KNOWN_PREFIXES if p not in SUBMODULE_LIKE_PREFIXES and p not in own)
    known = tuple(p for p in KNOWN_PREFIXES if p not in own)
    # Each round removes one layer, in this order of preference: a leading prefix every
    # key carries; inner wrapper segments; (partial) a leading prefix some keys carry.
    while current:
        step = _strip_layer(current, need_all=True, allowed=known)
        if step is None:
            results = [_remove_inner(k) for k in current]
            if any(removed for _, removed in results):
                for _, removed in results:
                    inner.update(set(removed))
                current = [k for k, _ in results]
                steps.append(("inner", ""))
                continue
            if partial:
                step = _strip_layer(current, need_all=False, allowed=partial_ok)
        if step is None:
            break
        prefix, carrying = step
        current = [k[len(prefix) :] if _carries(k, prefix) else k for k in current]
        steps.append(("strip", prefix))
        stripped.append((prefix, carrying))
    skipped = {}
    for prefix in known:
        carrying = sum(1 for k in current if _carries(k, prefix))
        if carrying:
            skipped[prefix] = carrying
    return _StripPlan(tuple(steps), tuple(stripped), _ordered_counts(inner, INNER_WRAPPER_SEGMENTS), skipped)


def strip_prefix_report(
    state_dict: M, prefix: str | None = None, *, partial: bool = False, own: Iterable[str] = ()
) -> tuple[M, StripReport]:
    """Like :func:`strip_prefix`, and also say what was done.

    Args:
        state_dict: mapping key -> value; never mutated, values never inspected.
        prefix: ``None`` for the wrapper layers all keys carry, or exactly this prefix
            (see :func:`strip_prefix`).
        partial: with ``prefix=None``, also strip ``module.``, ``_orig_mod.`` and
            ``_forward_module.`` from the keys that carry them when not all do.
        own: with ``prefix=None``, leading prefixes that are the model's own (a Hugging Face base-model
            prefix, :func:`ckptfix.formats.hfarch.own_prefixes`): never stripped.

    Returns:
        ``(new_state_dict, StripReport)``; the new mapping has the input's type, ``_metadata`` re-keyed.

    Raises:
        KeyConflictError: an explicit prefix that no key has (the message lists
            what was detected), or stripping would make two keys collide.

    >>> sd, report = strip_prefix_report({"module.a.w": 1, "b.w": 2})
    >>> sd
    {'module.a.w': 1, 'b.w': 2}
    >>> report.summary()  # doctest: +ELLIPSIS
    "nothing stripped from 2 keys; left 'module.' in place: it is on 1 of 2 keys only (strip it with ...)"
    >>> strip_prefix_report({"module.a.w": 1, "b.w": 2}, partial=True)[0]
    {'a.w': 1, 'b.w': 2}
    """
    keys = list(state_dict.keys())
    if prefix is None:
        plan = _plan_strip(keys, partial=partial, own=tuple(_normalize_prefix(p) for p in own))
        fn: KeyFn = plan.apply
        stripped, inner_removed, skipped = plan.stripped, plan.inner_removed, plan.skipped
    else:
        wanted = _normalize_prefix(prefix)
        carrying = sum(1 for k in keys if k.startswith(wanted))
        if keys and wanted and carrying == 0:
            found = detect_prefixes(keys)
            detected = ", ".join(repr(p) for p in found.stacks) or "no wrapper prefixes"
            raise KeyConflictError(
                f"no key starts with {wanted!r}, so there is nothing to strip. "
                f"Detected: {detected}; keys start with {_top_segments(keys)}. "
                "Leave the prefix out to strip the detected wrapper prefixes."
            )

        def fn(key: str) -> str:
            return key[len(wanted) :] if wanted and key.startswith(wanted) else key

        stripped = ((wanted, carrying),) if wanted and carrying else ()
        inner_removed, skipped = {}, {}
    new = rename_keys(state_dict, fn)
    renamed = sum(1 for old, new_key in zip(keys, new.keys(), strict=False) if old != new_key)
    whose = dict(own) if isinstance(own, Mapping) else {p: "the model" for p in own}
    left = {
        _normalize_prefix(p): c
        for p, c in whose.items()
        if prefix is None and any(_carries(str(k), _normalize_prefix(p)) for k in new.keys())
    }
    report = StripReport(
        total_keys=len(keys),
        renamed_keys=renamed,
        stripped=tuple(stripped),
        inner_removed=dict(inner_removed),
        skipped=dict(skipped),
        own=left,
    )
    return new, report


def strip_prefix(state_dict: M, prefix: str | None = None, *, partial: bool = False, own: Iterable[str] = ()) -> M:
    """Return a copy of ``state_dict`` without wrapper prefixes, ready for ``load_state_dict``.

    Args:
        state_dict: mapping key -> value; never mutated, values never inspected.
        prefix: ``None`` strips every known wrapper layer (:data:`KNOWN_PREFIXES`)
            that *all* keys carry, as often as it is stacked (``module._orig_mod.``,
            ``module.module.``), and removes :data:`INNER_WRAPPER_SEGMENTS`.  A string
            strips exactly that prefix (a missing trailing ``"."`` is added) from the
            keys that start with it, and nothing else.
        partial: with ``prefix=None``, also strip ``module.``, ``_orig_mod.`` and
            ``_forward_module.`` from the keys that carry them when not all do.
        own: leading prefixes that are the model's own (never stripped by default), see
            :func:`strip_prefix_report`.

    Returns:
        A new mapping of the same type, ``_metadata`` re-keyed.

    Raises:
        KeyConflictError: an explicit prefix that no key has (the message lists
            what was detected), or stripping would make two keys collide.

    >>> strip_prefix({"module.module.fc.w": 1})
    {'fc.w': 1}
    >>> strip_prefix({"model.fc.w": 1, "loss.pos_weight": 2}, "model")
    {'fc.w': 1, 'loss.pos_weight': 2}
    """
    return strip_prefix_report(state_dict, prefix, partial=partial, own=own)[0]


def add_prefix(state_dict: M, prefix: str) -> M:
    """Return a copy of ``state_dict`` with ``prefix`` in front of every key.

    Use it to load a plain checkpoint into a wrapped model (``add_prefix(sd, "module.")``
    for DataParallel/DDP).  A missing trailing ``"."`` is added.  ``_metadata`` is
    re-keyed: the root ``""`` entry moves to ``prefix`` (without the dot) and a copy
    stays at ``""`` for the wrapper itself.

    Args:
        state_dict: mapping key -> value; never mutated.
        prefix: the prefix, e.g. ``"module."``.

    Returns:
        A new mapping of the same type.

    Raises:
        TypeError: ``prefix`` is not a string.

    >>> add_prefix({"fc.w": 1}, "module.")
    {'module.fc.w': 1}
    """
    wanted = _normalize_prefix(prefix)

    def fn(key: str) -> str:
        return wanted + key

    return rename_keys(state_dict, fn)
