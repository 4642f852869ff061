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
from typing import Any, Mapping, Sequence

from ckptfix.errors import (
    CkptfixError,
    DriverMismatchError,
    DriverNotLoadedError,
    GpuQueryError,
    GpuToolingError,
)
from ckptfix.gpu.order import model_info
from ckptfix.gpu.records import Problem
from ckptfix.gpu.runner import Runner
from ckptfix.gpu.visible import GpuView, visible_gpus
from ckptfix.gpu.wheels import WHEEL_ARCHS, arch_text, runs_on, wheel_archs

DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")

# Minimum driver that *runs* a CUDA major release at all, through minor version compatibility (CUDA Toolkit
# release notes, Table 2 "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version
# Compatibility"): below it torch's CUDA build cannot start (driver_too_old).
_MIN_DRIVER: dict[int, tuple[int, ...]] = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}

# CUDA toolkit -> minimum (Linux, Windows) driver of its GA release, the driver that runs *everything* that
# toolkit builds.  Source: NVIDIA CUDA Toolkit Release Notes, Table 3 "CUDA Toolkit and Corresponding Driver
# Versions", https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html
CUDA_DRIVER_TABLE: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "13.0": ((580, 65, 6), (580, 88)),
    "12.9": ((575, 51, 3), (576, 2)),
    "12.8": ((570, 26), (570, 65)),
    "12.6": ((560, 28, 3), (560, 76)),
    "12.5": ((555, 42, 2), (555, 85)),
    "12.4": ((550, 54, 14), (551, 61)),
    "12.3": ((545, 23, 6), (545, 84)),
    "12.2": ((535, 54, 3), (536, 25)),
    "12.1": ((530, 30, 2), (531, 14)),
    "12.0": ((525, 60, 13), (527, 41)),
    "11.8": ((520, 61, 5), (520, 6)),
    "11.7": ((515, 43, 4), (516, 1)),
    "11.6": ((510, 39, 1), (511, 23)),
    "11.5": ((495, 29, 5), (496, 4)),
    "11.4": ((470, 42, 1), (471, 11)),
    "11.3": ((465, 19, 1), (465, 89)),
    "11.2": ((460, 27, 3), (460, 82)),
    "11.1": ((455, 23), (456, 38)),
    "11.0": ((450, 36, 6), (451, 22)),
    "10.2": ((440, 33), (441, 22)),
    "10.1": ((418, 39), (418, 96)),
}

# The CUDA builds published for each torch minor release (https://pytorch.org/get-started/previous-versions,
# checked for 2.4-2.9; 2.10 and 2.11 from pytorch/pytorch RELEASE.md's support matrix).  Which GPU architectures
# each build ships kernels for: ckptfix.gpu.wheels.WHEEL_ARCHS.  A newer release than the table knows is assumed
# to ship the newest row's builds: an assumption, so the recommendation says so.
TORCH_CUDA_BUILDS: dict[tuple[int, int], tuple[str, ...]] = {
    (2, 0): ("cu117", "cu118"),
    (2, 1): ("cu118", "cu121"),
    (2, 2): ("cu118", "cu121"),
    (2, 3): ("cu118", "cu121"),
    (2, 4): ("cu118", "cu121", "cu124"),
    (2, 5): ("cu118", "cu121", "cu124"),
    (2, 6): ("cu118", "cu124", "cu126"),
    (2, 7): ("cu118", "cu126", "cu128"),
    (2, 8): ("cu126", "cu128", "cu129"),
    (2, 9): ("cu126", "cu128", "cu130"),
    (2, 10): ("cu126", "cu128", "cu130"),
    (2, 11): ("cu126", "cu128", "cu130"),
}


#: the file every Jetson (L4T) carries, with its release; JetPack 5 and older have no nvidia-smi
TEGRA_RELEASE = "/etc/nv_tegra_release"
#: product names of Tegra GPUs (nvidia-smi of JetPack 6 says "Orin (nvgpu)"); a GB10 (DGX Spark) is not one
_TEGRA_NAMES = ("NVGPU", "JETSON", "ORIN", "XAVIER", "TEGRA", "THOR")
JETSON_TORCH_DOCS = "https://docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform/index.html"


