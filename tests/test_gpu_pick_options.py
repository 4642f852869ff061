"""pick-gpu: --lease 0 with -- CMD, the --release --json schema, a corrupt lease file (issue 23, item 8);
--exclude / --max-temp / --max-power (item 10)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from helpers import ROOT, fake_smi_env, run_cli

H200_FREE = "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90"  # GPU 2 of h200_after_release
SHOW = "import os; print(os.environ['CUDA_VISIBLE_DEVICES']); print(os.environ.get('CKPTFIX_LEASES_HELD', '-'))"


@pytest.fixture
def fake_env(tmp_path: Path) -> dict[str, str]:
    return fake_smi_env(tmp_path)


def test_lease_0_with_a_command_takes_no_lease(fake_env):
    r = run_cli("pick-gpu", "--lease", "0", "--", sys.executable, "-c", SHOW, scenario="two_free", env=fake_env)
    assert r.rc == 0, r
    cvd, held = r.out.splitlines()
    assert cvd.startswith("GPU-") and held == "", r
    assert "no lease taken (--lease 0)" in r.err
    assert not any(Path(fake_env["CKPTFIX_LEASE_DIR"]).glob("*.lease")) or all(
        p.stat().st_size == 0 for p in Path(fake_env["CKPTFIX_LEASE_DIR"]).glob("*.lease")
    )


def test_lease_seconds_with_a_command_is_a_usage_error(fake_env):
    r = run_cli("pick-gpu", "--lease", "60", "--", "true", scenario="two_free", env=fake_env)
    assert r.rc == 2 and "lasts as long as the command" in r.err, r


def test_release_json_has_a_schema(fake_env):
    schema = json.loads((ROOT / "docs" / "schemas" / "pick-gpu-release.schema.json").read_text())
    Draft202012Validator.check_schema(schema)
    r = run_cli("pick-gpu", "--export", scenario="two_free", env=fake_env)
    assert r.rc == 0, r
    token = r.out.rsplit("CKPTFIX_LEASE_TOKEN=", 1)[1].strip()
    r = run_cli("pick-gpu", "--release", "--json", scenario="two_free", env=fake_env, CKPTFIX_LEASE_TOKEN=token)
    assert r.rc == 0, r
    doc = json.loads(r.out)
    Draft202012Validator(schema).validate(doc)
    assert doc["token"] is True and [x["released"] for x in doc["leases"]] == [True]
    r = run_cli("pick-gpu", "--release", "--json", scenario="two_free", env=fake_env)
    Draft202012Validator(schema).validate(json.loads(r.out))


def test_corrupt_lease_file_does_not_block_pickers(fake_env):
    d = Path(fake_env["CKPTFIX_LEASE_DIR"])
    d.mkdir(mode=0o700, exist_ok=True)
    r = run_cli("pick-gpu", scenario="h200_after_release", env=fake_env)  # creates the lease file
    assert r.rc == 0 and r.out.strip() == H200_FREE, r
    (f,) = [p for p in d.iterdir() if p.suffix == ".lease"]
    f.write_bytes(b"\x00\x00\x00garbage")
    r = run_cli("pick-gpu", "--json", scenario="h200_after_release", env=fake_env)
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert doc["CUDA_VISIBLE_DEVICES"] == H200_FREE
    assert any("corrupt" in w and "stale" in w for w in doc["warnings"]), doc["warnings"]
    assert "corrupt" in r.err


# ------------------------------------------------------------- item 10: --exclude, --max-temp, --max-power, --watch


def test_exclude_by_index_uuid_prefix_and_pci(fake_env):
    # h200_after_release: free GPUs 2, 4, 5, 6 (2 first)
    r = run_cli("pick-gpu", "--lease", "0", "--exclude", "2", scenario="h200_after_release", env=fake_env)
    assert r.rc == 0 and r.out.strip().startswith("GPU-cb449822"), r  # GPU 4: ties with 5 and 6, lowest index
    r = run_cli(
        "pick-gpu",
        "--lease",
        "0",
        "--json",
        "-n",
        "2",
        "--exclude",
        "GPU-4e9e74b7,00000000:9A:00.0",
        scenario="h200_after_release",
        env=fake_env,
    )
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert [c["smi_index"] for c in doc["chosen"]] == [5, 6]
    why = {x["smi_index"]: x["reason"] for x in doc["rejected"]}
    assert why[2] == "excluded (--exclude GPU-4e9e74b7)" and why[4] == "excluded (--exclude 00000000:9A:00.0)"


def test_exclude_naming_no_gpu_is_a_usage_error(fake_env):
    r = run_cli("pick-gpu", "--exclude", "GPU-nope", scenario="two_free", env=fake_env)
    assert r.rc == 2 and "--exclude" in r.err and "names no GPU here" in r.err, r


def test_max_temp_and_max_power(fake_env):
    # h200_busy-like values: two_free GPUs are at 33 C and 118.41 W
    r = run_cli("pick-gpu", "--max-temp", "30", scenario="two_free", env=fake_env)
    assert r.rc == 22 and "33 C > --max-temp 30" in r.err, r
    r = run_cli("pick-gpu", "--max-power", "100", scenario="two_free", env=fake_env)
    assert r.rc == 22 and "118.41 W > --max-power 100" in r.err, r
    r = run_cli("pick-gpu", "--lease", "0", "--max-temp", "40", "--max-power", "120", scenario="two_free", env=fake_env)
    assert r.rc == 0, r
    # an unreported sensor fails the filter
    r = run_cli("pick-gpu", "--max-temp", "90", scenario="gb10_unified_memory", env=fake_env)
    assert r.rc == 22 and "temperature unavailable and --max-temp was given" in r.err, r


def test_pick_gpu_api_takes_the_new_filters(tmp_path):
    from ckptfix.gpu import pick_gpu

    from fakesmi import scenario_runner

    env: dict[str, str] = {"CKPTFIX_LEASE_DIR": str(tmp_path / "l")}
    got = pick_gpu(exclude=["0"], max_temp=50, environ=env, runner=scenario_runner("two_free"), lease=False)
    assert got.ids == ["GPU-8e137fa6-c3d9-6980-7733-0d8df296756e"]


def test_gpus_watch_refreshes_until_ctrl_c(fake_env):
    import signal
    import subprocess
    import time

    from helpers import cli_argv

    p = subprocess.Popen(
        cli_argv("gpus", "--watch", "0.2"),
        env=dict(fake_env, FAKE_SMI_SCENARIO="two_free"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    log = Path(fake_env["FAKE_SMI_LOG"])
    deadline = time.monotonic() + 30  # only to catch a hang

    def frames_started() -> int:
        return sum(1 for ln in log.read_text().splitlines() if ln.startswith("query-gpu ")) if log.exists() else 0

    while time.monotonic() < deadline and frames_started() < 4:  # the 4th query: 3 frames printed
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, (out, err)
    assert out.count("(Ctrl-C to leave)") >= 2 and out.count("cuda:0  0") >= 2, out
    assert "Traceback" not in err and "Aborted" not in err and "\x1b[" not in out, err


def test_gpus_watch_with_json_is_a_usage_error(fake_env):
    r = run_cli("gpus", "--watch", "1", "--json", scenario="two_free", env=fake_env)
    assert r.rc == 2 and "--watch" in r.err, r
