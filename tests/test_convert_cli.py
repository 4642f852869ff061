"""``ckptfix convert`` on the command line: output, exit codes, --json, --quiet."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import ckptfix.cli.convert  # noqa: F401  (registers the command even before the CLI wires it)
from ckptfix.cli import main
from ckptfix.errors import OutputError, UnsupportedError

from helpers import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture()
def ckpt(tmp_path):
    torch.manual_seed(0)
    emb = torch.randn(8, 4)
    p = tmp_path / "model.pth"
    torch.save(
        {"state_dict": {"module.emb.weight": emb, "module.head.weight": emb, "module.b": torch.zeros(8)}, "epoch": 2}, p
    )
    return p


def test_default_output_on_stdout(ckpt, tmp_path, capsys):
    assert main(["convert", str(ckpt)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "model.safetensors")
    assert "verified" in err and "module.head.weight -> module.emb.weight" in err
    assert set(load_file(tmp_path / "model.safetensors")) == {"module.emb.weight", "module.b"}


def test_json_and_strip_prefix(ckpt, tmp_path, capsys):
    out_path = tmp_path / "sub.safetensors"
    assert main(["convert", str(ckpt), "-o", str(out_path), "--strip-prefix", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["outputs"] == [str(out_path)] and doc["verified"] is True
    assert doc["aliases"] == {"head.weight": "emb.weight"} and doc["key_path"] == ["state_dict"]
    assert err == ""
    assert set(load_file(out_path)) == {"emb.weight", "b"}


def test_quiet_prints_nothing(ckpt, tmp_path, capsys):
    assert main(["convert", str(ckpt), "-q"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and err == ""
    assert (tmp_path / "model.safetensors").exists()


def test_exit_codes(ckpt, tmp_path, capsys):
    assert main(["convert", str(ckpt), "-q"]) == 0
    assert main(["convert", str(ckpt)]) == OutputError.exit_code
    assert "--force" in capsys.readouterr().err
    assert main(["convert", str(ckpt), "--force", "-q"]) == 0
    bad = tmp_path / "bad.pth"
    torch.save({"x": torch.zeros(2, dtype=torch.complex128)}, bad)
    assert main(["convert", str(bad)]) == UnsupportedError.exit_code
    assert "'x'" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing.pth")]) == 3
    assert main(["convert", str(ckpt), "--max-shard-size", "lots", "-o", str(tmp_path / "s.safetensors")]) == 2


def test_sharded_cli_and_reverse(ckpt, tmp_path, capsys):
    dst = tmp_path / "sh.safetensors"
    assert main(["convert", str(ckpt), "-o", str(dst), "--max-shard-size", "100B"]) == 0
    lines = capsys.readouterr().out.split()
    assert lines[-1] == str(tmp_path / "sh.safetensors.index.json")
    assert os.path.basename(lines[0]) == "sh-00001-of-00002.safetensors"
    assert main(["convert", lines[-1], "-o", str(tmp_path / "back.pth"), "-q"]) == 0
    sd = torch.load(tmp_path / "back.pth", weights_only=True)
    assert sd["module.head.weight"].data_ptr() == sd["module.emb.weight"].data_ptr()


def test_python_dash_m_subprocess(ckpt, tmp_path):
    """The real entry point; no torch import needed for the fast path, no progress bar without a TTY."""
    r = subprocess.run(
        [sys.executable, "-m", "ckptfix", "convert", str(ckpt), "-o", str(tmp_path / "o.safetensors")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "o.safetensors")
    assert "converting" not in r.stderr


def test_convert_prints_the_default_output_relative(dp_work):
    r = run_cli("convert", "m.pt", cwd=dp_work)
    assert r.rc == 0, r.err
    assert r.out == "m.safetensors\n"
    assert str(dp_work) not in r.err and "converted m.pt" in r.err
