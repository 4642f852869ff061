"""Fixtures for the torch-free tests (helpers in notorch_helpers.py; see its docstring)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from notorch_helpers import CKPT, RUNNER, Run, clean_env


@pytest.fixture
def cli(tmp_path: Path):
    """``cli(*args, env=None)`` -> :class:`Run`, with the working directory in ``tmp_path/work``."""
    work = tmp_path / "work"
    work.mkdir()

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Run:
        p = subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=work, env=env or clean_env(tmp_path),
                           capture_output=True, text=True, timeout=timeout)
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
