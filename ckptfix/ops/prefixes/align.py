"""Align a state dict's keys to a target's: score prefix renamings by names and shapes (:mod:`ckptfix.ops.prefixes`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ckptfix.errors import AlignmentError, UnsupportedError
from ckptfix.ops.prefixes.rename import _INNER_NAMES, _KNOWN_NAMES, KeyFn, M, _carries, _remove_inner, rename_keys

__all__ = [
    "MIN_FIT",
    "AlignmentCandidate",
    "AlignmentReport",
    "ShapeMismatch",
    "align_state_dict",
    "rename_refusal",
]

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
