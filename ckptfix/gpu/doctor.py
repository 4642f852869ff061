"""``ckptfix doctor``: one report to paste into a bug thread.

The only module in :mod:`ckptfix.gpu` that may import torch, and only inside
:func:`torch_info`, guarded: a missing or broken torch is reported, not raised.
CUDA is never initialised (``torch.cuda.is_available()`` is not called).
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from ckptfix.errors import CkptfixError
from ckptfix.gpu.smi import Runner
from ckptfix.gpu.visible import GpuView, Problem, cuda_initialized

DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")

# minimum Linux driver for each CUDA major (CUDA release notes, "minor version compatibility")
_MIN_DRIVER = {11: (450, 80), 12: (525, 60), 13: (580, 0)}


@dataclass
class DoctorReport:
    python: dict[str, Any]
    torch: dict[str, Any]
    driver_version: str | None
    gpus: GpuView | None
    gpu_error: str | None
    environment: dict[str, str | None]
    distributed: dict[str, str]
    problems: list[Problem] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "ckptfix.doctor/1",
            "python": self.python,
            "torch": self.torch,
            "driver_version": self.driver_version,
            "gpu_error": self.gpu_error,
            "gpus": None if self.gpus is None else self.gpus.to_dict(),
            "environment": self.environment,
            "distributed": self.distributed,
            "problems": [p.to_dict() for p in self.problems],
        }


def torch_info() -> dict[str, Any]:
    """torch version and build, imported lazily; never initialises CUDA."""
    try:
        import torch  # noqa: PLC0415 - the one lazy torch import in ckptfix.gpu
    except ImportError as e:
        from ckptfix._torch import is_torch_missing

        return {"installed": False, "error": "not installed" if is_torch_missing(e) else str(e)}
    except Exception as e:  # a broken install (missing .so, ABI mismatch...)
        return {"installed": False, "error": f"{type(e).__name__}: {e}"}
    cuda = getattr(torch.version, "cuda", None)
    return {
        "installed": True,
        "version": getattr(torch, "__version__", "?"),
        "cuda": cuda,
        "build": "cuda" if cuda else ("rocm" if getattr(torch.version, "hip", None) else "cpu"),
        "cudnn": _safe(lambda: torch.backends.cudnn.version()) if cuda else None,
        "cuda_initialized": _safe(lambda: bool(torch.cuda.is_initialized())),
    }


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _driver_tuple(v: str | None) -> tuple[int, int] | None:
    if not v:
        return None
    parts = v.split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def diagnose(
    torch: Mapping[str, Any], view: GpuView | None, gpu_error: str | None, env: Mapping[str, str]
) -> list[Problem]:
    """Problems with fixes, from facts gathered elsewhere (pure)."""
    problems: list[Problem] = []
    has_gpu = view is not None and len(view.physical) > 0
    if not torch.get("installed"):
        err = torch.get("error")
        what = "torch is not installed" if err == "not installed" else f"torch cannot be imported ({err})"
        problems.append(Problem("torch_missing", what, 'pip install "ckptfix[torch]" (needed by load_anywhere, train, demo)'))
    elif has_gpu and not torch.get("cuda"):
        problems.append(
            Problem(
                "cpu_only_torch",
                f"this machine has NVIDIA GPUs but torch {torch.get('version')} is a CPU-only build "
                "(torch.version.cuda is None)",
                "install a CUDA build, e.g. pip install torch --index-url https://download.pytorch.org/whl/cu126",
            )
        )
    if view is not None and torch.get("cuda") and view.driver_version:
        major = _driver_tuple(torch["cuda"])
        drv = _driver_tuple(view.driver_version)
        need = _MIN_DRIVER.get(major[0]) if major else None
        if need and drv and drv < need:
            problems.append(
                Problem(
                    "driver_too_old",
                    f"torch is built for CUDA {torch['cuda']} which needs driver >= {need[0]}.{need[1]:02d}, "
                    f"this machine has {view.driver_version}",
                    "upgrade the NVIDIA driver, or install a torch built for an older CUDA",
                )
            )
    if gpu_error:
        problems.append(Problem("no_gpu", gpu_error, "" if "run on CPU" in gpu_error else "run on CPU"))
    if view is not None:
        problems.extend(view.problems)
    local_rank = env.get("LOCAL_RANK")
    if view is not None and local_rank is not None and local_rank.isdigit() and view.devices:
        if int(local_rank) >= len(view.devices):
            problems.append(
                Problem(
                    "local_rank_out_of_range",
                    f"LOCAL_RANK={local_rank} but only {len(view.devices)} GPU(s) are visible: cuda:{local_rank} "
                    "does not exist",
                    "launch at most one process per visible GPU (torchrun --nproc-per-node), or widen "
                    "CUDA_VISIBLE_DEVICES",
                )
            )
    if env.get("WORLD_SIZE") and not env.get("MASTER_ADDR") and env.get("WORLD_SIZE") != "1":
        problems.append(
            Problem(
                "master_addr_missing",
                f"WORLD_SIZE={env['WORLD_SIZE']} but MASTER_ADDR is not set",
                "launch with torchrun, or export MASTER_ADDR and MASTER_PORT",
            )
        )
    return problems


def doctor_report(
    *, env: Mapping[str, str] | None = None, runner: Runner | None = None, timeout: float = 10.0
) -> DoctorReport:
    """Gather everything (runs nvidia-smi, imports torch) and diagnose.  Never raises for GPU trouble."""
    from ckptfix.gpu.smi import query
    from ckptfix.gpu.visible import build_view

    env = os.environ if env is None else env
    python = {
        "version": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
    }
    try:
        from ckptfix import __version__

        python["ckptfix"] = __version__
    except Exception:  # pragma: no cover
        pass
    in_process_cuda = cuda_initialized()
    tinfo = torch_info()
    view: GpuView | None = None
    gpu_error: str | None = None
    try:
        wants_mig = (env.get("CUDA_VISIBLE_DEVICES") or "").startswith("MIG-") or None
        snap = query(runner=runner, timeout=timeout, mig=wants_mig, env=dict(env))
        view = build_view(snap, env, cuda_is_initialized=in_process_cuda)
    except CkptfixError as e:
        gpu_error = f"{e} (exit code {e.exit_code})"
    environment = {k: env.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_HOME", "LD_LIBRARY_PATH")}
    dist = {k: env[k] for k in DIST_VARS if k in env}
    dist.update({k: v for k, v in sorted(env.items()) if k.startswith("NCCL_") or k.startswith("TORCH_NCCL")})
    problems = diagnose(tinfo, view, gpu_error, env)
    return DoctorReport(
        python=python,
        torch=tinfo,
        driver_version=view.driver_version if view else None,
        gpus=view,
        gpu_error=gpu_error,
        environment=environment,
        distributed=dist,
        problems=problems,
    )
