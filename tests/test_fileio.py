"""ckptfix.files.fileio: every copy path (forced by monkeypatching), odd offsets, short copies, EXDEV, verification."""

from __future__ import annotations

import errno
import os
import zlib

import pytest

from ckptfix.errors import CorruptCheckpointError, OutputError
from ckptfix.files import fileio

SIZE = 3 * fileio.FOLIO + 12345


@pytest.fixture
def files(tmp_path):
    data = os.urandom(SIZE)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    dst = tmp_path / "dst.bin"
    dst.write_bytes(b"")
    s = os.open(src, os.O_RDONLY)
    d = os.open(dst, os.O_RDWR)
    yield data, s, d, dst
    os.close(s)
    os.close(d)


def _refuse(err: int):
    def f(*a, **k):
        raise OSError(err, os.strerror(err))

    return f


def _check(data: bytes, dst, src_off: int, dst_off: int, size: int) -> None:
    got = dst.read_bytes()
    assert got[dst_off : dst_off + size] == data[src_off : src_off + size]


@pytest.mark.parametrize(
    ("src_off", "dst_off", "size"),
    [
        (0, 0, SIZE),
        (1, 0, SIZE - 1),
        (13, 4099, SIZE - 13),
        (fileio.FOLIO - 1, 7, 2 * fileio.FOLIO + 3),
        (64, 8 + 4096, 100_000),
        (SIZE - 1, 3, 1),
    ],
)
def test_kernel_copy_takes_any_offsets(files, src_off, dst_off, size, monkeypatch):
    data, s, d, dst = files
    used = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: used.append(a) or real(*a))
    monkeypatch.setattr(fileio, "_buffered", _refuse(errno.EFAULT))  # never the user-space buffer
    assert fileio.copy_range(s, src_off, d, dst_off, size, kernel="any") == 0
    _check(data, dst, src_off, dst_off, size)
    assert used


@pytest.mark.parametrize(
    ("src_off", "dst_off", "kernel"), [(0, 0, True), (13, 13 + 2 * fileio.FOLIO, True), (13, 0, False)]
)
def test_by_default_the_kernel_copies_congruent_offsets_only(files, monkeypatch, src_off, dst_off, kernel):
    data, s, d, dst = files
    used = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: used.append(a) or real(*a))
    fileio.copy_range(s, src_off, d, dst_off, 50_000)
    _check(data, dst, src_off, dst_off, 50_000)
    assert bool(used) == kernel == fileio.in_kernel(src_off, dst_off)
    used.clear()
    fileio.copy_range(s, src_off, d, dst_off, 50_000, kernel="never")
    assert not used


def test_short_copies_are_continued(files, monkeypatch):
    data, s, d, dst = files
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda a, b, n, so, do: real(a, b, min(n, 1000), so, do))
    fileio.copy_range(s, 5, d, 11, SIZE - 5, kernel="any")
    _check(data, dst, 5, 11, SIZE - 5)


@pytest.mark.parametrize("err", [errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP])
def test_refused_kernel_copy_falls_back_to_sendfile(files, monkeypatch, err):
    data, s, d, dst = files
    sent = []
    real = os.sendfile
    monkeypatch.setattr(os, "copy_file_range", _refuse(err))
    monkeypatch.setattr(os, "sendfile", lambda *a: sent.append(a) or real(*a))
    fileio.copy_range(s, 3, d, 17, SIZE - 3, kernel="any")
    _check(data, dst, 3, 17, SIZE - 3)
    assert sent
    assert os.lseek(d, 0, os.SEEK_CUR) == 0  # the caller's descriptor keeps its file position


def test_fallback_is_per_call_not_per_file(files, monkeypatch):
    data, s, d, dst = files
    calls = []
    real = os.copy_file_range

    def once(*a):
        calls.append(a)
        if len(calls) == 1:
            raise OSError(errno.EXDEV, "cross-device")
        return real(*a)

    monkeypatch.setattr(os, "copy_file_range", once)
    fileio.copy_range(s, 0, d, 0, 1000, kernel="any")
    fileio.copy_range(s, 1000, d, 1000, SIZE - 1000, kernel="any")
    _check(data, dst, 0, 0, SIZE)
    assert len(calls) >= 2  # the second copy tried the kernel again


def test_last_fallback_is_pread_pwrite(files, monkeypatch):
    data, s, d, dst = files
    monkeypatch.setattr(os, "copy_file_range", _refuse(errno.EXDEV))
    monkeypatch.setattr(os, "sendfile", _refuse(errno.EINVAL))
    fileio.copy_range(s, 9, d, 2, SIZE - 9, kernel="any")
    _check(data, dst, 9, 2, SIZE - 9)
    monkeypatch.delattr(os, "copy_file_range")
    monkeypatch.delattr(os, "sendfile")
    fileio.copy_range(s, 0, d, 0, SIZE)
    _check(data, dst, 0, 0, SIZE)


