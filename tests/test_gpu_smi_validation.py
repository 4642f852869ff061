"""Every --query-gpu row is validated (column count, number and unit of each field): a decimal comma or a
shifted row is an error naming the field, never a pick (issue 23, item 3); a GPU that fell off the bus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptfix.errors import GpuOutputError
from ckptfix.gpu import parse
from ckptfix.gpu.visible import visible_gpus

from fakesmi import scenario_runner
from helpers import fake_smi_env, run_cli

SAMPLES = Path(__file__).parent / "fixtures" / "nvidia-smi" / "samples"
HEADER = "index, uuid, pci.bus_id, name, memory.total [MiB], memory.used [MiB], memory.free [MiB], utilization.gpu [%]"


@pytest.fixture
def fake_env(tmp_path: Path) -> dict[str, str]:
    return fake_smi_env(tmp_path)


def test_decimal_comma_is_refused_naming_the_field():
    with pytest.raises(GpuOutputError) as ei:
        visible_gpus(env={}, runner=scenario_runner("comma_locale"))
    msg = str(ei.value)
    assert "field power.draw is '118,41', a decimal comma" in msg, msg
    assert "LC_ALL=C" in msg and ei.value.exit_code == 28


def test_decimal_comma_without_header():
    # nounits, no header (the case): 47,5 W used to shift every later column
    fields = ["index", "uuid", "name", "memory.total", "memory.free", "power.draw", "compute_cap"]
    text = "0, GPU-1, NVIDIA X, 81559, 80000, 47,5, 9.0\n"
    with pytest.raises(GpuOutputError, match=r"field power.draw is '47,5', a decimal comma"):
        parse.parse_gpu_csv(text, fields)
    text = "0, GPU-1, NVIDIA X, 81559, 80000, 47.5, 9,0\n"
    with pytest.raises(GpuOutputError, match=r"field compute_cap is '9,0', a decimal comma"):
        parse.parse_gpu_csv(text, fields)


@pytest.mark.parametrize(
    "row, field, why",
    [
        ("0, GPU-1, 00000000:3A:00.0, NVIDIA H200, 143771 MHz, 0, 143269, 0", "memory.total", "unit 'MHz'"),
        ("0, GPU-1, 00000000:3A:00.0, NVIDIA H200, 143771, 0, 143269, 0 W", "utilization.gpu", "unit 'W'"),
        ("0, GPU-1, 00000000:3A:00.0, NVIDIA H200, 143771, 0, lots, 0", "memory.free", "not a size in MiB"),
        ("0, GPU-1, 3A:00, NVIDIA H200, 143771, 0, 143269, 0", "pci.bus_id", "not a PCI bus id"),
        ("0, GPU-1, 00000000:3A:00.0, NVIDIA H200, 143771, 150000, 143269, 0", "memory.used", "larger than"),
    ],
)
def test_a_field_that_does_not_fit_is_named(row, field, why):
    with pytest.raises(GpuOutputError) as ei:
        parse.parse_gpu_csv(f"{HEADER}\n{row}\n")
    assert f"field {field} is" in str(ei.value) and why in str(ei.value), ei.value


def test_a_gpu_row_with_missing_columns_is_an_error_not_a_warning():
    with pytest.raises(GpuOutputError, match=r"6 fields where 8 were asked"):
        parse.parse_gpu_csv(f"{HEADER}\n0, GPU-1, 00000000:3A:00.0, NVIDIA H200, 143771, 0\n")


def test_gib_units_are_still_converted_and_names_with_commas_still_merge():
    (g,), w = parse.parse_gpu_csv(
        f"{HEADER}\n0, GPU-1, 00000000:3A:00.0, NVIDIA Foo, Bar, 80 GiB, 1 GiB, 79 GiB, 5 %\n"
    )
    assert (g.name, g.memory_total_mib, g.memory_free_mib, g.utilization_pct, w) == (
        "NVIDIA Foo, Bar",
        81920,
        80896,
        5,
        [],
    )


def test_pick_gpu_in_a_comma_locale_picks_nothing(fake_env):
    r = run_cli("pick-gpu", "--lease", "0", scenario="comma_locale", env=fake_env)
    assert r.rc == 28, r
    assert r.out == "" and "power.draw" in r.err and r.err.count("\n") == 1, r
    r = run_cli("gpus", "--json", scenario="comma_locale", env=fake_env)
    assert r.rc == 28 and "Traceback" not in r.err, r


def test_fallen_off_gpu_is_warned_about_and_the_rest_are_usable(fake_env):
    r = run_cli("gpus", "--json", scenario="fallen_off", env=fake_env)
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert [d["smi_index"] for d in doc["physical"]] == [0, 1, 2, 4, 5, 6, 7]
    assert any("GPU is lost" in w for w in doc["warnings"]), doc["warnings"]
    assert any(p["code"] == "gpu_unreadable" for p in doc["problems"]), doc["problems"]
    r = run_cli("pick-gpu", "--lease", "0", scenario="fallen_off", env=fake_env)
    assert r.rc == 0 and r.out.strip() == "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90", r


@pytest.mark.parametrize(
    "name", ["csv_recorded_1xH200_driver580_units.txt", "csv_recorded_1xH200_driver580_nounits.txt"]
)
def test_real_h200_rows_pass_validation(name):
    text = (SAMPLES / name).read_text().split("\n", 1)[1]
    (g,), warnings = parse.parse_gpu_csv(text)
    assert warnings == []
    assert (g.name, g.memory_total_mib, g.compute_cap, g.max_sm_clock_mhz, g.driver_version) == (
        "NVIDIA H200",
        143771,
        (9, 0),
        1980,
        "580.159.04",
    )
    assert 0 < (g.power_w or 0) < 1000 and g.mig_enabled is False
