"""A local HTTP server with Range support and fault modes, for the remote-read tests.

:class:`RangeServer` (a :class:`http.server.ThreadingHTTPServer`) serves a folder: ``HEAD`` and ``GET`` with one
``bytes=a-b`` range (206 + ``Content-Range``), an ``ETag`` per file (its size, mtime and the server's
``version``), ``If-Match`` (412 when it does not match), folder listings as ``http.server`` makes them.
Every request is logged (:attr:`RangeServer.log`) with the bytes of body sent, so tests count requests and
bytes instead of timing anything.

Faults (:meth:`RangeServer.fault`) apply to the next ``count`` GET (or HEAD) requests whose path ends with
``path``:

* ``drop``: send the headers and half the body, then close the connection;
* ``short``: a ``Content-Length`` that promises the whole range, half the body, then close;
* ``503`` / ``500`` / ``429`` / ``403`` / ``404``: that status;
* ``change``: bump the server's version first (every ETag changes, as if the object was overwritten);
* ``ignore-range``: answer 200 with the whole file;
* ``stale-etag``: send the range with a different ``ETag`` header and ignore ``If-Match``;
* ``stall``: send the headers and half the body, then nothing (until the server shuts down).
"""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Iterator

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass
class Fault:
    kind: str
    path: str = ""
    count: int = 1
    method: str = "GET"


@dataclass
class Hit:
    method: str
    path: str
    range: str | None
    status: int
    sent: int = 0


class Handler(http.server.SimpleHTTPRequestHandler):
    server: RangeServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _fault(self, method: str) -> Fault | None:
        with self.server.lock:
            for f in self.server.faults:
                if f.count > 0 and f.method == method and self.path.split("?")[0].endswith(f.path):
                    f.count -= 1
                    return f
        return None

    def _record(self, method: str, status: int, sent: int = 0) -> Hit:
        hit = Hit(method, self.path, self.headers.get("Range"), status, sent)
        with self.server.lock:
            self.server.log.append(hit)
        return hit

    def _status(self, method: str, code: int) -> None:
        # recorded before the answer: a client that gives up on this answer may count the requests at once
        self._record(method, code)
        body = f"error {code}\n".encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        if code == 503:
            self.send_header("Retry-After", "0")
        self.end_headers()
        if method == "GET":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_GET(self) -> None:
        self._serve("GET")

    def _serve(self, method: str) -> None:
        fpath = self.translate_path(self.path)
        if os.path.isdir(fpath):
            fault = self._fault(method) if self.server.dir_faults else None
            if fault is not None and fault.kind.isdigit():  # a folder's URL answered with an error status
                return self._status(method, int(fault.kind))
            self._record(method, 200)
            if method == "HEAD":
                return super().do_HEAD()
            return super().do_GET()
        fault = self._fault(method)
        if fault is not None and fault.kind == "change":
            with self.server.lock:
                self.server.version += 1
            fault = None
        if fault is not None and fault.kind.isdigit():
            return self._status(method, int(fault.kind))
        if not os.path.isfile(fpath):
            return self._status(method, 404)
        st = os.stat(fpath)
        size = st.st_size
        etag = f'"{size:x}-{st.st_mtime_ns:x}-{self.server.version}"'
        stale = fault is not None and fault.kind == "stale-etag"
        im = self.headers.get("If-Match")
        if im is not None and im != etag and not stale and self.server.honor_if_match:
            return self._status(method, 412)
        rng = self.headers.get("Range")
        start, end, status = 0, size, 200
        if rng and not (fault is not None and fault.kind == "ignore-range"):
            m = _RANGE.match(rng.strip())
            if not m:
                return self._status(method, 416)
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            if start >= size or start >= end:
                return self._status(method, 416)
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", '"stale"' if stale else etag)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        if fault is not None and fault.kind in ("drop", "short"):
            self.send_header("Connection", "close")
        if method == "HEAD":
            self._record(method, status)
        self.end_headers()
        if method == "HEAD":
            return
        n = end - start
        if fault is not None and fault.kind in ("drop", "short", "stall"):
            n //= 2
        sent = 0
        hit = self._record(method, status)  # logged first and counted before each write: the client never
        with open(fpath, "rb") as f:  # holds bytes the log does not show yet
            f.seek(start)
            while sent < n:
                chunk = f.read(min(1 << 20, n - sent))
                if not chunk:
                    break
                with self.server.lock:
                    hit.sent += len(chunk)
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent += len(chunk)
        if fault is not None and fault.kind == "stall":  # half the body, then nothing until the client gives up
            self.wfile.flush()
            self.server.stalled.wait(10)
            self.close_connection = True
            return
        if fault is not None and fault.kind in ("drop", "short"):
            self.wfile.flush()
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(2)


class RangeServer(http.server.ThreadingHTTPServer):
    """Serve ``root`` on ``127.0.0.1`` at a free port (see the module's description)."""

    daemon_threads = True

    def __init__(self, root: str) -> None:
        self.root = root
        self.lock = threading.Lock()
        self.log: list[Hit] = []
        self.faults: list[Fault] = []
        self.version = 0
        self.honor_if_match = True
        self.dir_faults = False  # faults apply to folder URLs too (a server whose `HEAD /sub` is 404)
        self.errors: list[str] = []
        self.stalled = threading.Event()  # set at shutdown: stalled answers end
        super().__init__(("127.0.0.1", 0), lambda *a, **k: Handler(*a, directory=root, **k))

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that went away mid-answer (a fault it provoked): not an error of the test."""
        import sys

        with self.lock:
            self.errors.append(repr(sys.exc_info()[1]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def fault(self, kind: str, path: str = "", count: int = 1, method: str = "GET") -> None:
        """Arm a fault for the next ``count`` requests whose path ends with ``path``."""
        with self.lock:
            self.faults.append(Fault(kind, path, count, method))

    def reset(self) -> None:
        """Forget the log and the faults."""
        with self.lock:
            self.log.clear()
            self.faults.clear()

    def sent(self) -> int:
        """Body bytes sent so far."""
        with self.lock:
            return sum(h.sent for h in self.log)

    def requests(self) -> list[Hit]:
        with self.lock:
            return list(self.log)


@contextlib.contextmanager
def serving(root: str) -> Iterator[RangeServer]:
    """A :class:`RangeServer` on ``root`` in a thread, shut down after the block."""
    srv = RangeServer(root)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.stalled.set()
        srv.shutdown()
        srv.server_close()
        t.join(5)


__all__ = ["RangeServer", "serving", "Fault", "Hit", "field"]
