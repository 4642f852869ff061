"""On a real NVIDIA GPU (skipped elsewhere): ckptfix's cuda:N is torch's cuda:N, and pick_gpu() refuses
after torch.cuda.is_available() for real.  Each check runs in a fresh process (CUDA state is per process)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import run_python

ROOT = Path(__file__).resolve().parent.parent
HAS_SMI = shutil.which("nvidia-smi") is not None
real_gpu = pytest.mark.skipif(not HAS_SMI, reason="needs a real NVIDIA GPU and nvidia-smi")


def _py(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
    e.update(env)
    return run_python(code, env=e, timeout=300)


CUDA_TORCH = "import torch, sys\nif torch.version.cuda is None: print('skip: CPU-only torch'); sys.exit(0)\n"


@real_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("env", [{}, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, {"CUDA_VISIBLE_DEVICES": "0"}])
def test_cuda_index_is_torchs_device(env):
    code = (
        "from ckptfix.gpu import visible_gpus\nv = visible_gpus()\n"
        + CUDA_TORCH
        + "assert torch.cuda.device_count() == len(v.devices), (torch.cuda.device_count(), len(v.devices))\n"
        "for d in v.devices:\n"
        "    u = str(torch.cuda.get_device_properties(d.cuda_index).uuid).lower()\n"
        "    mine = (d.mig_device.uuid if d.mig_device else d.uuid).lower()\n"
        "    assert u in mine, (d.cuda_index, u, mine, v.order_certain)\n"
        "print('ok', len(v.devices))\n"
    )
    p = _py(code, **env)
    assert p.returncode == 0 and (p.stdout.startswith("ok") or p.stdout.startswith("skip")), p.stderr


@real_gpu
@pytest.mark.gpu
def test_is_available_then_pick_gpu_is_refused_for_real(tmp_path):
    code = (
        CUDA_TORCH + "torch.cuda.is_available()\nassert not torch.cuda.is_initialized()\n"
        "from ckptfix.gpu import pick_gpu\nfrom ckptfix.errors import CudaAlreadyInitializedError\n"
        "try:\n    pick_gpu(lease=False)\nexcept CudaAlreadyInitializedError as e:\n    print('refused:', e)\n"
    )
    p = _py(code, CKPTFIX_LEASE_DIR=str(tmp_path / "l"))
    assert p.stdout.startswith(("refused:", "skip")), (p.stdout, p.stderr)


@real_gpu
@pytest.mark.gpu
def test_pick_gpu_first_then_torch_sees_only_the_pick(tmp_path):
    code = (
        "from ckptfix.gpu import pick_gpu\nres = pick_gpu(lease=False)\n"
        + CUDA_TORCH
        + "assert torch.cuda.device_count() == 1\n"
        "u = str(torch.cuda.get_device_properties(0).uuid).lower()\n"
        "assert u in res.chosen[0].gpu.id.lower(), (u, res.chosen[0].gpu.id)\nprint('ok')\n"
    )
    p = _py(code, CKPTFIX_LEASE_DIR=str(tmp_path / "l"))
    assert p.returncode == 0 and p.stdout.strip() in ("ok", "skip: CPU-only torch"), p.stderr
