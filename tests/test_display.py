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


def test_read_only_file_system_is_worded_alike_by_every_command(dp_work, monkeypatch):
    """convert checks the directory first (os.access fails EROFS on a read-only mount), strip-prefix fails
    creating its temp file (EROFS): one wording, not 'rofs: permission denied' for one of them (issue #38 item 7).
    A read-only mount needs root to make, so the file system's answers are simulated for that one directory."""
    import tempfile

    rofs = dp_work / "rofs"
    rofs.mkdir()
    real_access, real_statvfs, real_mkstemp = os.access, os.statvfs, tempfile.mkstemp

    class RoStat:
        def __init__(self, st):
            self.f_flag = st.f_flag | os.ST_RDONLY

    def on_rofs(p) -> bool:
        return os.path.abspath(os.fspath(p)) == str(rofs)

    def mkstemp(suffix=None, prefix=None, dir=None, text=False):
        if dir is not None and on_rofs(dir):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_mkstemp(suffix, prefix, dir, text)

    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if on_rofs(p) else real_access(p, mode, **k))
    monkeypatch.setattr(os, "statvfs", lambda p: RoStat(real_statvfs(p)) if on_rofs(p) else real_statvfs(p))
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    tail = ": read-only file system; -o to choose a writable location\n"
    conv = run_cli("convert", "m.pt", "-o", "rofs/m.safetensors", cwd=dp_work, isolated=False)
    assert (conv.rc, conv.err) == (9, "Error: rofs" + tail)
    strip = run_cli("strip-prefix", "m.pt", "-o", "rofs/m.pt", cwd=dp_work, isolated=False)
    assert (strip.rc, strip.err) == (9, "Error: " + os.path.join("rofs", "m.pt") + tail)


def test_a_git_lfs_pointer_is_named_with_git_lfs_pull(dp_work):
    """A clone without git-lfs leaves pointer files where the checkpoints were (issue #38 item 7). The pointer
    is written as git-lfs writes it (docs/spec.md of git-lfs: version, oid sha256, size; sorted keys)."""
    import hashlib

    real = (dp_work / "m.pt").read_bytes()
    pointer = (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(real).hexdigest()}\nsize {len(real)}\n"
    )
    (dp_work / "model.safetensors").write_text(pointer)
    (dp_work / "m.pt").write_text(pointer)
    want = (
        f"a Git LFS pointer of a {len(real):,}-byte file, not the checkpoint (the clone did not download it); "
        "run `git lfs pull --include=NAME` (or `git lfs pull`) in the repository\n"
    )
    for args in (("inspect", "m.pt"), ("scan", "m.pt"), ("convert", "m.pt"), ("inspect", "model.safetensors")):
        r = run_cli(*args, cwd=dp_work, isolated=False)
        name = args[1]
        assert (r.rc, r.err) == (4, f"Error: {name}: " + want.replace("NAME", name)), r.err
