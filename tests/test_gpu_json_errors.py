"""Every ``--json`` run of ``gpus`` and ``pick-gpu`` prints one JSON document on stdout, failures included: with
``error`` (``exit_code``, ``message``) matching the exit code, valid against docs/schemas/ (issue 38, item 5).
The failures are replayed from real nvidia-smi outputs (tests/fixtures/nvidia-smi/samples, INDEX.md)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from helpers import fake_smi_env, run_cli

SCHEMAS = Path(__file__).resolve().parents[1] / "docs" / "schemas"

#: scenario -> the exit code nvidia-smi's failure maps to (each scenario replays a verbatim sample)
FAILURES = {
    "driver_not_loaded": 26,  # samples/err_driver_not_loaded_rc9.txt
    "lib_mismatch": 27,  # samples/err_driver_lib_version_mismatch_rc18.txt
    "no_devices": 21,  # samples/err_no_devices_found.txt
    "no_supported_gpus": 21,  # samples/err_no_supported_gpus_rc255.txt
    "only_gpu_lost": 25,  # samples/err_device_handle_unknown_error_prefix_line.txt, nothing else
}


def validate(doc, name: str) -> None:
    Draft202012Validator(json.loads((SCHEMAS / f"{name}.schema.json").read_text())).validate(doc)


def one_document(r, rc: int, name: str) -> dict:
    assert r.rc == rc, r
    doc = json.loads(r.out)  # exactly one document: json.loads refuses anything after it
    validate(doc, name)
    assert doc["error"]["exit_code"] == rc, doc
    assert doc["error"]["message"] and doc["error"]["message"] in r.err, (doc, r.err)
    assert r.err.count("Error: ") == 1 and "Traceback" not in r.err, r
    return doc


@pytest.fixture
def env(tmp_path: Path):
    return fake_smi_env(tmp_path)


@pytest.mark.parametrize("scenario", sorted(FAILURES))
def test_gpus_json_on_nvidia_smi_failures(env, scenario):
    doc = one_document(run_cli("gpus", "--json", scenario=scenario, env=env), FAILURES[scenario], "gpus")
    assert doc["devices"] == [] and doc["physical"] == []


@pytest.mark.parametrize("scenario", sorted(FAILURES))
def test_pick_gpu_json_on_nvidia_smi_failures(env, scenario):
    doc = one_document(run_cli("pick-gpu", "--json", scenario=scenario, env=env), FAILURES[scenario], "pick-gpu")
    assert doc["chosen"] == [] and doc["CUDA_VISIBLE_DEVICES"] is None


def test_json_without_nvidia_smi(env):
    env = dict(env, PATH="/usr/bin:/bin")
    if shutil.which("nvidia-smi", path=env["PATH"]) or os.path.exists("/dev/dxg"):
        pytest.skip("a real nvidia-smi is installed (or this is WSL2)")
    one_document(run_cli("gpus", "--json", env=env), 20, "gpus")
    one_document(run_cli("pick-gpu", "--json", env=env), 20, "pick-gpu")


def test_gpus_json_when_cuda_visible_devices_hides_every_gpu(env):
    doc = one_document(run_cli("gpus", "--json", scenario="h200_busy", env=env, CUDA_VISIBLE_DEVICES=""), 21, "gpus")
    assert len(doc["physical"]) == 8 and doc["devices"] == []
    doc = one_document(
        run_cli("pick-gpu", "--json", scenario="h200_busy", env=env, CUDA_VISIBLE_DEVICES=""), 21, "pick-gpu"
    )
    assert doc["chosen"] == []


def test_pick_gpu_json_no_gpu_fits_names_each_rejection(env):
    r = run_cli("pick-gpu", "--json", "--min-free", "1000GiB", "--lease", "0", scenario="h200_busy", env=env)
    doc = one_document(r, 22, "pick-gpu")
    assert doc["chosen"] == [] and len(doc["rejected"]) == 8
    assert all("--min-free" in x["reason"] for x in doc["rejected"]), doc["rejected"]


def test_pick_gpu_json_fewer_than_asked_lists_the_ones_that_qualify(env):
    r = run_cli("pick-gpu", "--json", "-n", "3", "--lease", "0", scenario="two_free", env=env)
    doc = one_document(r, 22, "pick-gpu")
    assert doc["chosen"] == [] and doc["qualified"] == []  # 2 GPUs visible, 3 asked: refused before ranking
    r = run_cli(
        "pick-gpu", "--json", "-n", "5", "--max-procs", "0", "--lease", "0", scenario="h200_hidden_procs", env=env
    )
    doc = one_document(r, 22, "pick-gpu")  # 4 of the 8 have memory in use with no visible process
    assert len(doc["qualified"]) == 4 and len(doc["rejected"]) == 4 and doc["leases"] == [], doc


def test_pick_gpu_json_wait_timeout(env):
    r = run_cli(
        "pick-gpu",
        "--json",
        "--min-free",
        "1000GiB",
        "--wait",
        "0.2",
        "--interval",
        "0.05",
        "--lease",
        "0",
        scenario="h200_busy",
        env=env,
    )
    doc = one_document(r, 23, "pick-gpu")
    assert doc["waited_s"] >= 0.2 and len(doc["rejected"]) == 8


@pytest.mark.parametrize("args", [("--exclude", "99"), ("--min-free", "lots")])
def test_pick_gpu_json_bad_option_values(env, args):
    r = run_cli("pick-gpu", "--json", *args, scenario="h200_busy", env=env)
    assert r.rc == 2, r
    doc = json.loads(r.out)
    validate(doc, "pick-gpu")
    assert doc["error"]["exit_code"] == 2 and doc["chosen"] == []


def test_pick_gpu_json_unsafe_lease_directory(env, tmp_path: Path):
    unsafe = tmp_path / "open-leases"
    unsafe.mkdir()
    unsafe.chmod(0o777)  # world-writable: anyone could plant a lease file there
    bad = dict(env, CKPTFIX_LEASE_DIR=str(unsafe))
    doc = one_document(run_cli("pick-gpu", "--json", scenario="h200_busy", env=bad), 9, "pick-gpu")
    assert doc["chosen"] == []
    doc = one_document(run_cli("pick-gpu", "--release", "--json", scenario="h200_busy", env=bad), 9, "pick-gpu-release")
    assert doc["leases"] == []


@pytest.mark.parametrize("scenario", ["driver_not_loaded", "only_gpu_lost"])
def test_doctor_json_reports_the_failure_in_its_document(env, scenario):
    # doctor exits 0 whenever it could write the report: the GPU failure is its gpu_error and a problem
    r = run_cli("doctor", "--json", scenario=scenario, env=env)
    assert r.rc == 0, r
    doc = json.loads(r.out)
    validate(doc, "doctor")
    assert f"(exit code {FAILURES[scenario]})" in doc["gpu_error"] and doc["problems"], doc
