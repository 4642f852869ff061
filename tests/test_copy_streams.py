"""The copy of local byte ranges as a few contiguous streams (``ckptfix.ops.convert.write._streams``).

Two streams measured faster than one on a 0.5 GB GPT-2-layout checkpoint (warm 0.114 vs 0.142 s for the whole
``convert --no-verify``; cold the same); the output must be the same bytes whatever the number, and a
difference found while verifying must still name the tensor and where in it.
"""

from __future__ import annotations

import os
import threading

import pytest

from ckptfix.errors import CorruptCheckpointError, VerificationError
from ckptfix.ops.convert import write
from ckptfix.ops.convert.items import Item

MIB = 1 << 20


def small_streams(monkeypatch: pytest.MonkeyPatch, k: str, *, buffer: bool = False) -> None:
    """A small test file copied as ``k`` streams, cut at 4 KiB (and with ``buffer``, read 4 KiB at a time)."""
    from ckptfix.files import fileio

    monkeypatch.setattr(write, "STREAM_MIN", 8 << 10)
    monkeypatch.setattr(write, "BUFFER", 4096)
    if buffer:
        monkeypatch.setattr(fileio, "BUFFER", 4096)
    monkeypatch.setenv("CKPTFIX_COPY_STREAMS", k)


def flip_write(monkeypatch: pytest.MonkeyPatch, nth: int, delay: float = 0.0) -> list[int]:
    """``fileio.pwrite_all`` with the first byte of the ``nth`` write flipped (counted across the streams under a
    lock: they write at once), each write ``delay`` seconds slower; returns the offsets written, as they come."""
    import time

    from ckptfix.files import fileio

    real = fileio.pwrite_all
    writes: list[int] = []
    lock = threading.Lock()

    def flipping(fd: int, data: bytes | bytearray | memoryview, off: int) -> int:
        with lock:
            writes.append(off)
            flip = len(writes) == nth
        time.sleep(delay)
        if flip:
            data = bytes([data[0] ^ 0xFF]) + bytes(data[1:])
        return real(fd, data, off)

    monkeypatch.setattr(fileio, "pwrite_all", flipping)
    return writes


