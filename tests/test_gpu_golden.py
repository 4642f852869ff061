"""``ckptfix gpus`` and ``ckptfix doctor`` print exactly tests/golden/{gpus,doctor}_<case>.txt.

Each case replays a recorded nvidia-smi scenario (tests/fixtures/nvidia-smi/scenarios) through the fake
nvidia-smi, runs the CLI in a fresh process, and compares the command line, stdout, stderr and exit code with
the golden file, byte for byte.  What depends on the machine running the tests (Python's version, path and
platform, the torch version) is masked in the doctor's output.

After an intended change of the output, regenerate the files and review the diff::

    CKPTFIX_UPDATE_GOLDEN=1 pytest tests/test_gpu_golden.py
    git diff tests/golden/
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from helpers import fake_smi_env, run_cli

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("CKPTFIX_UPDATE_GOLDEN") == "1"

# case -> (scenario, extra environment)
GPUS_CASES: dict[str, tuple[str, dict[str, str]]] = {
    "h200_busy": ("h200_busy", {}),
    "h200_busy_cvd_truncated": ("h200_busy", {"CUDA_VISIBLE_DEVICES": "7,GPU-x,2"}),
    "h200_busy_cvd_empty": ("h200_busy", {"CUDA_VISIBLE_DEVICES": ""}),
    "h200_hidden_procs": ("h200_hidden_procs", {}),
    "mixed": ("mixed", {}),
    "mixed_pci_bus_id": ("mixed", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
    "mixed_order_typo": ("mixed", {"CUDA_DEVICE_ORDER": "pci_bus_id"}),
    "mixed_t4_a100": ("mixed_t4_a100", {}),
    "mig_host": ("mig_host", {}),
    "mig_host_one_mig": ("mig_host", {"CUDA_VISIBLE_DEVICES": "MIG-4c7db5d8"}),
    "k8s_insufficient_permissions": ("k8s_insufficient_permissions", {}),
    "gb10_unified_memory": ("gb10_unified_memory", {}),
    "warning_line": ("warning_line", {}),
    "two_domains": ("two_domains", {}),
    "pci_order_mismatch": ("pci_order_mismatch", {}),
    "driver_not_loaded": ("driver_not_loaded", {}),
    "no_devices": ("no_devices", {}),
    # issue 23's stand-in machines
    "comma_locale": ("comma_locale", {}),
    "fallen_off": ("fallen_off", {}),
    "mig_pod": ("mig_pod", {}),
    "mig_pod_two_slices": (
        "mig_pod",
        {"CUDA_VISIBLE_DEVICES": "MIG-ac2471ee-ea05-55fe-b7d7-8c31210e7a6e,MIG-960c229f-92b5-5543-8eb5-2999f26ef6b8"},
    ),
    "old_arch": ("old_arch", {}),
    "two_free_cvd_uncertain": ("two_free", {"CUDA_VISIBLE_DEVICES": "0,9,0"}),
}

DOCTOR_CASES: dict[str, tuple[str, dict[str, str]]] = {
    "h200_busy": ("h200_busy", {}),
    "mixed_ranks": ("mixed", {"LOCAL_RANK": "3", "WORLD_SIZE": "2", "RANK": "1"}),
    "mig_host": ("mig_host", {}),
    "k8s_insufficient_permissions": ("k8s_insufficient_permissions", {}),
    "driver_not_loaded": ("driver_not_loaded", {}),
    "old_arch": ("old_arch", {}),
    "lib_mismatch": ("lib_mismatch", {}),
}

# the same machines with PyPI's default torch 2.13.0, the CUDA 13.0 build (`pip install torch`): case -> scenario
DOCTOR_CUDA_CASES: dict[str, str] = {
    "h200_busy_cu130": "h200_busy",  # driver 570 is too old for CUDA 13
    "old_arch_cu130": "old_arch",  # a V100 and a 1080 Ti: no cu130 kernels for sm_70 / sm_61
    "no_nvidia_smi_cu130": "",  # no driver at all (no nvidia-smi on PATH)
}
#: what torch._C._cuda_getArchFlags() says in torch-2.13.0+cu130 from PyPI (the kernels it ships; no PTX)
CU130_ARCH_FLAGS = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"


def transcript(command: str, extra: dict[str, str], out: str, err: str, rc: int) -> str:
    """One run as a golden file: the command line, stdout, stderr and the exit code."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
    return f"$ {env + ' ' if env else ''}ckptfix {command}\n{out}--- stderr\n{err}--- exit code {rc}\n"


