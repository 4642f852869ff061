"""Framework folders as inputs (ckptfix.ops.frameworks): checkpoints the frameworks wrote themselves.

The fixtures in tests/fixtures/frameworks/ were written by transformers' Trainer, accelerate and
Lightning (``make.py``; versions in ``VERSIONS``); ``NAME.expected.safetensors`` beside each holds the
state dict the framework's own loader gives back.  The suite never needs the frameworks; the opt-in
``-m frameworks`` test regenerates the fixtures with the installed ones and compares again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jsonschema import Draft202012Validator
from safetensors import safe_open
from safetensors.torch import load_file

from ckptfix import load_anywhere
from ckptfix.errors import CheckpointNotFoundError, NoModelWeightsError
from ckptfix.ops.convert import convert
from ckptfix.ops.frameworks import LAYOUTS, file_role, is_sidecar_name, resolve
from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint
from ckptfix.ops.load import load_checkpoint

from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
FW = REPO / "tests" / "fixtures" / "frameworks"
SCHEMA = json.loads((REPO / "docs" / "schemas" / "inspect.schema.json").read_text(encoding="utf-8"))

#: fixture -> (layout, weights relative to the folder)
FOLDERS = {
    "trainer/checkpoint-2": ("hf-trainer", "model.safetensors"),
    "accelerate": ("accelerate", "model.safetensors"),
    "lightning_dcp": ("lightning-dcp", "."),
    "hf_llama_bin": ("hf-model", "pytorch_model.bin"),
    "hf_gpt2_sharded": ("hf-model", "model.safetensors.index.json"),
}
EXPECTED = {
    "trainer/checkpoint-2": "trainer",
    "accelerate": "accelerate",
    "lightning_dcp": "lightning_dcp",
    "hf_llama_bin": "hf_llama_bin",
    "hf_gpt2_sharded": "hf_gpt2_sharded",
    "lightning.ckpt": "lightning.ckpt",
}


def expected(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FW / f"{EXPECTED[name]}.expected.safetensors"))


def assert_matches_expected(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor the framework's loader gives back, bit for bit (tied names may be stored once)."""
    for k, v in want.items():
        if k in got:
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:  # a tied name stored once (GPT-2's lm_head.weight): equal to a stored tensor
            assert any(g.shape == v.shape and torch.equal(g, v) for g in got.values()), k
    assert set(got) <= set(want)


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_resolve_names_layout_and_weights(folder: str) -> None:
    r = resolve(FW / folder)
    assert r is not None
    layout, weights = FOLDERS[folder]
    assert r.layout.name == layout
    assert os.path.relpath(r.weights, r.path) == weights
    assert r.layout.checked  # every entry says which versions it was checked against


def test_every_layout_has_checked_versions_and_a_detector() -> None:
    assert {lay.name for lay in LAYOUTS} >= {"hf-trainer", "accelerate", "lightning-dcp", "torch-dcp", "hf-model"}
    for lay in LAYOUTS:
        assert lay.checked and callable(lay.detect)


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_inspect_folder(folder: str) -> None:
    rep = inspect_checkpoint(FW / folder)
    assert rep.framework is not None and rep.framework["layout"] == FOLDERS[folder][0]
    want = expected(folder)
    assert rep.tensor_count <= len(want) and rep.tensor_count > 0
    doc = rep.to_dict()
    Draft202012Validator(SCHEMA).validate(json.loads(json.dumps(doc, default=str)))


def test_inspect_trainer_lines_per_file() -> None:
    p = run_cli("inspect", str(FW / "trainer" / "checkpoint-2"), isolated=True)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "transformers Trainer (hf-trainer" in out
    assert (
        "optimizer     optimizer.pt: 2 param group(s), 16 params, 48 state tensors (exp_avg, exp_avg_sq, step)" in out
    )
    assert "trainer-state trainer_state.json: global_step 2, epoch 1.0" in out
    assert "scheduler     scheduler.pt: last_epoch 2" in out
    assert "rng           rng_state.pth: RNG states: python, numpy, cpu" in out
    assert "args          training_args.bin: TrainingArguments: max_steps 2" in out
    assert p.torch_imported is False


