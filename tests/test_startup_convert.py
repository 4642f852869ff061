"""``convert FILE.pt``: what it imports (no torch, numpy or remote driver), how its temp files are made, how it exits.

``convert`` of a local torch zip runs in a fresh interpreter through the console script's entry point
(:func:`ckptfix.cli.run`) and lists ``sys.modules`` at exit.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

#: what ``convert model.pt -o model.safetensors`` must not import: it uses none of them
NEVER = ["torch", "numpy", "fsspec", "s3fs", "aiohttp", "botocore", "huggingface_hub"]

_RUN = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('\\nMODULES ' + ' '.join(sorted(sys.modules)) + '\\n'))\n"
    "sys.argv[0] = 'ckptfix'\n"
    "from ckptfix.cli import run\n"
    "run()\n"
)


def _convert(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**(env or os.environ), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", _RUN, "convert", *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def _modules(p: subprocess.CompletedProcess[str]) -> set[str]:
    assert p.returncode == 0, p.stderr
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("MODULES ")]
    assert line, p.stderr  # atexit handlers ran
    return set(line[-1].split()[1:])


@pytest.fixture(scope="module")
def torch_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small ``torch.save`` zip (a model's state dict)."""
    from tests.helpers import CkptFactory

    return Path(CkptFactory(tmp_path_factory.mktemp("startup-convert")).plain().path)


@pytest.mark.parametrize("verify", [True, False])
def test_convert_of_a_local_torch_zip_imports_no_torch_numpy_or_remote_driver(torch_zip, tmp_path, verify):
    out = tmp_path / "model.safetensors"
    p = _convert([str(torch_zip), "-o", str(out), "--json"] + ([] if verify else ["--no-verify"]))
    mods = _modules(p)
    assert out.is_file()
    assert '"outputs"' in p.stdout  # stdout flushed before the exit
    assert sorted(m for m in NEVER if m in mods) == []


def test_convert_exit_status_and_error_line_are_kept(tmp_path):
    p = _convert([str(tmp_path / "missing.pt"), "-o", str(tmp_path / "o.safetensors")])
    assert p.returncode != 0
    assert p.stderr.startswith("Error: ") and "Traceback" not in p.stderr
    assert "MODULES " in p.stderr


def test_temp_files_are_new_and_named_for_the_stale_cleaner(tmp_path):
    from ckptfix.files import atomic

    final = tmp_path / "model.safetensors"
    fd, tmp = atomic.new_temp(str(final))
    try:
        assert os.path.isabs(tmp) and os.path.dirname(tmp) == str(tmp_path)
        assert atomic._TEMP_RE.fullmatch(os.path.basename(tmp))
        assert os.path.basename(tmp).startswith(f".{final.name}{atomic.TEMP_MARK}")
        assert os.fstat(fd).st_size == 0 and not os.get_inheritable(fd)
    finally:
        os.close(fd)
        os.unlink(tmp)
        atomic.release_temp(tmp)


def test_new_temp_still_gives_the_final_mode_and_holds_the_lock(tmp_path):
    from ckptfix.files import atomic

    final = tmp_path / "out.pt"
    final.write_bytes(b"old")
    final.chmod(0o640)
    fd, tmp = atomic.new_temp(str(final))
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o640
        assert tmp in atomic._locks
    finally:
        os.close(fd)
        os.unlink(tmp)
        atomic.release_temp(tmp)


def test_a_conversion_preallocating_its_output_does_not_load_ctypes(tmp_path):
    """An output of 32 MiB or more on ext4 is preallocated (``fileio.preallocate``) through ``os.posix_fallocate``
    for a file mapped by extents: ``ctypes`` (about 2.5 ms to load) is not needed."""
    torch = pytest.importorskip("torch")
    from ckptfix.files import fileio

    fd = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if fileio.fs_type(fd) not in fileio.PREALLOCATE_FS or not fileio._extent_mapped(fd):
            pytest.skip("not an ext4 file system with extents")
    finally:
        os.close(fd)
    src = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(10 << 20), "b": torch.ones(3)}, src)  # 40 MiB
    out = tmp_path / "big.safetensors"
    mods = _modules(_convert([str(src), "-o", str(out), "-q"]))
    assert "ckptfix.files.fileio" in mods and "ctypes" not in mods
    assert out.stat().st_size > fileio.PREALLOCATE_MIN


def test_posix_fallocate_reserves_the_blocks_of_an_extent_file(tmp_path, monkeypatch):
    from ckptfix.files import fileio

    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not fileio._extent_mapped(fd):
            pytest.skip("not an ext4 file mapped by extents")
        monkeypatch.setitem(sys.modules, "ctypes", None)  # importing it would fail
        assert fileio._fallocate(fd, 3 << 20) == 0
        st = os.fstat(fd)
        assert st.st_size == 3 << 20 and st.st_blocks * 512 >= 3 << 20
    finally:
        os.close(fd)