def test_kernel_copy_that_stops_midway_is_finished_another_way(files, monkeypatch):
    data, s, d, dst = files
    real = os.copy_file_range
    state = {"n": 0}

    def half(*a):
        state["n"] += 1
        if state["n"] > 1:
            raise OSError(errno.EXDEV, "cross-device")
        return real(*a)

    monkeypatch.setattr(os, "copy_file_range", half)
    monkeypatch.setattr(os, "sendfile", _refuse(errno.EINVAL))
    fileio.copy_range(s, 100, d, 0, SIZE - 100, kernel="any")
    _check(data, dst, 100, 0, SIZE - 100)


def test_crc_copy_returns_the_crc(files):
    data, s, d, dst = files
    assert fileio.copy_range(s, 7, d, 0, SIZE - 7, crc=True) == zlib.crc32(data[7:]) & 0xFFFFFFFF
    _check(data, dst, 7, 0, SIZE - 7)


def test_source_ending_early_is_corruption(files, monkeypatch):
    _, s, d, _ = files
    for kernel in ("any", "never"):
        with pytest.raises(CorruptCheckpointError, match="ended early"):
            fileio.copy_range(s, SIZE - 10, d, 0, 100, kernel=kernel)
    monkeypatch.setattr(os, "copy_file_range", _refuse(errno.EXDEV))
    with pytest.raises(CorruptCheckpointError, match="ended early"):
        fileio.copy_range(s, SIZE - 10, d, 0, 100, crc=True)


def test_full_disk_is_an_output_error(files, monkeypatch):
    _, s, d, _ = files
    monkeypatch.setattr(os, "copy_file_range", _refuse(errno.ENOSPC))
    with pytest.raises(OutputError, match="no space"):
        fileio.copy_range(s, 0, d, 0, 100)
    monkeypatch.setattr(os, "pwrite", _refuse(errno.ENOSPC))
    with pytest.raises(OutputError, match="no space"):
        fileio.pwrite_all(d, b"x", 0)


def test_reflink_is_tried_on_aligned_ranges_only(files, monkeypatch):
    data, s, d, dst = files
    seen = []
    monkeypatch.setattr(fileio, "reflink_range", lambda *a: seen.append(a) or False)
    fileio.copy_range(s, 1, d, 0, SIZE - 1)
    assert not seen  # the source offset is not on a block
    fileio.copy_range(s, 0, d, 0, SIZE)
    blk = fileio._block_size(d)
    assert seen == [(s, 0, d, 0, SIZE - SIZE % blk)]
    _check(data, dst, 0, 0, SIZE)
    seen.clear()
    fileio.copy_range(s, 0, d, 0, SIZE, reflink=False)
    assert not seen


def test_reflink_success_copies_only_the_tail(files, monkeypatch):
    data, s, d, dst = files
    blk = fileio._block_size(d)
    body = SIZE - SIZE % blk

    def fake_clone(src_fd, so, dst_fd, do, n):  # what a reflink leaves behind: the same bytes
        os.pwrite(dst_fd, os.pread(src_fd, n, so), do)
        return True

    copied = []
    real = os.copy_file_range
    monkeypatch.setattr(fileio, "reflink_range", fake_clone)
    monkeypatch.setattr(os, "copy_file_range", lambda *a: copied.append(a[2]) or real(*a))
    fileio.copy_range(s, 0, d, 0, SIZE)
    _check(data, dst, 0, 0, SIZE)
    assert sum(copied) == SIZE - body


def test_real_reflink_refusal_is_quiet(files):
    _, s, d, _ = files
    fileio.reflink_range(s, 0, d, 0, 4096)  # cloned or refused, never raises
    assert fileio.reflink_range(s, 0, d, 0, 0) is False


def test_verification_catches_a_corrupted_byte(files):
    data, s, d, dst = files
    fileio.copy_range(s, 5, d, 3, SIZE - 5)
    crc = zlib.crc32(data[5:]) & 0xFFFFFFFF
    assert fileio.verify_crc(d, 3, SIZE - 5, crc) is None
    assert fileio.verify_equal(s, 5, d, 3, SIZE - 5) is None
    assert fileio.verify_equal(s, 5, d, 3, SIZE - 5, from_device=True) is None
    at = 2 * fileio.READBACK + 17 if SIZE > 2 * fileio.READBACK + 20 else SIZE // 2
    b = os.pread(d, 1, 3 + at)
    os.pwrite(d, bytes([b[0] ^ 1]), 3 + at)
    assert fileio.verify_crc(d, 3, SIZE - 5, crc) is not None
    where = fileio.verify_equal(s, 5, d, 3, SIZE - 5)
    assert where is not None and where <= at < where + fileio.READBACK


