"""Review findings on the copy streams (``ckptfix.ops.convert.write``)."""

from __future__ import annotations

import pytest

from ckptfix.ops.convert import write
from tests.test_copy_streams import flip_write, small_streams


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
