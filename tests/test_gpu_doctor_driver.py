"""doctor files driver problems under their own codes, each with a fix (issue 23, item 8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptfix.gpu.doctor import doctor_report

from fakesmi import scenario_runner
from helpers import fake_smi_env, run_cli


@pytest.mark.parametrize(
    "scenario, code, fix",
    [
        ("driver_not_loaded", "driver_not_loaded", "modprobe nvidia"),
        ("lib_mismatch", "driver_mismatch", "reboot"),
        ("no_devices", "no_gpu", "dmesg"),
    ],
)
def test_driver_problems_have_their_code_and_a_fix(scenario, code, fix):
    report = doctor_report(env={}, runner=scenario_runner(scenario))
    (p,) = [p for p in report.problems if p.code == code]
    assert fix in p.fix, p
    assert all(q.fix for q in report.problems), report.problems


def test_no_nvidia_smi_has_a_fix(tmp_path: Path):
    env = fake_smi_env(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("doctor", "--json", env=dict(env, PATH=str(empty) + ":/usr/bin:/bin"))
    assert r.rc == 0, r
    doc = json.loads(r.out)
    (p,) = [p for p in doc["problems"] if p["code"] == "no_gpu"]
    assert "install the NVIDIA driver" in p["fix"], p
