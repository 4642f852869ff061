"""A folder's verdict covers every file in it, at any depth, or says ``unknown`` naming what it left out.

The outside pass of issues 33 and 39 found folder scans that said ``safe`` about files they never read: a pickle
four folders down (``d1/d2/d3/d4/optimizer.pt``, locally and on S3), a sub-folder that links outside the folder,
a file an HTTP listing links whose ``HEAD`` answers 404 (while ``GET`` serves it, as ``torch.load`` after a
download gets it), a listed ``sub/`` whose no-slash ``HEAD`` is 404, and a ``.git/optimizer.pt``.  Each is
planted here as a pickle that runs ``touch MARKER`` under ``pickle.load`` / ``torch.load(weights_only=False)``
(checked with the real loader), and the verdict must not be ``safe``; the walk's bounds
(:data:`~ckptfix.ops.scan.MAX_FOLDER_DEPTH`, :data:`~ckptfix.ops.scan.MAX_FOLDER_ENTRIES`) leave out what lies
past them and say so (``unknown``), never ``safe``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from helpers import Evil, run_cli  # noqa: E402


def _run(marker: Path) -> bytes:
    return pickle.dumps(Evil(str(marker)))


def _folder(d: Path, place: str, marker: Path) -> Path:
    """A Hugging Face model folder (``model.safetensors``) with a pickle that runs code at ``place``."""
    d.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
    (d / place).parent.mkdir(parents=True, exist_ok=True)
    (d / place).write_bytes(_run(marker))
    return d


def _oracle_runs(path: Path, marker: Path) -> None:
    """The loader's own verdict: pickle.load of the planted file runs it."""
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(path)!r}, 'rb'))"], check=True)
    assert marker.exists()
    marker.unlink()


@pytest.mark.parametrize("place", ["d1/d2/d3/d4/optimizer.pt", "a/b/c/d/e/f/g/h/i/j/optimizer.pt"])
def test_a_pickle_deep_in_a_folder_makes_it_dangerous(tmp_path: Path, place: str) -> None:
    marker = tmp_path / "pwned"
    d = _folder(tmp_path / "run", place, marker)
    _oracle_runs(d / place, marker)
    r = run_cli("scan", str(d), "--json")
    assert r.rc == 11, r.err
    doc = json.loads(r.out)
    assert doc["verdict"] == "dangerous" and doc["files"][place]["verdict"] == "dangerous"
    ins = json.loads(run_cli("inspect", str(d), "--json").out)
    assert ins["weights_only_ok"] is False and ins["folder_scan"]["files"][place]["verdict"] == "dangerous"
    assert not marker.exists()


def test_a_pickle_deep_in_an_s3_folder_makes_it_dangerous(tmp_path: Path, s3_server: Any) -> None:
    marker = tmp_path / "pwned"
    place = "d1/d2/d3/d4/optimizer.pt"
    d = _folder(tmp_path / "run", place, marker)
    url = s3_server.upload(d, f"{s3_server.prefix('deep')}/run") + "/"
    r = run_cli("scan", url, "--json")
    assert r.rc == 11, r.err
    doc = json.loads(r.out)
    assert doc["verdict"] == "dangerous" and doc["files"][place]["verdict"] == "dangerous"
    assert not marker.exists()


def test_past_the_depth_bound_the_verdict_is_unknown_naming_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.ops import scan

    d = tmp_path / "run"
    d.mkdir()
    save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
    (d / "d1" / "d2" / "d3").mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(d / "d1" / "d2" / "d3" / "deep.safetensors"))  # safe, yet unread
    # d1/d2/d3/deep.safetensors is 4 levels down (a folder's own files are 1 level down)
    monkeypatch.setattr(scan, "MAX_FOLDER_DEPTH", 3)
    rep = scan.scan_checkpoint(d)
    assert rep.verdict == "unknown"
    assert rep.files["d1/d2/d3"]["verdict"] == "unknown"
    assert any("d1/d2/d3" in u and "4 levels down" in u and "limit of 3" in u for u in rep.unknown), rep.unknown
    monkeypatch.setattr(scan, "MAX_FOLDER_DEPTH", 4)
    assert scan.scan_checkpoint(d).verdict == "safe"  # within the bound: every file read


def test_past_the_entry_bound_the_verdict_is_unknown_naming_what_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.ops import scan

    d = tmp_path / "run"
    d.mkdir()
    save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
    (d / "sub").mkdir()
    for i in range(4):
        save_file({"w": torch.zeros(2)}, str(d / "sub" / f"s{i}.safetensors"))
    monkeypatch.setattr(scan, "MAX_FOLDER_ENTRIES", 3)
    rep = scan.scan_checkpoint(d)
    assert rep.verdict == "unknown"
    assert any("limit of 3 entries" in u and "sub/s2.safetensors" in u for u in rep.unknown), rep.unknown
    monkeypatch.setattr(scan, "MAX_FOLDER_ENTRIES", 6)
    assert scan.scan_checkpoint(d).verdict == "safe"


def test_a_sub_folder_linking_outside_is_not_read_and_not_safe(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "optimizer.pt").write_bytes(_run(marker))
    d = _folder(tmp_path / "run", "ok.txt", marker)
    (d / "ok.txt").write_text("hello\n")
    os.symlink("../outside", d / "sub")
    r = run_cli("scan", str(d))
    assert r.rc == 11, r.err
    assert r.out.splitlines()[0].split(": ", 1)[1].startswith("unknown"), r.out
    assert "sub" in r.out and "not followed" in r.out
    doc = json.loads(run_cli("scan", str(d), "--json").out)
    assert doc["verdict"] == "unknown" and doc["files"]["sub"]["verdict"] == "unknown"
    assert not any("optimizer.pt" in p for p in doc["pickles"])  # the link was not read (containment)
    ins = json.loads(run_cli("inspect", str(d), "--json").out)
    assert ins["weights_only_ok"] is False and ins["folder_scan"]["verdict"] == "unknown"
    assert not marker.exists()


