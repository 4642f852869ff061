"""An adversarial pass on remote inputs (issue #26): hostile servers and hostile checkpoint authors.

Each test serves something crafted (a lying HTTP server from this file, or tests/rangeserver.py's folder server)
and checks the promise: a typed one-line error or the right answer, bounded memory, nothing outside the
checkpoint's folder read, no payload run.  Memory is measured with :mod:`tracemalloc` (peaks, never times).
"""

from __future__ import annotations

import contextlib
import http.server
import threading
import tracemalloc
import zlib
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from ckptfix.errors import RemoteUnavailableError
from ckptfix.remote import file as rfile
from ckptfix.remote.file import RemoteFile

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_BACKOFF", "0")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "20")
    rfile._PINS.clear()


# --------------------------------------------------------------------------- a server that lies

#: answers a GET: (handler, start, end) -> None; writes the whole answer itself
Answer = Callable[[http.server.BaseHTTPRequestHandler, int, int], None]


class _Lying(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(self.server.size))
        self.send_header("ETag", '"v1"')
        self.end_headers()

    def do_GET(self) -> None:
        rng = self.headers.get("Range", "bytes=0-")
        a, _, b = rng.split("=", 1)[1].partition("-")
        start = int(a)
        end = int(b) + 1 if b else self.server.size
        try:
            self.server.answer(self, start, end)
        except (BrokenPipeError, ConnectionResetError):
            pass


@contextlib.contextmanager
def lying(answer: Answer, size: int = 2 * MiB) -> Iterator[str]:
    """A server whose HEAD says ``size`` bytes and ETag "v1" and whose GETs ``answer`` writes; yields a file URL."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Lying)
    srv.daemon_threads = True
    srv.answer = answer  # type: ignore[attr-defined]
    srv.size = size  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/f.bin"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def _head206(h: http.server.BaseHTTPRequestHandler, start: int, end: int, size: int, **headers: str) -> None:
    h.send_response(206)
    h.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
    h.send_header("ETag", '"v1"')
    for k, v in headers.items():
        h.send_header(k.replace("_", "-"), v)
    h.end_headers()


def _peak_of(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()``'s result (or the exception it raised) and the peak of Python allocations while it ran."""
    tracemalloc.start()
    try:
        try:
            out: Any = fn()
        except Exception as e:  # noqa: BLE001 - returned for the test to check
            out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_range_answered_with_a_huge_body_is_refused_without_reading_it_all() -> None:
    """206 with the right Content-Range but 256 MiB of body for a 64 KiB range: refused after n+1 bytes."""

    def answer(h: http.server.BaseHTTPRequestHandler, start: int, end: int) -> None:
        _head206(h, start, end, 2 * MiB, Content_Length=str(256 * MiB))
        chunk = b"y" * MiB
        for _ in range(256):
            h.wfile.write(chunk)

    with lying(answer) as url:
        out, peak = _peak_of(lambda: RemoteFile(url).pread(100, 0))
    assert isinstance(out, RemoteUnavailableError), out
    assert "more than" in str(out)
    assert peak < 32 * MiB, f"peak {peak / MiB:.0f} MiB"


def test_a_compressed_range_answer_is_refused_not_inflated() -> None:
    """Content-Encoding: gzip on a range (asked for identity): a bomb of 256 MiB of zeros is never inflated, and
    decoded bytes are never taken for the object's."""
    co = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip
    zero = bytes(MiB)
    bomb = b"".join(co.compress(zero) for _ in range(256)) + co.flush()

    def answer(h: http.server.BaseHTTPRequestHandler, start: int, end: int) -> None:
        _head206(h, start, end, 2 * MiB, Content_Length=str(len(bomb)), Content_Encoding="gzip")
        h.wfile.write(bomb)

    with lying(answer) as url:
        out, peak = _peak_of(lambda: RemoteFile(url).pread(100, 0))
    assert isinstance(out, RemoteUnavailableError), out
    assert "Content-Encoding" in str(out)
    assert peak < 32 * MiB, f"peak {peak / MiB:.0f} MiB"