def is_tegra(view: GpuView | None, *, release_file: str = TEGRA_RELEASE) -> bool:
    """Whether this is an NVIDIA Jetson (Tegra SoC, the ``nvgpu`` driver): a GPU named so, or L4T's release file.

    Args:
        view: the GPU view (``None`` when nvidia-smi could not be asked).
        release_file: L4T's release file (tests).

    Returns:
        True on a Jetson.
    """
    for g in view.physical if view is not None else ():
        up = (g.name or "").upper()
        if any(f in up for f in _TEGRA_NAMES):
            return True
    return os.path.exists(release_file)


def _jetson_text(view: GpuView | None) -> str:
    names = sorted({g.name for g in view.physical if g.name}) if view is not None else []
    what = f" ({', '.join(names)})" if names else ""
    return (
        f"this is an NVIDIA Jetson{what}, a Tegra SoC with the nvgpu driver: the CUDA wheels of "
        "download.pytorch.org are built for discrete GPUs and do not run on it (no driver upgrade changes that); "
        "install NVIDIA's PyTorch build for this JetPack release (its version: "
        f"`cat {TEGRA_RELEASE}`), as {JETSON_TORCH_DOCS} says, or use NVIDIA's PyTorch container for Jetson"
    )


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
    tegra: bool = False  # an NVIDIA Jetson (see :func:`is_tegra`)

    def to_dict(self) -> dict[str, Any]:
        """The ``ckptfix doctor --json`` document."""
        return {
            "schema": "ckptfix.doctor/1",
            "python": self.python,
            "torch": self.torch,
            "driver_version": self.driver_version,
            "gpu_error": self.gpu_error,
            "gpus": None if self.gpus is None else self.gpus.to_dict(),
            "environment": self.environment,
            "distributed": self.distributed,
            "tegra": self.tegra,
            "problems": [p.to_dict() for p in self.problems],
        }


def torch_info() -> dict[str, Any]:
    """torch version and build, imported lazily; never initialises CUDA.

    Returns:
        ``{"installed": False, "error": ...}``, or the version, ``cuda``, ``build`` (cuda/rocm/cpu), ``cudnn``
        and ``cuda_initialized``.
    """
    try:
        import torch  # the one lazy torch import in ckptfix.gpu
    except ImportError as e:
        from ckptfix._torch import is_torch_missing

        return {"installed": False, "error": "not installed" if is_torch_missing(e) else str(e)}
    except Exception as e:  # noqa: BLE001 - a broken install (missing .so, ABI mismatch...)
        return {"installed": False, "error": f"{type(e).__name__}: {e}"}
    cuda = getattr(torch.version, "cuda", None)
    return {
        "installed": True,
        "version": getattr(torch, "__version__", "?"),
        "cuda": cuda,
        "build": "cuda" if cuda else ("rocm" if getattr(torch.version, "hip", None) else "cpu"),
        "cudnn": _safe(lambda: torch.backends.cudnn.version()) if cuda else None,
        # the architectures this build has kernels for; read from the build, never by initialising CUDA
        "arch_list": _safe(lambda: str(torch._C._cuda_getArchFlags()).split()) if cuda else None,
        "cuda_initialized": _safe(lambda: bool(torch.cuda.is_initialized())),
    }


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a report never fails on one probe
        return None


def _version(v: str | None) -> tuple[int, ...] | None:
    if not v:
        return None
    try:
        return tuple(int(x) for x in v.strip().split("+")[0].split(".") if x != "")
    except ValueError:
        return None


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join([str(v[0])] + [f"{x:02d}" for x in v[1:]])