def test_a_link_back_into_the_folder_is_walked_once(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    d = _folder(tmp_path / "run", "sub/optimizer.pt", marker)
    os.symlink(".", d / "loop")  # run/loop -> run: an endless walk without the seen-set
    doc = json.loads(run_cli("scan", str(d), "--json").out)
    assert doc["verdict"] == "dangerous" and doc["files"]["sub/optimizer.pt"]["verdict"] == "dangerous"
    assert not any(n.startswith("loop/") for n in doc["files"]), doc["files"]


def test_a_pickle_in_git_makes_the_folder_dangerous(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    d = _folder(tmp_path / "run", ".git/optimizer.pt", marker)
    (d / ".git" / "objects" / "ab").mkdir(parents=True)
    (d / ".git" / "objects" / "ab" / "cdef").write_bytes(b"x\x01" + os.urandom(64))  # a loose object: zlib
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    _oracle_runs(d / ".git" / "optimizer.pt", marker)
    r = run_cli("scan", str(d), "--json")
    assert r.rc == 11, r.err
    doc = json.loads(r.out)
    assert doc["verdict"] == "dangerous" and doc["files"][".git/optimizer.pt"]["verdict"] == "dangerous"
    assert set(doc["files"]) == {"model.safetensors", ".git/optimizer.pt"}  # git's own files: no pickle, no entry
    assert not marker.exists()


def _http_folder(tmp_path: Path, place: str, marker: Path) -> Path:
    www = tmp_path / "www"
    _folder(www / "run", place, marker)
    return www


def test_an_http_listed_file_whose_head_is_404_is_not_dropped(tmp_path: Path) -> None:
    from rangeserver import serving

    marker = tmp_path / "pwned"
    www = _http_folder(tmp_path, "optimizer.pt", marker)
    with serving(str(www)) as srv:
        srv.fault("404", "optimizer.pt", count=100, method="HEAD")  # GET still serves it
        r = run_cli("scan", f"{srv.url}/run/", "--json", CKPTFIX_REMOTE_BACKOFF="0")
    assert r.rc == 11, r.err
    doc = json.loads(r.out)
    assert doc["verdict"] in ("unknown", "dangerous")
    assert doc["files"]["optimizer.pt"]["verdict"] in ("unknown", "dangerous")
    assert not marker.exists()


def test_an_http_listed_sub_folder_whose_head_is_404_is_walked(tmp_path: Path) -> None:
    from rangeserver import serving

    marker = tmp_path / "pwned"
    www = _http_folder(tmp_path, "sub/optimizer.pt", marker)
    with serving(str(www)) as srv:
        srv.dir_faults = True
        srv.fault("404", "/run/sub", count=100, method="HEAD")  # `GET /run/sub/` lists it
        r = run_cli("scan", f"{srv.url}/run/", "--json", CKPTFIX_REMOTE_BACKOFF="0")
    assert r.rc == 11, r.err
    doc = json.loads(r.out)
    assert doc["verdict"] == "dangerous" and doc["files"]["sub/optimizer.pt"]["verdict"] == "dangerous"
    assert not marker.exists()


def test_a_pickle_deep_in_a_hub_folder_makes_it_dangerous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import HfFileSystem

    from ckptfix.files.remote import file as rfile

    from hubserver import serving

    marker = tmp_path / "pwned"
    place = "d1/d2/d3/d4/optimizer.pt"
    d = _folder(tmp_path / "run", place, marker)
    with serving({"user/deep": {"main": str(d)}}) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
        monkeypatch.setenv("CKPTFIX_REMOTE_BACKOFF", "0")
        rfile._PINS.clear()
        HfFileSystem.clear_instance_cache()
        r = run_cli("scan", "hf://user/deep", "--json")
    assert r.rc == 11, r.err
    doc = json.loads(r.out)
    assert doc["verdict"] == "dangerous" and doc["files"][place]["verdict"] == "dangerous"
    assert not marker.exists()


@pytest.mark.parametrize("key", ["sub/../y.pt", "x#a.pt", "x?a=1.pt", "sub\\z.pt", "sub/%2e%2e/z.pt"])
def test_an_s3_object_no_url_can_address_makes_the_folder_unknown(tmp_path: Path, s3_server: Any, key: str) -> None:
    """Legal S3 keys that joined back to the folder's URL would name another object: not read, so the verdict is
    unknown naming them, never safe (a recursive download writes them into the copy torch.load reads)."""
    marker = tmp_path / "pwned"
    d = _folder(tmp_path / "run", "ok.txt", marker)
    (d / "ok.txt").unlink()
    pfx = f"{s3_server.prefix('odd')}/run"
    url = s3_server.upload(d, pfx) + "/"
    s3_server.put_bytes(f"{pfx}/{key}", _run(marker))
    r = run_cli("scan", url, "--json")
    doc = json.loads(r.out)
    assert r.rc == 11 and doc["verdict"] != "safe", r.out
    assert any("no URL of this folder can address" in str(v) for v in doc["files"].values())
    assert not marker.exists()
