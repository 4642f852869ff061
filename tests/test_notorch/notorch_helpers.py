"""Torch-free test helpers: run the CLI in a subprocess in which ``import torch`` fails.

This folder must pass in a venv without torch (``.ci/run`` runs it there with
``--confcutdir tests/test_notorch``, so ``tests/conftest.py``, which imports torch,
is not loaded).  With torch installed the subprocesses block it
(``sys.modules["torch"] = None``), so the same tests mean the same thing in both venvs.
Nothing here imports torch, numpy or safetensors.torch.  The fixtures are defined here and
registered for the folder by its conftest.py; the test modules import the other helpers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
CKPT = FIXTURES / "ckpt"

# Block torch (`import torch` raises ModuleNotFoundError), then run the CLI.
RUNNER = (
    "import sys, os\n"
    "sys.modules['torch'] = None\n"
    "from ckptfix.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "sys.stdout.flush()\n"
    "sys.exit(rc)\n"
)


@dataclass
class Run:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment for a CLI subprocess: this tree first on PYTHONPATH, no CUDA/ckptfix variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CUDA_", "CKPTFIX_", "FAKE_SMI", "NO_COLOR", "FORCE_COLOR"))
    }
    env["PYTHONPATH"] = str(REPO)
    env["CKPTFIX_LEASE_DIR"] = str(tmp_path / "leases")
    env.update(extra)
    return env


@pytest.fixture
def cli(tmp_path: Path):
    """``cli(*args, env=None)`` -> :class:`Run`, with the working directory in ``tmp_path/work``."""
    work = tmp_path / "work"
    work.mkdir()

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Run:
        p = subprocess.run(
            [sys.executable, "-c", RUNNER, *args],
            cwd=work,
            env=env or clean_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return Run(p.returncode, p.stdout, p.stderr)

    run.work = work  # type: ignore[attr-defined]
    return run


@pytest.fixture
def ckpts(cli) -> Path:
    """A writable copy of tests/fixtures/ckpt in the CLI's working directory."""
    dst = cli.work
    for p in CKPT.iterdir():
        if p.name.endswith(".py"):
            continue
        if p.is_dir():
            shutil.copytree(p, dst / p.name)
        else:
            shutil.copy(p, dst / p.name)
    return dst


def read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, raw bytes) of a .safetensors file, parsed by hand (no torch, no numpy)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], body[a:b])
    return out