def recommend_cuda_build(
    torch_version: str | None,
    driver: str | None,
    *,
    windows: bool = False,
    gpus: Sequence[tuple[str, tuple[int, int]]] = (),
) -> dict[str, Any]:
    """The newest CUDA build of the installed torch release that this driver runs and that ships kernels for
    every GPU's architecture, or the upgrade it needs.

    Args:
        torch_version: e.g. ``"2.6.0+cpu"``.
        driver: nvidia-smi's ``driver_version``, e.g. ``"470.82.01"``.
        windows: compare with the Windows column of the driver table.
        gpus: ``(label, compute capability)`` of each GPU, e.g. ``("GPU 0 (Tesla V100)", (7, 0))``; a build
            without kernels for one of them is not recommended (:mod:`ckptfix.gpu.wheels`).

    Returns:
        ``{"torch": "2.6", "builds": [...], "assumed": bool, "build": "cu124" | None,
        "command": "pip install ...", "upgrade_to": "560.28.03" | None, "lacks_arch": {build: [label, ...]},
        "no_build_fits": bool}``.
    """
    gpus_all = list(gpus)
    # a GPU no CUDA build of any release in the table runs (Kepler, sm_37): left out of the choice below
    nowhere = [label for label, cc in gpus if not _runs_anywhere(cc)]
    runnable = [(label, cc) for label, cc in gpus if label not in nowhere]
    every_gpu_unsupported = bool(gpus) and not runnable
    gpus = runnable
    tv = _version(torch_version) or (0, 0)
    key = (tv[0], tv[1] if len(tv) > 1 else 0)
    assumed = key not in TORCH_CUDA_BUILDS
    if assumed:
        known = sorted(TORCH_CUDA_BUILDS)
        key_used = known[-1] if key > known[-1] else next((k for k in reversed(known) if k <= key), known[0])
    else:
        key_used = key
    builds = TORCH_CUDA_BUILDS[key_used]
    drv = _version(driver)
    col = 1 if windows else 0

    def need(b: str) -> tuple[int, ...]:
        cuda = f"{b[2:-1]}.{b[-1]}"
        return CUDA_DRIVER_TABLE[cuda][col]

    def compat(b: str) -> tuple[int, ...]:  # minor version compatibility (Table 2): runs, without PTX JIT
        major = int(b[2:-1])
        return _MIN_DRIVER.get(major, need(b)) if not windows else need(b)

    lacks: dict[str, list[str]] = {}
    for b in builds:
        archs = wheel_archs(key_used, b)
        missing = [label for label, cc in gpus if archs is not None and not runs_on(archs, cc)]
        if missing:
            lacks[b] = missing
    fitting = [b for b in builds if b not in lacks]
    no_build_fits = not fitting
    if fitting:
        builds = tuple(fitting)
    ok = [b for b in builds if drv is not None and drv >= need(b)]
    ok_compat = [b for b in builds if drv is not None and drv >= compat(b)]
    pin = f"torch=={tv[0]}.{tv[1]}.{tv[2]}" if len(tv) >= 3 else "torch"
    out: dict[str, Any] = {
        "torch": f"{key[0]}.{key[1]}",
        "builds": list(TORCH_CUDA_BUILDS[key_used]),
        "assumed": assumed,
        "build": None,
        "command": None,
        "minor_version_compatibility": False,
        "upgrade_to": None,
        "upgrade_to_at_least": None,
        "lacks_arch": lacks,
        "no_build_fits": no_build_fits,
        "no_torch_runs": nowhere,
        "every_gpu_unsupported": every_gpu_unsupported,
        "kepler": any(cc[0] == 3 for label, cc in gpus_all if label in nowhere),
    }
    best = ok[-1] if ok else (ok_compat[0] if ok_compat else None)
    if best is not None:
        out["build"] = best
        out["command"] = f"pip install {pin} --index-url https://download.pytorch.org/whl/{best}"
        out["minor_version_compatibility"] = not ok
        if not ok:
            out["upgrade_to"] = _fmt(need(best))
    else:
        out["upgrade_to"] = _fmt(need(builds[0]))
        out["upgrade_to_at_least"] = _fmt(compat(builds[0]))
    return out


def _runs_anywhere(cc: tuple[int, int]) -> bool:
    """Whether some CUDA build of some torch release in :data:`ckptfix.gpu.wheels.WHEEL_ARCHS` runs ``cc``."""
    return any(runs_on(archs, cc) for builds in WHEEL_ARCHS.values() for archs in builds.values())


