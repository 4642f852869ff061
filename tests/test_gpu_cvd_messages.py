"""CUDA_VISIBLE_DEVICES: every entry out of range says so (not "not both"); where NVIDIA's documented rule and
torch's emulation disagree (``0,9,0``) the answer is uncertain and both readings are shown (issue 23, item 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptfix.gpu.visible import visible_gpus

from fakesmi import scenario_runner
from helpers import fake_smi_env, run_cli


def view(cvd: str, scenario: str = "two_free"):
    return visible_gpus(env={"CUDA_VISIBLE_DEVICES": cvd}, runner=scenario_runner(scenario))


@pytest.mark.parametrize("cvd", ["5,6", "4", "7,0"])
def test_out_of_range_indices_say_so(cvd):
    v = view(cvd)
    assert v.devices == ()
    for p in v.problems:
        assert "not both" not in p.fix, p
    empty = next(p for p in v.problems if p.code == "cvd_empty")
    assert "past this machine's last GPU" in empty.fix and "indices 0..1" in empty.fix, empty
    assert "inside this container" in empty.fix


def test_mixing_kinds_still_says_not_both():
    v = view("0,GPU-4e9e74b7")
    assert any("not both" in p.fix for p in v.problems), v.problems


def test_duplicate_after_an_invalid_index_is_uncertain_and_shows_both():
    v = view("0,9,0")
    assert [d.smi_index for d in v.devices] == [0]  # NVIDIA's documented truncation rule
    assert v.order_certain is False
    (p,) = [p for p in v.problems if p.code == "cvd_uncertain"]
    assert "cuda:0 = GPU 0" in p.message and "hides every GPU" in p.message and "uncertain" in p.message
    assert "torch" in p.message and "CUDA_VISIBLE_DEVICES=0" in p.fix
    assert not any(p.code == "cvd_empty" for p in v.problems)


def test_duplicate_uuid_after_an_unknown_one_is_uncertain():
    v = view("GPU-8e137fa6,GPU-ffff,GPU-8e137fa6")
    assert [d.smi_index for d in v.devices] == [1]
    assert any(p.code == "cvd_uncertain" for p in v.problems)


def test_plain_duplicate_is_still_certain_and_empty():
    v = view("0,1,0")
    assert v.devices == () and not any(p.code == "cvd_uncertain" for p in v.problems)
    assert any(p.code == "cvd_empty" and "appears twice" in p.message for p in v.problems)


def test_cli_json_shows_the_uncertainty(tmp_path: Path):
    env = fake_smi_env(tmp_path)
    r = run_cli("gpus", "--json", scenario="two_free", env=env, CUDA_VISIBLE_DEVICES="0,9,0")
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert doc["order_certain"] is False and [d["smi_index"] for d in doc["devices"]] == [0]
    assert "cvd_uncertain" in [p["code"] for p in doc["problems"]]


def test_pick_gpu_with_every_index_out_of_range_says_so(tmp_path: Path):
    env = fake_smi_env(tmp_path)
    r = run_cli("pick-gpu", scenario="two_free", env=env, CUDA_VISIBLE_DEVICES="4,5")
    assert r.rc == 21, r
    assert "hides all of them" in r.err and "past this machine's last GPU" in r.err and "not both" not in r.err, r
