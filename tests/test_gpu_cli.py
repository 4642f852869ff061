"""The GPU commands end to end: a real subprocess, a fake ``nvidia-smi`` on PATH, real exit codes.

The fake (tests/fixtures/nvidia-smi/fake-nvidia-smi.sh) replays a named scenario
from tests/fixtures/nvidia-smi/scenarios/, chosen by $FAKE_SMI_SCENARIO.
Every run also reports whether torch ended up in sys.modules.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CLI_PROGRAM, ROOT, SCENARIOS, cli_argv, fake_smi_env, run_cli, run_python, smi_calls

H200_FREE = "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90"  # GPU 2 after release: 0 MiB used


@pytest.fixture
def fake_env(tmp_path: Path) -> dict[str, str]:
    """An environment with the fake nvidia-smi first on PATH and a private lease dir."""
    return fake_smi_env(tmp_path)


# ----------------------------------------------------------------------------- torch stays out


def test_importing_gpu_modules_does_not_import_torch():
    code = (
        "import sys, ckptfix.gpu, ckptfix.gpu.smi, ckptfix.gpu.visible, ckptfix.gpu.pick, ckptfix.gpu.render\n"
        "assert 'torch' not in sys.modules"
    )
    p = run_python(code)
    assert p.returncode == 0, p.stderr


def test_importing_cli_gpu_does_not_import_torch():
    code = "import sys, ckptfix.cli.gpu, ckptfix.gpu\nassert 'torch' not in sys.modules, 'torch imported'\n"
    p = run_python(code)
    assert p.returncode == 0, p.stderr


def test_gpus_and_pick_gpu_never_import_torch(fake_env):
    r = run_cli("gpus", scenario="h200_busy", env=fake_env, isolated=True)
    assert r.rc == 0, r
    assert r.torch_imported is False
    r = run_cli("pick-gpu", scenario="h200_after_release", env=fake_env, isolated=True)
    assert r.rc == 0, r
    assert r.torch_imported is False


def test_doctor_may_import_torch(fake_env):
    r = run_cli("doctor", "--json", scenario="h200_busy", env=fake_env, isolated=True)
    assert r.rc == 0, r
    assert r.torch_imported is True


# ----------------------------------------------------------------------------- gpus


def test_gpus_table_8xh200(fake_env):
    r = run_cli("gpus", scenario="h200_busy", env=fake_env)
    assert r.rc == 0, r
    lines = r.out.splitlines()
    assert lines[0].split() == [
        "cuda",
        "smi",
        "uuid",
        "pci",
        "name",
        "used/total",
        "GiB",
        "free",
        "GiB",
        "util",
        "procs",
    ]
    assert lines[1].split()[:4] == ["cuda:0", "0", "GPU-a44622e3", "18:00.0"]
    assert "NVIDIA H200" in lines[1] and "127.0/140.4" in lines[1]
    assert lines[8].split()[:3] == ["cuda:7", "7", "GPU-28780eb0"]
    assert lines[8].split()[-1] == "1"  # the [Not Found] process still counts
    assert lines[9].startswith("env: CUDA_VISIBLE_DEVICES=<unset>  CUDA_DEVICE_ORDER=<unset> (CUDA uses FASTEST_FIRST)")
    assert "driver=570.124.06" in lines[9] and "(8 of 8 GPUs visible to CUDA)" in lines[9]
    assert r.err == ""
    # one or two nvidia-smi calls, never -L when no GPU has MIG enabled
    calls = smi_calls(fake_env)
    assert sorted(c.split()[0] for c in calls) == ["apps", "query-gpu"]


def test_gpus_json_schema(fake_env):
    r = run_cli("gpus", "--json", scenario="h200_busy", CUDA_VISIBLE_DEVICES="7,GPU-x,2", env=fake_env)
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert doc["schema"] == "ckptfix.gpus/1"
    assert doc["environment"] == {
        "CUDA_VISIBLE_DEVICES": "7,GPU-x,2",
        "CUDA_DEVICE_ORDER": None,
        "effective_order": "FASTEST_FIRST",
    }
    assert doc["physical_gpu_count"] == 8 and doc["order_certain"] is True
    (d,) = doc["devices"]
    for key in (
        "cuda_index",
        "smi_index",
        "uuid",
        "pci_bus_id",
        "name",
        "memory_total_mib",
        "memory_free_mib",
        "utilization_pct",
        "process_count",
    ):
        assert key in d
    assert (d["cuda_index"], d["smi_index"], d["uuid"]) == (0, 7, "GPU-28780eb0-24d5-1f13-59b8-ae5c23617a72")
    assert (d["memory_total_mib"], d["memory_free_mib"], d["utilization_pct"], d["process_count"]) == (
        143771,
        85198,
        0,
        1,
    )
    assert any("'GPU-x' is a UUID after indices" in w for w in doc["warnings"])
    assert [p["code"] for p in doc["problems"]] == ["cvd_truncated"]


def test_gpus_mixed_models_warns_order_uncertain(fake_env):
    r = run_cli("gpus", scenario="mixed", env=fake_env)
    assert r.rc == 0, r
    assert "cuda:0?" in r.out and "T1000" in r.out
    assert "CUDA_DEVICE_ORDER is not PCI_BUS_ID" in r.err
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in r.err
    r = run_cli("gpus", scenario="mixed", CUDA_DEVICE_ORDER="PCI_BUS_ID", env=fake_env)
    assert r.rc == 0 and "cuda:0 " in r.out and "?" not in r.out and r.err == ""


def test_gpus_invalid_device_order_warns(fake_env):
    r = run_cli("gpus", scenario="mixed", CUDA_DEVICE_ORDER="pci_bus_id", env=fake_env)
    assert r.rc == 0, r
    assert "cuda:0?" in r.out  # CUDA reads it as FASTEST_FIRST: still a guess on mixed models
    assert "CUDA_DEVICE_ORDER='pci_bus_id' (invalid: CUDA uses FASTEST_FIRST)" in r.out
    assert "warning: CUDA_DEVICE_ORDER='pci_bus_id' is not a value CUDA knows" in r.err
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID exactly" in r.err
    r = run_cli("gpus", "--json", scenario="h200_busy", CUDA_DEVICE_ORDER="PCI_BUS_IDX", env=fake_env)
    doc = json.loads(r.out)
    assert doc["environment"]["effective_order"] == "FASTEST_FIRST"
    assert [p["code"] for p in doc["problems"]] == ["device_order_invalid"]
    r = run_cli("doctor", "--json", scenario="h200_busy", CUDA_DEVICE_ORDER="pci_bus_id", env=fake_env)
    assert r.rc == 0 and "device_order_invalid" in [p["code"] for p in json.loads(r.out)["problems"]]


def test_gpus_mig_host_lists_mig_devices_as_cuda_rows_and_maps_mig_uuid(fake_env):
    r = run_cli("gpus", "--json", scenario="mig_host", env=fake_env)
    doc = json.loads(r.out)
    devs = doc["devices"]
    # CVD unset: the 4 whole GPUs, then the 16 MIG devices of GPUs 4-7 (7 + 3 + 2 + 4), never their parents
    assert [d["mig_enabled"] for d in devs] == [False] * 4 + [True] * 16
    assert all(d["mig_device"]["uuid"].startswith("MIG-") for d in devs[4:])
    assert devs[4]["mig_device"]["uuid"] == "MIG-1c5876e6-d3b9-524a-9eb4-664fcfbd4de2"
    assert devs[4]["memory_total_mib"] == 5120 and devs[11]["memory_total_mib"] == 10240
    assert not doc["order_certain"]
    (p,) = [p for p in doc["problems"] if p["code"] == "mig_enumeration"]
    assert "MIG-1c5876e6-d3b9-524a-9eb4-664fcfbd4de2" in p["fix"] and "nvidia-smi -L" not in p["fix"]
    table = run_cli("gpus", scenario="mig_host", env=fake_env)
    assert "cuda:4?" in table.out and "MIG-1c5876e6" in table.out and "1g.5gb" in table.out
    assert any(c.startswith("L ") for c in smi_calls(fake_env))
    r = run_cli("gpus", "--json", scenario="mig_host", CUDA_VISIBLE_DEVICES="MIG-4c7db5d8", env=fake_env)
    (d,) = json.loads(r.out)["devices"]
    assert d["smi_index"] == 6 and d["mig_device"]["uuid"] == "MIG-4c7db5d8-f005-5927-803e-9ee984a56e15"


def test_gpus_insufficient_permissions_and_gb10(fake_env):
    r = run_cli("gpus", scenario="k8s_insufficient_permissions", env=fake_env)
    assert r.rc == 0, r
    assert "NVIDIA A100-SXM4-80GB" in r.out and "-/-" in r.out
    assert "[Insufficient Permissions]" in r.err
    r = run_cli("gpus", scenario="gb10_unified_memory", env=fake_env)
    assert r.rc == 0 and "NVIDIA GB10" in r.out and "[N/A]" in r.err


def test_gpus_warning_line_before_output(fake_env):
    r = run_cli("gpus", "--json", scenario="warning_line", env=fake_env)
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert [d["smi_index"] for d in doc["devices"]] == [0, 2, 3]
    assert any("Unable to determine the device handle for GPU1" in w for w in doc["warnings"])
    assert any("exited with code 15 but printed usable output" in w for w in doc["warnings"])


def test_gpus_lost_gpu_makes_cuda_column_a_guess(fake_env):
    r = run_cli("gpus", "--json", scenario="warning_line", env=fake_env)
    doc = json.loads(r.out)
    assert doc["order_certain"] is False
    assert [p["code"] for p in doc["problems"]] == ["gpu_unreadable"]
    r = run_cli("gpus", scenario="warning_line", env=fake_env)
    assert r.out.startswith("cuda ") and "cuda:1?  2" in r.out and "could not read GPU(s) 1" in r.err


def test_gpus_json_marks_memory_used_by_invisible_processes(fake_env):
    r = run_cli("gpus", "--json", scenario="h200_hidden_procs", env=fake_env)
    devs = json.loads(r.out)["devices"]
    assert devs[0]["process_count"] == 0 and devs[0]["hidden_used_mib"] == 130013  # the `0*` row
    assert devs[2]["hidden_used_mib"] == 0  # 0 MiB used: idle


def test_process_list_hang_degrades_to_unknown_counts(fake_env, tmp_path):
    """--query-gpu answers, --query-compute-apps hangs (scenario apps_hang): GPUs are listed, process counts unknown.

    Here the process list hangs for an hour: the command finishing at all (a fresh interpreter, a timeout that only
    catches a hang) shows that it did not wait for it -- no wall-clock budget a loaded machine could exceed."""
    shutil.copytree(SCENARIOS / "apps_hang", tmp_path / "scen" / "apps_hang")
    (tmp_path / "scen" / "apps_hang" / "apps.hang").write_text("3600\n")
    env = dict(fake_env, FAKE_SMI_DIR=str(tmp_path / "scen"))
    r = run_cli("gpus", "--json", "--timeout", "1", scenario="apps_hang", env=env, isolated=True, timeout=900)
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert len(doc["devices"]) == 8
    assert all(d["process_count"] is None and d["hidden_used_mib"] is None for d in doc["devices"])
    (w,) = [w for w in doc["warnings"] if "--query-compute-apps" in w]
    assert "did not answer within 1s: process counts unknown" in w
    r = run_cli("gpus", "--timeout", "1", scenario="apps_hang", env=fake_env)
    assert r.rc == 0, r
    assert [ln.split()[-1] for ln in r.out.splitlines()[1:9]] == ["?"] * 8
    assert "0*" not in r.out  # unknown is not "0 processes": used memory is not blamed on hidden ones
    assert "process counts unknown" in r.err
    # pick-gpu: --max-procs cannot be checked, so it rejects; without it, ranks on memory alone
    r = run_cli("pick-gpu", "--max-procs", "0", "--timeout", "1", scenario="apps_hang", env=fake_env)
    assert r.rc == 22, r
    assert "process count unavailable (--query-compute-apps failed or timed out)" in r.err
    r = run_cli("pick-gpu", "--json", "--lease", "0", "-n", "8", "--timeout", "1", scenario="apps_hang", env=fake_env)
    assert r.rc == 0, r
    chosen = json.loads(r.out)["chosen"]
    assert chosen[0]["smi_index"] == 2 and chosen[0]["process_count"] is None
    assert all("not visible here" not in c["reason"] and "? process(es)" in c["reason"] for c in chosen)


def test_main_query_hang_is_still_an_error(fake_env, tmp_path):
    scen = tmp_path / "scen" / "gpu_hang"
    shutil.copytree(SCENARIOS / "two_free", scen)
    (scen / "query-gpu.hang").write_text("30\n")
    r = run_cli("gpus", "--timeout", "0.5", FAKE_SMI_DIR=str(scen.parent), FAKE_SMI_SCENARIO="gpu_hang", env=fake_env)
    assert r.rc == 25, r
    assert r.err.startswith("Error: nvidia-smi did not answer within 0.5s") and len(r.err.splitlines()) == 1


def test_timeout_must_be_positive(fake_env):
    for command in ("gpus", "pick-gpu", "doctor"):
        r = run_cli(command, "--timeout", "0", scenario="h200_busy", env=fake_env)
        assert r.rc == 2 and "--timeout" in r.err, r


@pytest.mark.parametrize(
    "scenario, code, text",
    [
        ("driver_not_loaded", 26, "cannot talk to the NVIDIA driver"),
        ("lib_mismatch", 27, "driver/library version mismatch (NVML library 535.161)"),
        ("no_devices", 21, "No devices were found"),
        ("no_supported_gpus", 21, "No supported GPUs were found"),
    ],
)
@pytest.mark.parametrize("command", ["gpus", "pick-gpu"])
def test_failures_one_line_and_exit_code(fake_env, scenario, code, text, command):
    r = run_cli(command, scenario=scenario, env=fake_env)
    assert r.rc == code, r
    assert r.out == ""
    assert r.err.startswith("Error: ") and text in r.err and "Traceback" not in r.err
    assert len(r.err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["gpus", "pick-gpu", "doctor"])
def test_nvidia_smi_missing(fake_env, command):
    env = dict(fake_env, PATH="/usr/bin:/bin")
    if shutil.which("nvidia-smi", path=env["PATH"]) or os.path.exists("/dev/dxg"):
        pytest.skip("a real nvidia-smi is installed (or this is WSL2)")
    r = run_cli(command, scenario="h200_busy", env=env)
    if command == "doctor":
        assert r.rc == 0 and "nvidia-smi not found on PATH" in r.out
        return
    assert r.rc == 20, r
    assert r.err.strip() == (  # names the variable that points ckptfix at an nvidia-smi off PATH (issue 34 C6)
        "Error: nvidia-smi not found on PATH: no NVIDIA driver is installed here; run on CPU or install the driver "
        "(if nvidia-smi is elsewhere, set CKPTFIX_NVIDIA_SMI to its path)"
    )


@pytest.mark.parametrize("cvd", ["", "-1", "1,1", "NoDevFiles"])
def test_gpus_cvd_hiding_everything_still_prints_the_document(fake_env, cvd):
    r = run_cli("gpus", "--json", scenario="h200_busy", CUDA_VISIBLE_DEVICES=cvd, env=fake_env)
    assert r.rc == 21, r
    doc = json.loads(r.out)
    assert doc["devices"] == [] and len(doc["physical"]) == 8
    assert {p["cuda_index"] for p in doc["physical"]} == {None}
    (p,) = [p for p in doc["problems"] if p["code"] == "cvd_empty"]
    assert p["fix"]
    assert r.err.count("Error: ") == 1 and "nvidia-smi sees 8 GPU(s) but none is visible to CUDA" in r.err
    t = run_cli("gpus", scenario="h200_busy", CUDA_VISIBLE_DEVICES=cvd, env=fake_env)
    assert t.rc == 21 and t.out.count("\n-  ") == 8 and "(0 of 8 GPUs visible to CUDA)" in t.out, t
    assert "fix:" in t.err


def test_gpus_table_keeps_the_pci_domain_on_a_two_domain_box(fake_env):
    r = run_cli("gpus", scenario="two_domains", env=fake_env)
    assert r.rc == 0, r
    assert "0000:10:00.0" in r.out and "0001:10:00.0" in r.out
    assert "0000:3a:00.0" not in run_cli("gpus", scenario="two_free", env=fake_env).out  # one domain: short form


def test_pick_gpu_ids_index_is_the_pci_order_index(fake_env):
    # nvidia-smi GPU 0 (the freest) sits on bus C1: third in PCI order
    r = run_cli("pick-gpu", "--ids", "index", "--export", "--lease", "0", scenario="pci_order_mismatch", env=fake_env)
    assert r.rc == 0, r
    assert r.out.startswith("export CUDA_VISIBLE_DEVICES=2; export CUDA_DEVICE_ORDER=PCI_BUS_ID"), r
    doc = json.loads(
        run_cli("gpus", "--json", scenario="pci_order_mismatch", CUDA_DEVICE_ORDER="PCI_BUS_ID", env=fake_env).out
    )
    assert [(d["cuda_index"], d["smi_index"]) for d in doc["devices"]] == [(0, 1), (1, 2), (2, 0)]


def test_gpus_mixed_t4_a100_guesses_the_a100s_first(fake_env):
    r = run_cli("gpus", "--json", scenario="mixed_t4_a100", env=fake_env)
    doc = json.loads(r.out)
    assert [d["smi_index"] for d in doc["devices"]] == [1, 2, 0] and not doc["order_certain"]
    assert [g["compute_cap"] for g in doc["physical"]] == ["7.5", "8.0", "8.0"]
    t = run_cli("gpus", scenario="mixed_t4_a100", env=fake_env)
    first = t.out.splitlines()[1]
    assert first.startswith("cuda:0?") and "A100" in first
    assert "CUDA_DEVICE_ORDER is not PCI_BUS_ID" in t.err
    # pick-gpu --ids index with an index CVD: "0" is the guessed cuda:0, an A100
    p = run_cli("pick-gpu", "--lease", "0", "--json", scenario="mixed_t4_a100", CUDA_VISIBLE_DEVICES="0", env=fake_env)
    assert json.loads(p.out)["chosen"][0]["smi_index"] == 1
    assert "different models" in p.err


# ----------------------------------------------------------------------------- pick-gpu


def test_pick_gpu_prints_uuid(fake_env):
    r = run_cli("pick-gpu", scenario="h200_after_release", env=fake_env)
    assert r.rc == 0, r
    assert r.out == H200_FREE + "\n"
    assert "picked GPU 2" in r.err and "leased until" in r.err
    assert len(smi_calls(fake_env)) == 2


def test_pick_gpu_export_and_index_ids(fake_env):
    r = run_cli("pick-gpu", "--export", "-n", "2", "--lease", "0", scenario="h200_after_release", env=fake_env)
    assert r.rc == 0, r
    assert r.out == (
        f"export CUDA_VISIBLE_DEVICES={H200_FREE},GPU-cb449822-5571-be90-8303-e7558da3ea66; "
        "export CUDA_DEVICE_ORDER=PCI_BUS_ID\n"
    )
    r = run_cli("pick-gpu", "--ids", "index", "-n", "4", "--lease", "0", scenario="h200_after_release", env=fake_env)
    assert r.out == "2,4,5,6\n"  # all tie on free GiB, util and processes


def test_pick_gpu_json(fake_env):
    r = run_cli("pick-gpu", "--json", "-n", "2", scenario="h200_after_release", env=fake_env)
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert doc["schema"] == "ckptfix.pick-gpu/1"
    assert [c["smi_index"] for c in doc["chosen"]] == [2, 4]
    assert doc["chosen"][0]["uuid"] == H200_FREE
    assert doc["chosen"][0]["reason"] == (
        "139.9 GiB free, 0% util, 0 process(es); "
        "free memory within 512 MiB of GPU 4 (143,269 MiB vs 143,025 MiB: counted as equal), "
        "same utilization and processes; lower nvidia-smi index"
    )
    assert doc["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert len(doc["leases"]) == 2


def test_pick_gpu_respects_existing_cvd_and_filters(fake_env):
    r = run_cli("pick-gpu", scenario="h200_after_release", CUDA_VISIBLE_DEVICES="0,1,7", env=fake_env)
    assert r.rc == 0, r
    assert r.out.strip() == "GPU-28780eb0-24d5-1f13-59b8-ae5c23617a72"
    r = run_cli(
        "pick-gpu", "--max-procs", "0", scenario="h200_after_release", CUDA_VISIBLE_DEVICES="0,1,7", env=fake_env
    )
    assert r.rc == 22, r
    assert r.err.startswith("Error: no GPU fits the request (need 1 GPU(s), 0 qualify:")
    assert "GPU 7 (NVIDIA H200): 1 process(es) > --max-procs 0" in r.err


def test_pick_gpu_keeps_order_warning_when_index_cvd_chose_candidates(fake_env):
    # CUDA_VISIBLE_DEVICES=0 under FASTEST_FIRST on mixed models may mean an RTX PRO 6000, not the T1000
    r = run_cli("pick-gpu", "--lease", "0", scenario="mixed", CUDA_VISIBLE_DEVICES="0", env=fake_env)
    assert r.rc == 0, r
    assert "GPUs are different models" in r.err
    r = run_cli("pick-gpu", "--lease", "0", scenario="mixed", env=fake_env)  # unset: UUID output is order-proof
    assert r.rc == 0 and "GPUs are different models" not in r.err


def test_pick_gpu_hidden_processes_count_as_busy(fake_env):
    r = run_cli("pick-gpu", "--max-procs", "0", "-n", "8", "--lease", "0", scenario="h200_hidden_procs", env=fake_env)
    assert r.rc == 22
    assert "used with no visible process" in r.err
    r = run_cli("gpus", scenario="h200_hidden_procs", env=fake_env)
    assert "0*" in r.out


def test_pick_gpu_skips_mig_parents_and_unavailable_memory(fake_env):
    r = run_cli("pick-gpu", "-n", "4", "--ids", "index", "--lease", "0", scenario="mig_host", env=fake_env)
    assert r.rc == 0, r
    assert r.out == "0,1,3,2\n"
    r = run_cli("pick-gpu", "-n", "5", "--lease", "0", scenario="mig_host", env=fake_env)
    assert r.rc == 22 and "a CUDA process sees a single MIG instance: -n 5 cannot use MIG devices" in r.err
    r = run_cli("pick-gpu", scenario="k8s_insufficient_permissions", env=fake_env)
    assert r.rc == 22 and "memory is unavailable ([Insufficient Permissions])" in r.err
    # a unified-memory GPU (GB10, Jetson: memory.* [N/A]) is picked with no memory filter, memory marked unknown
    r = run_cli("pick-gpu", "--lease", "0", scenario="gb10_unified_memory", env=fake_env)
    assert r.rc == 0 and r.out == "0\n", r
    assert "memory unknown" in r.err and "unified memory" in r.err, r


def test_pick_gpu_unified_memory(fake_env):
    # issue 34 C1: DGX Spark GB10 (samples/csv_GB10_unified_memory_NA_a.txt) and Jetson Orin ("Orin (nvgpu)")
    for scenario in ("gb10_unified_memory", "jetson_orin"):
        r = run_cli("pick-gpu", "--json", "--lease", "0", scenario=scenario, env=fake_env)
        assert r.rc == 0, r
        (c,) = json.loads(r.out)["chosen"]
        assert c["memory_known"] is False and c["memory_free_mib"] is None and "memory unknown" in c["reason"]
        # --min-free cannot be checked: refused at once, saying why, and --wait is not offered (it cannot help)
        r = run_cli("pick-gpu", "--min-free", "8GiB", scenario=scenario, env=fake_env)
        assert r.rc == 22, r
        assert "memory is unknown on this GPU" in r.err and "unified memory" in r.err, r
        assert "--wait" not in r.err and "drop --min-free" in r.err, r
        r = run_cli(
            "pick-gpu", "--min-free", "8GiB", "--wait", "30", "--interval", "10", scenario=scenario, env=fake_env
        )
        assert r.rc == 22 and "waiting for GPUs" not in r.err, r  # no 30 s wait for what cannot change
        r = run_cli("gpus", "--json", scenario=scenario, env=fake_env)
        (p,) = [p for p in json.loads(r.out)["problems"] if p["code"] == "memory_unavailable"]
        assert "pick-gpu picks it with memory unknown" in p["fix"], p


def test_pick_gpu_command_on_unified_memory(fake_env):
    script = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    r = run_cli("pick-gpu", "--", sys.executable, "-c", script, scenario="gb10_unified_memory", env=fake_env)
    assert r.rc == 0 and r.out == "0\n", r
    assert "memory unknown" in r.err, r


def test_pick_gpu_min_free_and_max_util(fake_env):
    r = run_cli("pick-gpu", "--min-free", "100GiB", scenario="h200_busy", env=fake_env)
    assert r.rc == 22 and "83.2 GiB free < --min-free 100.0 GiB" in r.err
    r = run_cli("pick-gpu", "--min-free", "lots", scenario="h200_busy", env=fake_env)
    assert r.rc == 2 and "cannot read size" in r.err


def test_pick_gpu_runs_command_with_env_and_lease(fake_env, tmp_path):
    script = (
        "import os, json, pathlib, sys; "
        "d = pathlib.Path(os.environ['CKPTFIX_LEASE_DIR']); "
        "print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['CUDA_DEVICE_ORDER']); "
        "print(sorted(p.name for p in d.iterdir())); sys.exit(3)"
    )
    r = run_cli("pick-gpu", "--", sys.executable, "-c", script, scenario="h200_after_release", env=fake_env)
    assert r.rc == 3, r  # the command's exit code
    first, second = r.out.splitlines()
    assert first == f"{H200_FREE} PCI_BUS_ID"
    assert H200_FREE in second
    # after the command the lease is free again: the next pick gets the same GPU
    r = run_cli("pick-gpu", "--lease", "0", scenario="h200_after_release", env=fake_env)
    assert r.out.strip() == H200_FREE


def test_pick_gpu_command_not_found(fake_env):
    r = run_cli("pick-gpu", "--", "no-such-command-xyz", scenario="h200_after_release", env=fake_env)
    assert r.rc == 127 and "command not found: no-such-command-xyz" in r.err


def test_pick_gpu_empty_command_is_not_found(fake_env):
    """``pick-gpu -- ""`` (an unset variable in a script): exit 127 with one line, not an internal error."""
    r = run_cli("pick-gpu", "--", "", scenario="two_free", env=fake_env)
    assert r.rc == 127 and "command not found" in r.err and "internal error" not in r.err, r


def test_pick_gpu_inside_a_pick_gpu_command_gets_the_commands_gpu(fake_env):
    """`ckptfix pick-gpu -- python train.py` with a train.py that calls pick_gpu() itself: the command holds the
    lease (inherited lock, same PID after exec); its own pick_gpu() must get that GPU, not NoGpuFitsError."""
    code = "from ckptfix.gpu import pick_gpu; print('child', pick_gpu().ids[0])"
    r = run_cli("pick-gpu", "--", sys.executable, "-c", code, scenario="two_free", env=fake_env)
    assert r.rc == 0, r
    assert r.out.strip().startswith("child GPU-"), r


SIGNAL_COUNTER = (
    "import os, pathlib, signal, sys, time\n"
    "n = 0\n"
    "def h(s, f):\n"
    "    global n\n"
    "    n += 1\n"
    "signal.signal(signal.SIGINT, h)\n"
    "signal.signal(signal.SIGTERM, h)\n"
    "out = pathlib.Path(sys.argv[1])\n"
    "pathlib.Path(str(out) + '.ready').write_text(str(os.getpid()))\n"
    "t = time.time() + 600\n"
    "while n == 0 and time.time() < t:\n"
    "    time.sleep(0.01)\n"
    "time.sleep(0.5)\n"  # any second delivery arrives in this window
    "out.write_text(str(n))\n"
)


@pytest.mark.parametrize("how", ["timeout", "kill_pid", "kill_group", "sigint_group"])
def test_pick_gpu_command_gets_each_signal_exactly_once(fake_env, tmp_path, how):
    """`pick-gpu -- CMD` execs CMD: one process, so timeout(1), `kill PID`, `kill -- -PGID` and a Ctrl-C
    (SIGINT to the foreground group) each reach the command exactly once; the lease ends with it."""
    import signal

    count = tmp_path / "count"
    ready = Path(str(count) + ".ready")
    env = dict(fake_env, FAKE_SMI_SCENARIO="two_free")
    argv = cli_argv("pick-gpu", "-n", "2", "--", sys.executable, "-c", SIGNAL_COUNTER, str(count))
    if how == "timeout":
        # --foreground: timeout(1) signals only its child (without it, it also signals its own process group, and
        # the command counts 2 when the two deliveries do not coalesce, as on a loaded machine); 15 s: a slow start
        argv = ["timeout", "--foreground", "-s", "TERM", "15"] + argv
    p = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )
    try:
        deadline = time.time() + 600  # only a hang
        while not (ready.exists() and ready.read_text()) and time.time() < deadline and p.poll() is None:
            time.sleep(0.02)
        assert ready.exists(), p.communicate(timeout=600)
        if how != "timeout":
            assert int(ready.read_text()) == p.pid  # exec: the command is the pick-gpu process
            # while it runs, its lease holds both GPUs
            busy = run_cli("pick-gpu", "--lease", "0", "-n", "1", env=env)
            assert busy.rc == 22 and "leased by another job" in busy.err, busy
        if how == "kill_pid":
            os.kill(p.pid, signal.SIGTERM)
        elif how == "kill_group":
            os.killpg(p.pid, signal.SIGTERM)
        elif how == "sigint_group":
            os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    assert count.read_text() == "1", err
    assert p.returncode == (124 if how == "timeout" else 0), err  # timeout(1) reports 124 when it fired
    # the lease ended with the command: both GPUs can be picked again
    again = run_cli("pick-gpu", "--lease", "0", "-n", "2", env=env)
    assert again.rc == 0, again


def test_pick_gpu_command_exit_status_and_signal_death_are_native(fake_env):
    r = run_cli(
        "pick-gpu",
        "--",
        sys.executable,
        "-c",
        "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
        scenario="two_free",
        env=fake_env,
    )
    assert r.rc == -15, r  # killed by SIGTERM, as without pick-gpu (a shell shows 143)


def test_pick_gpu_unusable_lease_dir_is_a_clear_error(fake_env, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    r = run_cli("pick-gpu", scenario="two_free", CKPTFIX_LEASE_DIR=str(not_a_dir), env=fake_env)
    assert r.rc == 9, r
    assert r.err.startswith("Error: cannot take a GPU lease in ") and "CKPTFIX_LEASE_DIR" in r.err
    assert len(r.err.strip().splitlines()) == 1 and r.out == ""


def test_pick_gpu_lease_makes_next_picker_choose_another(fake_env):
    a = run_cli("pick-gpu", "--lease", "60", scenario="two_free", env=fake_env)
    b = run_cli("pick-gpu", "--lease", "60", scenario="two_free", env=fake_env)
    c = run_cli("pick-gpu", "--lease", "60", scenario="two_free", env=fake_env)
    assert a.rc == b.rc == 0
    assert a.out != b.out
    assert c.rc == 22 and "leased by another job" in c.err


def test_two_concurrent_pickers_get_different_gpus(fake_env):
    """Start two `ckptfix pick-gpu` at the same moment (a start barrier), several rounds."""
    barrier = r"""
