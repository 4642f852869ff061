"""peft adapters, diffusers pipelines and sentence-transformers folders (issue #34 B1-B3), as the frameworks wrote them.

The fixtures (``tests/fixtures/frameworks/``, ``make_folders.py``, versions in ``VERSIONS_FOLDERS``) were written by
peft's / diffusers' ``save_pretrained`` and ``SentenceTransformer.save``; ``NAME.expected.safetensors`` beside each
holds the tensors the framework's own loader gives back (named as ``load_anywhere`` names them) and
``NAME.expected_out.safetensors`` the model's output on a fixed input.  The ckptfix tests need none of the
frameworks; the oracle tests (the framework's loader on the converted folder: bit-equal logits, outputs, embeddings)
skip cleanly where the framework is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from jsonschema import Draft202012Validator
from safetensors import safe_open
from safetensors.torch import load_file

from ckptfix import load_anywhere
from ckptfix.errors import KeyConflictError, OptionNotApplicableError, UnsupportedError
from ckptfix.ops.convert import convert
from ckptfix.ops.frameworks import resolve
from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint

from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
FW = REPO / "tests" / "fixtures" / "frameworks"
SCHEMAS = REPO / "docs" / "schemas"
TOKENS = [[1, 5, 7, 9, 11, 2]]  # make_folders.TOKENS


def schema(name: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8")))


def expected(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FW / f"{name}.expected.safetensors"))


def expected_out(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FW / f"{name}.expected_out.safetensors"))


def copy_fixture(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FW / name, dst)
    return dst


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def st_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    "folder, layout, weights",
    [
        ("peft_lora", "peft-adapter", "adapter_model.safetensors"),
        ("peft_lora_bin", "peft-adapter", "adapter_model.bin"),
        ("diffusers_bin", "diffusers-pipeline", None),
        ("diffusers_fp16", "diffusers-pipeline", None),
        ("diffusers_bin/unet", "diffusers-model", "diffusion_pytorch_model.bin"),
        ("diffusers_fp16/unet", "diffusers-model", "diffusion_pytorch_model.safetensors.index.fp16.json"),
        ("st_bin", "sentence-transformers", None),
        ("diffusers_fp16/text_encoder", "hf-model-variant", "model.fp16.safetensors"),
    ],
)
def test_resolve(folder: str, layout: str, weights: str | None) -> None:
    r = resolve(FW / folder)
    assert r is not None and r.layout.name == layout
    assert (None if r.weights is None else os.path.relpath(r.weights, r.path)) == weights
    assert r.layout.checked


def test_components_of_a_pipeline_and_of_sentence_transformers() -> None:
    from ckptfix.formats.pipelines import components_of

    comps = {c.name: c for c in components_of(resolve(FW / "diffusers_fp16"))}
    assert sorted(comps) == ["scheduler", "text_encoder", "tokenizer", "unet", "vae"]
    assert {v: os.path.basename(p) for v, p in comps["unet"].weights.items()} == {
        "fp16": "diffusion_pytorch_model.safetensors.index.fp16.json"
    }
    assert comps["scheduler"].weights == {} and comps["unet"].prefix == "unet."
    st = {c.name: c for c in components_of(resolve(FW / "st_bin"))}
    assert [st[n].rel for n in "0123"] == [".", "1_Pooling", "2_Dense", "3_Normalize"]
    assert os.path.basename(st["2"].main) == "pytorch_model.bin"
    assert st["0"].prefix == "0.model." and st["2"].prefix == "2."  # as SentenceTransformer.state_dict() names them


# --------------------------------------------------------------------------- B1 peft


def test_inspect_peft_shows_the_adapter() -> None:
    rep = inspect_checkpoint(FW / "peft_lora_bin")
    assert rep.framework["layout"] == "peft-adapter"
    ad = rep.framework["adapter"]
    assert ad["r"] == 2 and ad["lora_alpha"] == 4 and ad["task_type"] == "CAUSAL_LM"
    assert ad["target_modules"] == ["c_attn", "c_proj"] and ad["base_model_name_or_path"] == "peft_base"
    assert rep.tensor_count == 6 and all(".lora_" in t["name"] for t in rep.tensors)
    schema("inspect").validate(json.loads(json.dumps(rep.to_dict(), default=str)))
    p = run_cli("inspect", str(FW / "peft_lora"), isolated=True)
    assert p.returncode == 0, p.stderr
    assert "peft adapter (peft-adapter" in p.stdout
    assert "adapter_config.json: LORA, r 2, lora_alpha 4, target modules c_attn, c_proj, task CAUSAL_LM" in p.stdout
    assert "base model peft_base" in p.stdout
    assert p.torch_imported is False


def test_convert_peft_bin_writes_adapter_model_safetensors(tmp_path: Path) -> None:
    d = copy_fixture("peft_lora_bin", tmp_path)
    rep = convert(d)
    assert rep.outputs == [str(d / "adapter_model.safetensors")]  # where PeftModel.from_pretrained looks first
    same(st_tensors(d / "adapter_model.safetensors"), expected("peft_lora_bin"))  # the names peft loads
    assert rep.verified


def test_load_anywhere_peft_folder() -> None:
    for name in ("peft_lora", "peft_lora_bin"):
        same(dict(load_anywhere(FW / name)), expected(name))


def test_trainer_checkpoint_of_a_peft_model_reads_the_adapter(tmp_path: Path) -> None:
    d = copy_fixture("peft_lora", tmp_path)
    (d / "trainer_state.json").write_text('{"global_step": 2}')
    r = resolve(d)
    assert r.layout.name == "hf-trainer" and os.path.basename(r.weights) == "adapter_model.safetensors"
    same(dict(load_anywhere(d)), expected("peft_lora"))


# --------------------------------------------------------------------------- B2 diffusers


@pytest.mark.parametrize("name", ["diffusers_bin", "diffusers_fp16"])
def test_inspect_pipeline_lists_each_component(name: str) -> None:
    rep = inspect_checkpoint(FW / name)
    comps = {c["name"]: c for c in rep.framework["components"]}
    assert sorted(comps) == ["scheduler", "text_encoder", "tokenizer", "unet", "vae"]
    want = expected(name)
    for c in ("unet", "vae", "text_encoder"):
        (v,) = comps[c]["variants"].values()
        assert v["tensors"] == sum(1 for k in want if k.startswith(c + "."))
    assert comps["scheduler"]["variants"] == {}
    assert sorted(t["name"] for t in rep.tensors) == sorted(want)
    assert rep.tensor_count == len(want)
    doc = json.loads(json.dumps(rep.to_dict(), default=str))
    schema("inspect").validate(doc)
    one = inspect_checkpoint(FW / name, component="unet")
    assert one.framework["component"] == "unet"
    assert sorted(t["name"] for t in one.tensors) == sorted(k[5:] for k in want if k.startswith("unet."))


def test_inspect_cli_component_and_refusals() -> None:
    p = run_cli("inspect", str(FW / "diffusers_fp16"), "--component", "vae", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["framework"]["component"] == "vae" and doc["tensor_count"] == 92
    p = run_cli("inspect", str(FW / "diffusers_fp16"), "--component", "nope")
    assert p.returncode == KeyConflictError.exit_code and "its components: scheduler, text_encoder" in p.stderr
    p = run_cli("inspect", str(FW / "peft_lora"), "--component", "unet")
    assert p.returncode == OptionNotApplicableError.exit_code and "--component does not apply" in p.stderr
    p = run_cli("inspect", str(FW / "diffusers_bin"), isolated=True)
    assert p.returncode == 0 and p.torch_imported is False
    assert (
        "component     unet (diffusers UNet2DConditionModel): unet/diffusion_pytorch_model.bin: 208 tensors" in p.stdout
    )


@pytest.mark.parametrize("name", ["diffusers_bin", "diffusers_fp16"])
def test_load_anywhere_pipeline(name: str) -> None:
    same(dict(load_anywhere(FW / name)), expected(name))
    unet = load_anywhere(FW / name, key="unet")
    same(dict(unet), {k[5:]: v for k, v in expected(name).items() if k.startswith("unet.")})


@pytest.mark.parametrize("name", ["diffusers_bin", "diffusers_fp16"])
def test_convert_pipeline_writes_the_same_layout_in_safetensors(name: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    rep = convert(FW / name, out)
    assert rep.verified and rep.source_format == "diffusers-pipeline"
    src = sorted(str(p.relative_to(FW / name)) for p in (FW / name).rglob("*") if p.is_file())
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == sorted(p.replace("diffusion_pytorch_model.bin", "diffusion_pytorch_model.safetensors") for p in src)
    assert not any(p.endswith(".bin") for p in got)
    same(dict(load_anywhere(out)), expected(name))
    for p in out.rglob("*.safetensors"):
        with safe_open(str(p), "pt") as f:
            assert f.metadata()["format"] == "pt"  # what transformers' / diffusers' loaders require
    doc = json.loads(json.dumps(rep.to_dict()))
    schema("convert").validate(doc)
    assert sorted(doc["components"]) == ["scheduler", "text_encoder", "tokenizer", "unet", "vae"]


def test_convert_cli_pipeline_is_torch_free(tmp_path: Path) -> None:
    p = run_cli("convert", str(FW / "diffusers_bin"), "-o", str(tmp_path / "out"), isolated=True)
    assert p.returncode == 0, p.stderr
    assert p.torch_imported is False
    assert "component unet (diffusers UNet2DConditionModel): " in p.stderr
    assert (tmp_path / "out" / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    p = run_cli("inspect", str(FW / "diffusers_bin" / "unet"))
    assert "config        config.json: UNet2DConditionModel (diffusers 0.42.1)" in p.stdout
    same(
        dict(load_anywhere(FW / "diffusers_bin" / "unet")),
        {k[5:]: v for k, v in expected("diffusers_bin").items() if k.startswith("unet.")},
    )


def test_convert_one_component(tmp_path: Path) -> None:
    rep = convert(FW / "diffusers_bin", tmp_path / "unet.safetensors", component="unet")
    want = {k[5:]: v for k, v in expected("diffusers_bin").items() if k.startswith("unet.")}
    same(st_tensors(tmp_path / "unet.safetensors"), want)
    assert list(rep.components) == ["unet"]
    rep = convert(FW / "diffusers_bin", tmp_path / "unet_dir", component="unet")
    assert sorted(p.name for p in (tmp_path / "unet_dir").iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
    ]
    p = run_cli("convert", str(FW / "diffusers_bin"), "--component", "vae", "-o", str(tmp_path / "vae"), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["components"]["vae"]["outputs"] == [
        str(tmp_path / "vae" / "diffusion_pytorch_model.safetensors")
    ]


def test_convert_pipeline_refusals(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(Exception, match="already exists"):
        convert(FW / "diffusers_bin", out)
    with pytest.raises(Exception, match="not a model folder"):
        convert(FW / "diffusers_bin", out, force=True)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(OptionNotApplicableError, match="--strip-prefix"):
        convert(FW / "diffusers_bin", tmp_path / "o2", strip_prefix=True)
    with pytest.raises(OptionNotApplicableError, match="--component"):
        convert(FW / "peft_lora_bin" / "adapter_model.bin", tmp_path / "a.safetensors", component="unet")
    with pytest.raises(KeyConflictError):
        convert(FW / "diffusers_bin", tmp_path / "o3", component="nope")
    with pytest.raises(UnsupportedError, match="no weights"):
        convert(FW / "diffusers_bin", tmp_path / "s.safetensors", component="scheduler")
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_convert_pipeline_leaves_the_input_alone_and_the_force_replaces_a_model_folder(tmp_path: Path) -> None:
    d = copy_fixture("diffusers_bin", tmp_path)
    before = sorted((p.relative_to(d), p.stat().st_size) for p in d.rglob("*"))
    convert(d, tmp_path / "out")
    convert(d, tmp_path / "out", force=True)
    assert sorted((p.relative_to(d), p.stat().st_size) for p in d.rglob("*")) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_scan_and_diff_of_a_pipeline(tmp_path: Path) -> None:
    sc = scan_checkpoint(FW / "diffusers_bin")
    assert sc.verdict == "safe"
    assert {"unet/diffusion_pytorch_model.bin", "vae/diffusion_pytorch_model.bin"} <= set(sc.files)
    p = run_cli("diff", str(FW / "diffusers_bin"), str(FW / "diffusers_fp16"))
    assert p.returncode == UnsupportedError.exit_code and "compare one component" in p.stderr
    p = run_cli("diff", str(FW / "diffusers_bin" / "unet"), str(FW / "diffusers_fp16" / "unet"))
    assert p.returncode in (0, 1), p.stderr  # a component folder compares as any checkpoint


# --------------------------------------------------------------------------- B3 sentence-transformers


def test_inspect_sentence_transformers_finds_every_module() -> None:
    rep = inspect_checkpoint(FW / "st_bin")
    comps = {c["name"]: c for c in rep.framework["components"]}
    assert comps["2"]["weights"] == {"": "2_Dense/pytorch_model.bin"}
    assert comps["0"]["weights"] == {"": "model.safetensors"}
    assert sorted(t["name"] for t in rep.tensors) == sorted(expected("st_bin"))


def test_load_anywhere_sentence_transformers() -> None:
    same(dict(load_anywhere(FW / "st_bin")), expected("st_bin"))


def test_convert_sentence_transformers(tmp_path: Path) -> None:
    out = tmp_path / "st"
    rep = convert(FW / "st_bin", out)
    assert (out / "2_Dense" / "model.safetensors").is_file() and not (out / "2_Dense" / "pytorch_model.bin").exists()
    assert rep.components["2"]["outputs"] == [str(out / "2_Dense" / "model.safetensors")]
    assert rep.components["0"]["outputs"] == [str(out / "model.safetensors")]
    same(dict(load_anywhere(out)), expected("st_bin"))


# --------------------------------------------------------------------------- the frameworks' own loaders (oracles)


def test_oracle_peft_logits_bit_equal(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    d = copy_fixture("peft_lora_bin", tmp_path)
    convert(d)
    (d / "adapter_model.bin").unlink()  # only the converted file is left to read
    base = transformers.GPT2LMHeadModel.from_pretrained(str(FW / "peft_base"))
    model = peft.PeftModel.from_pretrained(base, str(d)).eval()
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits
    assert torch.equal(logits, expected_out("peft_lora_bin")["logits"])


@pytest.mark.parametrize("name, variant", [("diffusers_bin", None), ("diffusers_fp16", "fp16")])
def test_oracle_diffusers_components_bit_equal(name: str, variant: str | None, tmp_path: Path) -> None:
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "out"
    convert(FW / name, out)
    kw: dict = {"variant": variant, "torch_dtype": torch.float16} if variant else {}
    unet = diffusers.UNet2DConditionModel.from_pretrained(str(out / "unet"), **kw).eval()
    vae = diffusers.AutoencoderKL.from_pretrained(str(out / "vae"), **kw).eval()
    text = transformers.CLIPTextModel.from_pretrained(str(out / "text_encoder"), **kw).eval()
    g = torch.Generator().manual_seed(0)  # make_folders._pipeline_outputs
    sample, image = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 3, 16, 16, generator=g)
    want = expected_out(name)
    with torch.no_grad():
        hidden = text(torch.tensor(TOKENS)).last_hidden_state
        dt = next(unet.parameters()).dtype
        noise = unet(sample.to(dt), 3, encoder_hidden_states=hidden.to(dt)).sample
        latent = vae.encode(image.to(next(vae.parameters()).dtype)).latent_dist.mean
        decoded = vae.decode(latent).sample
    assert torch.equal(hidden, want["text_encoder"]) and torch.equal(noise, want["unet"])
    assert torch.equal(latent, want["vae.latent"]) and torch.equal(decoded, want["vae.decoded"])
    pipe = diffusers.DiffusionPipeline.from_pretrained(str(out), **kw)  # the whole pipeline loads too
    assert type(pipe).__name__ == "StableDiffusionPipeline"


def test_oracle_sentence_transformers_embeddings_equal(tmp_path: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    out = tmp_path / "st"
    convert(FW / "st_bin", out)
    model = st.SentenceTransformer(str(out), device="cpu")
    emb = model.encode(["a cat sat", "the dog"], convert_to_tensor=True)
    assert torch.equal(emb, expected_out("st_bin")["embeddings"])
    # load_anywhere names the tensors as SentenceTransformer.state_dict() does: they load strictly
    sd = load_anywhere(FW / "st_bin", model=model)
    assert sorted(sd) == sorted(model.state_dict())
    model.load_state_dict(sd, strict=True)


# --------------------------------------------------------------------------- folders from someone else


def test_a_module_path_outside_the_folder_is_not_read(tmp_path: Path) -> None:
    d = copy_fixture("st_bin", tmp_path)
    outside = tmp_path / "outside"
    shutil.copytree(d / "2_Dense", outside)
    mods = json.loads((d / "modules.json").read_text())
    mods[2]["path"] = "../outside"
    (d / "modules.json").write_text(json.dumps(mods))
    rep = inspect_checkpoint(d)
    (c,) = [c for c in rep.framework["components"] if c["name"] == "2"]
    assert "outside the folder" in c["problem"] and c["weights"] == {}
    assert not any(t["name"].startswith("2.") for t in rep.tensors)


def test_component_weights_linking_outside_are_refused(tmp_path: Path) -> None:
    d = copy_fixture("diffusers_bin", tmp_path)
    secret = tmp_path / "secret.bin"
    shutil.move(d / "vae" / "diffusion_pytorch_model.bin", secret)
    (d / "vae" / "diffusion_pytorch_model.bin").symlink_to(secret)
    for call in (lambda: convert(d, tmp_path / "out"), lambda: load_anywhere(d), lambda: inspect_checkpoint(d)):
        with pytest.raises(UnsupportedError, match="outside the folder"):
            call()
    assert not (tmp_path / "out").exists()


def test_a_broken_model_index_is_no_pipeline(tmp_path: Path) -> None:
    d = tmp_path / "p"
    d.mkdir()
    (d / "model_index.json").write_text("{not json")
    assert resolve(d) is None or resolve(d).layout.name != "diffusers-pipeline"


def test_the_layouts_page_lists_every_layout() -> None:
    """docs/layouts.md: every row of LAYOUTS, by its name, with what each command does."""
    from ckptfix.formats.layouts import LAYOUTS

    page = (REPO / "docs" / "layouts.md").read_text(encoding="utf-8")
    assert [lay.name for lay in LAYOUTS if f"(`{lay.name}`)" not in page] == []