def _oldest_arch() -> str:
    return arch_text([min(a for builds in WHEEL_ARCHS.values() for sass, _ in builds.values() for a in sass)])


def _no_build_text(rec: dict[str, Any], driver: str | None) -> str:
    """Every GPU here is older than every CUDA build of torch ckptfix knows (a K80 box): no driver upgrade helps."""
    first = min(WHEEL_ARCHS)
    kepler = (
        f"; R470 is the last NVIDIA driver branch for Kepler GPUs (driver {driver or '?'} here), so no driver "
        "upgrade helps either"
        if rec.get("kepler")
        else ""
    )
    return (
        f"no supported torch build runs these GPUs ({', '.join(rec['no_torch_runs'])}): every CUDA build of torch "
        f"{first[0]}.{first[1]} and later ships kernels for {_oldest_arch()} and newer only{kepler}. Run torch on the "
        "CPU (pip install torch --index-url https://download.pytorch.org/whl/cpu), or use an old torch release "
        "whose CUDA 11 build was compiled for these GPUs (check that torch.cuda.get_arch_list() lists "
        f"{rec['no_torch_runs'][0].rsplit(', ', 1)[-1].rstrip(')')}), or build torch from source for them"
    )


def _recommendation_text(rec: dict[str, Any], driver: str | None) -> str:
    if rec.get("every_gpu_unsupported"):
        return _no_build_text(rec, driver)
    return _build_text(rec, driver) + _left_out_text(rec)


def _left_out_text(rec: dict[str, Any]) -> str:
    """Some GPUs here run no torch build at all (a K80 next to a V100): the advice is for the others."""
    if not rec.get("no_torch_runs"):
        return ""
    kepler = (
        " (and while a Kepler GPU is installed the driver stays on R470, its last branch)" if rec.get("kepler") else ""
    )
    return (
        f"; that is for the other GPUs: {', '.join(rec['no_torch_runs'])} runs no torch build at all (every CUDA "
        f"build ships kernels for {_oldest_arch()} and newer only): leave it out with CUDA_VISIBLE_DEVICES{kepler}"
    )


def _build_text(rec: dict[str, Any], driver: str | None) -> str:
    note = (
        f" (torch {rec['torch']} is newer than ckptfix's table: assumed to ship {', '.join(rec['builds'])})"
        if rec["assumed"]
        else ""
    )
    lacks = rec.get("lacks_arch") or {}
    if rec.get("build") in rec["builds"] and not rec.get("no_build_fits"):  # only newer builds skipped surprise
        lacks = {b: who for b, who in lacks.items() if rec["builds"].index(b) > rec["builds"].index(rec["build"])}
    if lacks and rec.get("no_build_fits"):
        note += (
            f"; no CUDA build of torch {rec['torch']} ships kernels for every GPU here ("
            + "; ".join(f"{b}: not {', '.join(who)}" for b, who in lacks.items())
            + "): use an older torch release for those GPUs, or CUDA_VISIBLE_DEVICES to leave them out"
        )
    elif lacks:
        note += "; not " + "; not ".join(f"{b}: it ships no kernels for {', '.join(who)}" for b, who in lacks.items())
    if rec["command"] and rec["minor_version_compatibility"]:
        return (
            f"{rec['command']} (driver {driver} is below that CUDA's own {rec['upgrade_to']} but runs it through "
            f"CUDA minor version compatibility, without PTX JIT; upgrading the driver to >= {rec['upgrade_to']} "
            f"is better){note}"
        )
    if rec["command"]:
        fits = " with kernels for every GPU here" if rec.get("lacks_arch") and not rec.get("no_build_fits") else ""
        return f"{rec['command']} (the newest CUDA build of torch {rec['torch']} that driver {driver} runs{fits}){note}"
    return (
        f"upgrade the NVIDIA driver first, to >= {rec['upgrade_to']} (at the very least {rec['upgrade_to_at_least']}): "
        f"driver {driver} runs none of torch {rec['torch']}'s CUDA builds ({', '.join(rec['builds'])}); then "
        f"install one, e.g. pip install torch --index-url https://download.pytorch.org/whl/{rec['builds'][0]}{note}"
    )


