"""ckptfix.files.fileio: odd offsets, short and refused kernel copies, a full disk, verification."""

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
        (fileio.FOLIO + 5, 5, 2 * fileio.FOLIO),  # congruent: in the kernel
        (64, 8 + 4096, 100_000),
        (SIZE - 1, 3, 1),
    ],
)
def test_any_offsets_are_copied(files, src_off, dst_off, size):
    data, s, d, dst = files
    fileio.copy_range(s, src_off, d, dst_off, size)
    _check(data, dst, src_off, dst_off, size)


def test_short_kernel_copies_are_continued(files, monkeypatch):
    data, s, d, dst = files
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda a, b, n, so, do: real(a, b, min(n, 1000), so, do))
    fileio.copy_range(s, 0, d, 0, SIZE)
    assert dst.read_bytes() == data


@pytest.mark.parametrize("err", [errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, None])
def test_a_kernel_copy_refused_midway_is_finished_through_the_buffer(files, monkeypatch, err):
    data, s, d, dst = files
    real = os.copy_file_range
    calls = []

    def half(a, b, n, so, do):  # the kernel copies one folio, then refuses (or copies nothing)
        calls.append(n)
        if len(calls) > 1:
            if err is None:
                return 0
            raise OSError(err, os.strerror(err))
        return real(a, b, min(n, fileio.FOLIO), so, do)

    monkeypatch.setattr(os, "copy_file_range", half)
    fileio.copy_range(s, 0, d, 0, SIZE)
    assert dst.read_bytes() == data and len(calls) == 2


def test_source_ending_early_is_corruption(files, monkeypatch):
    _, s, d, _ = files
    for dst_off in (0, 10):  # in the kernel, through the buffer
        with pytest.raises(CorruptCheckpointError, match="ended early"):
            fileio.copy_range(s, SIZE - 10, d, dst_off, 100)


def test_full_disk_is_an_output_error(files, monkeypatch):
    _, s, d, _ = files
    monkeypatch.setattr(os, "copy_file_range", _refuse(errno.ENOSPC))
    with pytest.raises(OutputError, match="no space"):
        fileio.copy_range(s, 0, d, 0, 100)
    monkeypatch.setattr(os, "pwrite", _refuse(errno.ENOSPC))
    with pytest.raises(OutputError, match="no space"):
        fileio.pwrite_all(d, b"x", 0)


def test_verification_catches_a_corrupted_byte(files):
    data, s, d, dst = files
    fileio.copy_range(s, 5, d, 3, SIZE - 5)
    crc = zlib.crc32(data[5:]) & 0xFFFFFFFF
    assert fileio.verify_crc(d, 3, SIZE - 5, crc) is None
    assert fileio.verify_equal(s, 5, d, 3, SIZE - 5) is None
    assert fileio.verify_equal(s, 5, d, 3, SIZE - 5, from_device=True) is None
    at = 2 * fileio.BUFFER + 17 if SIZE > 2 * fileio.BUFFER + 20 else SIZE // 2
    b = os.pread(d, 1, 3 + at)
    os.pwrite(d, bytes([b[0] ^ 1]), 3 + at)
    assert fileio.verify_crc(d, 3, SIZE - 5, crc) is not None
    where = fileio.verify_equal(s, 5, d, 3, SIZE - 5)
    assert where is not None and where <= at < where + fileio.BUFFER


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
    """The disk "loses" a byte of every tensor write of ``min_size`` bytes or more, whichever way it is made."""
    real_write, real_copy = fileio.pwrite_all, os.copy_file_range

    def flip(fd, at):
        c = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([c[0] ^ 0x5A]), at)

    def write(fd, data, off):
        n = real_write(fd, data, off)
        if n >= min_size and off > 0:  # not the header
            flip(fd, off)
        return n

    def copy(s, fd, n, so, do):
        got = real_copy(s, fd, n, so, do)
        if got >= min_size:
            flip(fd, do + got - 1)
        return got

    monkeypatch.setattr(fileio, "pwrite_all", write)
    monkeypatch.setattr(os, "copy_file_range", copy)


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
    real = convert_write.copy

    def counted(src, pieces, *a, **k):
        copied.extend(n for *_, n in pieces)
        return real(src, pieces, *a, **k)

    monkeypatch.setattr(convert_write, "copy", counted)
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


@pytest.mark.parametrize("dst_off", [3 + fileio.FOLIO, 4])  # in the kernel, through the buffer
def test_a_checked_copy_reads_each_piece_back(files, monkeypatch, dst_off):
    data, s, d, dst = files
    src_off, size = 3, SIZE - 3
    seen = []
    assert fileio.copy(s, [(src_off, dst_off, size)], d, check=True, progress=seen.append) is None
    _check(data, dst, src_off, dst_off, size)
    assert sum(seen) == size
    _lossy(monkeypatch)
    bad = fileio.copy(s, [(src_off, dst_off, size)], d, check=True)
    assert bad is not None and bad[0] == 0 and bad[1] < size


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
    os.ftruncate(d, 0)
    assert fileio.copy_file_data(s, d) == SIZE
    assert dst.read_bytes() == data
