"""Torch-free test helpers: run the CLI in a subprocess in which ``import torch`` fails.

This folder must pass in a venv without torch (``.ci/run`` runs it there with
``--confcutdir tests/test_notorch``, so ``tests/conftest.py``, which imports torch,
is not loaded).  With torch installed the subprocesses block it
(``sys.modules["torch"] = None``), so the same tests mean the same thing in both venvs.
Nothing here imports torch, numpy or safetensors.torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CUDA_", "CKPTFIX_", "FAKE_SMI", "NO_COLOR", "FORCE_COLOR"))}
    env["PYTHONPATH"] = str(REPO)
    env["CKPTFIX_LEASE_DIR"] = str(tmp_path / "leases")
    env.update(extra)
    return env


def read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, raw bytes) of a .safetensors file, parsed by hand (no torch, no numpy)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], body[a:b])
    return out
