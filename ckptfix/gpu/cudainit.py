"""Is CUDA already initialised in this process (then ``CUDA_VISIBLE_DEVICES`` no longer takes effect)?

Never imports torch and never initialises CUDA: looks at an already imported torch and asks an already
loaded CUDA driver library.
"""

from __future__ import annotations

import os
import sys

__all__ = ["CUDA_NOT_INITIALIZED", "cuda_init_route", "cuda_initialized"]


CUDA_NOT_INITIALIZED = 3  # CUresult CUDA_ERROR_NOT_INITIALIZED: cuInit() has not run in this process


def _read_maps() -> str:
    """This process's memory map (``/proc/self/maps``); empty where there is none."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _loaded_libcuda(maps: str) -> str | None:
    """Path of the CUDA driver library (``libcuda.so*``) mapped into this process, if any."""
    for line in maps.splitlines():
        parts = line.split(None, 5)  # address perms offset dev inode [path]
        if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libcuda.so"):
            return parts[5].strip()
    return None


def _probe_cuinit(path: str) -> int | None:
    """``cuDeviceGetCount`` through the *already loaded* driver library: ``0`` once ``cuInit`` has run,
    ``CUDA_NOT_INITIALIZED`` (3) before; ``None`` if it cannot be asked.  Never loads or initialises it."""
    import ctypes  # only reached when libcuda is already mapped

    try:
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 4) | getattr(os, "RTLD_LOCAL", 0))
        fn = lib.cuDeviceGetCount
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    n = ctypes.c_int(0)
    try:
        return int(fn(ctypes.byref(n)))
    except Exception:  # noqa: BLE001 - a foreign library of that name
        return None


def cuda_init_route() -> str | None:
    """How CUDA was already initialised in *this* process, or ``None`` if it was not.  Never imports torch.

    Detected routes:

    * torch (only if already imported: ``sys.modules``): ``torch.cuda.is_initialized()`` (a CUDA tensor,
      ``torch.cuda.init()``, ``set_device``...), a forked child of a CUDA process
      (``torch.cuda._is_in_bad_fork()``), a cached device count;
    * any route through the CUDA driver, whoever took it: ``torch.cuda.is_available()`` /
      ``device_count()`` on CUDA builds (``cudaGetDeviceCount`` runs ``cuInit``), cupy, jax, numba,
      pycuda, a C extension: the driver library ``libcuda.so`` is mapped into the process
      (``/proc/self/maps``) and answers ``cuDeviceGetCount`` with success (it answers
      ``CUDA_ERROR_NOT_INITIALIZED`` before ``cuInit``, so merely importing a library that links
      libcuda does not count).  If libcuda is loaded but cannot be asked, it counts as initialised.

    Returns:
        A short description of the route, or ``None``.
    """
    tcuda = getattr(sys.modules.get("torch"), "cuda", None)
    if tcuda is not None:
        try:
            if tcuda.is_initialized():
                return "torch.cuda is initialised (a CUDA tensor, torch.cuda.init(), set_device(), ...)"
        except Exception:  # noqa: BLE001 - a half-imported or stubbed torch
            pass
        try:
            if tcuda._is_in_bad_fork():
                return "this process was forked from one that had initialised CUDA"
        except Exception:  # noqa: BLE001 - a torch without this private hook
            pass
        if getattr(tcuda, "_cached_device_count", None) is not None:
            return "torch.cuda has cached its device count (CUDA was initialised)"
    lib = _loaded_libcuda(_read_maps())
    if lib is None:
        return None
    rc = _probe_cuinit(lib)
    if rc == CUDA_NOT_INITIALIZED:
        return None
    if rc is None:
        return f"the CUDA driver library is loaded ({lib}) and could not be asked whether cuInit ran"
    return (
        f"the CUDA driver was initialised (cuInit) by some call in this process, e.g. torch.cuda.is_available() "
        f"or device_count(), or another CUDA library ({lib})"
    )


def cuda_initialized() -> bool:
    """True if CUDA is already initialised in *this* process, by any route (see :func:`cuda_init_route`)."""
    return cuda_init_route() is not None
