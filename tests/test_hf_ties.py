"""A transformers Trainer ``checkpoint-N/`` of a tied model (issue 34 B10): GPT-2's ``lm_head.weight`` is left out
of ``model.safetensors`` by ``save_pretrained`` (tied to ``transformer.wte.weight``); ``model.state_dict()`` has it.

The fixture is tests/fixtures/frameworks/trainer/ (``make.py``: transformers' own Trainer); its
``trainer.expected.safetensors`` is the state dict ``from_pretrained`` gives back, ``lm_head.weight`` included.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from ckptfix import load_anywhere
from ckptfix.ops.convert import convert
from ckptfix.ops.load import load_checkpoint

torch = pytest.importorskip("torch")

FW = Path(__file__).resolve().parent / "fixtures" / "frameworks"
CK = FW / "trainer" / "checkpoint-2"


def _want() -> dict:
    return load_file(str(FW / "trainer.expected.safetensors"))


@pytest.mark.parametrize("where", ["folder", "file"])
def test_load_anywhere_gives_the_tied_head(where: str) -> None:
    # was: 16 names, lm_head.weight missing (model.state_dict() has 17)
    p = CK if where == "folder" else CK / "model.safetensors"
    lc = load_checkpoint(p)
    want = _want()
    assert set(lc.state_dict) == set(want)
    for k, v in want.items():
        assert torch.equal(lc.state_dict[k], v), k
    assert lc.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert lc.state_dict["lm_head.weight"] is lc.state_dict["transformer.wte.weight"]  # tied, as in the model
    assert list(lc.state_dict)[-1] == "lm_head.weight"


def test_untie_gives_a_copy_safetensors_can_save(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    sd = load_anywhere(CK, untie=True)
    assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
    assert sd["lm_head.weight"].data_ptr() != sd["transformer.wte.weight"].data_ptr()
    save_file(sd, str(tmp_path / "x.safetensors"))  # shared storage would be refused


def test_untied_config_adds_nothing(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    shutil.copytree(CK, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    assert "lm_head.weight" not in load_anywhere(d)


def test_convert_records_the_tie(tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    rep = convert(CK, out)
    assert rep.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert "tie_word_embeddings" in (rep.tied_rule or "")
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        assert "lm_head.weight" not in f.keys()  # stored once, as the input
    assert json.loads(meta["ckptfix.aliases"]) == {"lm_head.weight": "transformer.wte.weight"}
    assert json.loads(meta["ckptfix.order"])[-1] == "lm_head.weight"
    sd = load_anywhere(out)
    want = _want()
    assert set(sd) == set(want) and all(torch.equal(sd[k], v) for k, v in want.items())


def test_against_transformers_from_pretrained() -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(CK))
    want = model.state_dict()
    got = load_anywhere(CK)
    assert set(got) == set(want)  # (safetensors keeps names sorted, not in the model's order)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    fresh = transformers.AutoModelForCausalLM.from_config(model.config)
    fresh.load_state_dict(load_anywhere(CK, untie=True), strict=True)
    fresh.eval()
    model.eval()
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(fresh(x).logits, model(x).logits)
