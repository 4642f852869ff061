"""The ``--json`` documents match the JSON Schemas published in docs/schemas/ (real command output).

The schemas name the keys a consumer can rely on (``required``) and allow more
(``additionalProperties`` is left open), so adding a field is not a breaking change.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = REPO / "docs" / "schemas"
FIX = REPO / "tests" / "fixtures"


def schema(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))


def validate(doc: Any, name: str) -> None:
    Draft202012Validator(schema(name)).validate(doc)


@pytest.fixture
def run(tmp_path: Path):
    """``run(*args, rc=0, **env)`` -> parsed JSON stdout of ``ckptfix ARGS --json``, run in tmp_path/work."""
    work = tmp_path / "work"
    shutil.copytree(FIX / "ckpt", work, ignore=shutil.ignore_patterns("*.py"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(FIX / "nvidia-smi" / "fake-nvidia-smi.sh", bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "CKPTFIX_", "FAKE_SMI"))}
    base.update(
        PYTHONPATH=str(REPO),
        PATH=f"{bin_dir}{os.pathsep}{base.get('PATH', '')}",
        FAKE_SMI_DIR=str(FIX / "nvidia-smi" / "scenarios"),
        FAKE_SMI_SCENARIO="h200_busy",
        CKPTFIX_LEASE_DIR=str(tmp_path / "leases"),
    )

    def go(*args: str, rc: int = 0, **env: str) -> Any:
        from helpers import run_cli

        p = run_cli(*args, "--json", env={**base, **env}, cwd=work, timeout=300)
        assert p.returncode == rc, p.stderr
        return json.loads(p.stdout)

    go.work = work  # type: ignore[attr-defined]
    return go


@pytest.mark.parametrize("path", sorted(SCHEMAS.glob("*.schema.json")), ids=lambda p: p.name)
def test_every_schema_is_a_valid_json_schema(path):
    Draft202012Validator.check_schema(json.loads(path.read_text(encoding="utf-8")))


def test_there_is_a_schema_for_every_reporting_command():
    names = {p.name.removesuffix(".schema.json") for p in SCHEMAS.glob("*.schema.json")}
    assert {"inspect", "scan", "convert", "rewrite", "gpus", "pick-gpu", "doctor", "train-manifest"} <= names


@pytest.mark.parametrize(
    "name", ["ddp.pth", "legacy.pth", "lightning.ckpt", "model.safetensors", "sharded/pytorch_model.bin.index.json"]
)
def test_inspect(run, name):
    validate(run("inspect", name), "inspect")


def test_scan_one_file_and_several(run):
    validate(run("scan", "ddp.pth"), "scan")
    (run.work / "evil.pkl").write_bytes(b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00echo\x85R.")
    one = run("scan", "evil.pkl", rc=11)
    validate(one, "scan")
    assert one["verdict"] == "dangerous"
    many = run("scan", "ddp.pth", "evil.pkl", "nope.pt", rc=11)
    validate(many, "scan")
    assert [d["verdict"] for d in many] == ["safe", "dangerous", "error"]


def test_a_document_missing_a_required_key_is_rejected(run):
    from jsonschema import ValidationError

    doc = run("inspect", "ddp.pth")
    del doc["tensor_count"]
    with pytest.raises(ValidationError):
        validate(doc, "inspect")


@pytest.mark.parametrize(
    "args",
    [
        ("ddp.pth", "-o", "a.safetensors"),
        ("lightning.ckpt", "-o", "b.safetensors"),
        ("model.safetensors", "-o", "c.safetensors", "--max-shard-size", "30B"),
        ("model.safetensors", "-o", "back.pth"),
    ],
)
def test_convert(run, args):
    validate(run("convert", *args), "convert")


def test_strip_prefix_add_prefix_align(run):
    validate(run("strip-prefix", "ddp.pth"), "rewrite")
    validate(run("add-prefix", "model.safetensors", "--prefix", "module."), "rewrite")
    doc = run("align", "ddp.pth", "--to", "model.safetensors")
    validate(doc, "rewrite")
    assert doc["detail"]["exact"] is True


def test_gpus_pick_gpu_doctor(run):
    gpus = run("gpus")
    validate(gpus, "gpus")
    assert len(gpus["devices"]) == 8
    validate(run("pick-gpu"), "pick-gpu")
    doc = run("doctor")
    validate(doc, "doctor")
    validate(doc["gpus"], "gpus")
    no_gpu = run("doctor", PATH="/usr/bin:/bin")
    validate(no_gpu, "doctor")


def test_doctor_without_nvidia_smi_is_still_valid(run, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    doc = run("doctor", PATH=str(empty))
    validate(doc, "doctor")


@pytest.mark.slow
def test_train_manifest(run):
    report = run(
        "train", "--mode", "dp", "--epochs", "1", "--train-samples", "64", "--test-samples", "32", "--out", "runs", "-q"
    )
    manifest = json.loads((run.work / "runs" / "checkpoints.json").read_text(encoding="utf-8"))
    validate(manifest, "train-manifest")
    assert manifest["checkpoints"][0]["expected_prefix"] == "module."
    assert report["manifest"].endswith("checkpoints.json")
