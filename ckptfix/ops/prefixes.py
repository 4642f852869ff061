"""Detect, strip, add and align the key prefixes that model wrappers leave in state dicts.

Wrappers rename every key of the model they wrap:

========================================  ==========================================
wrapper                                   key of ``conv1.weight`` becomes
========================================  ==========================================
``nn.DataParallel`` / DDP                 ``module.conv1.weight``
``torch.compile``                         ``_orig_mod.conv1.weight``
Lightning ``self.model = net``            ``model.conv1.weight``
Lightning Fabric / strategies             ``_forward_module.conv1.weight``
FSDP / activation checkpointing           ``layer1._fsdp_wrapped_module.conv1.weight``
(saved from ``named_parameters()``)       ``layer1._checkpoint_wrapped_module.conv1.weight``
stacked                                   ``module._orig_mod.conv1.weight`` ...
========================================  ==========================================

Everything here is a pure function: no I/O, inputs are never mutated, values
are never looked at (except ``.shape`` in :func:`align_state_dict`) and the
result is a new mapping of the same type (``OrderedDict`` stays ``OrderedDict``)
whose hidden ``_metadata`` (module path -> ``{"version": ...}``, what
``load_state_dict`` reads) is re-keyed the same way as the keys, like
``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present`` does, but
on a copy.  This module never imports torch.

Choices worth knowing:

* A leading wrapper prefix (:data:`KNOWN_PREFIXES`) is stripped by default only
  when *every* key carries it.  ``partial=True`` also strips ``module.``,
  ``_orig_mod.`` and ``_forward_module.`` from the keys that carry them in a
  mixed checkpoint; ``model.`` is a common real submodule name (a Hugging Face
  ``LlamaForCausalLM`` has ``model.layers...`` next to ``lm_head``), so it is
  only stripped when every key carries it, or when asked for explicitly.
* Inner wrapper segments (:data:`INNER_WRAPPER_SEGMENTS`) come from wrapping
  single submodules, so they are removed wherever they appear (except as the
  last segment, which is a parameter name), whether or not every key has them.
  ``_orig_mod`` counts as inner only below the first segment (a compiled
  submodule); as the first segment it is a leading prefix like the others.
  ``module.`` is never removed from the middle of a key: it is too often a
  genuine submodule name (and DDP wraps whole models, not submodules).

>>> sd = {"module._orig_mod.conv.weight": 1, "module._orig_mod.conv.bias": 2}
>>> strip_prefix(sd)
{'conv.weight': 1, 'conv.bias': 2}
>>> add_prefix({"fc.weight": 1}, "module")
{'module.fc.weight': 1}

Detecting, stripping, adding and renaming come first; aligning (fitting another checkpoint's or a
model's keys, scored by names and shapes) is built on them.
"""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from ckptfix.errors import AlignmentError, KeyConflictError, UnsupportedError

