"""doctor's wheel advice checks the GPUs' compute capabilities against the architectures each CUDA build ships
(issue 23, item 4): a V100 + GTX 1080 Ti on driver 580 must not be sent to a CUDA 13 build."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ckptfix.gpu.doctor import TORCH_CUDA_BUILDS, _recommendation_text, diagnose, gpu_ccs, recommend_cuda_build
from ckptfix.gpu.records import SmiSnapshot
from ckptfix.gpu.visible import build_view, visible_gpus
from ckptfix.gpu.wheels import WHEEL_ARCHS, runs_on, wheel_archs

from fakesmi import scenario_runner
from helpers import fake_smi_env, run_cli

CPU_TORCH = {"installed": True, "version": "2.9.0+cpu", "cuda": None, "build": "cpu"}


def old_view():
    return visible_gpus(env={}, runner=scenario_runner("old_arch"))


def test_scenario_reads_compute_caps():
    assert [cc for _, cc in gpu_ccs(old_view())] == [(7, 0), (6, 1)]


def test_cpu_torch_on_v100_and_1080ti_gets_cu126_not_cu130():
    rec = recommend_cuda_build("2.9.0+cpu", "580.95.05", gpus=gpu_ccs(old_view()))
    assert rec["build"] == "cu126", rec
    assert set(rec["lacks_arch"]) == {"cu128", "cu130"}  # 2.9's cu128 dropped Pascal, cu130 Pascal and Volta
    assert [w.split(" (")[0] for w in rec["lacks_arch"]["cu130"]] == ["GPU 0", "GPU 1"]
    assert [w.split(" (")[0] for w in rec["lacks_arch"]["cu128"]] == ["GPU 1"]
    # without the GPUs the driver alone would have picked CUDA 13
    assert recommend_cuda_build("2.9.0+cpu", "580.95.05")["build"] == "cu130"


def test_doctor_problem_names_the_build_and_why():
    (p,) = [p for p in diagnose(CPU_TORCH, old_view(), None, {}) if p.code == "cpu_only_torch"]
    assert "whl/cu126" in p.fix and "whl/cu130" not in p.fix
    assert "not cu130: it ships no kernels for GPU 0 (Tesla V100-PCIE-16GB, sm_70)" in p.fix, p.fix


def test_installed_cuda13_build_on_old_gpus_is_a_problem():
    torch = {"installed": True, "version": "2.9.0+cu130", "cuda": "13.0", "build": "cuda"}
    (p,) = [p for p in diagnose(torch, old_view(), None, {}) if p.code == "wheel_lacks_arch"]
    assert "sm_75" in p.message and "GTX 1080 Ti, sm_61" in p.message and "no kernel image" in p.message
    assert "whl/cu126" in p.fix
    # the build's own arch list, when torch reports it, wins over the table
    torch["arch_list"] = ["sm_60", "sm_70", "sm_75"]
    assert not [p for p in diagnose(torch, old_view(), None, {}) if p.code == "wheel_lacks_arch"]


def test_2_11_cu128_dropped_volta():
    rec = recommend_cuda_build("2.11.0+cpu", "580.95.05", gpus=[("GPU 0 (V100)", (7, 0))])
    assert rec["build"] == "cu126" and set(rec["lacks_arch"]) == {"cu128", "cu130"}


@pytest.mark.parametrize(
    "cc, build, ok",
    [
        ((6, 1), "cu126", True),
        ((7, 0), "cu130", False),
        ((8, 9), "cu130", True),
        ((12, 1), "cu130", True),
        ((6, 1), "cu128", False),
        ((5, 2), "cu126", True),
        ((3, 7), "cu126", False),
    ],
)
def test_runs_on(cc, build, ok):
    assert runs_on(wheel_archs((2, 9), build), cc) is ok


def test_table_covers_every_published_build():
    for key, builds in TORCH_CUDA_BUILDS.items():
        if key >= min(WHEEL_ARCHS):
            for b in builds:
                assert wheel_archs(key, b) is not None, (key, b)


def test_doctor_json_on_the_old_box_is_valid_and_advises_cu126(tmp_path):
    import json

    from jsonschema import Draft202012Validator

    from helpers import ROOT, fake_smi_env, run_cli

    r = run_cli("doctor", "--json", scenario="old_arch", env=fake_smi_env(tmp_path))
    assert r.rc == 0, r
    doc = json.loads(r.out)
    schema = json.loads((ROOT / "docs" / "schemas" / "doctor.schema.json").read_text())
    Draft202012Validator(schema).validate(doc)
    fixes = " ".join(p["fix"] for p in doc["problems"] if p["code"] in ("cpu_only_torch", "wheel_lacks_arch"))
    if doc["torch"].get("installed"):
        assert "whl/cu126" in fixes and "whl/cu130" not in fixes, fixes


# ----------------------------------------------------------------------------- Kepler (issue 34 C3)


def _k80():
    return visible_gpus(env={}, runner=scenario_runner("k80_r470"))


@pytest.mark.parametrize(
    "torch",
    [
        {"installed": True, "version": "2.13.0+cpu", "cuda": None, "build": "cpu"},
        {"installed": True, "version": "2.13.0+cu126", "cuda": "12.6", "build": "cuda"},
        {"installed": True, "version": "2.6.0+cu118", "cuda": "11.8", "build": "cuda"},
    ],
)
def test_kepler_box_is_told_no_torch_build_runs_it_not_to_upgrade_the_driver(torch):
    view = _k80()
    assert [cc for _, cc in gpu_ccs(view)] == [(3, 7), (3, 7)]
    problems = diagnose(torch, view, None, {})
    fixes = [p for p in problems if p.code in ("cpu_only_torch", "driver_too_old", "wheel_lacks_arch")]
    assert fixes, problems
    for p in fixes:
        assert "upgrade the NVIDIA driver" not in p.fix and ">= 5" not in p.fix, p  # R470 is Kepler's last branch
        assert "no supported torch build runs these GPUs" in p.fix and "sm_37" in p.fix, p
        assert "CPU" in p.fix and "old torch" in p.fix and "R470" in p.fix, p


def test_kepler_next_to_a_supported_gpu_leaves_it_out():
    k80 = _k80().physical[0]
    v100 = replace(old_view().physical[0], index=1, driver_version="470.256.02")
    view = build_view(SmiSnapshot(gpus=(k80, v100), driver_version="470.256.02"), {})
    rec = recommend_cuda_build("2.6.0", "470.256.02", gpus=gpu_ccs(view))
    assert rec["no_torch_runs"] == ["GPU 0 (Tesla K80, sm_37)"] and rec["build"] == "cu118"  # for the V100
    text = _recommendation_text(rec, "470.256.02")
    assert "GPU 0 (Tesla K80, sm_37)" in text and "CUDA_VISIBLE_DEVICES" in text and "whl/cu118" in text


def test_doctor_cli_on_the_kepler_box(tmp_path):
    r = run_cli("doctor", "--json", scenario="k80_r470", env=fake_smi_env(tmp_path))
    assert r.rc == 0, r
    doc = json.loads(r.out)
    fixes = " ".join(p["fix"] for p in doc["problems"])
    assert "no supported torch build runs these GPUs" in fixes and "upgrade the NVIDIA driver" not in fixes, fixes
