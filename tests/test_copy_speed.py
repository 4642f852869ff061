"""Issue 25, convert at copy speed: output blocks reserved first where that measured faster, same bytes."""

from __future__ import annotations

import errno
import os

import pytest

from ckptfix.errors import OutputError
from ckptfix.files import fileio, pagecache


@pytest.fixture(autouse=True)
def _any_size(monkeypatch):
    monkeypatch.setattr(fileio, "PREALLOCATE_MIN", 0)  # the tests' files are small


def _new(tmp_path, name="out.bin"):
    p = tmp_path / name
    p.write_bytes(b"")
    return p, os.open(p, os.O_RDWR)


def test_fs_type_names_the_file_system(tmp_path):
    p, fd = _new(tmp_path)
    try:
        kind = fileio.fs_type(fd)
    finally:
        os.close(fd)
    if not os.path.exists("/proc/self/mountinfo"):
        assert kind is None
    else:
        assert isinstance(kind, str) and kind
    if os.path.isdir("/dev/shm") and os.path.exists("/proc/self/mountinfo"):
        fd = os.open("/dev/shm", os.O_RDONLY)
        try:
            assert fileio.fs_type(fd) == "tmpfs"
        finally:
            os.close(fd)


def test_preallocate_reserves_the_blocks_where_measured_faster(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "fs_type", lambda fd: "ext4")
    p, fd = _new(tmp_path)
    try:
        if fileio._fallocate(fd, 1) not in (0,):
            pytest.skip("this file system has no fallocate")
        os.ftruncate(fd, 0)
        assert fileio.preallocate(fd, 3 << 20)
        st = os.fstat(fd)
        assert st.st_size == 3 << 20
        assert st.st_blocks * 512 >= 3 << 20  # the blocks are the file's, not a hole
        assert os.pread(fd, 16, 1 << 20) == b"\0" * 16
    finally:
        os.close(fd)


def test_small_outputs_are_not_preallocated(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "PREALLOCATE_MIN", 1 << 20)
    monkeypatch.setattr(fileio, "fs_type", lambda fd: pytest.fail("looked up"))
    monkeypatch.setattr(fileio, "_fallocate", lambda fd, n: pytest.fail("preallocated"))
    p, fd = _new(tmp_path)
    try:
        assert not fileio.preallocate(fd, (1 << 20) - 1)
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)


def test_preallocate_is_skipped_elsewhere(tmp_path, monkeypatch):
    called = []
    monkeypatch.setattr(fileio, "_fallocate", lambda fd, n: called.append(n) or 0)
    for kind in ("tmpfs", "btrfs", None):
        monkeypatch.setattr(fileio, "fs_type", lambda fd, kind=kind: kind)
        p, fd = _new(tmp_path, f"{kind}.bin")
        try:
            assert not fileio.preallocate(fd, 1 << 20)
            assert os.fstat(fd).st_size == 0
        finally:
            os.close(fd)
    assert called == []


@pytest.mark.parametrize("err", [errno.EOPNOTSUPP, errno.EINVAL, errno.EFBIG, None])
def test_preallocate_refused_means_plain_writes(tmp_path, monkeypatch, err):
    monkeypatch.setattr(fileio, "fs_type", lambda fd: "ext4")
    monkeypatch.setattr(fileio, "_fallocate", lambda fd, n: err)
    p, fd = _new(tmp_path)
    try:
        assert not fileio.preallocate(fd, 1 << 20)
    finally:
        os.close(fd)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_preallocate_on_a_full_disk_is_an_output_error(tmp_path, monkeypatch, err):
    monkeypatch.setattr(fileio, "fs_type", lambda fd: "ext4")
    monkeypatch.setattr(fileio, "_fallocate", lambda fd, n: err)
    p, fd = _new(tmp_path)
    try:
        with pytest.raises(OutputError, match="no space left"):
            fileio.preallocate(fd, 1 << 20)
    finally:
        os.close(fd)


def _checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    src = tmp_path / "m.pt"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 257, generator=g)
    torch.save({"module.w": w, "module.b": torch.randn(7, generator=g), "module.tied": w}, src)
    return src


