"""ckptfix.files.atomic: temp files locked while written, stale ones cleaned, backups bounded, same-file checks."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from ckptfix.cli import main
from ckptfix.files import atomic
from ckptfix.files.atomic import output_error


def _age(p: Path, seconds: float = 3600) -> None:
    t = time.time() - seconds
    os.utime(p, (t, t))


def test_temp_files_follow_the_naming_and_are_locked(tmp_path):
    fd, tmp = atomic.new_temp(str(tmp_path / "out.pth"))
    os.close(fd)
    name = os.path.basename(tmp)
    assert atomic._TEMP_RE.fullmatch(name) and name.startswith(".out.pth.ckptfix-")
    _age(Path(tmp))
    # another process cannot take the lock: the temp is not stale while we hold it
    code = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
        "except OSError:\n    print('held')"
    )
    r = subprocess.run([sys.executable, "-c", code, tmp], capture_output=True, text=True, timeout=600)
    assert r.stdout.strip() == "held"
    assert atomic.clean_stale_temps(str(tmp_path)) == []
    os.unlink(tmp)
    atomic.release_temp(tmp)


def test_a_killed_writers_temp_is_removed_by_the_next_write(tmp_path):
    code = (
        "import os, sys, signal; sys.path.insert(0, sys.argv[2]); from ckptfix.files import atomic\n"
        "fd, tmp = atomic.new_temp(sys.argv[1]); os.write(fd, b'x' * 1000); print(tmp, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "model.pth"), str(Path(__file__).parents[1])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    tmp = Path(r.stdout.strip())
    assert tmp.exists()
    assert atomic.clean_stale_temps(str(tmp_path)) == []  # too young: its writer might just be starting
    _age(tmp)
    src = tmp_path / "src.pth"
    torch.save({"module.w": torch.ones(2)}, src)
    assert main(["strip-prefix", str(src), "-o", str(tmp_path / "fixed.pth")]) == 0
    assert not tmp.exists()


def test_only_ckptfix_named_regular_files_are_touched(tmp_path):
    keep = [
        tmp_path / ".model.pth.abcdefgh.tmp",
        tmp_path / "model.pth.ckptfix-abcdefgh.tmp",
        tmp_path / ".model.pth.ckptfix-abc.tmp",
        tmp_path / ".x.ckptfix-abcdefgh.tmp.bak",
    ]
    for p in keep:
        p.write_bytes(b"user data")
        _age(p)
    link = tmp_path / ".y.ckptfix-abcdefgh.tmp"
    os.symlink(keep[0], link)
    stale = tmp_path / ".z.ckptfix-abcdefgh.tmp"
    stale.write_bytes(b"left over")
    _age(stale)
    assert atomic.clean_stale_temps(str(tmp_path)) == [str(stale)]
    assert all(p.exists() for p in keep) and os.path.islink(link)


def test_backups_are_bounded_to_two(tmp_path):
    p = tmp_path / "m.pth"
    for i in range(4):
        if i:
            atomic.make_backup(str(p))
        new = tmp_path / "new"
        new.write_bytes(f"v{i}".encode())
        os.replace(new, p)  # as an in-place rewrite does: a new file under the old name
    # .bak is the file before the first rewrite, .bak1 the one before the latest
    assert (tmp_path / "m.pth.bak").read_bytes() == b"v0"
    assert (tmp_path / "m.pth.bak1").read_bytes() == b"v2"
    assert sorted(os.listdir(tmp_path)) == ["m.pth", "m.pth.bak", "m.pth.bak1"]


def test_same_file_sees_hard_links_and_symlinks(tmp_path):
    a = tmp_path / "a"
    a.write_bytes(b"x")
    os.link(a, tmp_path / "h")
    os.symlink(a, tmp_path / "s")
    assert atomic.same_file(str(a), str(tmp_path / "h")) and atomic.same_file(str(a), str(tmp_path / "s"))
    assert not atomic.same_file(str(a), str(tmp_path / "missing"))


def test_convert_to_a_hard_link_of_the_input_is_refused(tmp_path, capsys):
    src = tmp_path / "m.pth"
    torch.save({"module.w": torch.ones(2)}, src)
    os.link(src, tmp_path / "link.safetensors")
    before = src.read_bytes()
    rc = main(["convert", str(src), "-o", str(tmp_path / "link.safetensors"), "--force"])
    err = capsys.readouterr().err
    assert rc == 9 and "input" in err
    assert src.read_bytes() == before
    assert main(["strip-prefix", str(src), "-o", str(tmp_path / "link.safetensors"), "--force"]) == 9
    assert src.read_bytes() == before


# --- moved from test_review_ckpt.py: in-place through symlinks and hard links; outputs that are dirs or the input


def test_in_place_through_a_symlink_fixes_the_target(tmp_path):
    """--in-place on a symlink rewrites the file it points to, keeps the link, and backs up the real file."""
    from helpers import dp_state_dict, run_cli

    real_dir = tmp_path / "store"
    real_dir.mkdir()
    real = real_dir / "real.pt"
    torch.save({"state_dict": dp_state_dict()}, real)
    link = tmp_path / "link.pt"
    link.symlink_to(os.path.relpath(real, tmp_path))
    p = run_cli("strip-prefix", link, "--in-place")
    assert p.returncode == 0, p.stderr
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    assert list(torch.load(real, weights_only=True)["state_dict"]) == [f"l{i}.weight" for i in range(6)]
    assert (real_dir / "real.pt.bak").is_file() and not (real_dir / "real.pt.bak").is_symlink()
    assert list(torch.load(real_dir / "real.pt.bak", weights_only=True)["state_dict"])[0] == "module.l0.weight"


def test_in_place_on_a_hard_linked_file_says_so(tmp_path):
    """Replacing a hard-linked file leaves the other link on the old content, and the report notes it."""
    from ckptfix.ops.prefixes import strip_prefix_report
    from ckptfix.ops.rewrite import rewrite_checkpoint

    from helpers import dp_state_dict

    a = tmp_path / "a.pt"
    torch.save({"state_dict": dp_state_dict()}, a)
    b = tmp_path / "b.pt"
    os.link(a, b)
    rep = rewrite_checkpoint(str(a), lambda sd: strip_prefix_report(sd), in_place=True, backup=False)
    assert any("hard link" in n for n in rep.notes)
    assert list(torch.load(b, weights_only=True)["state_dict"])[0] == "module.l0.weight"  # b is the old file


def test_output_that_is_a_directory_is_refused_without_suggesting_force(tmp_path):
    from helpers import assert_one_line_error, dp_state_dict, leftovers, run_cli

    src = tmp_path / "m.pt"
    torch.save({"state_dict": dp_state_dict()}, src)
    d = tmp_path / "out"
    d.mkdir()
    for extra in ([], ["--force"]):
        p = run_cli("strip-prefix", src, "-o", d, *extra)
        assert_one_line_error(p, 9)
        assert "is a directory" in p.stderr and "--force" not in p.stderr
    assert os.listdir(d) == [] and leftovers(tmp_path) == []


def test_output_that_is_the_input_through_a_symlink_is_refused(tmp_path):
    """-o naming the input by another path (a symlink) is refused (exit 9) even with --force; the input is unchanged."""
    from helpers import assert_one_line_error, dp_state_dict, run_cli, sha256

    src = tmp_path / "m.pt"
    torch.save({"state_dict": dp_state_dict()}, src)
    link = tmp_path / "link.pt"
    link.symlink_to(src)
    h = sha256(src)
    p = run_cli("strip-prefix", link, "-o", src, "--force")
    assert_one_line_error(p, 9)
    assert "is the input" in p.stderr and sha256(src) == h


def test_permission_denied_is_said_once():
    e = output_error(OSError(errno.EACCES, os.strerror(errno.EACCES)), "/nowhere/x.pt")
    assert str(e).lower().count("permission denied") == 1, str(e)


def test_a_directory_that_refuses_files_is_not_called_missing(tmp_path):
    e = output_error(OSError(errno.ENOENT, os.strerror(errno.ENOENT)), str(tmp_path / "x.pt"))
    assert "does not exist" not in str(e) and "cannot create a file there" in str(e)
    e = output_error(OSError(errno.ENOENT, os.strerror(errno.ENOENT)), str(tmp_path / "no" / "x.pt"))
    assert "the output directory does not exist" in str(e)
