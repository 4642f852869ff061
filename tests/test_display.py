"""ckptfix.display: paths shown as the user typed them, one wording for each mistake in every command."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

from ckptfix.display import shown_path

from helpers import run_cli

SHARDED = Path(__file__).parent / "fixtures" / "ckpt" / "sharded"


def test_shown_path_is_relative_under_the_current_directory(tmp_path):
    assert shown_path(str(tmp_path / "out" / "x.pt"), cwd=str(tmp_path)) == os.path.join("out", "x.pt")
    assert shown_path(str(tmp_path), cwd=str(tmp_path)) == "."
    assert shown_path("rel/x.pt", cwd=str(tmp_path)) == "rel/x.pt"
    assert shown_path("/elsewhere/x.pt", cwd=str(tmp_path)) == "/elsewhere/x.pt"
    assert shown_path(str(tmp_path) + "-sibling/x.pt", cwd=str(tmp_path)) == str(tmp_path) + "-sibling/x.pt"


def test_already_exists_and_missing_directory_name_the_path_as_typed(dp_work):
    (dp_work / "m.safetensors").write_bytes(b"x")
    r = run_cli("convert", "m.pt", cwd=dp_work)
    assert r.rc == 9 and r.err.startswith("Error: m.safetensors already exists;"), r.err
    r = run_cli("strip-prefix", "m.pt", "-o", "out/y.pt", cwd=dp_work)
    assert r.rc == 9 and r.err.startswith("Error: out: the output directory does not exist"), r.err


def test_already_exists_is_worded_alike_by_every_command(dp_work):
    (dp_work / "m.stripped.pt").write_bytes(b"x")
    (dp_work / "m.safetensors").write_bytes(b"x")
    strip = run_cli("strip-prefix", "m.pt", cwd=dp_work).err
    conv = run_cli("convert", "m.pt", cwd=dp_work).err
    tail = " already exists; pass --force to overwrite it, or -o to choose another path\n"
    assert strip == "Error: m.stripped.pt" + tail
    assert conv == "Error: m.safetensors" + tail


def test_output_is_input_is_worded_alike(dp_work):
    strip = run_cli("strip-prefix", "m.pt", "-o", "m.pt", cwd=dp_work).err
    conv = run_cli("convert", "m.safetensors", "-o", "m.safetensors", cwd=dp_work)
    assert strip.startswith("Error: m.pt: the output is the input; -o to choose another path")
    assert "--in-place" in strip
    torch.save({"a": torch.zeros(2)}, dp_work / "n.pt")
    conv = run_cli("convert", "n.pt", "-o", "n.pt", cwd=dp_work).err
    assert conv == "Error: n.pt: the output is the input; -o to choose another path\n"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_output_in_proc(dp_work):
    r = run_cli("strip-prefix", "m.pt", "-o", "/proc/x.pt", cwd=dp_work)
    assert r.rc == 9 and "does not exist" not in r.err, r.err


def test_directory_outputs_say_permission_denied_once(tmp_path, monkeypatch):
    """DCP and sharded outputs go through the same wording (no 'cannot write X: X: permission denied')."""
    import tempfile

    from ckptfix.errors import OutputError
    from ckptfix.ops.rewrite.keys import add_prefix_checkpoint

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    shutil.copytree(SHARDED, tmp_path / "sharded")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "makedirs", refuse)
    with pytest.raises(OutputError) as ei:
        add_prefix_checkpoint("sharded/pytorch_model.bin.index.json", "module.", output="out")
    assert str(ei.value) == "out: permission denied; -o to choose a writable location"
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    from ckptfix.ops.convert.dcp_out import convert_to_dcp

    torch.save({"a": torch.zeros(2)}, tmp_path / "n.pt")
    from ckptfix.ops.convert import convert

    convert("n.pt", "n.safetensors")
    with pytest.raises(OutputError) as ei:
        convert_to_dcp("n.safetensors", "n.dcp")
    assert str(ei.value) == "n.dcp: permission denied; -o to choose a writable location"
