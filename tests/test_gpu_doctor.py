"""doctor: the CUDA build it recommends runs on the driver; a hung nvidia-smi is not "no GPU"; rank checks."""

from __future__ import annotations

import json
import shutil

import pytest

from ckptfix.gpu.doctor import CUDA_DRIVER_TABLE, TORCH_CUDA_BUILDS, diagnose, recommend_cuda_build
from ckptfix.gpu.records import SmiGpu, SmiSnapshot
from ckptfix.gpu.visible import build_view

from helpers import SCENARIOS, fake_smi_env, run_cli


def _view(driver: str):
    g = SmiGpu(
        index=0,
        uuid="GPU-1",
        pci_bus_id="00000000:01:00.0",
        name="Tesla T4",
        memory_total_mib=15360,
        memory_used_mib=0,
        memory_free_mib=15360,
        utilization_pct=0,
        processes=(),
        driver_version=driver,
    )
    return build_view(SmiSnapshot(gpus=(g,), driver_version=driver), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})


def _codes(problems):
    return {p.code: p for p in problems}


CPU_TORCH = {"installed": True, "version": "2.6.0+cpu", "cuda": None, "build": "cpu"}


@pytest.mark.parametrize(
    "driver, expect",
    [
        ("570.124.06", "whl/cu126"),  # runs every 2.6 build: the newest
        ("550.54.15", "whl/cu124"),  # 12.6 needs 560.28.03: cu124 is the newest it runs
        ("470.82.01", "whl/cu118"),  # minor version compatibility (>= 450.80.02), said as such
        ("440.33", "upgrade the NVIDIA driver first, to >= 520.61.05"),
    ],
)
def test_cpu_torch_gets_a_build_the_driver_runs(driver, expect):
    p = _codes(diagnose(CPU_TORCH, _view(driver), None, {}))["cpu_only_torch"]
    assert expect in p.fix
    assert "whl/cu126" not in p.fix or driver.startswith("570")


def test_minor_version_compatibility_is_named():
    p = _codes(diagnose(CPU_TORCH, _view("470.82.01"), None, {}))["cpu_only_torch"]
    assert "minor version compatibility" in p.fix and "520.61.05" in p.fix


def test_driver_too_old_recommends_what_the_driver_runs():
    torch = {"installed": True, "version": "2.6.0+cu126", "cuda": "12.6", "build": "cuda"}
    probs = _codes(diagnose(torch, _view("470.82.01"), None, {}))
    assert "needs driver >= 525.60.13" in probs["driver_too_old"].message
    assert "whl/cu118" in probs["driver_too_old"].fix
    assert "driver_too_old" not in _codes(diagnose(torch, _view("525.60.13"), None, {}))
    assert "driver_too_old" not in _codes(diagnose(torch, _view("535.104.05"), None, {}))


def test_newer_torch_than_the_table_says_it_assumes():
    rec = recommend_cuda_build("2.13.0+cpu", "570.124.06")
    newest = max(TORCH_CUDA_BUILDS)
    assert rec["assumed"] and rec["builds"] == list(TORCH_CUDA_BUILDS[newest]) and rec["build"] == "cu128"
    assert not recommend_cuda_build("2.6.1", "570.124.06")["assumed"]


def test_windows_column():
    assert recommend_cuda_build("2.6.0", "560.76", windows=True)["build"] == "cu126"
    assert recommend_cuda_build("2.6.0", "560.70", windows=True)["build"] == "cu124"


def test_table_is_consistent():
    for builds in TORCH_CUDA_BUILDS.values():
        for b in builds:
            assert f"{b[2:-1]}.{b[-1]}" in CUDA_DRIVER_TABLE, b
    order = sorted(CUDA_DRIVER_TABLE, key=lambda v: tuple(map(int, v.split("."))))
    linux = [CUDA_DRIVER_TABLE[v][0] for v in order]
    assert linux == sorted(linux)  # newer toolkits never need an older driver


