"""Every script in examples/ runs and does its job (each is one real task)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples")


def _env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def dp_ckpt(tmp_path_factory) -> str:
    from ckptfix.train import TrainConfig, train

    out = tmp_path_factory.mktemp("ex")
    res = train(TrainConfig(mode="dp", out=str(out), epochs=1, train_samples=256, test_samples=64, quiet=True))
    return res.final_checkpoint


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_env(), timeout=300, **kw)
    assert p.returncode == 0, p.stderr[-2000:]
    return p


def test_examples_index_lists_every_script():
    scripts = sorted(f for f in os.listdir(EX) if f.endswith(".py"))
    index = open(os.path.join(EX, "README.md")).read()
    assert scripts and all(f"`{s.split()[0]}" in index for s in scripts)


def test_load_any_checkpoint(dp_ckpt):
    p = _run([os.path.join(EX, "load_any_checkpoint.py"), dp_ckpt])
    assert "strip 'module.'" in p.stdout and "exact" in p.stdout


def test_release_as_safetensors(dp_ckpt, tmp_path):
    out = tmp_path / "rel.safetensors"
    p = _run([os.path.join(EX, "release_as_safetensors.py"), dp_ckpt, str(out)])
    assert out.exists() and "strict=True" in p.stdout


def test_pick_gpu_then_train_falls_back_or_picks(tmp_path):
    p = _run([os.path.join(EX, "pick_gpu_then_train.py")])
    assert "matmul ok" in p.stdout


@pytest.mark.slow
def test_resume_ddp_from_dp_under_torchrun(dp_ckpt, tmp_path):
    out = tmp_path / "resumed.pt"
    p = _run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            os.path.join(EX, "resume_ddp_from_dp.py"),
            dp_ckpt,
            str(out),
        ]
    )
    assert out.exists() and "strip 'module.'" in p.stdout
    import torch

    ck = torch.load(out, weights_only=True)
    assert ck["epoch"] == 2 and not any(k.startswith("module.") for k in ck["model_state_dict"])


def test_load_any_checkpoint_under_torchrun_auto(dp_ckpt):
    p = _run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            os.path.join(EX, "load_any_checkpoint.py"),
            dp_ckpt,
        ]
    )
    assert p.stdout.count("loaded 8 tensors") == 2