def _torch_problems(
    torch: Mapping[str, Any], view: GpuView | None, *, windows: bool, tegra: bool = False
) -> list[Problem]:
    """torch missing, a CPU-only build on a GPU machine, a CUDA build the driver cannot run."""
    problems: list[Problem] = []
    has_gpu = view is not None and len(view.physical) > 0

    def advice(rec: dict[str, Any]) -> str:  # a Jetson takes none of the upstream builds
        return _jetson_text(view) if tegra else _recommendation_text(rec, view.driver_version if view else None)

    if not torch.get("installed"):
        err = torch.get("error")
        what = "torch is not installed" if err == "not installed" else f"torch cannot be imported ({err})"
        problems.append(Problem("torch_missing", what, "pip install torch (needed by load_anywhere, train, demo)"))
    elif (has_gpu or tegra) and not torch.get("cuda") and torch.get("build") != "rocm":
        driver = view.driver_version if view is not None else None
        rec = recommend_cuda_build(torch.get("version"), driver, windows=windows, gpus=gpu_ccs(view))
        problems.append(
            Problem(
                "cpu_only_torch",
                f"this machine has NVIDIA GPUs but torch {torch.get('version')} is a CPU-only build "
                "(torch.version.cuda is None)",
                advice(rec),
            )
        )
    lacking = _installed_build_problem(torch, view, windows, tegra) if torch.get("installed") else None
    if lacking is not None:
        problems.append(lacking)
    if view is not None and torch.get("cuda") and view.driver_version:
        major = _version(torch["cuda"])
        drv = _version(view.driver_version)
        need = _MIN_DRIVER.get(major[0]) if major else None
        if need and drv and drv < need:
            rec = recommend_cuda_build(torch.get("version"), view.driver_version, windows=windows, gpus=gpu_ccs(view))
            problems.append(
                Problem(
                    "driver_too_old",
                    f"torch is built for CUDA {torch['cuda']} which needs driver >= {_fmt(need)}, "
                    f"this machine has {view.driver_version}",
                    advice(rec),
                )
            )
    return problems


#: gpu_error_kind -> (problem code, fix) for the driver problems that are not "no GPU"
_DRIVER_FIXES: dict[str, tuple[str, str]] = {
    "driver_not_loaded": (
        "driver_not_loaded",
        "load the NVIDIA kernel module (`sudo modprobe nvidia`), or reboot after a driver install; in a "
        "container, run it with the GPUs (`docker run --gpus all`, or the pod's nvidia.com/gpu resource); "
        "until then torch runs on CPU only",
    ),
    "driver_mismatch": (
        "driver_mismatch",
        "the driver was upgraded but the old kernel module is still loaded: reboot (or stop every GPU process and "
        "reload the modules: `sudo rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && sudo modprobe nvidia`); "
        "until then torch runs on CPU only",
    ),
    "no_nvidia_smi": (
        "no_gpu",
        "install the NVIDIA driver (it brings nvidia-smi; or set CKPTFIX_NVIDIA_SMI to where it is), or run on CPU",
    ),
    "no_gpu": (
        "no_gpu",
        "check `dmesg` for a failed device, or the GPUs granted to this container/job; otherwise run on CPU",
    ),
}


def gpu_error_kind_of(e: CkptfixError) -> str:
    """Which of doctor's GPU problems an error of :func:`ckptfix.gpu.visible_gpus` is.

    Returns:
        ``"query"`` (nvidia-smi failed or hung), ``"driver_not_loaded"``, ``"driver_mismatch"``,
        ``"no_nvidia_smi"`` or ``"no_gpu"``.
    """
    if isinstance(e, GpuQueryError):
        return "query"
    if isinstance(e, DriverNotLoadedError):
        return "driver_not_loaded"
    if isinstance(e, DriverMismatchError):
        return "driver_mismatch"
    if isinstance(e, GpuToolingError):
        return "no_nvidia_smi"
    return "no_gpu"


