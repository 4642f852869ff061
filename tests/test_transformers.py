"""convert keeps the tied names transformers keeps: the converted folder loads with from_pretrained, bit-identical.

The client is transformers itself: tiny GPT-2 and BERT models are built here, saved the way transformers 4.x
wrote ``pytorch_model.bin`` (``torch.save(model.state_dict())``, tied tensors shared), converted by ckptfix,
and loaded back with ``AutoModel`` and the head model.  Skipped when transformers is not installed.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ckptfix.ops.convert import convert_to_safetensors  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg), "transformer.wte.weight", "lm_head.weight"


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=32,
    )
    return transformers.BertForMaskedLM(cfg), "bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"


MODELS = {"gpt2": _gpt2, "bert": _bert}


def _save_hf_bin(model, folder, prefix: str = "", config: bool = True) -> str:
    os.makedirs(folder, exist_ok=True)
    if config:  # as save_pretrained writes it: architectures names the class
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(folder)
    sd = model.state_dict()
    if prefix:  # a DataParallel copy: every key carries module.
        sd = type(sd)((prefix + k, v) for k, v in sd.items())
    path = os.path.join(folder, "pytorch_model.bin")
    torch.save(sd, path)
    return path


def _outputs(model, ids):
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _base_of(model):
    return getattr(model, model.base_model_prefix)


@pytest.fixture(scope="module", params=list(MODELS))
def built(request):
    torch.manual_seed(0)
    model, embed, head = MODELS[request.param]()
    model.eval()
    ids = torch.randint(0, 97, (2, 7))
    return request.param, model, embed, head, ids


@pytest.mark.parametrize("layout", ["single", "sharded", "dataparallel"])
def test_from_pretrained_on_converted_folder(built, tmp_path, layout):
    name, model, embed, head, ids = built
    folder = tmp_path / name
    src = _save_hf_bin(model, folder, prefix="module." if layout == "dataparallel" else "")
    kw = {}
    if layout == "sharded":
        kw["max_shard_size"] = 40_000
    if layout == "dataparallel":
        kw["strip_prefix"] = True
    rep = convert_to_safetensors(src, **kw)
    assert rep.verified
    # transformers looks for model.safetensors (or its sharded index) in the folder
    if layout == "sharded":
        assert rep.index == str(folder / "model.safetensors.index.json") and len(rep.outputs) > 1
        assert all(os.path.basename(p).startswith("model-0000") for p in rep.outputs)
    else:
        assert rep.outputs == [str(folder / "model.safetensors")]
    assert rep.aliases.get(head) == embed, rep.aliases  # the embedding is stored, the head is the alias
    assert "transformers" in (rep.tied_rule or "")
    os.remove(src)  # only the converted weights are left to load
    head_cls = type(model)
    loaded = head_cls.from_pretrained(folder, use_safetensors=True)
    assert torch.equal(_outputs(loaded, ids), _outputs(model, ids))
    base = transformers.AutoModel.from_pretrained(folder, use_safetensors=True)
    assert torch.equal(_outputs(base, ids), _outputs(_base_of(model), ids))
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_state_dict_order_without_config(built, tmp_path):
    """No config.json: the first name in the state dict's order is kept -- what save_pretrained keeps too."""
    name, model, embed, head, ids = built
    src = _save_hf_bin(model, tmp_path / "f", config=False)
    rep = convert_to_safetensors(src, tmp_path / "out.safetensors")
    assert rep.aliases.get(head) == embed and rep.tied_rule == "state-dict order"
    if name == "bert":  # the decoder bias is tied to cls.predictions.bias, which comes first
        assert rep.aliases.get("cls.predictions.decoder.bias") == "cls.predictions.bias"
    # the converted weights load into the model and give the same outputs
    folder = tmp_path / "hf"
    folder.mkdir()
    model.config.save_pretrained(folder)
    shutil.copy(tmp_path / "out.safetensors", folder / "model.safetensors")
    loaded = type(model).from_pretrained(folder, use_safetensors=True)
    assert torch.equal(_outputs(loaded, ids), _outputs(model, ids))


def test_keep_forces_a_name(built, tmp_path):
    name, model, embed, head, _ = built
    src = _save_hf_bin(model, tmp_path / "f")
    rep = convert_to_safetensors(src, tmp_path / "o.safetensors", keep=[head])
    assert rep.aliases.get(embed) == head and rep.tied_rule == "--keep"


def test_cli_converts_inside_the_folder(built, tmp_path):
    from helpers import run_cli

    name, model, embed, head, ids = built
    src = _save_hf_bin(model, tmp_path / "f")
    p = run_cli("convert", src, "--json", timeout=180)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["outputs"] == [str(tmp_path / "f" / "model.safetensors")]
    assert doc["aliases"][head] == embed
    assert json.loads((tmp_path / "f" / "config.json").read_text())["architectures"] == [type(model).__name__]


def test_the_name_alphabetical_order_keeps_breaks_automodel(tmp_path):
    """Negative control: storing lm_head.weight (the name that sorts first, Hugging Face convert.py's choice)
    leaves AutoModel without its embedding -- the check above would catch a regression."""
    torch.manual_seed(0)
    model, embed, head = _gpt2()
    model.eval()
    ids = torch.randint(0, 97, (2, 7))
    folder = tmp_path / "neg"
    src = _save_hf_bin(model, folder)
    convert_to_safetensors(src, keep=[head])
    os.remove(src)
    base = transformers.AutoModel.from_pretrained(folder, use_safetensors=True)
    assert not torch.equal(_outputs(base, ids), _outputs(_base_of(model), ids))


@pytest.mark.parametrize("shards", [1, 3])
def test_dcp_checkpoint_of_an_hf_model_converts_to_a_folder_transformers_loads(built, tmp_path, shards):
    """A DCP save of a transformers model (as FSDP ranks would write it), consolidated by ckptfix without
    torch into model.safetensors, loads with ``from_pretrained`` and gives bit-identical outputs."""
    from ckptfix.ops.convert import convert

    name, model, embed, head, ids = built
    folder = tmp_path / name
    src = _save_hf_bin(model, folder)
    st = folder / "start.safetensors"
    convert(src, st)
    run = tmp_path / "run.dcp"
    convert(st, run, shards=shards)  # written through torch's own DCP writer, as `shards` ranks would
    os.remove(src)
    os.remove(st)
    rep = convert(run, folder / "model.safetensors")
    assert rep.verified and rep.outputs == [str(folder / "model.safetensors")]
    loaded = type(model).from_pretrained(folder, use_safetensors=True)
    assert torch.equal(_outputs(loaded, ids), _outputs(model, ids))
    base = transformers.AutoModel.from_pretrained(folder, use_safetensors=True)
    assert torch.equal(_outputs(base, ids), _outputs(_base_of(model), ids))