def mask_machine(text: str) -> str:
    """Replace what depends on the machine running the tests (doctor's python and torch facts)."""
    text = re.sub(r"^python:  .*$", "python:  <masked: version (executable) on platform>", text, flags=re.M)
    text = re.sub(r"^torch:   .*$", "torch:   <masked: version and build>", text, flags=re.M)
    return re.sub(r"torch(==| )\d+\.\d+(\.\d+)?(\+\w+)?", r"torch\g<1><version>", text)


def check(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no {path}: run CKPTFIX_UPDATE_GOLDEN=1 pytest {Path(__file__).name}"
    assert text == path.read_text(), f"{name}: output differs from {path} (regenerate if intended)"


def machine_env(tmp_path: Path, extra: dict[str, str]) -> dict[str, str]:
    env = fake_smi_env(tmp_path)
    for k in ("LD_LIBRARY_PATH", "NO_COLOR", "FORCE_COLOR", "TERM", "COLUMNS"):
        env.pop(k, None)
    env.update(extra)
    return env


@pytest.mark.parametrize("case", sorted(GPUS_CASES))
def test_gpus_text_is_golden(case: str, tmp_path: Path) -> None:
    scenario, extra = GPUS_CASES[case]
    r = run_cli("gpus", env=machine_env(tmp_path, extra), scenario=scenario, isolated=True)
    assert r.torch_imported is False or r.rc != 0
    check(f"gpus_{case}", transcript("gpus", extra, r.out, r.err, r.rc))


@pytest.mark.parametrize("case", sorted(DOCTOR_CASES))
def test_doctor_text_is_golden(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")  # without torch the report says so instead (test_notorch)
    # the files are the report of a CPU-only torch build (what the machine's GPUs need then is part of it), whichever
    # build is installed here: torch.version says which build it is, the doctor reads nothing else to tell
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    scenario, extra = DOCTOR_CASES[case]
    r = run_cli("doctor", env=machine_env(tmp_path, extra), scenario=scenario, isolated=False)  # the build, faked
    check(f"doctor_{case}", mask_machine(transcript("doctor", extra, r.out, r.err, r.rc)))


@pytest.mark.parametrize("case", sorted(DOCTOR_CUDA_CASES))
def test_doctor_text_with_a_cuda_build_is_golden(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # the build, whichever is installed here
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch._C, "_cuda_getArchFlags", lambda: CU130_ARCH_FLAGS, raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 92000)
    env = machine_env(tmp_path, {})
    scenario = DOCTOR_CUDA_CASES[case]
    if not scenario:  # a PATH without nvidia-smi, whatever this machine has installed
        if os.path.exists("/dev/dxg"):
            pytest.skip("WSL2 (/dev/dxg): nvidia-smi is looked for beside the Windows driver too")
        (tmp_path / "empty").mkdir()
        env["PATH"] = str(tmp_path / "empty")
    r = run_cli("doctor", env=env, scenario=scenario or None, isolated=False)
    check(f"doctor_{case}", mask_machine(transcript("doctor", {}, r.out, r.err, r.rc)))


def test_every_golden_file_belongs_to_a_case() -> None:
    names = {f"gpus_{c}.txt" for c in GPUS_CASES} | {f"doctor_{c}.txt" for c in (*DOCTOR_CASES, *DOCTOR_CUDA_CASES)}
    assert {p.name for p in GOLDEN.glob("*.txt")} <= names
