"""pick_gpu() refuses once CUDA is initialised in the process, whatever initialised it.

No GPU here: torch's route is simulated the way torch takes it (``is_available()`` ->
``_cuda_getDeviceCount()`` -> ``cuInit`` loads and initialises libcuda while
``torch.cuda.is_initialized()`` stays False), and the driver-level detection is exercised for
real against a stand-in ``libcuda.so.1`` compiled here (it answers ``cuDeviceGetCount`` with
``CUDA_ERROR_NOT_INITIALIZED`` until ``cuInit`` ran, as the real driver does).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from ckptfix.errors import CudaAlreadyInitializedError
from ckptfix.gpu import cudainit as vis
from ckptfix.gpu import pick_gpu

from fakesmi import scenario_runner
from helpers import run_python

ROOT = Path(__file__).resolve().parent.parent
LIBCUDA_LINE = "7f3a2c000000-7f3a2c200000 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05\n"


class FakeDriver:
    """libcuda as torch's CUDA build reaches it: not mapped until the first runtime call, then cuInit."""

    def __init__(self) -> None:
        self.loaded = False
        self.initialized = False

    def maps(self) -> str:
        return "55d0c0000000-55d0c0001000 r--p 00000000 08:01 99 /usr/bin/python3.11\n" + (
            LIBCUDA_LINE if self.loaded else ""
        )

    def probe(self, path: str) -> int:
        assert path.endswith("libcuda.so.580.95.05")
        return 0 if self.initialized else vis.CUDA_NOT_INITIALIZED

    def cu_init(self) -> None:
        self.loaded = self.initialized = True


def _fake_torch(driver: FakeDriver) -> types.ModuleType:
    torch = types.ModuleType("torch")

    def _cuda_get_device_count() -> int:  # cudaGetDeviceCount: runs cuInit (torch's own comment says so)
        driver.cu_init()
        return 2

    torch._C = types.SimpleNamespace(_cuda_getDeviceCount=_cuda_get_device_count)
    cuda = types.ModuleType("torch.cuda")
    cuda._initialized = False
    cuda._cached_device_count = None
    cuda.is_initialized = lambda: cuda._initialized
    cuda._is_in_bad_fork = lambda: False
    cuda.is_available = lambda: torch._C._cuda_getDeviceCount() > 0
    torch.cuda = cuda
    return torch


@pytest.fixture
def driver(monkeypatch):
    d = FakeDriver()
    monkeypatch.setattr(vis, "_read_maps", d.maps)
    monkeypatch.setattr(vis, "_probe_cuinit", d.probe)
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(d))
    return d


def test_is_available_then_pick_gpu_is_refused(driver, tmp_path):
    import torch  # the fake

    environ = {"CKPTFIX_LEASE_DIR": str(tmp_path / "l")}
    assert vis.cuda_init_route() is None
    assert torch.cuda.is_available()
    assert not torch.cuda.is_initialized()  # what fooled the old check
    with pytest.raises(CudaAlreadyInitializedError) as ei:
        pick_gpu(environ=environ, runner=scenario_runner("h200_after_release"))
    msg = str(ei.value)
    assert ei.value.exit_code == 24 and "cuInit" in msg and "before any torch.cuda call" in msg
    assert "CUDA_VISIBLE_DEVICES" not in environ


def test_pick_gpu_before_is_available_works(driver, tmp_path):
    environ = {"CKPTFIX_LEASE_DIR": str(tmp_path / "l")}
    res = pick_gpu(environ=environ, runner=scenario_runner("h200_after_release"), lease=False)
    assert environ["CUDA_VISIBLE_DEVICES"] == res.chosen[0].gpu.uuid


def test_a_library_that_only_links_libcuda_does_not_count(driver):
    driver.loaded = True  # e.g. `import cupy`: libcuda mapped, cuInit not called
    assert vis.cuda_init_route() is None
    driver.initialized = True  # cupy.cuda.runtime.getDeviceCount(), jax.devices(), numba.cuda...
    assert "cuInit" in vis.cuda_init_route()


def test_libcuda_that_cannot_be_asked_counts_as_initialised(driver, monkeypatch):
    driver.loaded = True
    monkeypatch.setattr(vis, "_probe_cuinit", lambda path: None)
    assert "could not be asked" in vis.cuda_init_route()


@pytest.mark.parametrize(
    "attr, value, words",
    [("_initialized", True, "torch.cuda is initialised"), ("_cached_device_count", 8, "cached")],
)
def test_torch_side_routes(driver, attr, value, words):
    import torch

    setattr(torch.cuda, attr, value)
    assert words in vis.cuda_init_route()


def test_forked_child_of_a_cuda_process(driver):
    import torch

    torch.cuda._is_in_bad_fork = lambda: True
    assert "forked" in vis.cuda_init_route()


def test_real_cpu_torch_is_available_does_not_count():
    """The CPU build has no cuInit route: pick_gpu() after is_available() is still fine there."""
    code = (
        "import torch; torch.cuda.is_available(); torch.cuda.device_count()\n"
        "from ckptfix.gpu.cudainit import cuda_init_route\n"
        "assert torch.version.cuda is not None or cuda_init_route() is None, cuda_init_route()\n"
        "print('ok')\n"
    )
    p = run_python(code, timeout=600)
    assert p.stdout.strip() == "ok", p.stderr


LIBCUDA_C = r"""
static int inited = 0;
int cuInit(unsigned int flags) { (void)flags; inited = 1; return 0; }
int cuDeviceGetCount(int *n) { if (!inited) return 3; *n = 2; return 0; }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_driver_detection_against_a_real_loaded_library(tmp_path):
    """/proc/self/maps, dlopen(RTLD_NOLOAD) and the cuDeviceGetCount probe, for real, in a fresh process."""
    src = tmp_path / "libcuda.c"
    src.write_text(LIBCUDA_C)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=600)
    code = textwrap.dedent(
        f"""
        import ctypes
        from ckptfix.gpu.cudainit import cuda_init_route
        from ckptfix.gpu import pick_gpu
        from ckptfix.errors import CudaAlreadyInitializedError
        assert cuda_init_route() is None
        cu = ctypes.CDLL({str(lib)!r})          # e.g. a library linked against libcuda: loaded, not initialised
        assert cuda_init_route() is None, cuda_init_route()
        cu.cuInit(0)                             # what cudaGetDeviceCount / cupy / jax do
        route = cuda_init_route()
        assert route is not None and {str(lib)!r} in route, route
        try:
            pick_gpu(environ={{"CKPTFIX_LEASE_DIR": {str(tmp_path / "l")!r}}})
        except CudaAlreadyInitializedError:
            print("refused")
        """
    )
    p = run_python(code, timeout=600)
    assert p.stdout.strip() == "refused", p.stderr


def test_detection_never_imports_torch():
    code = (
        "import sys\nfrom ckptfix.gpu.cudainit import cuda_init_route\ncuda_init_route()\n"
        "print('torch' in sys.modules)\n"
    )
    p = run_python(code, timeout=600)
    assert p.stdout.strip() == "False", p.stderr
