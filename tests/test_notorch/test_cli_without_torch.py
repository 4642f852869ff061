"""Every command that does not need torch works without it; the others say so in one line (exit 14).

Each test runs ``ckptfix`` in a subprocess where ``import torch`` fails (see conftest.py), on the tiny
checkpoints of tests/fixtures/ckpt (written once by torch; ``model.safetensors`` there, written by
``safetensors.torch.save_file``, is the oracle for the tensor bytes).
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
from notorch_helpers import CKPT, FIXTURES, REPO, clean_env, read_safetensors

INSTALL = "pip install torch"
EXPECTED = read_safetensors(CKPT / "model.safetensors")


def _same_tensors(path: Path, prefix: str = "") -> None:
    got = read_safetensors(path)
    assert {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in got.items()} == EXPECTED


@pytest.mark.skipif(os.environ.get("CKPTFIX_EXPECT_NO_TORCH") != "1", reason="only in the torch-free CI venv")
def test_this_venv_really_has_no_torch():
    assert importlib.util.find_spec("torch") is None
    assert importlib.util.find_spec("numpy") is None


def test_importing_ckptfix_and_every_command_module_does_not_import_torch():
    code = (
        "import sys, ckptfix, ckptfix.cli, ckptfix.cli.ckpt, ckptfix.cli.convert, ckptfix.cli.gpu, "
        "ckptfix.cli.train, ckptfix.cli.demo, ckptfix.formats, ckptfix.ops.inspect, ckptfix.ops.prefixes, "
        "ckptfix.ops.rewrite, ckptfix.ops.convert, ckptfix.gpu; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')); print(bad)"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_every_command_has_help_without_torch(cli):
    top = cli("--help")
    assert top.rc == 0
    for cmd in (
        "inspect",
        "scan",
        "strip-prefix",
        "add-prefix",
        "align",
        "convert",
        "gpus",
        "pick-gpu",
        "doctor",
        "train",
        "demo",
    ):
        r = cli(cmd, "--help")
        assert r.rc == 0 and "Usage: ckptfix " + cmd in r.out, (cmd, r.err)


@pytest.mark.parametrize(
    "name,fmt",
    [
        ("ddp.pth", "torch-zip"),
        ("legacy.pth", "torch-legacy"),
        ("lightning.ckpt", "torch-zip"),
        ("model.safetensors", "safetensors"),
    ],
)
def test_inspect(cli, ckpts, name, fmt):
    r = cli("inspect", "--json", name)
    assert r.rc == 0, r.err
    doc = r.json()
    assert doc["format"] == fmt and doc["tensor_count"] == 3


def test_inspect_sharded_index(cli, ckpts):
    r = cli("inspect", "--json", "sharded/pytorch_model.bin.index.json")
    assert r.rc == 0, r.err
    assert r.json()["tensor_count"] == 3


def test_scan_safe_dangerous_and_several_files(cli, ckpts):
    assert cli("scan", "ddp.pth").rc == 0
    # GLOBAL os.system; "echo" ; TUPLE1 ; REDUCE ; STOP -- never executed, only read
    (ckpts / "evil.pkl").write_bytes(b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00echo\x85R.")
    r = cli("scan", "evil.pkl")
    assert r.rc == 11 and r.err.startswith("Error: ") and "os.system" in r.err
    r = cli("scan", "--json", "ddp.pth", "evil.pkl", "missing.pt", "model.safetensors")
    assert r.rc == 11  # the worst of 0, 11, 3, 0
    docs = r.json()
    assert [d["path"] for d in docs] == ["ddp.pth", "evil.pkl", "missing.pt", "model.safetensors"]
    assert [d["verdict"] for d in docs] == ["safe", "dangerous", "error", "safe"]
    assert docs[2]["exit_code"] == 3
    r = cli("scan", "ddp.pth", "missing.pt")
    assert r.rc == 3 and "missing.pt" in r.err and "1 of 2 files failed" in r.err


def test_strip_prefix_then_convert_gives_the_oracle_bytes(cli, ckpts):
    r = cli("strip-prefix", "ddp.pth")
    assert r.rc == 0, r.err
    out = r.out.strip()
    assert out == "ddp.stripped.pth"
    assert cli("inspect", "--json", out).json()["prefixes"] == {}
    r = cli("convert", out, "-o", "stripped.safetensors")
    assert r.rc == 0, r.err
    _same_tensors(ckpts / "stripped.safetensors")


def test_add_prefix_on_safetensors(cli, ckpts):
    r = cli("add-prefix", "model.safetensors", "--prefix", "module.")
    assert r.rc == 0, r.err
    got = read_safetensors(ckpts / r.out.strip())
    assert sorted(got) == sorted("module." + k for k in EXPECTED)


def test_align_to_a_checkpoint(cli, ckpts):
    r = cli("align", "ddp.pth", "--to", "model.safetensors", "-o", "aligned.pth")
    assert r.rc == 0, r.err
    assert cli("convert", "aligned.pth").rc == 0
    _same_tensors(ckpts / "aligned.safetensors")


@pytest.mark.parametrize(
    "name,prefix", [("ddp.pth", "module."), ("legacy.pth", "module."), ("lightning.ckpt", "model.")]
)
def test_convert_zip_legacy_lightning(cli, ckpts, name, prefix):
    r = cli("convert", name, "-o", "out.safetensors")
    assert r.rc == 0, r.err
    _same_tensors(ckpts / "out.safetensors", prefix)


def test_convert_sharded_bin(cli, ckpts):
    (ckpts / "conv").mkdir()
    r = cli("convert", "sharded/pytorch_model.bin.index.json", "-o", "conv/model.safetensors")
    assert r.rc == 0, r.err
    got: dict = {}
    for p in sorted((ckpts / "conv").glob("*.safetensors")):
        got.update(read_safetensors(p))
    assert got == EXPECTED


def test_convert_safetensors_to_sharded_safetensors(cli, ckpts):
    r = cli("convert", "model.safetensors", "-o", "resharded.safetensors", "--max-shard-size", "30B")
    assert r.rc == 0, r.err
    index = json.loads((ckpts / "resharded.safetensors.index.json").read_text())
    got: dict = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(read_safetensors(ckpts / shard))
    assert got == EXPECTED and len(set(index["weight_map"].values())) > 1


def test_gpus_pick_gpu_and_doctor_with_a_fake_nvidia_smi(cli, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(FIXTURES / "nvidia-smi" / "fake-nvidia-smi.sh", bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = clean_env(
        tmp_path,
        PATH=f"{bin_dir}:/usr/bin:/bin",
        FAKE_SMI_DIR=str(FIXTURES / "nvidia-smi" / "scenarios"),
        FAKE_SMI_SCENARIO="h200_busy",
    )
    r = cli("gpus", "--json", env=env)
    assert r.rc == 0, r.err
    assert r.json()["physical_gpu_count"] == 8
    r = cli("pick-gpu", "--json", env=env)
    assert r.rc == 0, r.err
    assert r.json()["chosen"][0]["smi_index"] == 7  # the one with the most free memory
    r = cli("doctor", env=env)
    assert r.rc == 0, r.err
    assert "torch:   not installed" in r.out
    assert INSTALL in r.out
    assert cli("doctor", "--json", env=env).json()["torch"]["installed"] is False


@pytest.mark.parametrize(
    "args,feature",
    [
        (["train", "--epochs", "1"], "ckptfix train"),
        (["demo"], "ckptfix demo"),
        (["convert", "model.safetensors", "-o", "back.pth"], "converting safetensors back to .pth"),
    ],
)
def test_commands_that_need_torch_say_so_in_one_line(cli, ckpts, args, feature):
    r = cli(*args)
    assert r.rc == 14, (r.out, r.err)
    assert r.err.count("\n") == 1 and r.err.startswith(f"Error: {feature} needs torch") and INSTALL in r.err
    assert "Traceback" not in r.err


def test_align_to_a_factory_that_needs_torch(cli, ckpts):
    (ckpts / "mymodel.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(4, 3)\n")
    env = clean_env(ckpts.parent, PYTHONPATH=f"{REPO}{os.pathsep}{ckpts}")
    r = cli("align", "ddp.pth", "--to", "mymodel:build", env=env)
    assert r.rc == 14 and "align --to module:factory needs torch" in r.err and INSTALL in r.err


def test_load_anywhere_raises_torch_missing_error(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from ckptfix import load_anywhere\n"
        "from ckptfix.errors import TorchMissingError\n"
        "try:\n"
        f"    load_anywhere({str(CKPT / 'ddp.pth')!r})\n"
        "except TorchMissingError as e:\n"
        "    print(e.exit_code, e)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=clean_env(tmp_path)
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("14 load_anywhere") and INSTALL in p.stdout


def test_trust_needs_torch_too(cli, ckpts):
    r = cli("convert", "ddp.pth", "--trust", "-o", "t.safetensors")
    assert r.rc in (0, 14), r.err  # conversion reads bytes; --trust only matters when torch loading is needed
    if r.rc == 14:
        assert INSTALL in r.err
