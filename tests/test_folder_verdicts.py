"""A folder's verdict is the verdict of every pickle-bearing file in it (issue 33 §1, issue 39 §1).

The folders are the frameworks' own (tests/fixtures/frameworks: transformers' Trainer ``checkpoint-2/``, accelerate's
``save_state``), copied, with one file replaced at test time by a file that runs ``touch MARKER`` under
``torch.load(weights_only=False)`` / ``pickle.load`` (a torch zip or a protocol-2 pickle): ``inspect`` must not say
``weights_only ok`` and must name the file, ``scan`` must name it in its per-file entries, in text and JSON.  An
``.npy`` object array is a pickle ``np.load(allow_pickle=True)`` runs; a TorchScript archive gets one verdict from
both commands; ``scan hf://...`` and ``scan s3://.../`` of a folder cover the same files as the local scan.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint

from helpers import CkptFactory, Evil, run_cli

FIX = Path(__file__).parent / "fixtures" / "frameworks"

PLACEMENTS = [
    ("trainer/checkpoint-2", "optimizer.pt"),
    ("trainer/checkpoint-2", "scheduler.pt"),
    ("trainer/checkpoint-2", "rng_state.pth"),
    ("trainer/checkpoint-2", "training_args.bin"),
    ("accelerate", "random_states_0.pkl"),
    ("accelerate", "custom_checkpoint_0.pkl"),
    ("accelerate", "optimizer.bin"),
    ("accelerate", "scheduler.bin"),
]


def _hostile(path: Path, marker: Path, mode: str) -> None:
    import torch

    obj = {"state": {}, "param_groups": [], "payload": Evil(str(marker))}
    path.unlink(missing_ok=True)
    if mode == "zip":
        torch.save(obj, path)
    else:
        path.write_bytes(pickle.dumps(obj, protocol=2))


@pytest.mark.parametrize("mode", ["zip", "pickle2"])
@pytest.mark.parametrize(("folder", "name"), PLACEMENTS)
def test_a_file_that_runs_code_makes_the_folder_unsafe_in_inspect_and_scan(
    tmp_path: Path, folder: str, name: str, mode: str
) -> None:
    d = tmp_path / "ck"
    shutil.copytree(FIX / folder, d)
    marker = tmp_path / "pwned"
    _hostile(d / name, marker, mode)

    rep = inspect_checkpoint(d)
    assert rep.weights_only_ok is False
    assert name in rep.weights_only_reason
    assert rep.folder_scan is not None and rep.folder_scan["verdict"] == "dangerous"
    assert rep.folder_scan["files"][name]["verdict"] == "dangerous"
    assert rep.folder_scan["files"][name]["dangerous"] == ["posix.system"]

    text = run_cli("inspect", str(d))
    assert text.returncode == 0, text.stderr
    assert "weights_only  ok" not in text.stdout
    assert f"{name}: " in text.stdout and "[scan: dangerous, posix.system]" in text.stdout
    doc = json.loads(run_cli("inspect", str(d), "--json").stdout)
    assert doc["weights_only_ok"] is False and doc["folder_scan"]["files"][name]["verdict"] == "dangerous"

    sc = scan_checkpoint(d)
    assert sc.verdict == "dangerous" and sc.files[name]["verdict"] == "dangerous"
    safe = [n for n, f in sc.files.items() if n != name and f["dangerous"]]
    assert safe == []  # only the file that runs code is named dangerous
    out = run_cli("scan", str(d))
    assert out.returncode == 11 and f"file      {name}: dangerous (posix.system)" in out.stdout
    assert name in out.stderr
    sdoc = json.loads(run_cli("scan", str(d), "--json").stdout)
    assert sdoc["files"][name]["verdict"] == "dangerous"
    assert not marker.exists()  # nothing was unpickled

    if mode == "zip":  # the oracle: torch.load of that file does run the code
        import torch

        torch.load(d / name, weights_only=False)
        assert marker.exists()


def test_a_real_folder_names_each_files_verdict(tmp_path: Path) -> None:
    """The Trainer folder as written: the weights load with weights_only=True, rng_state.pth and training_args.bin
    do not (numpy and accelerate globals): the folder is not weights_only ok, and each file says why."""
    import torch

    d = FIX / "trainer" / "checkpoint-2"
    rep = inspect_checkpoint(d)
    files = rep.folder_scan["files"]
    for name, f in files.items():
        if name.endswith((".pt", ".pth", ".bin")):
            try:
                torch.load(d / name, weights_only=True)
                ok = True
            except Exception:  # noqa: BLE001 - torch's weights-only refusal
                ok = False
            assert (f["verdict"] == "safe") is ok, name
    assert rep.weights_only_ok is False and "training_args.bin" in rep.weights_only_reason


def test_an_npy_object_array_in_a_folder_is_scanned(tmp_path: Path) -> None:
    import numpy as np

    d = tmp_path / "ck"
    shutil.copytree(FIX / "trainer" / "checkpoint-2", d)
    marker = tmp_path / "pwned"
    np.save(d / "extra.npy", np.array([Evil(str(marker))], dtype=object), allow_pickle=True)
    np.save(d / "plain.npy", np.arange(4.0))
    np.savez(d / "more.npz", a=np.array([Evil(str(marker))], dtype=object), b=np.zeros(2))
    sc = scan_checkpoint(d)
    assert sc.files["extra.npy"]["verdict"] == "dangerous" and "posix.system" in sc.files["extra.npy"]["dangerous"]
    assert sc.files["more.npz"]["verdict"] == "dangerous"
    assert sc.files["plain.npy"]["verdict"] == "safe"
    rep = inspect_checkpoint(d)
    assert rep.weights_only_ok is False and "extra.npy" in rep.weights_only_reason
    assert not marker.exists()
    np.load(d / "extra.npy", allow_pickle=True)  # the oracle: numpy runs it
    assert marker.exists()


def test_torchscript_has_one_verdict_in_scan_and_inspect(tmp_path: Path) -> None:
    b = CkptFactory(tmp_path).torchscript()
    sc = scan_checkpoint(b.path)
    assert sc.verdict != "safe" and any("torch.jit.load" in g for g in sc.unknown)
    assert inspect_checkpoint(b.path).weights_only_ok is False
    assert run_cli("scan", str(b.path)).returncode == 11


# --------------------------------------------------------------------------- remote folders


def _remote_folder(root: Path) -> Path:
    """39 §1: a sharded safetensors checkpoint beside pytorch_model.bin, optimizer.pt and training_args.bin that
    pickle os.system."""
    import torch
    from safetensors.torch import save_file

    d = root / "repo"
    d.mkdir()
    marker = root / "pwned"
    save_file({"w": torch.zeros(2, 2)}, str(d / "model-00001-of-00001.safetensors"))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 16}, "weight_map": {"w": "model-00001-of-00001.safetensors"}})
    )
    torch.save({"w": torch.zeros(2, 2), "e": Evil(str(marker))}, d / "pytorch_model.bin")
    torch.save({"state": {}, "x": Evil(str(marker))}, d / "optimizer.pt")
    (d / "training_args.bin").write_bytes(pickle.dumps(Evil(str(marker)), protocol=2))
    (d / "config.json").write_text('{"model_type": "bert"}')
    return d


def _files(doc: dict[str, Any]) -> dict[str, str]:
    return {n: f["verdict"] for n, f in doc["files"].items()}


def test_scan_of_a_hub_folder_covers_every_pickle_bearing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import HfFileSystem

    from ckptfix.files.remote import file as rfile

    from hubserver import serving

    d = _remote_folder(tmp_path)
    local = json.loads(run_cli("scan", str(d), "--json").stdout)
    assert _files(local) == {
        "model.safetensors.index.json": "safe",
        "optimizer.pt": "dangerous",
        "pytorch_model.bin": "dangerous",
        "training_args.bin": "dangerous",
    }
    with serving({"user/mixed": {"main": str(d)}}) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
        monkeypatch.setenv("CKPTFIX_REMOTE_BACKOFF", "0")
        rfile._PINS.clear()
        HfFileSystem.clear_instance_cache()
        got = run_cli("scan", "hf://user/mixed", "--json")
        assert got.returncode == 11, got.stderr
        doc = json.loads(got.stdout)
        ins = json.loads(run_cli("inspect", "hf://user/mixed", "--json").stdout)
    assert ins["weights_only_ok"] is False and _files(ins["folder_scan"]) == _files(local)
    assert doc["verdict"] == "dangerous"
    assert _files(doc) == _files(local)
    assert doc["globals"] == local["globals"]
    assert not (tmp_path / "pwned").exists()


def test_scan_of_an_s3_folder_covers_every_pickle_bearing_file(tmp_path: Path, s3_server: Any) -> None:
    d = _remote_folder(tmp_path)
    local = json.loads(run_cli("scan", str(d), "--json").stdout)
    url = s3_server.upload(d, f"{s3_server.prefix('mixed')}/ckpt")
    for u in (url, url + "/"):
        got = run_cli("scan", u, "--json")
        assert got.returncode == 11, got.stderr
        doc = json.loads(got.stdout)
        assert doc["verdict"] == "dangerous" and _files(doc) == _files(local), u
        assert doc["globals"] == local["globals"]
        ins = json.loads(run_cli("inspect", u, "--json").stdout)
        assert ins["weights_only_ok"] is False and _files(ins["folder_scan"]) == _files(local), u
    assert not (tmp_path / "pwned").exists()
