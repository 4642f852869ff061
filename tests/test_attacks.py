"""Attack corpus: every code-execution route we know, in every container, through every command.

Each hostile file runs ``touch <canary>`` when a full unpickler loads it (proved by the positive
control: plain ``pickle.load`` / ``torch.load(weights_only=False)`` does create the canary).  ckptfix
must never create it: ``inspect``, ``scan``, ``strip-prefix``, ``add-prefix``, ``convert`` and
``load_anywhere`` all run on every file, ``scan`` must call it dangerous or unknown (exit 11), and
the others either work on the inert placeholders or fail with a one-line typed error.
(DCP directories are covered by the DCP tests.)
"""

from __future__ import annotations

import io
import json
import os
import pickle
import time
from pathlib import Path

import hostile
import pytest
import torch

from ckptfix import load_anywhere
from ckptfix.cli import main
from ckptfix.errors import CkptfixError

#: exit codes a command may end with on a hostile file (never 1, the internal error)
ALLOWED = {0, 4, 5, 6, 8, 11, 12, 13}
COMMANDS = ("inspect", "scan", "strip-prefix", "add-prefix", "convert")


def _argv(cmd: str, path: Path, out: Path) -> list[str]:
    if cmd == "strip-prefix":
        return [cmd, str(path), "-o", str(out / "s.out"), "--force"]
    if cmd == "add-prefix":
        return [cmd, str(path), "--prefix", "m.", "-o", str(out / "a.out"), "--force"]
    if cmd == "convert":
        return [cmd, str(path), "-o", str(out / "c.safetensors"), "--force"]
    return [cmd, str(path)]


def attack(capsys, path: Path, canary: Path, tmp_path: Path, *, scan_code: int = 11) -> None:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    for cmd in COMMANDS:
        rc = main(_argv(cmd, path, out))
        err = capsys.readouterr().err
        assert not canary.exists(), f"{cmd} ran code from {path.name}"
        assert rc in ALLOWED, (cmd, rc, err)
        if cmd == "scan":
            assert rc == scan_code, (path.name, rc, err)
        if rc:
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert lines and lines[-1].startswith("Error: ") and "Traceback" not in err, (cmd, err)
    for written in out.iterdir():  # what ckptfix wrote is as inert as what it read
        try:
            load_anywhere(written)
        except CkptfixError:
            pass
    try:
        load_anywhere(path)
    except CkptfixError:
        pass
    time.sleep(0.01)
    assert not canary.exists(), f"load_anywhere ran code from {path.name}"


CANARY_NAME = "canary"
ROUTES = sorted(hostile.expressions("/c"))


@pytest.fixture
def canary(tmp_path) -> Path:
    return tmp_path / CANARY_NAME


def _zip_file(tmp_path: Path, expr: bytes) -> Path:
    src = tmp_path / "clean.pth"
    torch.save({"module.w": torch.arange(4.0), "evil": hostile.MARKER}, src)
    name, data = next((n, d) for n, d in hostile.zip_members(src) if n.endswith("/data.pkl"))
    return hostile.replace_member(src, name, hostile.splice(data, expr), tmp_path / "evil.pth")


def _legacy_file(tmp_path: Path, expr: bytes) -> Path:
    buf = io.BytesIO()
    torch.save({"module.w": torch.arange(4.0), "evil": hostile.MARKER}, buf, _use_new_zipfile_serialization=False)
    p = tmp_path / "evil_legacy.pth"
    p.write_bytes(hostile.splice(buf.getvalue(), expr))
    return p


def _bare_file(tmp_path: Path, expr: bytes) -> Path:
    p = tmp_path / "evil.pkl"
    p.write_bytes(hostile.splice(pickle.dumps({"w": 1, "evil": hostile.MARKER}, protocol=2), expr))
    return p


BUILDERS = {"zip": _zip_file, "legacy": _legacy_file, "bare-pickle": _bare_file}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("container", sorted(BUILDERS))
def test_route_never_runs(capsys, tmp_path, canary, container, route):
    path = BUILDERS[container](tmp_path, hostile.expressions(str(canary))[route])
    attack(capsys, path, canary, tmp_path)