def test_verification_catches_a_short_output(files):
    data, s, d, dst = files
    fileio.copy_range(s, 0, d, 0, 1000)
    assert fileio.verify_equal(s, 0, d, 0, 2000) == 0
    assert fileio.verify_crc(d, 0, 2000, zlib.crc32(data[:2000])) is not None


def test_crc_range_from_device(files):
    data, s, _, _ = files
    assert fileio.crc_range(s, 1, 5000, from_device=True) == zlib.crc32(data[1:5001]) & 0xFFFFFFFF
    assert fileio.crc_range(s, 0, 0) == 0


def test_fileio_imports_neither_torch_nor_the_formats():
    import subprocess
    import sys

    code = (
        "import sys, ckptfix.files.fileio; "
        "print([m for m in ('torch', 'ckptfix.formats', 'click') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _lossy(monkeypatch, min_size: int = 1000) -> None:
    """The disk "loses" a byte of every tensor write of ``min_size`` bytes or more, whichever way it is copied."""
    from ckptfix.ops.convert import write as convert_write

    real_write, real_copy = fileio.pwrite_all, fileio.copy_range

    def flip(fd, at):
        c = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([c[0] ^ 0x5A]), at)

    def write(fd, data, off):
        n = real_write(fd, data, off)
        if n >= min_size and off > 0:  # not the header
            flip(fd, off)
        return n

    def copy(s, so, fd, do, n, *a, **k):
        got = real_copy(s, so, fd, do, n, *a, **k)
        if n >= min_size:
            flip(fd, do + n - 1)
        return got

    monkeypatch.setattr(fileio, "pwrite_all", write)
    monkeypatch.setattr(fileio, "copy_range", copy)
    monkeypatch.setattr(convert_write, "copy_range", copy)


