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


def _block_numpy(folder) -> dict:
    """An environment whose ``numpy`` (first on ``PYTHONPATH``, inherited by torchrun's workers) refuses to import."""
    block = folder / "block"
    (block / "numpy").mkdir(parents=True)
    (block / "numpy" / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named numpy (blocked for this test)", name="numpy")\n'
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(block), ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    return env


@pytest.fixture()
def no_numpy_env(tmp_path):
    return _block_numpy(tmp_path)


def _ckptfix(env, *args, check=True):
    from helpers import run_cli

    p = run_cli(*args, env=env, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr
    return p


# Every single-process command of this file, run once per test session in ONE interpreter with numpy blocked
# (main() called as the console script calls it): a fresh interpreter per command cost 2-3 torch imports per
# test.  Each step's exit code is recorded; the tests below check their own steps and what they wrote.
_IN_PROCESS = r"""
import json, os, sys
root, tiny = sys.argv[1], sys.argv[2:]
report = {}
import torch
try:
    torch.zeros(2).numpy()
    report["numpy"] = "torch found numpy"
except RuntimeError as e:
    report["numpy"] = str(e)
from ckptfix.cli import main

def run(key, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    report.setdefault(key, []).append([list(argv), rc])
    return rc

for mode in ("single", "dp", "manual"):
    out = os.path.join(root, mode, "runs")
    if run(mode, "train", "--mode", mode, "--out", out, "--epochs", "1", *tiny, "-q") == 0:
        e = json.load(open(os.path.join(out, "checkpoints.json")))["checkpoints"][0]
        first = os.path.join(out, e["path"])
        run(mode, "train", "--mode", "single", "--out", out, "--epochs", "2", *tiny, "-q", "--resume", first)
        run(mode, "convert", first, "-o", os.path.join(root, mode, "m.safetensors"))
out = os.path.join(root, "dcp", "runs")
if run("dcp", "train", "--out", out, "--epochs", "1", *tiny, "-q", "--save-format", "dcp") == 0:
    first = os.path.join(out, "single-dcp_epoch1.dcp")
    run("dcp", "train", "--out", out, "--epochs", "2", *tiny, "-q", "--resume", first)
json.dump(report, open(os.path.join(root, "report.json"), "w"))
"""


@pytest.fixture(scope="module")
def in_process_runs(tmp_path_factory):
    """(folder, the steps' report, the interpreter's stderr) of :data:`_IN_PROCESS`, numpy blocked."""
    from helpers import run_python

    root = tmp_path_factory.mktemp("no_numpy")
    env = _block_numpy(root)
    code = f"import sys; sys.argv[1:] = {[str(root / 'runs'), *TINY]!r}\n" + _IN_PROCESS
    p = run_python(code, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return root / "runs", json.loads((root / "runs" / "report.json").read_text()), p.stderr


def _steps_ok(report, key, n, stderr):
    steps = report.get(key, [])
    assert len(steps) == n and all(rc == 0 for _, rc in steps), (steps, stderr[-4000:])


def test_numpy_really_blocked(no_numpy_env, in_process_runs):
    p = subprocess.run(
        [sys.executable, "-c", "import numpy"], env=no_numpy_env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode != 0 and "blocked for this test" in p.stderr
    _, report, _ = in_process_runs
    assert "Numpy is not available" in report["numpy"]  # torch itself ran without numpy in the shared interpreter


@pytest.mark.parametrize("mode", ["single", "dp", "manual"])
def test_train_and_resume_without_numpy(in_process_runs, mode):
    runs, report, stderr = in_process_runs
    _steps_ok(report, mode, 3, stderr)  # train, resume in single mode, convert
    man = json.load(open(runs / mode / "runs" / "checkpoints.json"))
    e = man["checkpoints"][0]
    assert len(e["probe"]["output_sha256"]) == 64
    assert man["checkpoints"][-1]["epoch"] == 2 and man["checkpoints"][-1]["resume"]["restored"]
    assert os.path.getsize(runs / mode / "m.safetensors") > 0


# Two launches cover every distributed path the trainer has: ddp + a .pt written by rank 0 (atomic_torch_save
# under torchrun), and fsdp + DCP (the full-state gather every fsdp save does, the sharded gather, save_dcp by
# every rank) resumed in single mode.  ddp + dcp (the same save_dcp) and fsdp + pt (the same gather and
# atomic_torch_save) add no code path, only a torchrun launch each.
@pytest.mark.slow
@pytest.mark.parametrize("mode,fmt", [("ddp", "pt"), ("fsdp", "dcp")])
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


def test_dcp_save_and_resume_without_numpy(in_process_runs):
    runs, report, stderr = in_process_runs
    _steps_ok(report, "dcp", 2, stderr)
    man = json.load(open(runs / "dcp" / "runs" / "checkpoints.json"))
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
