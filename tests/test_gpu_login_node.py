"""A login node without a driver: ``gpus`` still says what CUDA_VISIBLE_DEVICES asks for, and ``--json``
prints a document with no GPUs plus the error, exiting 20 (issue 23, item 9)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from helpers import ROOT, fake_smi_env, run_cli

CVD = "GPU-28780eb0,1gpu,0"


@pytest.fixture
def login_env(tmp_path: Path) -> dict[str, str]:
    env = fake_smi_env(tmp_path)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    env["PATH"] = f"{empty}:/usr/bin:/bin"
    return env


def test_gpus_json_without_nvidia_smi(login_env):
    r = run_cli("gpus", "--json", env=login_env, CUDA_VISIBLE_DEVICES=CVD)
    assert r.rc == 20, r
    doc = json.loads(r.out)
    Draft202012Validator(json.loads((ROOT / "docs" / "schemas" / "gpus.schema.json").read_text())).validate(doc)
    assert doc["devices"] == [] and doc["physical"] == [] and doc["physical_gpu_count"] == 0
    assert doc["error"]["exit_code"] == 20 and "nvidia-smi not found" in doc["error"]["message"]
    assert doc["environment"]["CUDA_VISIBLE_DEVICES"] == CVD
    (p,) = doc["problems"]
    assert p["code"] == "cvd_truncated" and "'1gpu'" in p["message"] and p["fix"]
    assert "at most GPU-28780eb0" in doc["cvd_summary"] and "ignores '1gpu'" in doc["cvd_summary"]
    assert r.err.startswith("Error: nvidia-smi not found") and r.err.count("\n") == 1, r


def test_gpus_text_without_nvidia_smi(login_env):
    r = run_cli("gpus", env=login_env, CUDA_VISIBLE_DEVICES=CVD)
    assert r.rc == 20, r
    assert r.out.startswith(f"CUDA_VISIBLE_DEVICES={CVD!r}: CUDA will use at most GPU-28780eb0"), r
    assert "warning: CUDA_VISIBLE_DEVICES=" in r.err and r.err.rstrip().splitlines()[-1].startswith("Error: ")


def test_unset_cvd_without_nvidia_smi(login_env):
    r = run_cli("gpus", env=login_env)
    assert r.rc == 20 and "CUDA will use every GPU" in r.out, r
