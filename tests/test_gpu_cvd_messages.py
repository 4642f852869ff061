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


# ----------------------------------------------------------------------------- upper-case UUIDs (issue 34, C5)

UPPER_1 = "GPU-8E137FA6-C3D9-6980-7733-0D8DF296756E"  # GPU 1 of two_free, written in upper case


def _torch_reading(cvd: str, uuids: list[str]) -> list[int]:
    """torch's own emulation (the oracle): _parse_visible_devices' GPU- list, then _transform_uuid_to_ordinals."""
    import torch.cuda

    seen: list[str] = []
    for elem in cvd.split(","):  # torch.cuda._parse_visible_devices, the GPU- branch
        if elem in seen:
            return []
        if not elem.startswith("GPU-"):
            break
        seen.append(elem)
    return torch.cuda._transform_uuid_to_ordinals(seen, uuids)


@pytest.mark.parametrize(
    "cvd",
    [UPPER_1, "GPU-8E137FA6", f"GPU-4e9e74b7,{UPPER_1}", f"{UPPER_1},GPU-4e9e74b7", "GPU-4E9E74B7,GPU-8e137fa6"],
)
def test_upper_case_uuid_is_uncertain(cvd):
    v = view(cvd)
    uuids = [g.uuid for g in v.physical]
    torch_sees = _torch_reading(cvd, uuids)
    documented = [d.smi_index for d in v.devices]
    assert torch_sees != documented  # the two readings differ: that is the uncertainty
    assert v.order_certain is False
    (p,) = [p for p in v.problems if p.code == "cvd_uncertain"]
    assert "case" in p.message and "torch" in p.message and "uncertain" in p.message, p
    torch_words = "no GPU" if not torch_sees else ", ".join(f"cuda:{i} = GPU {j}" for i, j in enumerate(torch_sees))
    assert torch_words in p.message, p
    lower = ",".join("GPU-" + e[4:].lower() for e in cvd.split(","))
    assert "lower case" in p.fix and f"CUDA_VISIBLE_DEVICES={lower}" in p.fix, p  # the value torch reads alike


def test_lower_case_uuid_prefixes_stay_certain():
    for cvd in ("GPU-8e137fa6", "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90,GPU-8e137fa6"):
        v = view(cvd)
        assert v.order_certain is True and not any(p.code == "cvd_uncertain" for p in v.problems), cvd
        assert [d.smi_index for d in v.devices] == _torch_reading(cvd, [g.uuid for g in v.physical])


def test_upper_case_uuid_cli_json(tmp_path: Path):
    env = fake_smi_env(tmp_path)
    r = run_cli("gpus", "--json", scenario="two_free", env=env, CUDA_VISIBLE_DEVICES=UPPER_1)
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert doc["order_certain"] is False and [d["smi_index"] for d in doc["devices"]] == [1]
    assert "cvd_uncertain" in [p["code"] for p in doc["problems"]]
