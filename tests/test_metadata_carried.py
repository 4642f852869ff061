"""A safetensors input's own ``__metadata__`` is data: convert keeps every entry (renamed with its tensor), and a
conversion to a torch file, which has no place for it, names what it left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from helpers import run_cli  # noqa: E402

META = {"user_key": "keep me", "module.a": json.dumps({"_type": "Int8Tensor", "block_size": [1, 4]})}


@pytest.fixture
def st(tmp_path: Path) -> Path:
    save_file({"module.a": torch.randn(4, 4), "module.b": torch.randn(4)}, str(tmp_path / "m.safetensors"), META)
    return tmp_path


def _meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def test_convert_keeps_every_metadata_entry(st):
    r = run_cli("convert", "m.safetensors", "-o", "out.safetensors", cwd=st)
    assert r.rc == 0, r.err
    got = _meta(st / "out.safetensors")
    assert {k: got[k] for k in META} == META
    assert got["format"] == "pt"


def test_an_entry_named_after_a_tensor_follows_its_new_name(st):
    r = run_cli("convert", "m.safetensors", "--strip-prefix", "-o", "out.safetensors", cwd=st)
    assert r.rc == 0, r.err
    got = _meta(st / "out.safetensors")
    assert got["a"] == META["module.a"] and got["user_key"] == "keep me" and "module.a" not in got
    # strip-prefix (the rewrite) already kept it: both ways agree
    r = run_cli("strip-prefix", "m.safetensors", "-o", "s.safetensors", cwd=st)
    assert r.rc == 0, r.err
    assert _meta(st / "s.safetensors")["user_key"] == "keep me"


def test_a_sharded_input_keeps_each_shards_entries(tmp_path):
    sh = tmp_path / "sh"
    sh.mkdir()
    save_file({"a": torch.randn(4)}, str(sh / "model-00001-of-00002.safetensors"), {"a": "first", "note": "n"})
    save_file({"b": torch.randn(4)}, str(sh / "model-00002-of-00002.safetensors"), {"b": "second"})
    index = {
        "metadata": {"total_size": 32},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (sh / "model.safetensors.index.json").write_text(json.dumps(index))
    r = run_cli("convert", "sh/model.safetensors.index.json", "-o", "one.safetensors", cwd=tmp_path)
    assert r.rc == 0, r.err
    got = _meta(tmp_path / "one.safetensors")
    assert (got["a"], got["b"], got["note"]) == ("first", "second", "n")


def test_a_torch_output_names_the_metadata_it_cannot_hold(st):
    r = run_cli("convert", "m.safetensors", "-o", "out.pth", "--json", cwd=st)
    assert r.rc == 0, r.err
    doc = json.loads(r.out)
    assert "__metadata__" in doc["excluded"]
    assert "2 safetensors metadata entries (module.a, user_key)" in doc["excluded_detail"]["__metadata__"]
    r = run_cli("convert", "m.safetensors", "-o", "out2.pth", cwd=st)
    assert "excluded: __metadata__ (2 safetensors metadata entries" in r.err


def test_plain_hf_metadata_is_not_reported(tmp_path):
    save_file({"a": torch.randn(4)}, str(tmp_path / "hf.safetensors"), {"format": "pt"})
    r = run_cli("convert", "hf.safetensors", "-o", "hf.pth", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "excluded" not in r.err
