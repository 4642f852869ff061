"""``hf://`` against a Hub endpoint that lies or is sick (issue #33 §3): a compressed range answer, a reply far longer
than the range, an endless body and a byte-by-byte drip.  Each is a typed one-line error naming the URL, in bounded
memory (peaks measured with :mod:`tracemalloc`) and bounded time (``CKPTFIX_REMOTE_TIMEOUT`` set low; the thread
join is a hang catcher only, nothing is timed).  The endpoint is tests/hubserver.py with its ``hostile`` hook.
"""

from __future__ import annotations

import http.server
import threading
import tracemalloc
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("huggingface_hub")

from ckptfix.errors import RemoteUnavailableError
from ckptfix.files.remote import file as rfile
from ckptfix.files.remote.file import RemoteFile

from hubserver import HubServer, serving

MiB = 1 << 20
URL = "hf://user/repo/blob.bin"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("hub") / "main"
    root.mkdir()
    (root / "blob.bin").write_bytes(bytes(range(256)) * (8 * 1024))  # 2 MiB
    with serving({"user/repo": {"main": str(root)}}) as srv:
        yield srv


@pytest.fixture
def srv(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.setenv("CKPTFIX_REMOTE_BACKOFF", "0")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "1")
    rfile._PINS.clear()
    hub.reset()
    from huggingface_hub import HfFileSystem

    HfFileSystem.clear_instance_cache()
    return hub


def _head206(h: http.server.BaseHTTPRequestHandler, start: int, end: int, size: int, **headers: str) -> None:
    h.send_response(206)
    h.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
    h.send_header("ETag", '"x"')
    for k, v in headers.items():
        h.send_header(k.replace("_", "-"), v)
    h.end_headers()


_BOMB: list[bytes] = []


def _bomb() -> bytes:
    """256 MiB of zeros, gzipped (about 256 KiB), made once before any request waits on it."""
    if not _BOMB:
        co = zlib.compressobj(6, zlib.DEFLATED, 31)
        zero = bytes(MiB)
        _BOMB.append(b"".join(co.compress(zero) for _ in range(256)) + co.flush())
    return _BOMB[0]


def gzip_bomb(h: Any, start: int, end: int, size: int) -> None:
    body = _bomb()
    _head206(h, start, end, size, Content_Length=str(len(body)), Content_Encoding="gzip")
    h.wfile.write(body)


def oversized(h: Any, start: int, end: int, size: int) -> None:
    _head206(h, start, end, size, Content_Length=str(256 * MiB))
    chunk = b"y" * MiB
    for _ in range(256):
        h.wfile.write(chunk)


def endless(h: Any, start: int, end: int, size: int) -> None:
    """No length: the body ends when the connection does (never, within any budget: 320 MiB here)."""
    _head206(h, start, end, size, Connection="close")
    h.close_connection = True
    chunk = b"z" * MiB
    for _ in range(320):
        h.wfile.write(chunk)


def drip(h: Any, start: int, end: int, size: int) -> None:
    """A byte every 0.2 s: never idle for the 1 s read timeout, but the whole request has a deadline."""
    _head206(h, start, end, size, Content_Length=str(end - start))
    for _ in range(end - start):
        if h.server.stop.wait(0.2):  # type: ignore[attr-defined]
            return
        h.wfile.write(b"x")
        h.wfile.flush()


def _run(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()``'s result or exception and the peak of Python allocations, in a thread (a hang catcher of 60 s)."""
    box: list[Any] = []

    def go() -> None:
        try:
            box.append(fn())
        except Exception as e:  # noqa: BLE001 - checked by the caller
            box.append(e)

    tracemalloc.start()
    try:
        t = threading.Thread(target=go, daemon=True)
        t.start()
        t.join(60)
        return (box[0] if box else None), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (gzip_bomb, "Content-Encoding"),
        (oversized, "more than"),
        (endless, "more than"),
        (drip, "deadline"),
    ],
    ids=["gzip", "oversized", "endless", "drip"],
)
def test_a_lying_or_sick_hub_is_a_typed_error_in_bounded_memory_and_time(
    srv: HubServer, answer: Any, said: str, tmp_path: Path
) -> None:
    srv.stop = threading.Event()  # type: ignore[attr-defined]
    _bomb()
    rf = RemoteFile(URL)  # the open (metadata) is honest; the range answers are not
    srv.hostile = answer
    try:
        out, peak = _run(lambda: rf.pread(100, 1_500_000))
    finally:
        srv.stop.set()  # type: ignore[attr-defined]
    assert out is not None, "the read never ended"
    assert isinstance(out, RemoteUnavailableError), repr(out)
    msg = str(out)
    assert URL in msg and said in msg and "\n" not in msg, msg
    assert peak < 32 * MiB, f"peak {peak / MiB:.0f} MiB"


def test_an_honest_range_after_a_sick_one_reads_the_right_bytes(
    srv: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same open file: one oversized answer, retried, then the server's honest answer is the bytes asked."""
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    rf = RemoteFile(URL)
    calls = []

    def once(h: Any, start: int, end: int, size: int) -> None:
        calls.append((start, end))
        srv.hostile = None
        oversized(h, start, end, size)

    srv.hostile = once
    data = rf.pread(100, 1_500_000)
    want = (bytes(range(256)) * (8 * 1024))[1_500_000:1_500_100]
    assert data == want and len(calls) == 1