def gpu_ccs(view: GpuView | None) -> list[tuple[str, tuple[int, int]]]:
    """``(label, compute capability)`` of each physical GPU: nvidia-smi's ``compute_cap`` (R510+), else the model.

    Returns:
        One pair per GPU whose capability is known, e.g. ``("GPU 0 (Tesla V100-PCIE-16GB, sm_70)", (7, 0))``.
    """
    out: list[tuple[str, tuple[int, int]]] = []
    for g in view.physical if view is not None else ():
        cc = g.compute_cap or model_info(g.name)[0]
        if cc is not None:
            out.append((f"GPU {g.index} ({g.name or '?'}, sm_{cc[0]}{cc[1]})", cc))
    return out


def _installed_build_problem(
    torch: Mapping[str, Any], view: GpuView | None, windows: bool, tegra: bool = False
) -> Problem | None:
    """``wheel_lacks_arch``: the installed CUDA build of torch ships no kernels for a GPU here."""
    cuda = _version(torch.get("cuda"))
    tv = _version(torch.get("version"))
    if not cuda or not tv or len(tv) < 2 or view is None:
        return None
    build = f"cu{cuda[0]}{cuda[1] if len(cuda) > 1 else 0}"
    flags = torch.get("arch_list")
    archs: tuple[tuple[tuple[int, int], ...], tuple[int, int] | None] | None
    if isinstance(flags, list) and flags:  # what this very build was compiled for (torch._C._cuda_getArchFlags)
        sass = tuple((int(f[3:-1]), int(f[-1])) for f in flags if f.startswith("sm_") and f[3:].isdigit())
        ptx = max(
            ((int(f[8:-1]), int(f[-1])) for f in flags if f.startswith("compute_") and f[8:].isdigit()), default=None
        )
        archs = (sass, ptx)
    else:
        archs = wheel_archs((tv[0], tv[1]), build)
    if archs is None:
        return None
    missing = [label for label, cc in gpu_ccs(view) if not runs_on(archs, cc)]
    if not missing:
        return None
    rec = recommend_cuda_build(torch.get("version"), view.driver_version, windows=windows, gpus=gpu_ccs(view))
    return Problem(
        "wheel_lacks_arch",
        f"torch {torch.get('version')} ships kernels for {arch_text(archs[0])}"
        + (f" (+PTX {arch_text([archs[1]])})" if archs[1] else "")
        + f', not for {", ".join(missing)}: CUDA calls there fail with "no kernel image is available"',
        _jetson_text(view) if tegra else _recommendation_text(rec, view.driver_version),
    )


def _gpu_error_problem(gpu_error: str, kind: str, tegra: bool = False) -> Problem:
    """nvidia-smi hung or failed (``kind="query"``), a driver problem, or there is no usable GPU."""
    if kind == "no_nvidia_smi" and tegra:
        return Problem(
            "no_gpu",
            gpu_error,
            f"this is an NVIDIA Jetson ({TEGRA_RELEASE} exists): JetPack 5 and older ship no nvidia-smi (JetPack 6 "
            "has one, with memory [N/A]), and the GPU is there for CUDA all the same: watch it with `tegrastats` "
            "(or jtop); ckptfix gpus / pick-gpu need nvidia-smi",
        )
    if kind != "query":
        code, fix = _DRIVER_FIXES.get(kind, _DRIVER_FIXES["no_gpu"])
        return Problem(code, gpu_error, fix)
    hung = "did not answer" in gpu_error
    return Problem(
        "nvidia_smi_hung" if hung else "nvidia_smi_failed",
        gpu_error,
        "a hung nvidia-smi usually means a GPU or the driver is stuck: look for Xid errors in "
        "`dmesg`; stop the processes using the GPU, then reset it (`nvidia-smi -r -i N`) or reboot; "
        "CUDA programs will likely hang too until then"
        if hung
        else "run `nvidia-smi` to see the full error; check `dmesg` for Xid errors",
    )


