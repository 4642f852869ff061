"""Review of the start-up work of issue 25: behaviour the previous tree had that the changes must keep."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfix.errors import OutputError
from ckptfix.gpu import leases
from ckptfix.gpu.leases import held_lease, hold_for_process, lease_dir, lease_file, open_lease_dir, try_lease

ROOT = Path(__file__).resolve().parent.parent
KEY = "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90"


@pytest.mark.parametrize(
    "spelling", [".", "./", "./leases", "./leases/", "leases//", "./a//b/./c", "a/./b/", "a/../b", "//x/y", "///x", "/"]
)
def test_lease_paths_are_spelled_as_pathlib_spelled_them(spelling):
    """pick-gpu's lease paths (messages, Lease.path) were pathlib's: ``./a//b/./c`` printed ``a/b/c``."""
    assert lease_dir({"CKPTFIX_LEASE_DIR": spelling}) == str(Path(spelling))
    assert lease_file(spelling, KEY) == str(Path(spelling) / f"{KEY}.lease")
    if spelling in (".", "./", "/"):  # directories that exist: $XDG_RUNTIME_DIR is taken
        assert lease_dir({"XDG_RUNTIME_DIR": spelling}) == str(Path(spelling) / "ckptfix-leases")


def test_unsafe_lease_directory_is_named_as_before(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir("bad", 0o700)
    os.chmod("bad", 0o777)
    with pytest.raises(OutputError) as e:
        open_lease_dir("./bad/")
    assert "directory bad:" in str(e.value) and "`chmod 700 bad`" in str(e.value)


def test_held_lease_is_found_however_its_path_is_spelled(tmp_path, monkeypatch):
    """held_lease compared pathlib paths (``./d/x`` == ``d/x``); str paths must match the same way."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(leases, "_HELD", [])
    lease, _ = try_lease("./d//", KEY, None)
    assert lease is not None
    try:
        hold_for_process([lease])
        assert held_lease(Path("d") / f"{KEY}.lease") is lease
        assert held_lease(f"./d//{KEY}.lease") is lease
        assert held_lease(lease_file("d", KEY)) is lease
    finally:
        assert lease.fd is not None
        os.close(lease.fd)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["inspect"], ["inspect", "--json"], ["scan"], ["--help"]], ids=" ".join)
@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
def test_a_full_standard_output_is_one_error_line_not_an_internal_error(args, unbuffered, tmp_path):
    """stdout redirected to a full disk: ``Error: cannot write the output to standard output ...``, exit 9 (the
    output errors' code), in a plain shell's environment with and without ``PYTHONUNBUFFERED`` (issue 36:
    buffered, the interpreter flushed what the failed write had left in stdout's buffer again at exit:
    ``Exception ignored in: <stdout>``, exit 120)."""
    from tests.helpers import CkptFactory, plain_env

    argv = [*args, str(CkptFactory(tmp_path).plain().path)] if args != ["--help"] else args
    env = plain_env(tmp_path, **({"PYTHONUNBUFFERED": "1"} if unbuffered else {}))
    with open("/dev/full", "w") as full:
        p = subprocess.run(
            [sys.executable, "-m", "ckptfix", *argv],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
    assert p.returncode == OutputError.exit_code, p.stderr
    assert p.stderr.startswith("Error: cannot write the output to standard output: No space left on device")
    assert p.stderr.count("\n") == 1 and "internal error" not in p.stderr
