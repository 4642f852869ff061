"""ckptfix.formats.stmeta: the ckptfix.* safetensors metadata, encoded and decoded in one place (torch as oracle)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptfix.formats import stmeta


def test_encode_writes_format_first_and_only_what_is_given():
    meta = stmeta.encode(source_format="torch-zip", key_path=("model",), order=["a", "b"])
    assert list(meta) == ["format", stmeta.SOURCE_FORMAT, stmeta.KEY_PATH, stmeta.ORDER]
    assert meta["format"] == "pt" and all(isinstance(v, str) for v in meta.values())
    full = stmeta.encode(
        source_format="dcp",
        key_path=(),
        order=["a", "b", "c"],
        aliases={"b": "a"},
        views={"c": {"base": "a", "offset": 1, "shape": [2], "stride": [1]}},
        extra={"epoch": 3},
    )
    assert stmeta.aliases(full, {"a": 0}) == {"b": "a"}
    assert stmeta.order(full) == ["a", "b", "c"]
    assert stmeta.views(full) == {"c": {"base": "a", "offset": 1, "shape": [2], "stride": [1]}}
    assert stmeta.key_path(full) == () and stmeta.extra(full) == {"epoch": 3}


def test_extra_too_large_is_reported_not_written(monkeypatch):
    monkeypatch.setattr(stmeta, "MAX_EXTRA_JSON", 10)
    skipped: dict[str, str] = {}
    meta = stmeta.encode(source_format="x", key_path=(), order=[], extra={"k": "v" * 20}, skipped=skipped)
    assert stmeta.EXTRA not in meta and "too large" in skipped["<extra>"]


@pytest.mark.parametrize("bad", ["{", "[1]", "null", '"text"'])
def test_malformed_values_decode_as_empty(bad):
    meta = {k: bad for k in (stmeta.ALIASES, stmeta.ORDER, stmeta.VIEWS, stmeta.KEY_PATH, stmeta.EXTRA)}
    assert stmeta.aliases(meta, {"a": 1}) == {}
    assert stmeta.views(meta) == {} and stmeta.extra(meta) == {}
    assert stmeta.order(meta) == []  # a list of non-names too
    assert stmeta.key_path(meta) == (("1",) if bad == "[1]" else ())


def test_hugging_face_style_aliases_are_understood():
    meta = {"format": "pt", "lm_head.weight": "wte.weight", "note": "not a tensor name"}
    assert stmeta.aliases(meta, {"wte.weight": 1}) == {"lm_head.weight": "wte.weight"}


def test_rename_follows_every_name_the_metadata_holds():
    meta = stmeta.encode(
        source_format="torch-zip",
        key_path=(),
        order=["m.a", "m.b", "m.c"],
        aliases={"m.b": "m.a"},
        views={"m.c": {"base": "m.a", "offset": 0, "shape": [1], "stride": [1]}},
    )
    mapping = {"m.a": "a", "m.b": "b", "m.c": "c"}
    out = stmeta.rename(dict(meta), mapping, {"m.a": 0, "m.c": 0})
    assert stmeta.order(out) == ["a", "b", "c"]
    assert stmeta.aliases(out, {"a": 0, "c": 0}) == {"b": "a"}
    assert stmeta.views(out)["c"]["base"] == "a"
    hf = stmeta.rename({"format": "pt", "m.b": "m.a"}, mapping, {"m.a": 0})
    assert hf == {"format": "pt", "b": "a"}


def test_logical_state_dict_adds_aliases_in_original_order():
    meta = stmeta.encode(source_format="x", key_path=(), order=["b", "a"], aliases={"b": "a"})
    assert list(stmeta.logical_state_dict({"a": 1}, meta).items()) == [("b", 1), ("a", 1)]
    stored = {"a": 1}
    assert stmeta.logical_state_dict(stored, {"format": "pt"}) is stored


def test_restore_shares_aliases_and_views_through_a_real_file(tmp_path):
    base = torch.arange(6.0)
    meta = stmeta.encode(
        source_format="torch-zip",
        key_path=(),
        order=["tail", "w", "tied"],
        aliases={"tied": "w"},
        views={"tail": {"base": "w", "offset": 2, "shape": [2, 2], "stride": [2, 1]}},
    )
    save_file({"w": base}, tmp_path / "m.safetensors", metadata=meta)
    back = stmeta.restore(load_file(tmp_path / "m.safetensors"), meta)
    assert list(back) == ["tail", "w", "tied"]
    assert back["tied"] is back["w"]
    assert torch.equal(back["tail"], base[2:].view(2, 2))
    assert back["tail"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()


def test_restore_ignores_views_that_do_not_fit():
    meta = {stmeta.VIEWS: json.dumps({"v": {"base": "w", "offset": 99, "shape": [4], "stride": [1]}})}
    assert list(stmeta.restore({"w": torch.zeros(2)}, meta)) == ["w"]
