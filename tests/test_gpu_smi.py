"""Pure nvidia-smi parser tests over the real samples, plus query() with an injected runner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if not any(Path(p, "ckptfix", "__init__.py").exists() for p in sys.path if p):  # a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptfix.errors import DriverMismatchError, DriverNotLoadedError, GpuQueryError, GpuToolingError, NoGpuError
from ckptfix.gpu import parse, runner, smi
from ckptfix.gpu.runner import RunResult

from fakesmi import scenario_runner

SAMPLES = Path(__file__).parent / "fixtures" / "nvidia-smi" / "samples"
SCENARIOS = Path(__file__).parent / "fixtures" / "nvidia-smi" / "scenarios"


def sample(name: str) -> str:
    text = (SAMPLES / name).read_text()
    assert text.startswith("# SOURCE")
    return text.split("\n", 1)[1]


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    "raw, value, placeholder",
    [
        ("130013 MiB", "130013 MiB", None),
        (" [N/A]", None, "N/A"),
        ("N/A", None, "N/A"),
        ("[Not Supported]", None, "Not Supported"),
        ("[Insufficient Permissions]", None, "Insufficient Permissions"),
        ("[Unknown Error]", None, "Unknown Error"),
        ("[Not Found]", None, "Not Found"),
        ("", None, "empty"),
    ],
)
def test_parse_value(raw, value, placeholder):
    assert parse.parse_value(raw) == (value, placeholder)


@pytest.mark.parametrize(
    "text, mib, expected",
    [
        ("130013 MiB", True, 130013),
        ("130013", True, 130013),
        ("2 GiB", True, 2048),
        ("100 %", False, 100),
        ("11.17 W", False, 11.17),
        ("junk", False, None),
        (None, False, None),
        ("5 parsecs", True, None),
    ],
)
def test_parse_number(text, mib, expected):
    assert parse.parse_number(text, mib=mib) == expected


# ----------------------------------------------------------------------------- --query-gpu samples


def test_h200_with_header_and_units():
    gpus, warnings = parse.parse_gpu_csv(sample("csv_8xH200_busy_units.txt"))
    assert warnings == []
    assert [g.index for g in gpus] == list(range(8))
    g7 = gpus[7]
    assert (g7.uuid, g7.memory_used_mib, g7.memory_total_mib, g7.utilization_pct) == (
        "GPU-28780eb0-24d5-1f13-59b8-ae5c23617a72",
        58071,
        143771,
        0,
    )
    assert g7.memory_free_mib == 143771 - 58071  # derived: the sample has no memory.free column


def test_noheader_nounits_titanx_with_explicit_fields():
    fields = ["index", "uuid", "name", "temperature.gpu", "utilization.gpu", "memory.used", "memory.total"]
    gpus, warnings = parse.parse_gpu_csv(sample("csv_noheader_nounits_8xTITANX_busy.txt"), fields)
    assert warnings == [] and len(gpus) == 8
    assert (gpus[0].name, gpus[0].memory_used_mib, gpus[0].memory_free_mib, gpus[0].temperature_c) == (
        "GeForce GTX TITAN X",
        802,
        12206 - 802,
        25.0,
    )


def test_noheader_units_kept():
    gpus, _ = parse.parse_gpu_csv(
        sample("csv_noheader_units_mixed_models_order_mismatch.txt"), ["name", "memory.total", "index"]
    )
    assert [(g.index, g.name, g.memory_total_mib) for g in gpus] == [
        (0, "NVIDIA GeForce GTX 1660 SUPER", 6144),
        (1, "NVIDIA GeForce RTX 3090", 24576),
    ]


def test_name_with_spaces_and_bare_na():
    fields = [
        "power.limit",
        "power.min_limit",
        "power.max_limit",
        "memory.total",
        "vbios_version",
        "driver_version",
        "name",
        "uuid",
        "power.draw",
        "temperature.gpu",
        "temperature.memory",
        "clocks.current.graphics",
        "clocks.sm",
        "clocks.mem",
        "utilization.gpu",
        "utilization.memory",
        "fan.speed",
        "pcie.link.width.current",
        "pstate",
    ]
    (g,), warnings = parse.parse_gpu_csv(sample("csv_noheader_nounits_bare_NA_no_brackets_driver440.txt"), fields)
    assert warnings == []
    assert (g.name, g.uuid, g.power_w, g.utilization_pct, g.driver_version) == (
        "GeForce RTX 2080",
        "GPU-22b2c6ac-2d49-4863-197c-9c469071178a",
        176.98,
        86,
        "440.64",
    )
    assert g.unavailable_reason("temperature.memory") == "N/A"


def test_name_with_comma_is_merged():
    text = "index, uuid, name, memory.total [MiB]\n0, GPU-1, NVIDIA Foo, Bar Edition, 100 MiB\n"
    (g,), warnings = parse.parse_gpu_csv(text)
    assert (g.name, g.memory_total_mib, warnings) == ("NVIDIA Foo, Bar Edition", 100, [])


@pytest.mark.parametrize(
    "name, placeholder",
    [
        ("csv_noheader_nounits_fan_NA_newdriver.txt", "N/A"),
        ("csv_noheader_nounits_fan_NotSupported_olddriver.txt", "Not Supported"),
    ],
)
def test_fan_placeholder_changes_across_drivers(name, placeholder):
    fields = [
        "memory.total",
        "memory.free",
        "memory.used",
        "temperature.gpu",
        "fan.speed",
        "utilization.gpu",
        "utilization.memory",
    ]
    (g,), _ = parse.parse_gpu_csv(sample(name), fields)
    assert (g.memory_total_mib, g.memory_free_mib, g.unavailable_reason("fan.speed")) == (2004, 2004, placeholder)


def test_insufficient_permissions_and_mig_parent_na():
    (g,), _ = parse.parse_gpu_csv(sample("csv_k8s_MIG_A100_insufficient_permissions.txt"))
    assert (g.index, g.uuid, g.name, g.memory_free_mib, g.utilization_pct) == (
        0,
        None,
        "NVIDIA A100-SXM4-80GB",
        None,
        None,
    )
    assert g.unavailable_reason("memory.free") == "Insufficient Permissions"
    assert g.unavailable_reason("utilization.gpu") == "N/A"


@pytest.mark.parametrize("name", ["csv_GB10_unified_memory_NA_a.txt", "csv_GB10_unified_memory_NA_b.txt"])
def test_gb10_memory_na(name):
    (g,), _ = parse.parse_gpu_csv(sample(name))
    assert g.memory_total_mib is None and g.memory_free_mib is None
    assert g.unavailable_reason("memory.total") == "N/A"


def test_gb10_loop_mode_rows():
    gpus, _ = parse.parse_gpu_csv(sample("csv_GB10_loop_l1.txt"))
    assert [g.utilization_pct for g in gpus] == [0, 2, 0, 0, 0]


def test_unknown_error_rows_are_kept_as_unavailable():
    gpus, warnings = parse.parse_gpu_csv(
        sample("csv_loop_mode_Unknown_Error_rows.txt"),
        ["utilization.gpu", "utilization.encoder", "utilization.decoder"],
    )
    assert warnings == []
    assert [g.utilization_pct for g in gpus] == [0, None, None]
    assert gpus[1].unavailable_reason("utilization.gpu") == "Unknown Error"


def test_mig_mode_and_vgpu_samples():
    fields = ["index", "name", "uuid", "driver_version", "memory.total", "mig.mode.current"]
    gpus, _ = parse.parse_gpu_csv(sample("csv_noheader_2xRTXPRO6000_Server_mig_mode.txt"), fields)
    assert [(g.index, g.mig_enabled, g.memory_total_mib) for g in gpus] == [(4, False, 97887), (5, False, 97887)]
    (g,), _ = parse.parse_gpu_csv(
        sample("csv_noheader_nounits_vGPU_MIG_H100L.txt"), ["clocks.max.sm", "memory.total", "gpu_name"]
    )
    assert (g.name, g.memory_total_mib) == ("NVIDIA H100L-2-24C", 24576)


def test_pci_bus_ids_kept_verbatim():
    gpus, _ = parse.parse_gpu_csv(sample("csv_mixed_T1000_2xRTXPRO6000_pci_order.txt"))
    assert [g.pci_bus_id for g in gpus] == ["00000000:47:00.0", "00000000:5E:00.0", "00000000:75:00.0"]
    gpus, _ = parse.parse_gpu_csv(sample("csv_mixed_5060Ti_5060_driver580.txt"))
    assert [g.driver_version for g in gpus] == ["580.173.02"] * 2


def test_warning_line_before_output():
    text = sample("err_device_handle_unknown_error_prefix_line.txt") + sample("csv_8xH200_after_release.txt")
    gpus, warnings = parse.parse_gpu_csv(text)
    assert len(gpus) == 8
    assert warnings == ["Unable to determine the device handle for GPU1: 0000:34:00.0: Unknown Error"]


# ----------------------------------------------------------------------------- apps and -L


def test_apps_not_found_process():
    procs, warnings = parse.parse_apps_csv(sample("apps_8xH200_with_NotFound_process.txt"))
    assert warnings == [] and len(procs) == 8
    assert procs[-1] == smi.GpuProcess("GPU-28780eb0-24d5-1f13-59b8-ae5c23617a72", 1758887, None, 58060)


def test_apps_header_only_and_empty():
    assert parse.parse_apps_csv(sample("apps_header_only_no_processes.txt")) == ([], [])
    assert parse.parse_apps_csv("") == ([], [])


def test_apps_same_pid_on_two_gpus():
    apps_part, gpu_part = sample("apps_and_csv_4gpu_same_pid_two_gpus.txt").split("index, uuid", 1)
    procs, _ = parse.parse_apps_csv(apps_part, ["gpu_uuid", "pid", "used_memory"])
    assert [p.pid for p in procs] == [1912379, 3891903, 1912379]
    gpus, _ = parse.parse_gpu_csv("index, uuid" + gpu_part)
    assert [g.memory_used_mib for g in gpus] == [529, 5, 74709, 567]


def test_list_modern_mig():
    gpus, migs, junk = parse.parse_list(sample("L_dgxa100_8xA100-40GB_mixed_MIG.txt"))
    assert len(gpus) == 8 and len(migs) == 7 + 3 + 2 + 4 and junk == []
    assert migs[-1].profile == "1g.5gb" and migs[-1].parent_index == 7 and migs[-1].device_index == 3


def test_list_docs_rendered_without_indent():
    gpus, migs, junk = parse.parse_list(sample("L_docs_R470_8xA100_every_MIG_layout_DOCS_RENDERED.txt"))
    assert len(gpus) == 8 and len(migs) == 26 and junk == []
    assert {m.profile for m in migs if m.parent_index == 6} == {"1c.7g.40gb", "2c.7g.40gb", "3c.7g.40gb"}


@pytest.mark.parametrize(
    "name, n", [("L_legacy_R460_MIG-GPU_uuid_format_6xA100.txt", 4), ("L_legacy_gpu_operator_docs_7x1g5gb.txt", 7)]
)
def test_list_legacy_mig_ids(name, n):
    _, migs, _ = parse.parse_list(sample(name))
    assert len(migs) == n
    assert all(m.uuid == f"MIG-{m.parent_uuid}/{m.uuid.split('/')[1]}/0" for m in migs)


def test_list_container_renumbered():
    gpus, migs, _ = parse.parse_list(sample("L_container_2xMIG7g_renumbered.txt"))
    assert [g[0] for g in gpus] == [0, 1] and gpus[0][2] == "GPU-9e13f17f-a213-eb38-9a9c-0b2a540e4908"


# ----------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "name, rc, cls, code",
    [
        ("err_driver_not_loaded_rc9.txt", 9, DriverNotLoadedError, 26),
        ("err_driver_lib_version_mismatch_rc18.txt", 18, DriverMismatchError, 27),
        ("err_no_devices_found.txt", 6, NoGpuError, 21),
        ("err_no_supported_gpus_rc255.txt", 255, NoGpuError, 21),
    ],
)
def test_classify_failure(name, rc, cls, code):
    err = parse.classify_failure(rc, sample(name))
    assert type(err) is cls and err.exit_code == code
    assert isinstance(err, NoGpuError)  # scripts catching NoGpuError fall back to CPU for all of these
    assert "run on CPU" in str(err)


def test_classify_by_text_even_with_other_rc():
    assert isinstance(parse.classify_failure(0, sample("err_no_devices_found.txt")), NoGpuError)
    assert isinstance(parse.classify_failure(1, "", sample("err_driver_not_loaded_rc9.txt")), DriverNotLoadedError)
    assert parse.classify_failure(3, "something else") is None


# ----------------------------------------------------------------------------- query() with an injected runner


def test_query_h200_two_calls_processes_attached():
    calls: list[list[str]] = []
    snap = smi.query(runner=scenario_runner("h200_busy", calls))
    assert snap.calls == 2 and len(calls) == 2
    assert calls[0][1].startswith("--query-gpu=index,uuid,pci.bus_id,name,memory.total")
    assert calls[0][2] == "--format=csv,nounits"
    assert snap.driver_version == "570.124.06" and snap.processes_known
    assert [g.process_count for g in snap.gpus] == [1] * 8
    assert snap.gpus[7].processes[0].name is None


def test_query_mig_host_lists_mig_devices_with_third_call():
    snap = smi.query(runner=scenario_runner("mig_host"))
    assert snap.calls == 3 and snap.mig_listed
    assert [len(g.mig_devices) for g in snap.gpus] == [0, 0, 0, 0, 7, 3, 2, 4]


def test_query_mig_requested_lists_in_the_first_round_once():
    calls: list[list[str]] = []
    snap = smi.query(runner=scenario_runner("mig_host", calls), mig=True)
    assert snap.calls == 3 and snap.mig_listed and sum(len(g.mig_devices) for g in snap.gpus) == 16
    assert [c[1] for c in calls] == [calls[0][1], calls[1][1], "-L"]  # one round: gpu, apps, -L
    assert sum(c[1:] == ["-L"] for c in calls) == 1


#: a Tesla K80 on driver 418.67 (issue 34 C2): what R418 answers for each field it knows; it has neither
#: mig.mode.current (R450+) nor compute_cap (R510+) and rejects the first unknown field it meets, as
#: `Field "mig.mode.current" is not a valid field to query.` (the message of tests in this file and of the
#: public bug reports the stand-ins come from); values in the format of --format=csv,nounits
_R418_K80 = {
    "index": "0",
    "uuid": "GPU-5d1b4e36-1c7a-0f63-2a4b-7f3e9c0d8a21",
    "pci.bus_id": "00000000:04:00.0",
    "name": "Tesla K80",
    "memory.total": "11441",
    "memory.used": "0",
    "memory.free": "11441",
    "utilization.gpu": "0",
    "temperature.gpu": "33",
    "power.draw": "28.00",
    "clocks.max.sm": "875",
    "driver_version": "418.67",
}


def _r418_runner(seen):
    def runner(argv, timeout):
        seen.append(argv[1])
        if not argv[1].startswith("--query-gpu="):
            return RunResult(0, "")
        asked = argv[1].split("=", 1)[1].split(",")
        bad = next((f for f in asked if f not in _R418_K80), None)
        if bad is not None:
            return RunResult(2, f'Field "{bad}" is not a valid field to query.\n\n')
        return RunResult(0, ", ".join(_R418_K80[f] for f in asked) + "\n")

    return runner


def test_query_retries_without_only_the_rejected_fields():
    seen: list[str] = []
    snap = smi.query(runner=_r418_runner(seen))
    g = snap.gpus[0]
    assert g.name == "Tesla K80" and g.memory_free_mib == 11441
    # issue 34 C2: temperature and power survive the retries (they were dropped with mig.mode.current)
    assert g.temperature_c == 33 and g.power_w == 28.0 and g.max_sm_clock_mhz == 875
    assert g.mig_enabled is None and g.compute_cap is None
    gpu_calls = [c for c in seen if c.startswith("--query-gpu=")]
    assert len(gpu_calls) == 3 and "mig.mode.current" not in gpu_calls[-1] and "compute_cap" not in gpu_calls[-1]


def test_r418_gpus_pass_max_temp_and_max_power(tmp_path):
    from ckptfix.gpu import pick_gpu

    got = pick_gpu(
        max_temp=80, max_power=100, environ={"CKPTFIX_LEASE_DIR": str(tmp_path)}, runner=_r418_runner([]), lease=False
    )
    assert got.env["CUDA_VISIBLE_DEVICES"] == _R418_K80["uuid"]


def test_query_falls_back_to_basic_fields_when_no_field_is_named():
    def runner(argv, timeout):
        if argv[1].startswith("--query-gpu=") and "temperature.gpu" in argv[1]:
            return RunResult(2, "Some field is not a valid field to query.\n")
        if argv[1].startswith("--query-gpu="):
            return RunResult(0, "0, GPU-1, 00000000:01:00.0, Tesla K80, 11441, 0, 11441, 0, 418.67\n")
        return RunResult(0, "")

    snap = smi.query(runner=runner)
    assert snap.gpus[0].memory_free_mib == 11441 and snap.calls == 3


def test_query_failures_map_to_errors():
    with pytest.raises(DriverNotLoadedError):
        smi.query(runner=scenario_runner("driver_not_loaded"))
    with pytest.raises(DriverMismatchError, match="535.161"):
        smi.query(runner=scenario_runner("lib_mismatch"))
    with pytest.raises(NoGpuError, match="No devices were found"):
        smi.query(runner=scenario_runner("no_devices"))
    with pytest.raises(GpuQueryError, match="exited with code 3"):
        smi.query(runner=lambda argv, t: RunResult(3, "garbage\n"))
    with pytest.raises(NoGpuError):
        smi.query(runner=lambda argv, t: RunResult(0, ""))


def test_query_apps_failure_is_a_warning():
    def runner(argv, timeout):
        if argv[1].startswith("--query-compute-apps"):
            return RunResult(4, "Insufficient Permissions\n")
        return scenario_runner("h200_busy")(argv, timeout)

    snap = smi.query(runner=runner)
    assert not snap.processes_known and snap.gpus[0].process_count is None
    assert any("process counts unknown" in w for w in snap.warnings)


def test_query_apps_timeout_degrades_to_unknown_process_counts():
    snap = smi.query(runner=scenario_runner("apps_hang"), timeout=1)
    assert len(snap.gpus) == 8 and not snap.processes_known
    assert all(g.process_count is None for g in snap.gpus)
    (w,) = [w for w in snap.warnings if "--query-compute-apps" in w]
    assert "did not answer within 1s: process counts unknown" in w

    def main_hangs(argv, timeout):
        if argv[1].startswith("--query-gpu"):
            raise GpuQueryError("nvidia-smi did not answer within 1s")
        return scenario_runner("h200_busy")(argv, timeout)

    with pytest.raises(GpuQueryError, match="did not answer"):  # the main query keeps its error
        smi.query(runner=main_hangs)


def test_query_apps_failure_says_why():
    def runner(argv, timeout):
        if argv[1].startswith("--query-compute-apps"):
            return RunResult(15, "", "Unable to determine the device handle for GPU1: Unknown Error\n")
        return scenario_runner("h200_busy")(argv, timeout)

    snap = smi.query(runner=runner)
    (w,) = [w for w in snap.warnings if "--query-compute-apps" in w]
    assert "failed (code 15: Unable to determine the device handle for GPU1: Unknown Error)" in w


def test_run_parallel_optional_call_times_out_alone(tmp_path):
    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\nexec sleep 600\n")  # a hang: waiting for it would fail the test below
    slow.chmod(0o755)
    fast = tmp_path / "fast"
    fast.write_text("#!/bin/sh\necho ok\n")
    fast.chmod(0o755)
    a, b = runner.run_parallel([[str(fast)], [str(slow)]], 3, frozenset({1}))  # 3 s: room for a slow `fast`
    assert (a.returncode, a.stdout, a.timed_out) == (0, "ok\n", False)
    assert b.timed_out and b.stdout == ""
    with pytest.raises(GpuQueryError, match="did not answer"):  # not optional: still an error
        runner.run_parallel([[str(slow)], [str(fast)]], 0.3, frozenset({1}))


def test_find_nvidia_smi_missing_and_override(tmp_path):
    with pytest.raises(GpuToolingError, match="nvidia-smi not found on PATH"):
        runner.find_nvidia_smi({"PATH": str(tmp_path)})
    assert runner.find_nvidia_smi({"CKPTFIX_NVIDIA_SMI": "/opt/x/nvidia-smi"}) == "/opt/x/nvidia-smi"


def _wsl(tmp_path, *, device: bool, smi: bool):
    """A WSL2 stand-in: ``dxg`` (the device /dev/dxg) and ``wsl/lib/nvidia-smi`` where WSL keeps it."""
    lib = tmp_path / "wsl" / "lib"
    lib.mkdir(parents=True)
    if smi:
        (lib / "nvidia-smi").write_text("#!/bin/sh\n")
        (lib / "nvidia-smi").chmod(0o755)
    dxg = tmp_path / "dxg"
    if device:
        dxg.write_text("")
    empty = tmp_path / "bin"
    empty.mkdir()
    return {"PATH": str(empty)}, {"wsl_dir": str(lib), "wsl_device": str(dxg)}, lib / "nvidia-smi"


def test_find_nvidia_smi_on_wsl2_off_path(tmp_path):
    # issue 34 C6: WSL2 keeps nvidia-smi in /usr/lib/wsl/lib, off PATH for root, SSH and services
    env, where, smi = _wsl(tmp_path, device=True, smi=True)
    assert runner.find_nvidia_smi(env, **where) == str(smi)
    on_path = tmp_path / "bin" / "nvidia-smi"  # one on PATH still wins
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert runner.find_nvidia_smi(env, **where) == str(on_path)


def test_find_nvidia_smi_wsl_dir_only_on_wsl2(tmp_path):
    env, where, _ = _wsl(tmp_path, device=False, smi=True)  # no /dev/dxg: not WSL, the folder is not looked in
    with pytest.raises(GpuToolingError, match="CKPTFIX_NVIDIA_SMI") as e:
        runner.find_nvidia_smi(env, **where)
    assert "not found on PATH: no NVIDIA driver is installed here" in str(e.value)


def test_find_nvidia_smi_wsl2_without_it_says_where_it_looked(tmp_path):
    env, where, _ = _wsl(tmp_path, device=True, smi=False)
    with pytest.raises(GpuToolingError) as e:
        runner.find_nvidia_smi(env, **where)
    msg = str(e.value)
    assert where["wsl_dir"] in msg and "WSL2" in msg and "CKPTFIX_NVIDIA_SMI" in msg and "Windows" in msg


def test_subprocess_runner_timeout_and_missing(tmp_path):
    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\nsleep 5\n")
    slow.chmod(0o755)
    with pytest.raises(GpuQueryError, match="did not answer within 0.2s"):
        runner.subprocess_runner([str(slow)], 0.2)
    with pytest.raises(GpuQueryError, match="did not answer"):
        runner.run_parallel([[str(slow)], [str(slow)]], 0.2)
    with pytest.raises(GpuToolingError):
        runner.subprocess_runner([str(tmp_path / "nope")], 1)
    with pytest.raises(GpuToolingError):
        runner.run_parallel([[str(tmp_path / "nope")]], 1)


def test_processes_on_a_gpu_query_gpu_did_not_list_are_warned_about():
    def runner(argv, timeout):
        if argv[1].startswith("--query-gpu="):
            return RunResult(
                0, "0, GPU-1, 00000000:01:00.0, Tesla T4, 15360, 900, 14460, 0, 30, 27.0, [N/A], 7.5, 1590, 550.54.15\n"
            )
        if argv[1].startswith("--query-compute-apps="):
            return RunResult(0, "GPU-1, 11, python, 300\nGPU-2, 42, python, 600\nGPU-2, 43, python, 10\n")
        return RunResult(0, "")

    snap = smi.query(runner=runner)
    assert snap.gpus[0].process_count == 1
    (w,) = [w for w in snap.warnings if "did not list" in w]
    assert "2 compute process(es) (pid 42, 43) on GPU-2" in w
    assert snap.gpus[0].compute_cap == (7, 5) and snap.gpus[0].max_sm_clock_mhz == 1590


def test_compute_cap_rejected_by_an_old_driver_falls_back_keeping_mig_mode():
    seen: list[str] = []

    def runner(argv, timeout):
        seen.append(argv[1])
        if argv[1].startswith("--query-gpu=") and "compute_cap" in argv[1]:
            return RunResult(2, 'Field "compute_cap" is not a valid field to query.\n')
        if argv[1].startswith("--query-gpu="):
            row = "0, GPU-1, 00000000:01:00.0, A100, 40960, 0, 40536, 0, 30, 50.0, Disabled, 1410, 470.82.01\n"
            return RunResult(0, row)
        return RunResult(0, "")

    snap = smi.query(runner=runner)
    g = snap.gpus[0]
    assert g.mig_enabled is False and g.compute_cap is None and snap.calls == 3
    assert "mig.mode.current" in seen[-1] and "compute_cap" not in seen[-1]
    assert g.max_sm_clock_mhz == 1410  # only the rejected field is dropped


def test_parser_doctests():
    import doctest

    res = doctest.testmod(parse, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0 and res.attempted > 0
