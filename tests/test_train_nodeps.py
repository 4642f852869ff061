"""The trainer with only the declared dependencies (torch, click, safetensors): no numpy.

In the development venv numpy is installed, so these tests put a ``numpy`` package that refuses
to import first on ``PYTHONPATH`` (torchrun workers inherit it); ``.ci/run`` also runs this file
in a venv made with ``pip install torch==2.13.0 . pytest``, where numpy is really absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--train-samples", "128", "--test-samples", "32"]


@pytest.fixture()
def no_numpy_env(tmp_path):
    block = tmp_path / "block"
    (block / "numpy").mkdir(parents=True)
    (block / "numpy" / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named numpy (blocked for this test)", name="numpy")\n'
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(block), ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    return env


def _ckptfix(env, *args, check=True):
    from helpers import run_cli

    p = run_cli(*args, env=env, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_numpy_really_blocked(no_numpy_env):
    p = subprocess.run(
        [sys.executable, "-c", "import torch; torch.zeros(2).numpy()"], env=no_numpy_env, capture_output=True, text=True
    )
    assert p.returncode != 0 and "Numpy is not available" in p.stderr


@pytest.mark.parametrize("mode", ["single", "dp", "manual"])
def test_train_and_resume_without_numpy(tmp_path, no_numpy_env, mode):
    out = str(tmp_path / "runs")
    _ckptfix(no_numpy_env, "train", "--mode", mode, "--out", out, "--epochs", "1", *TINY, "-q")
    man = json.load(open(os.path.join(out, "checkpoints.json")))
    e = man["checkpoints"][0]
    assert len(e["probe"]["output_sha256"]) == 64
    _ckptfix(
        no_numpy_env,
        "train",
        "--mode",
        "single",
        "--out",
        out,
        "--epochs",
        "2",
        *TINY,
        "-q",
        "--resume",
        os.path.join(out, e["path"]),
    )
    st = str(tmp_path / "m.safetensors")
    _ckptfix(no_numpy_env, "convert", os.path.join(out, e["path"]), "-o", st)
    assert os.path.getsize(st) > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode,fmt", [("ddp", "pt"), ("ddp", "dcp"), ("fsdp", "dcp"), ("fsdp", "pt")])
def test_distributed_without_numpy(tmp_path, no_numpy_env, mode, fmt):
    out = str(tmp_path / "runs")
    _ckptfix(
        no_numpy_env,
        "train",
        "--mode",
        mode,
        "--nproc",
        "2",
        "--out",
        out,
        "--epochs",
        "1",
        *TINY,
        "-q",
        "--save-format",
        fmt,
    )
    (e,) = json.load(open(os.path.join(out, "checkpoints.json")))["checkpoints"]
    assert e["path"].endswith("." + fmt) and os.path.exists(os.path.join(out, e["path"]))
    if mode == "fsdp" and fmt == "dcp":  # the sharded checkpoint resumes in single mode without numpy too
        _ckptfix(
            no_numpy_env,
            "train",
            "--mode",
            "single",
            "--out",
            out,
            "--epochs",
            "2",
            *TINY,
            "-q",
            "--resume",
            os.path.join(out, e["path"]),
        )


def test_dcp_save_and_resume_without_numpy(tmp_path, no_numpy_env):
    out = str(tmp_path / "runs")
    _ckptfix(no_numpy_env, "train", "--out", out, "--epochs", "1", *TINY, "-q", "--save-format", "dcp")
    _ckptfix(
        no_numpy_env,
        "train",
        "--out",
        out,
        "--epochs",
        "2",
        *TINY,
        "-q",
        "--resume",
        os.path.join(out, "single-dcp_epoch1.dcp"),
    )
    man = json.load(open(os.path.join(out, "checkpoints.json")))
    assert man["checkpoints"][-1]["resume"]["restored"] == ["model", "optimizer"]


def test_probe_hash_matches_hashlib_of_numpy_bytes():
    """The numpy-free hash is the same as the old ``.numpy().tobytes()`` one (numpy as the oracle)."""
    np = pytest.importorskip("numpy")
    import hashlib

    import torch

    from ckptfix.train.probe import tensor_sha256

    t = torch.randn(8, 10)
    assert tensor_sha256(t) == hashlib.sha256(np.ascontiguousarray(t.numpy()).tobytes()).hexdigest()
    assert tensor_sha256(t.t()) == hashlib.sha256(np.ascontiguousarray(t.t().numpy()).tobytes()).hexdigest()