def test_hung_nvidia_smi_is_not_no_gpu():
    err = "nvidia-smi did not answer within 10s (a hung GPU or driver?): check `dmesg`, or retry (exit code 25)"
    probs = _codes(diagnose(CPU_TORCH, None, err, {}, gpu_error_kind="query"))
    assert "no_gpu" not in probs
    p = probs["nvidia_smi_hung"]
    assert "run on CPU" not in p.fix and "dmesg" in p.fix and "reboot" in p.fix


@pytest.mark.parametrize(
    "env, code",
    [
        ({"LOCAL_RANK": "8", "WORLD_SIZE": "8", "MASTER_ADDR": "h"}, "local_rank_out_of_range"),
        ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "rank_out_of_range"),
    ],
)
def test_rank_not_below_world_size(env, code):
    probs = _codes(diagnose(CPU_TORCH, None, None, env))
    assert code in probs and "WORLD_SIZE" in probs[code].message
    assert code not in _codes(diagnose(CPU_TORCH, None, None, dict(env, WORLD_SIZE="16")))


def test_doctor_cli_files_a_hung_nvidia_smi_as_such(tmp_path):
    fake_env = fake_smi_env(tmp_path)
    scen = tmp_path / "scen" / "gpu_hang"
    shutil.copytree(SCENARIOS / "two_free", scen)
    (scen / "query-gpu.hang").write_text("30\n")
    r = run_cli(
        "doctor",
        "--json",
        "--timeout",
        "0.5",
        env=fake_env,
        FAKE_SMI_DIR=str(scen.parent),
        FAKE_SMI_SCENARIO="gpu_hang",
    )
    assert r.rc == 0, r
    codes = [p["code"] for p in json.loads(r.out)["problems"]]
    assert "nvidia_smi_hung" in codes and "no_gpu" not in codes


# ----------------------------------------------------------------------------- Jetson (issue 34 C1)

JETSON_DOCS = "docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform"


def test_jetson_is_sent_to_nvidias_jetson_builds_not_the_cu126_wheel():
    from ckptfix.gpu.visible import visible_gpus

    from fakesmi import scenario_runner

    view = visible_gpus(env={}, runner=scenario_runner("jetson_orin"))  # "Orin (nvgpu)", every field [N/A]
    torch = {"installed": True, "version": "2.13.0", "cuda": None, "build": "cpu"}
    p = _codes(diagnose(torch, view, None, {}))["cpu_only_torch"]
    assert "Jetson" in p.fix and JETSON_DOCS in p.fix and "JetPack" in p.fix, p
    assert "download.pytorch.org/whl/cu" not in p.fix and "minor version compatibility" not in p.fix, p


def test_gb10_is_not_a_jetson():
    from ckptfix.gpu.doctor import is_tegra
    from ckptfix.gpu.visible import visible_gpus

    from fakesmi import scenario_runner

    assert not is_tegra(
        visible_gpus(env={}, runner=scenario_runner("gb10_unified_memory")), release_file="/nonexistent"
    )
    assert is_tegra(visible_gpus(env={}, runner=scenario_runner("jetson_orin")), release_file="/nonexistent")


def test_jetson_without_nvidia_smi_is_recognised_by_its_release_file(tmp_path):
    # JetPack 5 and older ship no nvidia-smi; /etc/nv_tegra_release says it is a Jetson
    from ckptfix.errors import GpuToolingError
    from ckptfix.gpu.doctor import doctor_report

    release = tmp_path / "nv_tegra_release"
    release.write_text("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64\n")

    def no_smi(argv, timeout):
        raise GpuToolingError("nvidia-smi not found on PATH: no NVIDIA driver is installed here")

    report = doctor_report(env={}, runner=no_smi, tegra_release=str(release))
    probs = _codes(report.problems)
    assert "install the NVIDIA driver" not in probs["no_gpu"].fix and "Jetson" in probs["no_gpu"].fix, probs
    if not report.torch.get("cuda"):
        assert JETSON_DOCS in probs["cpu_only_torch"].fix, probs