import os, sys, time
t = float(os.environ["START_AT"])
while time.time() < t:
    time.sleep(0.0005)
"""
    for round_ in range(3):
        lease_dir = Path(fake_env["CKPTFIX_LEASE_DIR"]) / f"r{round_}"
        env = dict(fake_env, FAKE_SMI_SCENARIO="two_free", CKPTFIX_LEASE_DIR=str(lease_dir))
        env["START_AT"] = str(time.time() + 1.5)
        code = barrier + CLI_PROGRAM
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, "pick-gpu", "--lease", "30"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=600) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        picked = {o.strip() for o, _ in outs}
        assert len(picked) == 2, outs


def test_pick_gpu_concurrent_commands_hold_leases(fake_env, tmp_path):
    """While one `pick-gpu -- cmd` runs, a second picker must take the other GPU."""
    flag = tmp_path / "started"
    done = tmp_path / "done"  # the command holds its lease until the second picker has finished, however slow
    hold = (
        f"import pathlib, time; pathlib.Path({str(flag)!r}).write_text('x'); t = time.time() + 600\n"
        f"while not pathlib.Path({str(done)!r}).exists() and time.time() < t: time.sleep(0.05)"
    )
    env = dict(fake_env, FAKE_SMI_SCENARIO="two_free")
    first = subprocess.Popen(
        cli_argv("pick-gpu", "--", sys.executable, "-c", hold),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    deadline = time.time() + 600  # only a hang
    while not flag.exists() and time.time() < deadline:
        time.sleep(0.05)
    second = run_cli("pick-gpu", "--json", env=env)
    done.write_text("x")
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert second.rc == 0, second
    chosen_second = json.loads(second.out)["chosen"][0]["smi_index"]
    assert "picked GPU 0" in err and chosen_second == 1


def test_pick_gpu_wait_times_out_with_own_exit_code(fake_env):
    r = run_cli(
        "pick-gpu", "--min-free", "200GiB", "--wait", "0.6", "--interval", "0.2", scenario="h200_busy", env=fake_env
    )
    assert r.rc == 23, r
    assert r.err.splitlines()[-1].startswith("Error: waited ")
    assert "waiting for GPUs" in r.err
    assert len(smi_calls(fake_env)) >= 4  # re-queried on every check


def test_pick_gpu_wait_succeeds_when_gpu_frees(fake_env, tmp_path):
    # a scenario directory whose content flips from busy to released while we wait
    # (scen/flip is a symlink swapped in one os.replace: the fake nvidia-smi never reads a half-copied or
    # half-flipped scenario, which made this test flaky when the files were overwritten one by one)
    scen = tmp_path / "scen"
    shutil.copytree(SCENARIOS / "h200_busy", tmp_path / "busy")
    shutil.copytree(SCENARIOS / "h200_after_release", tmp_path / "released")
    scen.mkdir()
    (scen / "flip").symlink_to(tmp_path / "busy", target_is_directory=True)
    env = dict(fake_env, FAKE_SMI_DIR=str(scen), FAKE_SMI_SCENARIO="flip")
    p = subprocess.Popen(
        cli_argv("pick-gpu", "--min-free", "100GiB", "--wait", "30", "--interval", "0.2"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    time.sleep(1.0)
    (scen / "flip.new").symlink_to(tmp_path / "released", target_is_directory=True)
    os.replace(scen / "flip.new", scen / "flip")
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert out.strip() == H200_FREE


def test_pick_gpu_cvd_hides_everything(fake_env):
    r = run_cli("pick-gpu", scenario="h200_busy", CUDA_VISIBLE_DEVICES="-1", env=fake_env)
    assert r.rc == 21
    assert "hides all of them" in r.err


# ----------------------------------------------------------------------------- doctor


def test_doctor_json_report(fake_env):
    r = run_cli(
        "doctor",
        "--json",
        scenario="mixed",
        LOCAL_RANK="5",
        WORLD_SIZE="8",
        NCCL_DEBUG="INFO",
        CUDA_VISIBLE_DEVICES="0,1,1",
        env=fake_env,
    )
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert doc["schema"] == "ckptfix.doctor/1"
    assert doc["python"]["version"].count(".") == 2
    assert doc["torch"]["installed"] is True and doc["torch"]["build"] in ("cpu", "cuda", "rocm")
    assert doc["driver_version"] == "580.95.05"
    assert doc["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1,1"
    assert doc["distributed"] == {"LOCAL_RANK": "5", "WORLD_SIZE": "8", "NCCL_DEBUG": "INFO"}
    codes = [p["code"] for p in doc["problems"]]
    if doc["torch"]["cuda"] is None:
        assert "cpu_only_torch" in codes
    assert "cvd_empty" in codes and "master_addr_missing" in codes
    assert all(p["fix"] for p in doc["problems"])


def test_doctor_text(fake_env):
    r = run_cli("doctor", scenario="mixed", env=fake_env)
    assert r.rc == 0, r
    assert r.out.startswith("python:  ")
    assert "driver:  580.95.05" in r.out and "cuda:0?" in r.out
    assert "[order_uncertain]" in r.out and "fix: export CUDA_DEVICE_ORDER=PCI_BUS_ID" in r.out
    r = run_cli("doctor", scenario="driver_not_loaded", env=fake_env)
    assert r.rc == 0 and "[driver_not_loaded]" in r.out and "exit code 26" in r.out


def test_python_m_ckptfix_entry_point(fake_env):
    env = dict(fake_env, FAKE_SMI_SCENARIO="h200_busy")
    p = subprocess.run([sys.executable, "-m", "ckptfix", "gpus"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("cuda")


def test_pick_gpu_release_gives_back_timed_leases(fake_env):
    a = run_cli("pick-gpu", "-n", "2", "--lease", "600", scenario="two_free", env=fake_env)
    assert a.rc == 0, a
    assert run_cli("pick-gpu", "--lease", "0", scenario="two_free", env=fake_env).rc == 22
    r = run_cli("pick-gpu", "--release", "--json", scenario="two_free", env=fake_env)
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert sorted(x["key"] for x in doc["leases"] if x["released"]) == sorted(a.out.strip().split(","))
    assert run_cli("pick-gpu", "-n", "2", "--lease", "0", scenario="two_free", env=fake_env).rc == 0
    again = run_cli("pick-gpu", "--release", scenario="two_free", env=fake_env)
    assert again.rc == 0 and again.out == "" and "nothing to release" in again.err
    bad = run_cli("pick-gpu", "--release", "-n", "2", scenario="two_free", env=fake_env)
    assert bad.rc == 2 and "--release takes no COMMAND" in bad.err


def test_pick_gpu_refuses_a_world_writable_lease_dir(fake_env, tmp_path):
    d = tmp_path / "shared-leases"
    d.mkdir()
    d.chmod(0o777)
    r = run_cli("pick-gpu", scenario="two_free", CKPTFIX_LEASE_DIR=str(d), env=fake_env)
    assert r.rc == 9 and r.out == "", r
    assert r.err.startswith("Error: refusing the GPU lease directory") and f"chmod 700 {d}" in r.err
    assert len(r.err.strip().splitlines()) == 1 and list(d.iterdir()) == []
