"""Hugging Face base-model prefixes and tied weights from config.json alone (ckptfix.formats.hfarch), torch-free."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckptfix.formats.hfarch import ARCHITECTURES, own_prefixes, tied_drop
from ckptfix.ops.convert import convert
from ckptfix.ops.inspect import inspect_checkpoint
from ckptfix.ops.prefixes import detect_prefixes, strip_prefix_report
from ckptfix.ops.rewrite.keys import strip_prefix_checkpoint

from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
FW = REPO / "tests" / "fixtures" / "frameworks"


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_table_matches_transformers(arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, arch)
    entry = ARCHITECTURES[arch]
    assert entry.prefix == cls.base_model_prefix
    tied = cls._tied_weights_keys or {}
    if isinstance(tied, dict):  # transformers 5: {dropped: kept}
        assert entry.tied == tied
    else:  # transformers 4.x: the dropped names (patterns)
        assert set(entry.tied) == set(tied)
    if entry.base is not None:
        base = getattr(transformers, entry.base)
        assert ARCHITECTURES[entry.base].tied == (base._tied_weights_keys or {})


def _llama_without_head(tmp_path: Path) -> Path:
    """A Llama folder saved as save_pretrained does: the tied lm_head left out, so every key has 'model.'."""
    d = tmp_path / "llama"
    d.mkdir()
    shutil.copy(FW / "hf_llama_bin" / "config.json", d / "config.json")
    sd = load_file(str(FW / "hf_llama_bin.expected.safetensors"))
    sd.pop("lm_head.weight")
    save_file(sd, str(d / "model.safetensors"))
    return d


def test_own_prefix_is_never_stripped_by_default(tmp_path: Path) -> None:
    d = _llama_without_head(tmp_path)
    src = d / "model.safetensors"
    assert own_prefixes(src) == {"model.": "LlamaForCausalLM"}
    keys = list(load_file(str(src)))
    assert detect_prefixes(keys).default_strip == ("model.",)  # keys alone: looks like Lightning's wrapper
    r = detect_prefixes(keys, own_prefixes(src))
    assert r.default_strip == () and r.own == {"model.": len(keys)} and "model." not in r.leading
    rep = inspect_checkpoint(src)
    assert rep.prefixes == {}
    assert any("LlamaForCausalLM's own base-model prefix" in n for n in rep.notes)
    out = tmp_path / "o.safetensors"
    convert(src, out, strip_prefix=True)
    assert set(load_file(str(out))) == set(keys)
    res = strip_prefix_checkpoint(str(src), output=str(tmp_path / "s.safetensors"))
    assert "own base-model prefix" in res.detail["summary"]
    assert set(load_file(str(tmp_path / "s.safetensors"))) == set(keys)
    # an explicit prefix is still obeyed
    new, _ = strip_prefix_report(dict.fromkeys(keys, 0), "model.", own=own_prefixes(src))
    assert all(not k.startswith("model.") for k in new)


def test_without_config_model_prefix_is_a_wrapper(tmp_path: Path) -> None:
    d = _llama_without_head(tmp_path)
    (d / "config.json").unlink()
    out = tmp_path / "o.safetensors"
    convert(d / "model.safetensors", out, strip_prefix=True)
    assert all(not k.startswith("model.") for k in load_file(str(out)))


def test_ddp_around_llama_strips_module_only(tmp_path: Path) -> None:
    d = _llama_without_head(tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    save_file({f"module.{k}": v for k, v in sd.items()}, str(d / "model.safetensors"))
    out = tmp_path / "o.safetensors"
    convert(d / "model.safetensors", out, strip_prefix=True)
    assert set(load_file(str(out))) == set(sd)


def test_tied_name_from_config_without_transformers(tmp_path: Path) -> None:
    src = FW / "hf_llama_bin" / "pytorch_model.bin"
    out = tmp_path / "o.safetensors"
    code = (
        "import sys, json; from ckptfix.ops.convert import convert; "
        f"r = convert({str(src)!r}, {str(out)!r}); "
        "print(json.dumps([r.aliases, r.tied_rule, 'transformers' in sys.modules, 'torch' in sys.modules]))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    aliases, rule, tf, torch_ = json.loads(p.stdout)
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "LlamaForCausalLM" in rule and "transformers" in rule
    assert tf is False and torch_ is False
    with safe_open(str(out), "np") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    c = run_cli("convert", str(src), "-o", str(tmp_path / "c.safetensors"), isolated=True)
    assert c.returncode == 0 and c.torch_imported is False


def test_tie_word_embeddings_false_and_unknown_architecture(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False}))
    assert tied_drop(d / "x.bin") is None
    assert own_prefixes(d / "x.bin") == {"model.": "LlamaForCausalLM"}
    (d / "config.json").write_text(json.dumps({"architectures": ["SomethingNew"]}))
    assert tied_drop(d / "x.bin") is None and own_prefixes(d / "x.bin") == {}
    (d / "config.json").write_text("[1, 2]")
    assert tied_drop(d / "x.bin") is None
    d2 = tmp_path / "bart"
    d2.mkdir()
    (d2 / "config.json").write_text(json.dumps({"architectures": ["BartForConditionalGeneration"]}))
    names, _ = tied_drop(d2 / "x.bin")
    assert set(names) == {"lm_head.weight", "model.decoder.embed_tokens.weight", "model.encoder.embed_tokens.weight"}
