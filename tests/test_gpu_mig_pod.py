"""MIG: a CUDA process sees a single MIG instance (warned, only that one shown), and pick-gpu leases MIG devices
by UUID, e.g. in a pod given MIG slices (issue 23, item 5)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ckptfix.gpu.pick import Criteria, rank_gpus
from ckptfix.gpu.visible import visible_gpus

from fakesmi import scenario_runner
from helpers import fake_smi_env, run_cli

POD_A = "MIG-ac2471ee-ea05-55fe-b7d7-8c31210e7a6e"
POD_B = "MIG-960c229f-92b5-5543-8eb5-2999f26ef6b8"


@pytest.fixture
def fake_env(tmp_path: Path) -> dict[str, str]:
    return fake_smi_env(tmp_path)


def test_two_mig_devices_in_cvd_show_only_the_first():
    v = visible_gpus(env={"CUDA_VISIBLE_DEVICES": f"{POD_A},{POD_B}"}, runner=scenario_runner("mig_pod"))
    assert [d.mig_device.uuid for d in v.devices if d.mig_device] == [POD_A]
    assert len(v.devices) == 1 and v.devices[0].cuda_index == 0
    (p,) = [p for p in v.problems if p.code == "mig_single"]
    assert "single MIG instance" in p.message and POD_B in p.message and "no cuda:1" in p.message
    assert "pick-gpu" in p.fix
    assert [d.id for d in v.candidates] == [POD_A, POD_B]


def test_mig_devices_rank_biggest_slice_first():
    v = visible_gpus(env={}, runner=scenario_runner("mig_host"))
    migs = [d for d in v.devices if d.mig_device]
    ranked, rejected = rank_gpus(migs, Criteria())
    assert ranked[0].gpu.mig_device.profile == "3g.20gb" and "MIG 3g.20gb slice of GPU 6" in ranked[0].reason
    assert rejected == []
    _, rejected = rank_gpus(migs, Criteria(max_util=50))
    assert len(rejected) == len(migs) and "not reported per MIG device" in rejected[0].reason
    ranked, _ = rank_gpus(migs, Criteria(min_free_mib=10 * 1024))
    assert {r.gpu.mig_device.profile for r in ranked} == {"3g.20gb", "2g.10gb"}


@pytest.mark.parametrize("cvd", [None, f"{POD_A},{POD_B}"])
def test_pick_gpu_in_a_mig_pod_leases_each_slice_by_uuid(fake_env, cvd):
    extra = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    first = run_cli("pick-gpu", scenario="mig_pod", env=fake_env, **extra)
    assert first.rc == 0, first
    assert first.out.strip() == POD_A
    second = run_cli("pick-gpu", "--json", scenario="mig_pod", env=fake_env, **extra)
    assert second.rc == 0, second
    doc = json.loads(second.out)
    assert doc["CUDA_VISIBLE_DEVICES"] == POD_B and doc["leases"][0]["key"] == POD_B
    third = run_cli("pick-gpu", scenario="mig_pod", env=fake_env, **extra)
    assert third.rc == 22 and "leased by another job" in third.err, third


def test_pick_gpu_command_runs_on_one_mig_slice(fake_env):
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    r = run_cli(
        "pick-gpu",
        "--",
        sys.executable,
        "-c",
        code,
        scenario="mig_pod",
        env=fake_env,
        CUDA_VISIBLE_DEVICES=f"{POD_A},{POD_B}",
    )
    assert r.rc == 0, r
    assert r.out.strip() == POD_A


def test_gpus_in_a_mig_pod_warns_and_lists_one_device(fake_env):
    r = run_cli("gpus", "--json", scenario="mig_pod", env=fake_env, CUDA_VISIBLE_DEVICES=f"{POD_A},{POD_B}")
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert [d["mig_device"]["uuid"] for d in doc["devices"]] == [POD_A]
    assert "mig_single" in [p["code"] for p in doc["problems"]]


def test_mig_pick_json_is_valid(fake_env):
    from jsonschema import Draft202012Validator

    from helpers import ROOT

    r = run_cli("pick-gpu", "--json", "--lease", "0", scenario="mig_pod", env=fake_env)
    assert r.rc == 0, r
    schema = json.loads((ROOT / "docs" / "schemas" / "pick-gpu.schema.json").read_text())
    Draft202012Validator(schema).validate(json.loads(r.out))
    r = run_cli("gpus", "--json", scenario="mig_pod", env=fake_env, CUDA_VISIBLE_DEVICES=f"{POD_A},{POD_B}")
    schema = json.loads((ROOT / "docs" / "schemas" / "gpus.schema.json").read_text())
    Draft202012Validator(schema).validate(json.loads(r.out))
