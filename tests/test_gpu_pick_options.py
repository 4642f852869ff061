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
