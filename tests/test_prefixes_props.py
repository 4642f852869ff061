"""Property tests for the prefix algebra: strip(add(x)) == x, no value lost or duplicated."""

from __future__ import annotations

from collections import Counter, OrderedDict

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ckptfix.errors import KeyConflictError
from ckptfix.ops.prefixes import (
    INNER_WRAPPER_SEGMENTS,
    KNOWN_PREFIXES,
    add_prefix,
    align_state_dict,
    detect_prefixes,
    rename_keys,
    strip_prefix,
)

WRAPPERS = [p[:-1] for p in KNOWN_PREFIXES + INNER_WRAPPER_SEGMENTS]
segment = st.one_of(st.from_regex(r"[a-z0-9_]{1,6}", fullmatch=True), st.sampled_from(WRAPPERS))
key = st.lists(segment, min_size=1, max_size=5).map(".".join)
keys = st.lists(key, max_size=12, unique=True)
# both spellings of a prefix: 'enc.layer' and 'enc.layer.'
prefix = st.tuples(st.lists(segment, min_size=1, max_size=3), st.booleans()).map(
    lambda t: ".".join(t[0]) + ("." if t[1] else "")
)


@st.composite
def state_dicts(draw: st.DrawFn, min_size: int = 0) -> OrderedDict:
    names = draw(st.lists(key, min_size=min_size, max_size=12, unique=True))
    sd: OrderedDict = OrderedDict((name, object()) for name in names)
    if draw(st.booleans()):
        paths = {""} | {n.rsplit(".", 1)[0] for n in names if "." in n}
        sd._metadata = OrderedDict((p, {"version": i}) for i, p in enumerate(sorted(paths)))
    return sd


def snapshot(sd) -> tuple:
    meta = getattr(sd, "_metadata", None)
    return (
        list(sd.items()),
        None if meta is None else [(k, dict(v)) for k, v in meta.items()],
    )


def value_ids(sd) -> Counter:
    return Counter(id(v) for v in sd.values())


@given(state_dicts(), prefix)
def test_strip_add_roundtrip(sd, p):
    added = add_prefix(sd, p)
    back = strip_prefix(added, p)
    assert list(back.items()) == list(sd.items())
    assert type(back) is type(sd)
    if hasattr(sd, "_metadata"):
        assert dict(back._metadata) == dict(sd._metadata)


@given(state_dicts(), prefix)
def test_default_strip_undoes_known_wrappers(sd, p):
    """Adding a known wrapper prefix to every key is undone by the default strip
    (as long as the plain dict had nothing to strip itself)."""
    try:
        assume(strip_prefix(sd) == sd)
    except KeyConflictError:
        assume(False)
    wrapper = p.split(".")[0] if p.split(".")[0] + "." in KNOWN_PREFIXES else "module"
    assert list(strip_prefix(add_prefix(sd, wrapper)).items()) == list(sd.items())


@given(state_dicts(), st.booleans())
def test_strip_never_loses_or_duplicates_values(sd, partial):
    before = snapshot(sd)
    try:
        out = strip_prefix(sd, partial=partial)
    except KeyConflictError:
        assert snapshot(sd) == before
        return
    assert value_ids(out) == value_ids(sd)
    assert len(out) == len(sd)
    assert snapshot(sd) == before


@given(state_dicts(), prefix)
def test_add_never_loses_values_nor_mutates(sd, p):
    before = snapshot(sd)
    out = add_prefix(sd, p)
    assert value_ids(out) == value_ids(sd)
    assert snapshot(sd) == before


@given(state_dicts(min_size=1), prefix, st.data())
def test_collisions_raise_and_leave_input_unchanged(sd, p, data):
    wanted = p if p.endswith(".") else p + "."
    dup = data.draw(st.sampled_from(list(sd)))
    assume(not dup.startswith(wanted))
    sd[wanted + dup] = object()  # both 'dup' and '<p>.dup': stripping p must collide
    before = snapshot(sd)
    with pytest.raises(KeyConflictError) as info:
        strip_prefix(sd, p)
    # the message names a real collision: 'dup', or another the drawn state dict already held ('0' and '000.0')
    colliding = [k for k in sd if isinstance(k, str) and wanted + k in sd]
    assert any(repr(k) in str(info.value) for k in colliding)
    assert snapshot(sd) == before


@given(state_dicts(min_size=2))
def test_rename_collision_raises(sd):
    before = snapshot(sd)
    with pytest.raises(KeyConflictError):
        rename_keys(sd, lambda k: "same")
    assert snapshot(sd) == before


@given(keys)
def test_detect_never_raises_and_counts_are_bounded(names):
    report = detect_prefixes(names)
    assert report.total_keys == len(names)
    assert all(0 < n <= len(names) for n in report.leading.values())
    assert all(0 < n <= len(names) for n in report.inner.values())
    report.to_dict()


@settings(max_examples=50)
@given(state_dicts(), keys)
def test_align_preserves_values_and_partitions_keys(sd, target):
    before = snapshot(sd)
    out, report = align_state_dict(sd, target)
    assert value_ids(out) == value_ids(sd)
    assert snapshot(sd) == before
    assert set(report.matched) | set(report.missing) == set(target)
    assert set(report.matched) | set(report.unexpected) == set(out)
    assert not (report.ambiguous and report.applied)