def _zip_with_tensor(tmp_path):
    torch = pytest.importorskip("torch")
    src = tmp_path / "m.pth"
    torch.save({"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7)}, src)
    from ckptfix.formats import read_checkpoint

    rec = read_checkpoint(str(src)).obj["w"]
    return src, rec.storage


def test_convert_checks_the_zip_crc_and_names_a_damaged_source(tmp_path):
    from ckptfix.ops.convert import convert_to_safetensors

    src, st = _zip_with_tensor(tmp_path)
    assert st.crc is not None
    convert_to_safetensors(src, tmp_path / "ok.safetensors")
    raw = bytearray(src.read_bytes())
    raw[st.file_offset + 1000] ^= 0x10  # bit rot in the source: its zip CRC no longer matches
    src.write_bytes(raw)
    convert_to_safetensors(src, tmp_path / "compared.safetensors")  # without fsync: compared with the source
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):  # after an fsync: the stored CRC-32
        convert_to_safetensors(src, tmp_path / "bad.safetensors", fsync=True)
    assert not (tmp_path / "bad.safetensors").exists()
    convert_to_safetensors(src, tmp_path / "unchecked.safetensors", verify=False)


@pytest.mark.parametrize("fsync", [False, True])
def test_convert_catches_a_byte_lost_on_the_way(tmp_path, monkeypatch, fsync):
    from ckptfix.errors import VerificationError
    from ckptfix.ops.convert import convert_to_safetensors

    src, _ = _zip_with_tensor(tmp_path)
    _lossy(monkeypatch, 100_000)
    with pytest.raises(VerificationError, match="differs"):
        convert_to_safetensors(src, tmp_path / "o.safetensors", fsync=fsync)
    assert not (tmp_path / "o.safetensors").exists()


def test_convert_of_safetensors_verifies_against_the_source(tmp_path, monkeypatch):
    from safetensors.numpy import save_file

    np = pytest.importorskip("numpy")
    from ckptfix.errors import VerificationError
    from ckptfix.ops.convert import convert_to_safetensors

    src = tmp_path / "in.safetensors"
    save_file({"a": np.arange(200_000, dtype=np.float32), "b": np.ones(3, dtype=np.float16)}, str(src))
    convert_to_safetensors(src, tmp_path / "ok.safetensors")
    _lossy(monkeypatch, 100_000)
    with pytest.raises(VerificationError, match="near byte 0"):
        convert_to_safetensors(src, tmp_path / "o.safetensors")


def _dcp(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.distributed.checkpoint")
    from test_dcp import grid, write_dcp

    rows = torch.arange(40 * 300, dtype=torch.float32).reshape(40, 300)
    cols = torch.arange(6 * 50, dtype=torch.float32).reshape(6, 50)
    d = write_dcp(
        tmp_path / "ckpt",
        [
            (("model", "rows"), rows, grid((40, 300), {0: [7, 30]})),  # row shards: copied in the kernel
            (("model", "cols"), cols, grid((6, 50), {1: [20]})),  # column shards: assembled
            (("model", "scalar"), torch.tensor(3.5), [((), ())]),
        ],
    )
    return d, {"rows": rows, "cols": cols, "scalar": torch.tensor(3.5)}


def test_dcp_row_shards_are_byte_ranges_with_their_crc(tmp_path):
    from ckptfix.formats.dcp.chunks import Files
    from ckptfix.formats.dcp.meta import read_metadata
    from ckptfix.ops.convert.dcp_in import DcpItem, _row_ranges

    d, _ = _dcp(tmp_path)
    meta = read_metadata(str(d))
    with Files(str(d)) as files:
        r = _row_ranges(files, meta.entries["model.rows"])
        assert r is not None and [n for _, _, n, _ in r] == [7 * 300 * 4, 23 * 300 * 4, 10 * 300 * 4]
        assert all(crc is not None for *_, crc in r)
        assert _row_ranges(files, meta.entries["model.cols"]) is None
        e = meta.entries["model.scalar"]
        assert DcpItem("s", e.dtype, (), e.nbytes, entry=e, files=files).ranges() is not None


@pytest.mark.parametrize("fsync", [False, True])
def test_dcp_consolidation_copies_ranges_and_verifies(tmp_path, monkeypatch, fsync):
    from safetensors.torch import load_file

    from ckptfix.errors import VerificationError
    from ckptfix.ops.convert import convert_to_safetensors
    from ckptfix.ops.convert import write as convert_write

    d, want = _dcp(tmp_path)
    copied = []
    for name in ("copy_range", "copy_checked"):  # without fsync each range is copied and checked in one go
        real = getattr(convert_write, name)
        monkeypatch.setattr(convert_write, name, lambda *a, _real=real, **k: copied.append(a[4]) or _real(*a, **k))
    out = tmp_path / "o.safetensors"
    convert_to_safetensors(d, out, fsync=fsync, jobs=2)
    got = load_file(out)
    for k, v in want.items():
        assert got[k].equal(v)
    assert sum(copied) == (40 * 300 + 1) * 4  # the row-sharded tensor and the scalar, not the column shards

    _lossy(monkeypatch)
    with pytest.raises(VerificationError, match="differs"):
        convert_to_safetensors(d, tmp_path / "bad.safetensors", fsync=fsync)
    assert not (tmp_path / "bad.safetensors").exists()


@pytest.mark.parametrize("kernel", ["congruent", "any", "never"])
@pytest.mark.parametrize("with_crc", [False, True])
def test_copy_checked_reads_each_piece_back(files, monkeypatch, kernel, with_crc):
    data, s, d, dst = files
    src_off, dst_off, size = 3, 3 + fileio.FOLIO * (kernel != "never"), SIZE - 3
    crc = zlib.crc32(data[src_off:]) & 0xFFFFFFFF if with_crc else None
    seen = []
    assert fileio.copy_checked(s, src_off, d, dst_off, size, crc, kernel=kernel, progress=seen.append) is None
    _check(data, dst, src_off, dst_off, size)
    assert sum(seen) == size
    _lossy(monkeypatch)
    at = fileio.copy_checked(s, src_off, d, dst_off, size, crc, kernel=kernel)
    assert at is not None and (with_crc or at < size)
    if crc is not None:  # a source that does not match its stored CRC is caught the same way
        monkeypatch.undo()
        assert fileio.copy_checked(s, src_off, d, dst_off, size, crc ^ 1, kernel=kernel) == 0


def test_buffers_are_reused_per_thread():
    import threading

    a = fileio._buffers()
    assert fileio._buffers() is a
    other = []
    t = threading.Thread(target=lambda: other.append(fileio._buffers()))
    t.start()
    t.join()
    assert other[0][0] is not a[0]


def test_copy_file_data_copies_a_whole_file(files, tmp_path, monkeypatch):
    data, s, d, dst = files
    assert fileio.copy_file_data(s, d) == SIZE
    assert dst.read_bytes() == data
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    e = os.open(empty, os.O_RDONLY)
    try:
        assert fileio.copy_file_data(e, d) == 0
    finally:
        os.close(e)
    monkeypatch.setattr(os, "copy_file_range", _refuse(errno.EXDEV))  # across file systems: still copied
    monkeypatch.setattr(os, "sendfile", _refuse(errno.EINVAL))
    os.ftruncate(d, 0)
    assert fileio.copy_file_data(s, d) == SIZE
    assert dst.read_bytes() == data
