"""GPU lease files: a hostile neighbour cannot make pick-gpu overwrite anything; leases can be given back."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from ckptfix.errors import OutputError
from ckptfix.gpu import leases
from ckptfix.gpu.leases import (
    held_lease,
    hold_for_process,
    lease_dir,
    lease_file,
    open_lease_dir,
    release_leases,
    try_lease,
)

KEY = "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90"
IS_ROOT = os.geteuid() == 0


def _as_other_process(f: Path) -> None:
    """A lease this process took counts as its own; make it look like another job's."""
    rec = json.loads(f.read_text())
    rec["pid"] = 1
    f.write_text(json.dumps(rec))


def _private(tmp_path: Path) -> Path:
    d = tmp_path / "leases"
    d.mkdir(mode=0o700)
    return d


def test_directory_is_created_0700(tmp_path):
    d = tmp_path / "a" / "leases"
    lease, _ = try_lease(d, KEY, 60)
    assert lease is not None
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d / f"{KEY}.lease").st_mode) == 0o600


def test_symlinked_lease_file_is_never_followed(tmp_path):
    d = _private(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (d / f"{KEY}.lease").symlink_to(victim)
    with pytest.raises(OutputError) as ei:
        try_lease(d, KEY, 60)
    assert "symlink" in str(ei.value) and "rm " in str(ei.value)
    assert ei.value.exit_code == 9
    assert victim.read_text() == "precious"


def test_hard_link_to_another_file_is_refused(tmp_path):
    d = _private(tmp_path)
    victim = d / "victim.txt"  # same filesystem; the lease name is a second link to it
    victim.write_text("precious")
    os.link(victim, d / f"{KEY}.lease")
    with pytest.raises(OutputError, match="hard links"):
        try_lease(d, KEY, 60)
    assert victim.read_text() == "precious"


def test_corrupt_lease_file_is_a_stale_lease_with_a_warning(tmp_path):
    # issue 23 item 8: it used to block every picker until removed by hand
    d = _private(tmp_path)
    f = d / f"{KEY}.lease"
    f.write_text('{"key": "GPU-x", "pi')  # a write cut short
    looked, _ = try_lease(d, KEY, 0)
    assert looked is not None and "corrupt" in (looked.warning or "") and "rewritten" not in looked.warning
    assert f.read_text() == '{"key": "GPU-x", "pi'  # only looking changes nothing
    lease, holder = try_lease(d, KEY, 60)
    assert lease is not None and holder == "", holder
    assert 'was corrupt (20 bytes: {"key": "GPU-x", "pi): taken as a stale lease and rewritten' in lease.warning
    record = json.loads(f.read_text())
    assert record["key"] == KEY and record["expires"] == lease.expires  # a proper lease again


def test_world_writable_directory_is_refused(tmp_path):
    d = _private(tmp_path)
    os.chmod(d, 0o777)
    with pytest.raises(OutputError) as ei:
        try_lease(d, KEY, 60)
    msg = str(ei.value)
    assert "world-writable" in msg and f"chmod 700 {d}" in msg and "\n" not in msg
    assert list(d.iterdir()) == []


def test_group_writable_directory_is_refused(tmp_path):
    d = _private(tmp_path)
    os.chmod(d, 0o770)
    with pytest.raises(OutputError, match="group- or world-writable"):
        open_lease_dir(d)


@pytest.mark.skipif(not IS_ROOT, reason="chown to another uid needs root")
def test_directory_owned_by_someone_else_is_refused(tmp_path):
    d = _private(tmp_path)
    os.chown(d, 4242, 4242)
    with pytest.raises(OutputError, match="owned by uid 4242"):
        try_lease(d, KEY, 60)
    assert list(d.iterdir()) == []


@pytest.mark.skipif(not IS_ROOT, reason="chown to another uid needs root")
def test_symlinked_directory_owned_by_someone_else_is_refused(tmp_path):
    real = _private(tmp_path)
    link = tmp_path / "planted"
    link.symlink_to(real)
    os.lchown(link, 4242, 4242)
    with pytest.raises(OutputError, match="symlink owned by uid 4242"):
        try_lease(link, KEY, 60)


@pytest.mark.skipif(not IS_ROOT, reason="chown to another uid needs root")
def test_lease_file_owned_by_someone_else_is_refused(tmp_path):
    d = _private(tmp_path)
    f = d / f"{KEY}.lease"
    f.write_text("")
    os.chown(f, 4242, 4242)
    with pytest.raises(OutputError, match="owned by uid 4242"):
        try_lease(d, KEY, 60)


def test_the_planted_attack_from_the_issue(tmp_path):
    """/tmp/ckptfix-leases-<uid> pre-created 0777 with GPU-x.lease -> victim file: refused, file intact."""
    d = tmp_path / "ckptfix-leases-0"
    d.mkdir()
    os.chmod(d, 0o777)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (d / f"{KEY}.lease").symlink_to(victim)
    with pytest.raises(OutputError):
        try_lease(d, KEY, None)
    assert victim.read_text() == "keep me"


def test_held_lease_fd_is_close_on_exec(tmp_path):
    lease, _ = try_lease(_private(tmp_path), KEY, None)
    try:
        assert lease.fd is not None and not os.get_inheritable(lease.fd)
    finally:
        lease.release()


def test_default_directory_order(tmp_path):
    xdg = tmp_path / "run"
    xdg.mkdir()
    tmpd = tmp_path / "tmp"
    tmpd.mkdir()
    uid = os.getuid()
    # str paths (no pathlib at pick-gpu's start-up), printed as pathlib would print them
    assert lease_dir({"CKPTFIX_LEASE_DIR": "/x"}) == "/x"
    assert lease_dir({"CKPTFIX_LEASE_DIR": "/x/"}) == "/x"
    assert lease_dir({"CKPTFIX_LEASE_DIR": "rel"}) == "rel"
    assert lease_dir({"XDG_RUNTIME_DIR": f"{xdg}/", "TMPDIR": str(tmpd)}) == f"{xdg}/ckptfix-leases"
    assert lease_dir({"TMPDIR": str(tmpd)}) == f"{tmpd}/ckptfix-leases-{uid}"
    assert lease_dir({"TMPDIR": str(tmp_path / "missing")}) == f"/tmp/ckptfix-leases-{uid}"
    assert lease_dir({}) == f"/tmp/ckptfix-leases-{uid}"


def test_token_makes_a_timed_lease_ones_own(tmp_path):
    d = _private(tmp_path)
    a, _ = try_lease(d, KEY, 60, token="t1", now=1000.0)
    assert a is not None
    _as_other_process(d / f"{KEY}.lease")
    assert try_lease(d, KEY, 60, token="t2", now=1001.0)[0] is None
    assert try_lease(d, KEY, 60, now=1001.0)[0] is None
    took, _ = try_lease(d, KEY, None, token="t1", now=1001.0)
    assert took is not None and took.fd is not None
    took.release()


def test_release_gives_back_only_this_tokens_timed_leases(tmp_path):
    d = _private(tmp_path)
    import time

    now = time.time()
    try_lease(d, "GPU-a", 60, token="mine", now=now)
    try_lease(d, "GPU-b", 60, token="theirs", now=now)
    _as_other_process(d / "GPU-b.lease")
    held, _ = try_lease(d, "GPU-c", None, token="mine")
    try:
        out = release_leases(d, token="mine")
        assert {(r.key, r.released) for r in out} == {("GPU-a", True), ("GPU-c", False)}
        assert try_lease(d, "GPU-a", 0, token="x")[0] is not None  # free again
        assert try_lease(d, "GPU-b", 0, token="x")[0] is None  # someone else's: untouched
        everything = release_leases(d)
        assert ("GPU-b", True) in {(r.key, r.released) for r in everything}
    finally:
        held.release()


def test_release_on_a_missing_directory_is_empty(tmp_path):
    assert release_leases(tmp_path / "none") == []


@pytest.mark.parametrize("field, value", [("host", "another-container"), ("start", -1)])
def test_a_reused_pid_does_not_make_a_live_lease_ones_own(tmp_path, field, value):
    """Containers sharing a lease directory run pick-gpu under the same small PID, and PIDs get reused on a busy
    host: a timed lease whose record has this PID but was written by another process must still be refused."""
    d = _private(tmp_path)
    lease, _ = try_lease(d, KEY, 600)
    assert lease is not None
    f = d / f"{KEY}.lease"
    rec = json.loads(f.read_text())
    assert rec["pid"] == os.getpid()
    rec[field] = value
    f.write_text(json.dumps(rec))
    again, who = try_lease(d, KEY, 600)
    assert again is None and "pid" in who


SPELLED_KEY = "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90"


@pytest.mark.parametrize(
    "spelling", [".", "./", "./leases", "./leases/", "leases//", "./a//b/./c", "a/./b/", "a/../b", "//x/y", "///x", "/"]
)
def test_lease_paths_are_spelled_as_pathlib_spelled_them(spelling):
    """pick-gpu's lease paths (messages, Lease.path) are spelled as pathlib spells them: ``./a//b/./c`` is ``a/b/c``."""
    assert lease_dir({"CKPTFIX_LEASE_DIR": spelling}) == str(Path(spelling))
    assert lease_file(spelling, SPELLED_KEY) == str(Path(spelling) / f"{SPELLED_KEY}.lease")
    if spelling in (".", "./", "/"):  # directories that exist: $XDG_RUNTIME_DIR is taken
        assert lease_dir({"XDG_RUNTIME_DIR": spelling}) == str(Path(spelling) / "ckptfix-leases")


def test_an_unsafe_lease_directory_is_named_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir("bad", 0o700)
    os.chmod("bad", 0o777)
    with pytest.raises(OutputError) as e:
        open_lease_dir("./bad/")
    assert "directory bad:" in str(e.value) and "`chmod 700 bad`" in str(e.value)


def test_held_lease_is_found_however_its_path_is_spelled(tmp_path, monkeypatch):
    """held_lease matches a lease however its path is spelled (``./d/x`` is ``d/x``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(leases, "_HELD", [])
    lease, _ = try_lease("./d//", SPELLED_KEY, None)
    assert lease is not None
    try:
        hold_for_process([lease])
        assert held_lease(Path("d") / f"{SPELLED_KEY}.lease") is lease
        assert held_lease(f"./d//{SPELLED_KEY}.lease") is lease
        assert held_lease(lease_file("d", SPELLED_KEY)) is lease
    finally:
        assert lease.fd is not None
        os.close(lease.fd)