def _distributed_problems(view: GpuView | None, env: Mapping[str, str]) -> list[Problem]:
    """Ranks out of range for the visible GPUs or the world size, a world without MASTER_ADDR."""
    problems: list[Problem] = []
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
    ws, lr, rk = env.get("WORLD_SIZE"), env.get("LOCAL_RANK"), env.get("RANK")
    if ws is not None and ws.isdigit():
        for name, val in (("LOCAL_RANK", lr), ("RANK", rk)):
            if val is not None and val.isdigit() and int(val) >= int(ws):
                problems.append(
                    Problem(
                        f"{name.lower()}_out_of_range",
                        f"{name}={val} but WORLD_SIZE={ws}: ranks run from 0 to {int(ws) - 1}",
                        "launch with torchrun (it sets RANK, LOCAL_RANK and WORLD_SIZE consistently), or fix the "
                        "exported values",
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


def diagnose(
    torch: Mapping[str, Any],
    view: GpuView | None,
    gpu_error: str | None,
    env: Mapping[str, str],
    *,
    gpu_error_kind: str = "no_gpu",
    windows: bool = False,
    tegra: bool | None = None,
) -> list[Problem]:
    """Problems with fixes, from facts gathered elsewhere (pure).

    Args:
        torch: :func:`torch_info`'s answer.
        view: the GPU view, ``None`` when nvidia-smi failed.
        gpu_error: why it failed (the error text).
        env: the environment.
        gpu_error_kind: from :func:`gpu_error_kind_of`: ``"query"`` (nvidia-smi failed or hung: the GPUs are
            there but in trouble), ``"driver_not_loaded"``, ``"driver_mismatch"``, ``"no_nvidia_smi"`` or
            ``"no_gpu"``.
        windows: use the Windows driver minimums.
        tegra: this is an NVIDIA Jetson (``None``: judged from the GPU names, :func:`is_tegra` without the
            release file).

    Returns:
        The problems, each with its fix: torch's, nvidia-smi's, the view's, then the distributed environment's.
    """
    if tegra is None:
        tegra = is_tegra(view, release_file="")
    problems = _torch_problems(torch, view, windows=windows, tegra=tegra)
    if gpu_error:
        problems.append(_gpu_error_problem(gpu_error, gpu_error_kind, tegra))
    if view is not None:
        problems.extend(view.problems)
    return problems + _distributed_problems(view, env)


def doctor_report(
    *,
    env: Mapping[str, str] | None = None,
    runner: Runner | None = None,
    timeout: float = 10.0,
    tegra_release: str = TEGRA_RELEASE,
) -> DoctorReport:
    """Gather everything (runs nvidia-smi, imports torch) and diagnose.  Never raises for GPU trouble.

    Args:
        env: the environment to report on (default ``os.environ``).
        runner: runs one nvidia-smi command (tests).
        timeout: seconds to wait for each nvidia-smi call.
        tegra_release: L4T's release file, whose presence means a Jetson (tests).

    Returns:
        The :class:`DoctorReport`; GPU failures are in ``gpu_error`` and ``problems``.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    python = {
        "version": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
    }
    try:
        from ckptfix._version import __version__

        python["ckptfix"] = __version__
    except Exception:  # noqa: BLE001  # pragma: no cover
        pass
    gpu_error_kind = "no_gpu"
    view: GpuView | None = None
    gpu_error: str | None = None
    try:
        view = visible_gpus(env=environ, runner=runner, timeout=timeout)  # before torch is imported
    except CkptfixError as e:
        gpu_error = f"{e} (exit code {e.exit_code})"
        gpu_error_kind = gpu_error_kind_of(e)
    tinfo = torch_info()
    environment = {
        k: environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_HOME", "LD_LIBRARY_PATH")
    }
    dist = {k: environ[k] for k in DIST_VARS if k in environ}
    dist.update({k: v for k, v in sorted(environ.items()) if k.startswith("NCCL_") or k.startswith("TORCH_NCCL")})
    tegra = is_tegra(view, release_file=tegra_release)
    problems = diagnose(
        tinfo, view, gpu_error, environ, gpu_error_kind=gpu_error_kind, windows=os.name == "nt", tegra=tegra
    )
    return DoctorReport(
        python=python,
        torch=tinfo,
        driver_version=view.driver_version if view else None,
        gpus=view,
        gpu_error=gpu_error,
        environment=environment,
        distributed=dist,
        problems=problems,
        tegra=tegra,
    )
