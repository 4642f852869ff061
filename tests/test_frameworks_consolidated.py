"""DeepSpeed ZeRO and torch HF-writer folders are rows of the framework table: inspect, scan, convert and load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cli

FW = Path(__file__).parent / "fixtures" / "frameworks"
ZERO = sorted(p for p in (FW / "deepspeed").iterdir() if p.is_dir())
HF = FW / "hfstorage" / "run"


@pytest.mark.parametrize("folder", ZERO, ids=lambda p: p.name)
def test_inspect_zero_folder_names_layout_and_counts_the_consolidated_model(folder):
    from ckptfix.ops.frameworks import resolve
    from ckptfix.ops.inspect import inspect_checkpoint

    r = resolve(folder)
    assert r is not None and r.layout.name == "deepspeed-zero"
    rep = inspect_checkpoint(folder)
    want = json.loads((folder / "expected.json").read_text())
    names = want["keys"]
    assert rep.tensor_count == len(names)
    assert rep.framework["layout"] == "deepspeed-zero"
    assert any(label == "layout" and "stage" in text for label, text in rep.framework["details"])
    assert not rep.weights_only_ok  # DeepSpeed pickles its own classes beside the tensors


def test_scan_zero_folder_scans_every_partition_and_is_not_safe():
    p = run_cli("scan", "--json", str(ZERO[0]))
    doc = json.loads(p.stdout)
    assert p.rc == 11 and any("deepspeed" in g for g in doc["globals"])


def test_inspect_hf_storage_folder():
    p = run_cli("inspect", "--json", str(HF))
    assert p.rc == 0, p.err
    doc = json.loads(p.stdout)
    assert doc["framework"]["layout"] == "hf-storage-dcp" and doc["tensor_count"] == 7


def test_key_is_refused_on_consolidated_folders():
    p = run_cli("inspect", str(ZERO[0]), "--key", "module")
    assert p.rc == 8 and p.err.startswith("Error: ") and "--key" in p.err