__all__ = [
    "INNER_WRAPPER_SEGMENTS",
    "KNOWN_PREFIXES",
    "MIN_FIT",
    "AlignmentCandidate",
    "AlignmentReport",
    "PrefixReport",
    "ShapeMismatch",
    "StripReport",
    "add_prefix",
    "align_state_dict",
    "detect_prefixes",
    "rename_keys",
    "rename_refusal",
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


# -- aligning to a target ------------------------------------------------------------------------

MIN_FIT = 0.5
"""A renaming is refused unless it matches at least this share of the checkpoint's keys."""


# --------------------------------------------------------------------------- align


class ShapeMismatch(NamedTuple):
    """A key matched by name but not by shape."""

    key: str
    checkpoint_shape: tuple[int, ...]
    target_shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form.

        Returns:
            ``key`` and both shapes as lists.
        """
        return {
            "key": self.key,
            "checkpoint_shape": list(self.checkpoint_shape),
            "target_shape": list(self.target_shape),
        }


@dataclass(frozen=True)
class AlignmentCandidate:
    """One renaming :func:`align_state_dict` scored.

    Attributes:
        rename: what it does, e.g. ``"strip 'module.'"`` or ``"replace 'module.' with 'model.'"``.
        strip: leading prefix removed (``""`` for none), from the keys that carry it.
        add: leading prefix added to those keys (``""`` for none).
        remove_inner: whether inner wrapper segments are removed first.
        matched: number of checkpoint keys that then match a target key.
        shape_mismatches: how many of those differ in shape.
    """

    rename: str
    strip: str
    add: str
    remove_inner: bool
    matched: int
    shape_mismatches: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form.

        Returns:
            The fields as plain values.
        """
        return {
            "rename": self.rename,
            "strip": self.strip,
            "add": self.add,
            "remove_inner": self.remove_inner,
            "matched": self.matched,
            "shape_mismatches": self.shape_mismatches,
        }


@dataclass(frozen=True)
class AlignmentReport:
    """How a checkpoint's keys line up with a target after :func:`align_state_dict`.

    Attributes:
        rename: the renaming applied (``"no change"`` when none, or when ambiguous).
        applied: True when the returned state dict was renamed.
        ambiguous: two different renamings tie for the best score; nothing was applied.
        candidates: the best distinct renamings scored, best first (all tied ones
            when ambiguous).
        matched: target keys present in the (renamed) checkpoint.
        missing: target keys absent from the checkpoint.
        unexpected: checkpoint keys absent from the target.
        shape_mismatches: matched keys whose shapes differ (only where both sides
            have shapes).
        shapes_compared: True when the target had shapes to compare.
    """

    rename: str
    applied: bool
    ambiguous: bool
    candidates: tuple[AlignmentCandidate, ...]
    matched: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    shape_mismatches: tuple[ShapeMismatch, ...]
    shapes_compared: bool

    @property
    def exact(self) -> bool:
        """No missing, no unexpected keys and no shape mismatches: ``strict=True`` will load."""
        return not (self.missing or self.unexpected or self.shape_mismatches)

    def summary(self) -> str:
        """One line for humans.

        Returns:
            The renaming (or the tied candidates) and the matched/missing/unexpected/mismatch counts.
        """
        if self.ambiguous:
            options = " | ".join(c.rename for c in self.candidates)
            head = f"ambiguous: {len(self.candidates)} renamings match equally well ({options}); nothing applied"
        else:
            head = self.rename
        return (
            f"{head}; matched {len(self.matched)}, missing {len(self.missing)}, "
            f"unexpected {len(self.unexpected)}, shape mismatches {len(self.shape_mismatches)}"
            + ("; exact" if self.exact else "")
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form.

        Returns:
            The fields, counts, ``exact`` and ``summary`` as plain values.
        """
        return {
            "rename": self.rename,
            "applied": self.applied,
            "ambiguous": self.ambiguous,
            "exact": self.exact,
            "candidates": [c.to_dict() for c in self.candidates],
            "matched_count": len(self.matched),
            "missing_count": len(self.missing),
            "unexpected_count": len(self.unexpected),
            "matched": list(self.matched),
            "missing": list(self.missing),
            "unexpected": list(self.unexpected),
            "shape_mismatches": [m.to_dict() for m in self.shape_mismatches],
            "shapes_compared": self.shapes_compared,
            "summary": self.summary(),
        }


_MAX_PREFIX_SEGMENTS = 3
_MAX_PREFIX_CANDIDATES = 12
_MAX_REPORTED_CANDIDATES = 10


def _shape_of(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return None


def _target_keys_and_shapes(target: Any) -> tuple[list[str], dict[str, tuple[int, ...] | None] | None]:
    if isinstance(target, str):
        raise TypeError("target must be a module, a state dict or an iterable of keys, not a single string")
    if not isinstance(target, Mapping) and callable(getattr(target, "state_dict", None)):
        target = target.state_dict()
    if isinstance(target, Mapping):
        shapes = {str(k): _shape_of(v) for k, v in target.items()}
        return list(shapes), shapes
    keys = list(dict.fromkeys(target))
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"target keys must be strings, got {type(key).__name__}")
    return keys, None


def _candidate_prefixes(keys: list[str]) -> list[str]:
    """Leading prefixes worth trying: every prefix of the leading wrapper run, plus
    the most common 1..3-segment prefixes."""
    wrappers: dict[str, None] = {}
    counts: Counter[str] = Counter()
    for key in keys:
        parts = key.split(".")
        run = 0
        while run < len(parts) - 1 and (parts[run] in _KNOWN_NAMES or parts[run] in _INNER_NAMES):
            run += 1
            wrappers[".".join(parts[:run]) + "."] = None
        for n in range(1, min(_MAX_PREFIX_SEGMENTS, len(parts) - 1) + 1):
            counts[".".join(parts[:n]) + "."] += 1
    common = sorted(counts, key=lambda p: (-counts[p], p.count("."), p))[:_MAX_PREFIX_CANDIDATES]
    return list(dict.fromkeys(["", *wrappers, *common]))


def _describe(strip: str, add: str, remove_inner: bool, carrying: int, total: int) -> str:
    parts = []
    if remove_inner:
        parts.append("remove inner wrapper segments")
    if strip and add:
        parts.append(f"replace {strip!r} with {add!r}")
    elif strip:
        parts.append(f"strip {strip!r}")
    elif add:
        parts.append(f"add {add!r}")
    if strip and carrying < total:
        parts[-1] += f" (on the {carrying} of {total} keys that carry it)"
    return " + ".join(parts) or "no change"


def _make_fn(strip: str, add: str, remove_inner: bool) -> KeyFn:
    def fn(key: str) -> str:
        if remove_inner:
            key = _remove_inner(key)[0]
        if strip == "" or _carries(key, strip):
            key = add + key[len(strip) :]
        return key

    return fn


def align_state_dict(state_dict: M, target: Any) -> tuple[M, AlignmentReport]:
    """Rename the checkpoint's keys so they match ``target`` as well as possible.

    Tries: no change, stripping / adding / replacing a leading prefix (wrapper
    prefixes and the most common leading prefixes on either side, on the keys
    that carry it), each with and without removing inner wrapper segments.  The
    candidate matching the most target keys wins; among equal ones, the one with
    fewer shape mismatches, then the one renaming more keys (a rename of the whole
    checkpoint beats one of a subset that happens to match as many).  Candidates
    that pair the same checkpoint keys with the same target keys count as one (the
    simplest description is reported).  If two candidates pairing keys differently
    tie for best, the result is ambiguous: the state dict is returned unchanged and
    ``report.candidates`` lists them.  Candidates that would collide are skipped.

    Args:
        state_dict: the checkpoint's state dict (not mutated).
        target: an ``nn.Module`` (its ``state_dict()`` is used), a state dict
            (values with ``.shape`` are compared), or an iterable of key names.

    Returns:
        ``(renamed_state_dict, AlignmentReport)``.

    Raises:
        TypeError: ``target`` is none of the above.
        UnsupportedError: a key of ``state_dict`` is not a string (a tuple key: nothing to align).

    >>> sd = {"module.fc.weight": 1, "module.fc.bias": 2}
    >>> new, report = align_state_dict(sd, ["model.fc.weight", "model.fc.bias"])
    >>> new, report.rename, report.exact
    ({'model.fc.weight': 1, 'model.fc.bias': 2}, "replace 'module.' with 'model.'", True)
    """
    bad = next((k for k in state_dict if not isinstance(k, str)), None)
    if bad is not None:
        raise UnsupportedError(
            f"the state dict has a key that is not a string ({bad!r}, a {type(bad).__name__}), and a module's "
            "load_state_dict takes string keys; load it without model= to get the dict as saved, and rename its "
            "keys in Python (e.g. {'.'.join(map(str, k)): v for k, v in sd.items()})"
        )
    target_keys, target_shapes = _target_keys_and_shapes(target)
    target_set = set(target_keys)
    ckpt_keys = list(state_dict.keys())
    ckpt_shapes = {k: _shape_of(v) for k, v in state_dict.items()} if target_shapes is not None else {}

    scored = _scored_renamings(ckpt_keys, target_keys, target_set)
    groups = _best_renamings(scored, ckpt_keys, target_set, ckpt_shapes, target_shapes)
    candidates = tuple(c for c, _ in groups.values())
    ambiguous = len(groups) > 1
    applied = False
    rename = "no change"
    result: M = rename_keys(state_dict, lambda k: k)
    if len(groups) == 1:
        chosen, fn = next(iter(groups.values()))
        if chosen.strip or chosen.add or chosen.remove_inner:
            result = rename_keys(state_dict, fn)
            applied = True
            rename = chosen.rename
    if ambiguous:
        candidates = candidates[:_MAX_REPORTED_CANDIDATES]

    result_keys = list(result.keys())
    result_set = set(result_keys)
    matched_keys = tuple(k for k in target_keys if k in result_set)
    shape_mismatches = _shape_mismatches(result, matched_keys, target_shapes)
    report = AlignmentReport(
        rename=rename,
        applied=applied,
        ambiguous=ambiguous,
        candidates=candidates,
        matched=matched_keys,
        missing=tuple(k for k in target_keys if k not in result_set),
        unexpected=tuple(k for k in result_keys if k not in target_set),
        shape_mismatches=tuple(shape_mismatches),
        shapes_compared=target_shapes is not None,
    )
    return result, report


_Scored = tuple[int, str, str, bool, int]  # (matched, strip, add, remove_inner, carrying)
_Groups = dict[tuple[tuple[str, str], ...], tuple["AlignmentCandidate", KeyFn]]


def _scored_renamings(ckpt_keys: list[Any], target_keys: list[str], target_set: set[str]) -> list[_Scored]:
    """Every (strip, add, remove-inner) renaming with the number of target keys it would match, best first."""
    scored: list[_Scored] = []
    variants = [False]
    if any(_remove_inner(k)[1] for k in ckpt_keys):
        variants.append(True)
    target_prefixes = _candidate_prefixes(target_keys)
    target_rests = {b: {t[len(b) :] for t in target_keys if b == "" or _carries(t, b)} for b in target_prefixes}
    for remove_inner in variants:
        base = [_remove_inner(k)[0] for k in ckpt_keys] if remove_inner else ckpt_keys
        for a in _candidate_prefixes(base):
            rests = {k[len(a) :] for k in base if a == "" or _carries(k, a)}
            others_matched = sum(1 for k in base if a and not _carries(k, a) and k in target_set)
            for b in target_prefixes:
                if a and a == b:
                    continue
                matched = len(rests & target_rests[b]) + others_matched
                scored.append((matched, a, b, remove_inner, len(rests)))
    # best first; among equals the simplest first (fewer prefix segments, no inner removal, shorter)
    scored.sort(key=lambda s: (-s[0], s[1].count(".") + s[2].count("."), s[3], len(s[1]) + len(s[2]), s[1], s[2]))
    return scored


def _best_renamings(
    scored: list[_Scored],
    ckpt_keys: list[Any],
    target_set: set[str],
    ckpt_shapes: dict[Any, Any],
    target_shapes: dict[str, Any] | None,
) -> _Groups:
    """The best-scoring renamings that do not collide, one per distinct pairing of checkpoint and target keys."""
    groups: _Groups = {}
    best: tuple[int, int, int] | None = None
    for matched, a, b, remove_inner, carrying in scored:
        if (best is not None and matched < best[0]) or matched == 0:
            break
        fn = _make_fn(a, b, remove_inner)
        new_keys = [fn(k) for k in ckpt_keys]
        if len(set(new_keys)) != len(new_keys):
            continue  # this renaming would collide: not a candidate
        pairs = tuple((old, new) for old, new in zip(ckpt_keys, new_keys, strict=False) if new in target_set)
        mismatches = _count_mismatches(pairs, ckpt_shapes, target_shapes)
        score = (len(pairs), -mismatches, carrying)
        if best is None or score > best:
            best, groups = score, {}
        if score < best:
            continue
        if pairs not in groups:
            desc = _describe(a, b, remove_inner, carrying, len(ckpt_keys))
            groups[pairs] = (AlignmentCandidate(desc, a, b, remove_inner, len(pairs), mismatches), fn)
    return groups


def _shape_mismatches(
    result: Mapping[str, Any], matched_keys: tuple[str, ...], target_shapes: dict[str, Any] | None
) -> list["ShapeMismatch"]:
    """The matched keys whose shapes differ from the target's (none when the target has no shapes)."""
    out: list[ShapeMismatch] = []
    if target_shapes is None:
        return out
    result_shapes = {k: _shape_of(v) for k, v in result.items()}
    for key in matched_keys:
        mine, theirs = result_shapes[key], target_shapes[key]
        if mine is not None and theirs is not None and mine != theirs:
            out.append(ShapeMismatch(key, mine, theirs))
    return out


def _count_mismatches(
    pairs: tuple[tuple[str, str], ...],
    ckpt_shapes: Mapping[str, tuple[int, ...] | None],
    target_shapes: Mapping[str, tuple[int, ...] | None] | None,
) -> int:
    if target_shapes is None:
        return 0
    count = 0
    for old, new in pairs:
        mine, theirs = ckpt_shapes.get(old), target_shapes.get(new)
        if mine is not None and theirs is not None and mine != theirs:
            count += 1
    return count


# --------------------------------------------------------------------------- the fit a renaming needs


def rename_refusal(report: AlignmentReport, key_count: int, *, renamed_only: bool = True) -> AlignmentError | None:
    """Why the renaming :func:`align_state_dict` chose must not be used: the one rule of ``align`` and
    ``load_anywhere(model=...)``.

    A renaming is refused when it fits badly (the best one matches fewer than :data:`MIN_FIT` of the
    checkpoint's keys) or when it splits a group of keys: it renames the keys under a multi-segment
    prefix (``'module.fc.'`` -> ``'fc2.'``) while keys under the same leading segment
    (``module.conv.weight``) stay unmatched.  That is a guess at layer names, not a wrapper fix, and
    ``strict=False`` would load the renamed tensors into whatever layer the guess named.  A renaming of
    every key that carries a wrapper prefix, with keys left over (a new head, ``n_averaged``), is not
    refused: what is missing or unexpected is reported, and loading it is the caller's choice.

    Args:
        report: the report of :func:`align_state_dict` on the checkpoint.
        key_count: how many keys the checkpoint's state dict has.
        renamed_only: judge only an applied renaming (``load_anywhere``: a checkpoint left as it is
            needs no fit); ``False`` also refuses a bad fit with nothing renamed (``align``: there is
            nothing worth writing).

    Returns:
        ``None`` when the renaming may be used, else the :class:`~ckptfix.errors.AlignmentError` to
        raise (it names the renaming and the fix).

    >>> _, r = align_state_dict({"module.fc.w": 1, "module.fc.b": 2, "module.conv.w": 3}, ["fc2.w", "fc2.b", "conv1.x"])
    >>> r.rename
    "replace 'module.fc.' with 'fc2.' (on the 2 of 3 keys that carry it)"
    >>> str(rename_refusal(r, 3)).split(";")[1]
    " it renames only part of the keys under 'module.', a guess at layer names, so nothing is renamed: check ..."
    >>> _, r = align_state_dict({"module.fc.w": 1, "n_averaged": 2}, ["fc.w", "fc.b"])
    >>> r.rename, rename_refusal(r, 2)
    ("strip 'module.' (on the 1 of 2 keys that carry it)", None)
    """
    if renamed_only and not report.applied:
        return None
    best = max((c.matched for c in report.candidates), default=len(report.matched))
    if best < MIN_FIT * max(key_count, 1):
        return AlignmentError(
            f"the checkpoint does not fit this target: the best renaming matches only {best} "
            f"of {key_count} keys ({len(report.missing)} target keys missing); "
            "check that --to (or model=) names the right model"
        )
    if not report.applied:
        return None
    strip = report.candidates[0].strip
    lead = strip.split(".", 1)[0] + "."
    if strip.count(".") > 1 and any(k.startswith(lead) for k in report.unexpected):
        return AlignmentError(
            f"{len(report.missing)} missing, {len(report.unexpected)} unexpected, "
            f"{len(report.shape_mismatches)} shape mismatches remain after '{report.rename}'; "
            f"it renames only part of the keys under {lead!r}, a guess at layer names, so nothing is renamed: "
            "check that --to (or model=) names the right model, "
            "or rename explicitly (strip-prefix --prefix, add-prefix)"
        )
    return None