@pytest.mark.parametrize("route", ["os.system", "stack_global", "torch.storage._load_from_bytes"])
def test_positive_control_the_files_are_hostile(tmp_path, canary, route):
    expr = hostile.expressions(str(canary))[route]
    for build, load in (
        (_zip_file, lambda p: torch.load(p, weights_only=False)),
        (_legacy_file, lambda p: torch.load(p, weights_only=False)),
        (_bare_file, lambda p: pickle.load(open(p, "rb"))),
    ):
        p = build(tmp_path, expr)
        try:
            load(p)
        except Exception:  # noqa: BLE001 - the payload ran before whatever failed
            pass
        assert canary.exists(), (build.__name__, route)
        canary.unlink()


@pytest.mark.parametrize("which", ["magic", "sys_info"])
def test_legacy_side_pickles(capsys, tmp_path, canary, which):
    payload = hostile.payloads(str(canary))["os.system"]
    p = hostile.legacy_file(tmp_path / "side.pth", **{f"{which}_pickle": payload})
    attack(capsys, p, canary, tmp_path)


class _Tagged(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.tag = hostile.MARKER

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _torchscript(tmp_path: Path) -> Path:
    p = tmp_path / "ts.pt"
    torch.jit.save(torch.jit.script(_Tagged()), str(p))
    return p


@pytest.mark.parametrize("route", ["os.system", "stack_global", "builtins.eval"])
def test_torchscript_data_pkl(capsys, tmp_path, canary, route):
    src = _torchscript(tmp_path)
    name, data = next((n, d) for n, d in hostile.zip_members(src) if n.endswith("/data.pkl"))
    p = hostile.replace_member(
        src, name, hostile.splice(data, hostile.expressions(str(canary))[route]), tmp_path / "evil_ts.pt"
    )
    attack(capsys, p, canary, tmp_path)


def test_torchscript_constants_pkl(capsys, tmp_path, canary):
    src = _torchscript(tmp_path)
    name = next(n for n, _ in hostile.zip_members(src) if n.endswith("/constants.pkl"))
    p = hostile.replace_member(src, name, hostile.payloads(str(canary))["os.system"], tmp_path / "evil_c.pt")
    attack(capsys, p, canary, tmp_path)


def test_sharded_bin_shard(capsys, tmp_path, canary):
    d = tmp_path / "hf"
    d.mkdir()
    evil = _zip_file(tmp_path, hostile.expressions(str(canary))["os.system"])
    os.replace(evil, d / "pytorch_model-00001-of-00002.bin")
    torch.save({"module.b": torch.zeros(2)}, d / "pytorch_model-00002-of-00002.bin")
    (d / "pytorch_model.bin.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "module.w": "pytorch_model-00001-of-00002.bin",
                    "module.b": "pytorch_model-00002-of-00002.bin",
                }
            }
        )
    )
    attack(capsys, d / "pytorch_model.bin.index.json", canary, tmp_path)


def test_safetensors_metadata_is_never_unpickled(capsys, tmp_path, canary):
    from safetensors.torch import save_file

    payload = hostile.payloads(str(canary))["os.system"].decode("latin-1")
    p = tmp_path / "m.safetensors"
    save_file(
        {"module.w": torch.ones(2)},
        str(p),
        metadata={"format": "pt", "pickle": payload, "ckptfix.extra": json.dumps({"x": payload})},
    )
    attack(capsys, p, canary, tmp_path, scan_code=0)
    assert main(["convert", str(p), "-o", str(tmp_path / "back.pth"), "--restore-wrapper"]) in (0, 8)
    assert not canary.exists()


def test_tar_checkpoint(capsys, tmp_path, canary):
    p = hostile.tar_checkpoint(tmp_path / "old.pt", hostile.payloads(str(canary))["os.system"])
    attack(capsys, p, canary, tmp_path)