def test_inspect_json_framework_entry() -> None:
    p = run_cli("inspect", str(FW / "accelerate"), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    Draft202012Validator(SCHEMA).validate(doc)
    fw = doc["framework"]
    assert fw["framework"] == "accelerate save_state" and fw["weights"] == "model.safetensors"
    roles = {f["file"]: f["role"] for f in fw["files"]}
    assert roles == {
        "custom_checkpoint_0.pkl": "custom",
        "optimizer.bin": "optimizer",
        "random_states_0.pkl": "rng",
        "scheduler.bin": "scheduler",
    }


def test_lightning_ckpt_file_names_framework() -> None:
    rep = inspect_checkpoint(FW / "lightning.ckpt")
    assert rep.framework is not None and rep.framework["layout"] == "lightning-ckpt"
    assert rep.framework["version"] == json.loads((FW / "VERSIONS").read_text())["lightning"]


def test_lightning_meta_shown() -> None:
    rep = inspect_checkpoint(FW / "lightning_dcp")
    assert rep.framework["lightning_meta"]["global_step"] == 2
    assert rep.framework["lightning_meta"]["hyper_parameters"] == {"hidden": 8, "lr": 0.01}
    p = run_cli("inspect", str(FW / "lightning_dcp"))
    assert "meta.pt: epoch 1, global_step 2, hyper_parameters {'hidden': 8, 'lr': 0.01}" in p.stdout


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_convert_folder_matches_framework_loader(folder: str, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    rep = convert(FW / folder, out)
    assert rep.outputs == [str(out)]
    got = load_file(str(out))
    assert_matches_expected(got, expected(folder))
    # and through ckptfix's loader, the aliases restored (the tied head of a .bin input comes back)
    sd = load_anywhere(out)
    assert_matches_expected(sd, expected(folder))
    if folder == "hf_llama_bin":
        assert set(sd) == set(expected(folder))


def test_convert_lightning_ckpt(tmp_path: Path) -> None:
    out = tmp_path / "l.safetensors"
    convert(FW / "lightning.ckpt", out)
    assert_matches_expected(load_file(str(out)), expected("lightning.ckpt"))


def test_convert_lightning_dcp_carries_meta(tmp_path: Path) -> None:
    out = tmp_path / "l.safetensors"
    convert(FW / "lightning_dcp", out)
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    extra = json.loads(meta["ckptfix.extra"]) if "ckptfix.extra" in meta else None
    assert extra is not None, meta.keys()
    assert extra["global_step"] == 2 and extra["epoch"] == 1
    assert extra["hyper_parameters"] == {"hidden": 8, "lr": 0.01}


def test_convert_folder_include_optimizer(tmp_path: Path) -> None:
    out = tmp_path / "t.safetensors"
    convert(FW / "trainer" / "checkpoint-2", out, include_optimizer=True)
    got = load_file(str(out))
    opt = torch.load(FW / "trainer" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    for i, st in opt["state"].items():
        for k, v in st.items():
            assert torch.equal(got[f"optimizer.state.{i}.{k}"], v)
    assert_matches_expected(
        {k: v for k, v in got.items() if not k.startswith("optimizer.")}, expected("trainer/checkpoint-2")
    )


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_load_anywhere_folder(folder: str) -> None:
    sd = load_anywhere(FW / folder)
    want = expected(folder)
    if folder == "lightning_dcp":
        sd = {f"model.{k}" if not k.startswith("model.") else k: v for k, v in sd.items()}
    assert_matches_expected(sd, want)


def test_default_output_of_hf_bin_folder(tmp_path: Path) -> None:
    d = tmp_path / "hf"
    shutil.copytree(FW / "hf_llama_bin", d)
    rep = convert(d)
    assert rep.outputs == [str(d / "model.safetensors")]
    d2 = tmp_path / "checkpoint-2"
    shutil.copytree(FW / "trainer" / "checkpoint-2", d2)
    assert convert(d2).outputs == [str(tmp_path / "checkpoint-2.safetensors")]


# --------------------------------------------------------------------------- optimizer files (Build 4)


@pytest.mark.parametrize("name", ["trainer/checkpoint-2/optimizer.pt", "accelerate/optimizer.bin"])
def test_optimizer_file_is_a_checkpoint(name: str, tmp_path: Path) -> None:
    # they were "corrupt" (exit 4): the state's tensors sit under integer keys (state[0]["exp_avg"]),
    # which the state-dict search never followed, so "no state dict found" -> CorruptCheckpointError
    path = FW / name
    rep = inspect_checkpoint(path)
    want = torch.load(path, weights_only=True)
    n = sum(len(s) for s in want["state"].values())
    assert rep.tensor_count == n
    assert any("an optimizer state" in x for x in rep.notes)
    lc = load_checkpoint(path)
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(lc.state_dict[f"state.{i}.{k}"], v)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # what the checkpoint is for
    assert lc.checkpoint["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
    assert opt is not None
    p = run_cli("inspect", str(path))
    assert p.returncode == 0, p.stderr


def test_convert_optimizer_file(tmp_path: Path) -> None:
    path = FW / "trainer" / "checkpoint-2" / "optimizer.pt"
    out = tmp_path / "o.safetensors"
    p = run_cli("convert", str(path), "-o", str(out))
    assert p.returncode == NoModelWeightsError.exit_code, p.stderr
    assert p.stderr.count("Error:") == 1 and "--include-optimizer" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
    convert(path, out, include_optimizer=True)
    got = load_file(str(out))
    want = torch.load(path, weights_only=True)
    assert torch.equal(got["optimizer.state.0.exp_avg"], want["state"][0]["exp_avg"])
    with safe_open(str(out), "pt") as f:
        extra = json.loads(f.metadata()["ckptfix.extra"])
    assert extra["optimizer"]["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]


def test_zero_optim_states_is_a_checkpoint(tmp_path: Path) -> None:
    # the layout DeepSpeed's stage_1_and_2 / stage3 state_dict() writes into *_optim_states.pt
    path = tmp_path / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    flat = torch.arange(10, dtype=torch.float32)
    torch.save(
        {
            "optimizer_state_dict": {
                "loss_scaler": None,
                "zero_stage": 2,
                "partition_count": [2],
                "base_optimizer_state": {"state": {0: {"exp_avg": torch.zeros(10)}}, "param_groups": [{"lr": 1e-3}]},
                "single_partition_of_fp32_groups": [flat],
            },
            "ds_config": {"zero_optimization": {"stage": 2}},
            "ds_version": "0.16.0",
        },
        path,
    )
    rep = inspect_checkpoint(path)
    assert rep.tensor_count == 2
    lc = load_checkpoint(path)
    assert torch.equal(lc.state_dict["optimizer_state_dict.single_partition_of_fp32_groups.0"], flat)
    assert run_cli("inspect", str(path)).returncode == 0


# --------------------------------------------------------------------------- bad inputs


def test_trainer_folder_without_weights(tmp_path: Path) -> None:
    d = tmp_path / "checkpoint-2"
    shutil.copytree(FW / "trainer" / "checkpoint-2", d)
    (d / "model.safetensors").unlink()
    before = sorted(os.listdir(tmp_path))
    for args in (["convert", str(d)], ["convert", str(d), "-o", str(tmp_path / "x.safetensors")], ["inspect", str(d)]):
        p = run_cli(*args)
        assert p.returncode == 15, p.stderr
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error:") and "no model weights" in lines[0], p.stderr
        assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(NoModelWeightsError):
        load_anywhere(d)


def test_other_folder_keeps_message_and_lists_checkpoints_first(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    for n in ("optimizer.pt", "rng_state.pth", "weights.pt"):
        shutil.copy(FW / "trainer" / "checkpoint-2" / "scheduler.pt", d / n)
    with pytest.raises(CheckpointNotFoundError, match=r"a directory with no checkpoint in it .*holds weights\.pt, "):
        inspect_checkpoint(d)
    assert is_sidecar_name("optimizer.pt") and not is_sidecar_name("model.safetensors")
    assert file_role("model-00001-of-00002.safetensors") == "weights"


def test_scan_folder_scans_every_pickle() -> None:
    r = scan_checkpoint(FW / "trainer" / "checkpoint-2")
    files = {p.split(":")[0] for p in r.pickles}
    assert files == {"optimizer.pt", "rng_state.pth", "scheduler.pt", "training_args.bin"}
    assert "transformers.training_args.TrainingArguments" in r.unknown
    a = scan_checkpoint(FW / "accelerate")
    assert {p.split(":")[0] for p in a.pickles} == {
        "custom_checkpoint_0.pkl",
        "optimizer.bin",
        "random_states_0.pkl",
        "scheduler.bin",
    }
    lt = scan_checkpoint(FW / "lightning_dcp")
    assert any(p.startswith("meta.pt") for p in lt.pickles) and ".metadata" in lt.pickles


# --------------------------------------------------------------------------- regenerate (opt-in)

_HAVE = all(importlib.util.find_spec(m) for m in ("transformers", "accelerate", "lightning"))


@pytest.mark.frameworks
@pytest.mark.skipif(not _HAVE, reason="needs transformers, accelerate and lightning installed")
def test_regenerate_with_installed_frameworks(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """``pytest -m frameworks``: write the fixtures again with the installed frameworks and check them."""
    if "frameworks" not in (request.config.getoption("-m") or ""):
        pytest.skip("opt-in: pytest -m frameworks")
    subprocess.run([sys.executable, str(FW / "make.py"), str(tmp_path)], check=True, capture_output=True, timeout=600)
    for folder, (layout, _) in FOLDERS.items():
        r = resolve(tmp_path / folder)
        assert r is not None and r.layout.name == layout, folder
        out = tmp_path / f"{EXPECTED[folder]}.out.safetensors"
        convert(tmp_path / folder, out)
        want = load_file(str(tmp_path / f"{EXPECTED[folder]}.expected.safetensors"))
        assert_matches_expected(load_file(str(out)), want)
    assert inspect_checkpoint(tmp_path / "lightning.ckpt").framework is not None


# --------------------------------------------------------------------------- align -o (Build 6)


@pytest.mark.parametrize("src", ["hf_llama_bin/pytorch_model.bin", "hf_gpt2_sharded/model.safetensors.index.json"])
def test_align_output_always_written(src: str, tmp_path: Path) -> None:
    """align -o OUT writes OUT even when no key needs renaming (an unchanged copy): a pipeline reads OUT."""
    path = FW / src
    out = tmp_path / ("out" if src.endswith(".json") else "out.bin")
    p = run_cli("align", str(path), "--to", str(path), "-o", str(out))
    assert p.returncode == 0, p.stderr
    assert "unchanged copy" in p.stderr
    assert out.exists()
    got = load_anywhere(out / "model.safetensors.index.json" if out.is_dir() else out)
    lc = load_checkpoint(path)
    # the input's tied lm_head.weight, put back from the config.json beside it (which the output folder lacks)
    want = {k: v for k, v in lc.state_dict.items() if k not in lc.tied}
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_scan_folder_walks_sub_folders_and_skips_text(tmp_path: Path) -> None:
    """A Trainer run with DeepSpeed: global_stepN/ holds pickles, `latest` is text; every pickle is scanned."""
    d = tmp_path / "checkpoint-2"
    shutil.copytree(FW / "trainer" / "checkpoint-2", d)
    (d / "global_step2").mkdir()
    (d / "latest").write_text("global_step2")
    torch.save({"module": {"w": torch.zeros(2)}}, d / "global_step2" / "mp_rank_00_model_states.pt")
    r = scan_checkpoint(d)
    assert any(p.startswith("global_step2/mp_rank_00_model_states.pt") for p in r.pickles), r.pickles
    assert r.errors == []