def _items(sizes: list[int], path: str = "/src.pt") -> list[Item]:
    out, off, begin = [], 64, 0
    for i, n in enumerate(sizes):
        it = Item(f"t{i}", "float32", (n // 4,), n, path=path, offset=off)
        it.begin = begin
        out.append(it)
        off, begin = off + n + 64, begin + n
    return out


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("CKPTFIX_COPY_STREAMS", raising=False)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_streams_cover_every_byte_once_in_order_at_whole_buffers(k, monkeypatch):
    monkeypatch.setenv("CKPTFIX_COPY_STREAMS", str(k))
    items = _items([3 * MIB + 12, 40, 70 * MIB, 8, 5 * MIB + 4, 0, 17 * MIB])
    parts = write._streams(items, 1000, 1)
    assert parts is not None and len(parts) == k
    segs = [sg for part in parts for sg in part]
    for it in items:  # each tensor's pieces, in order, tile its bytes in the source and in the output
        mine = [sg for sg in segs if sg.item is it]
        assert sum(sg.size for sg in mine) == it.nbytes
        at = 0
        for sg in mine:
            assert (sg.rel, sg.off, sg.pos) == (at, it.offset + at, 1000 + it.begin + at)
            at += sg.size
    total = sum(it.nbytes for it in items)
    sizes = [sum(sg.size for sg in part) for part in parts]
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 2 * write.BUFFER
    ends = [sum(sizes[: i + 1]) for i in range(k - 1)]
    assert all(e % write.BUFFER == 0 for e in ends)  # cut at whole buffers of the copy


def test_how_many_streams():
    big = write.STREAM_MIN
    assert write.stream_count(1, big - 1) == 1  # small copies: one stream, in this thread
    assert write.stream_count(1, big) == (write.STREAMS if len(__import__("os").sched_getaffinity(0)) > 1 else 1)
    assert write.stream_count(4, big) == 4  # --jobs N: N streams
    assert write.stream_count(0, 64 * big) == min(64, len(__import__("os").sched_getaffinity(0)))  # 0: one per CPU
    assert write.stream_count(64, 3 * big // 8) == 3  # none smaller than STREAM_MIN / 8


def test_the_environment_sets_the_number(monkeypatch):
    monkeypatch.setenv("CKPTFIX_COPY_STREAMS", "1")
    assert write.stream_count(8, 10 * write.STREAM_MIN) == 1
    parts = write._streams(_items([100 * MIB, 3]), 0, 8)  # one stream, in this thread
    assert parts is not None and len(parts) == 1 and [sg.size for sg in parts[0]] == [100 * MIB, 3]
    monkeypatch.setenv("CKPTFIX_COPY_STREAMS", "junk")
    assert write.stream_count(3, 10 * write.STREAM_MIN) == 3


def test_no_streams_for_gathered_items_or_remote_sources(monkeypatch):
    monkeypatch.setenv("CKPTFIX_COPY_STREAMS", "2")
    gathered = Item("g", "float32", (4,), 16, rec=object())
    gathered.begin = 0
    assert write._streams([*_items([100 * MIB]), gathered], 0, 1) is None
    assert write._streams(_items([100 * MIB], path="s3://b/m.pt"), 0, 1) is None


def test_an_item_whose_ranges_do_not_add_up_is_refused(monkeypatch):
    monkeypatch.setenv("CKPTFIX_COPY_STREAMS", "2")
    it = _items([100 * MIB])[0]
    monkeypatch.setattr(it, "ranges", lambda: [("/src.pt", 64, 100 * MIB - 4, None)])
    with pytest.raises(CorruptCheckpointError, match="expected"):
        write._streams([it], 0, 1)


def _checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(700, 301, generator=g)
    sd = {"module.w": w, "module.tied": w, "module.b": torch.randn(5, generator=g)}
    sd.update({f"module.l{i}.weight": torch.randn(97, 53 + i, generator=g) for i in range(9)})
    sd["module.mask"] = torch.rand(4099, generator=g) > 0.5  # odd byte counts: halves that do not divide
    sd["module.q"] = torch.randint(-100, 100, (5001,), dtype=torch.int8, generator=g)
    src = tmp_path / "m.pt"
    torch.save(sd, src)
    return src


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("k", ["2", "3", "7"])
def test_the_output_is_the_same_bytes_for_any_number_of_streams(tmp_path, monkeypatch, verify, k):
    from ckptfix.ops.convert import convert_to_safetensors

    src = _checkpoint(tmp_path)
    monkeypatch.setenv("CKPTFIX_COPY_STREAMS", "1")
    convert_to_safetensors(src, tmp_path / "one.safetensors", verify=verify)
    small_streams(monkeypatch, k)  # this small file in several streams
    used = []
    real = write._streams
    monkeypatch.setattr(write, "_streams", lambda *a: used.append(r := real(*a)) or r)
    convert_to_safetensors(src, tmp_path / "many.safetensors", verify=verify)
    assert used and used[0] is not None and len(used[0]) == int(k)
    assert (tmp_path / "many.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()


def test_a_difference_found_in_a_stream_names_the_tensor_and_where(tmp_path, monkeypatch):
    """A piece written wrong (one byte flipped on its way out) is found by the read-back, named, and nothing kept."""
    from ckptfix.ops.convert import convert_to_safetensors

    src = _checkpoint(tmp_path)
    small_streams(monkeypatch, "3")
    flip_write(monkeypatch, 4)  # the header, then the third piece of tensor bytes
    with pytest.raises(VerificationError, match=r"tensor '[^']+' differs from the source near byte \d+"):
        convert_to_safetensors(src, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


@pytest.mark.parametrize("check", [True, False])
def test_copy_pieces_reads_through_small_gaps_and_restarts_at_big_ones(tmp_path, check):
    import os

    from ckptfix.files import fileio

    data = os.urandom(3 * MIB)
    (tmp_path / "s").write_bytes(data)
    # source order; gaps of 100 B (read through), 200 KiB (a new span), an empty piece, pieces across buffers
    pieces = [(0, 10, 5000), (5100, 6000, 2 * MIB), (5100 + 2 * MIB + 200_000, 6100 + 2 * MIB, 7), (2_500_000, 9000, 0)]
    pieces.append((2_600_000, 3 * MIB, 300_000))
    src = os.open(tmp_path / "s", os.O_RDONLY)
    dst = os.open(tmp_path / "d", os.O_RDWR | os.O_CREAT, 0o600)
    reads = []
    real = fileio._read
    try:
        fileio._read = lambda fd, view, off: reads.append((fd, off)) or real(fd, view, off)
        done = []
        assert fileio.copy_pieces(src, pieces, dst, check=check, progress=done.append) is None
    finally:
        fileio._read = real
        os.close(src)
        os.close(dst)
    out = (tmp_path / "d").read_bytes()
    for so, do, n in pieces:
        assert out[do : do + n] == data[so : so + n]
    assert sum(done) == sum(n for _, _, n in pieces)
    src_reads = [off for fd, off in reads if fd == src]
    assert src_reads[:3] == [0, MIB, 2 * MIB]  # straight through the 100-byte gap, in whole buffers
    assert 5100 + 2 * MIB + 200_000 in src_reads  # the far piece: a new span, read where it starts


@pytest.mark.parametrize(("verify", "fsync"), [(True, False), (True, True), (False, False), (False, True)])
@pytest.mark.parametrize("k", ["1", "3"])
def test_progress_ends_at_the_total_and_never_goes_back(tmp_path, monkeypatch, verify, fsync, k):
    from ckptfix.ops.convert import convert_to_safetensors

    src = _checkpoint(tmp_path)
    small_streams(monkeypatch, k)
    seen: list[tuple[int, int]] = []
    convert_to_safetensors(
        src, tmp_path / "o.safetensors", verify=verify, fsync=fsync, progress=lambda d, t: seen.append((d, t))
    )
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == seen[-1][1] > 0
    assert len(seen) > 3


@pytest.mark.parametrize(("verify", "k"), [(True, "1"), (False, "1"), (True, "3"), (False, "3")])
def test_a_read_error_of_the_input_is_a_typed_error_naming_it(tmp_path, monkeypatch, verify, k):
    """``EIO`` while reading the source mid-copy (a bad sector): exit 4 naming the file, nothing left behind."""
    import errno

    from ckptfix.errors import CorruptCheckpointError
    from ckptfix.files import fileio
    from ckptfix.ops.convert import convert_to_safetensors

    src = _checkpoint(tmp_path)
    small_streams(monkeypatch, k)
    real = fileio._read
    src_name = str(src.resolve())

    def failing(fd, view, off):
        if off > 200_000 and os.readlink(f"/proc/self/fd/{fd}") == src_name:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, view, off)

    monkeypatch.setattr(fileio, "_read", failing)
    with pytest.raises(CorruptCheckpointError, match=r"m\.pt: cannot be read at byte \d+ \(Input/output error\)"):
        convert_to_safetensors(src, tmp_path / "o.safetensors", verify=verify)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


@pytest.mark.parametrize("junk", ["\u00b2", "\u0663", "1e3", "-2", "x"])
def test_a_junk_stream_count_in_the_environment_is_ignored_not_a_crash(junk, monkeypatch):
    """``"²".isdigit()`` is True but ``int("²")`` raises: the variable must be ignored like other junk."""
    monkeypatch.setenv("CKPTFIX_COPY_STREAMS", junk)
    assert write.stream_count(3, 1 << 30) == 3
    assert write.stream_count(1, 1) == 1


@pytest.mark.parametrize("verify", [True, False])
def test_ctrl_c_stops_the_copy_streams_without_waiting_for_them_to_finish(tmp_path, monkeypatch, verify):
    """Each stream is one task of run_tasks, which waits for the running tasks on Ctrl-C: without a way to stop
    them, an interrupted ``convert`` of a big file (two streams at the default ``--jobs 1``) went on copying to
    the end before it exited; with one stream (in the caller's thread) it stopped at once."""
    import os
    import signal
    import threading
    import time

    torch = pytest.importorskip("torch")
    from ckptfix.files import fileio
    from ckptfix.ops.convert import convert_to_safetensors

    src = tmp_path / "m.pt"
    torch.save({f"t{i}": torch.arange(4096, dtype=torch.float32) + i for i in range(40)}, src)  # 640 KiB
    small_streams(monkeypatch, "2", buffer=True)
    real = fileio.pwrite_all
    lock = threading.Lock()
    writes: list[int] = []
    at_signal: list[int] = []

    def slow(fd, data, off):  # 160 pieces of 4 KiB in 2 streams; after Ctrl-C each write takes 0.2 s
        with lock:
            writes.append(off)
            send = len(writes) == 20
            if send:
                at_signal.append(len(writes))
        if send:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, from inside the copy (no timer: the same on a slow machine)
        time.sleep(0.2 if at_signal else 0.001)
        return real(fd, data, off)

    monkeypatch.setattr(fileio, "pwrite_all", slow)
    with pytest.raises(KeyboardInterrupt):
        convert_to_safetensors(src, tmp_path / "o.safetensors", verify=verify)
    # the rest of the copy (140 writes) is not made: each stream stops at its next piece (slack for a slow machine)
    assert at_signal and len(writes) < at_signal[0] + 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_a_failing_stream_stops_the_others(tmp_path, monkeypatch):
    """A difference found in one stream is raised once the others stop, not after they copied their whole part."""

    torch = pytest.importorskip("torch")
    from ckptfix.errors import VerificationError
    from ckptfix.ops.convert import convert_to_safetensors

    src = tmp_path / "m.pt"
    torch.save({f"t{i}": torch.arange(4096, dtype=torch.float32) + i for i in range(40)}, src)
    small_streams(monkeypatch, "2", buffer=True)
    writes = flip_write(monkeypatch, 5, delay=0.01)  # one write of one stream
    with pytest.raises(VerificationError, match="differs from the source"):
        convert_to_safetensors(src, tmp_path / "o.safetensors")
    assert len(writes) < 40  # of 160 (slack for a slow machine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