@pytest.mark.parametrize("verify", [True, False])
def test_convert_output_is_the_same_bytes_with_or_without_preallocation(tmp_path, monkeypatch, verify):
    from ckptfix.ops.convert import convert_to_safetensors

    src = _checkpoint(tmp_path)
    monkeypatch.setattr(fileio, "fs_type", lambda fd: None)
    convert_to_safetensors(src, tmp_path / "plain.safetensors", verify=verify)
    seen = []
    real = fileio._fallocate
    monkeypatch.setattr(fileio, "fs_type", lambda fd: "ext4")
    monkeypatch.setattr(fileio, "_fallocate", lambda fd, n: seen.append(n) or real(fd, n))
    convert_to_safetensors(src, tmp_path / "pre.safetensors", verify=verify)
    out = (tmp_path / "pre.safetensors").read_bytes()
    assert seen == [len(out)]  # the whole file, reserved once
    assert out == (tmp_path / "plain.safetensors").read_bytes()


def test_convert_on_a_full_disk_stops_before_copying(tmp_path, monkeypatch):
    from ckptfix.ops.convert import convert_to_safetensors

    src = _checkpoint(tmp_path)
    monkeypatch.setattr(fileio, "fs_type", lambda fd: "ext4")
    monkeypatch.setattr(fileio, "_fallocate", lambda fd, n: errno.ENOSPC)
    from ckptfix.ops.convert import write

    copied = []
    monkeypatch.setattr(write, "copy_checked", lambda *a, **k: copied.append(a))
    monkeypatch.setattr(write, "copy_pieces", lambda *a, **k: copied.append(a))
    with pytest.raises(OutputError, match="no space left"):
        convert_to_safetensors(src, tmp_path / "o.safetensors")
    assert copied == []
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]  # no temp file left behind


@pytest.mark.parametrize("cached", [True, False])
def test_readahead_is_asked_only_for_windows_not_cached(tmp_path, monkeypatch, cached):
    advised = []
    monkeypatch.setattr(fileio, "page_cached", lambda fd, off: cached)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: advised.append((off, n, how)))
    fileio._ahead(3, 100, 100 + 3 * fileio.AHEAD)
    assert advised == ([] if cached else [(100, fileio.AHEAD, os.POSIX_FADV_WILLNEED)])


def _data_file(tmp_path, n: int = 1 << 20) -> tuple[int, bytes]:
    """A file of ``n`` random bytes, open for reading.  (What the page cache holds after a read is the kernel's:
    measured by ``benchmarks/check_header_pages.py``, never asserted here.)"""
    p = tmp_path / "scattered.bin"
    data = os.urandom(n)
    p.write_bytes(data)
    return os.open(p, os.O_RDONLY), data


def test_scattered_reads_give_each_range(tmp_path):
    fd, data = _data_file(tmp_path)
    try:
        ranges = [(10, 30), (5000, 200), (4090, 20), (300_000, 64), ((1 << 20) - 10, 50), (2 << 20, 8), (77, 0)]
        got = pagecache.read_scattered(fd, ranges)
        assert got == {off: data[off : off + n] for off, n in ranges}  # short at the end, empty past it
    finally:
        os.close(fd)


def test_scattered_reads_of_a_partly_read_file(tmp_path):
    fd, data = _data_file(tmp_path)
    try:
        os.pread(fd, 4096, 8192)
        got = pagecache.read_scattered(fd, [(8200, 16), (600_000, 16)])
        assert got == {8200: data[8200:8216], 600_000: data[600_000:600_016]}
    finally:
        os.close(fd)


def test_scattered_reads_drop_nothing_where_the_cache_cannot_be_asked(tmp_path, monkeypatch):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 64)
    monkeypatch.delattr(os, "RWF_NOWAIT", raising=False)
    dropped = []
    monkeypatch.setattr(pagecache, "drop_cached", lambda *a: dropped.append(a))
    fd = os.open(p, os.O_RDONLY)
    try:
        got = pagecache.read_scattered(fd, [(1, 3), (9000, 2)])
        assert got == {1: b"\x01\x02\x03", 9000: bytes([9000 % 256, 9001 % 256])}
    finally:
        os.close(fd)
    assert dropped == []


# what a cold torch zip's local-header pages are left as after members() reads them: not a unit test (the page
# cache is the kernel's), measured by benchmarks/check_header_pages.py (issue 36)
