"""A real S3 API for the remote tests: moto's server mode on a free local port (issue #26).

Torch-free and conftest-free, so the main suite, the torch-free CI venv and the benchmarks can all use it:

    from s3server import s3_server  # noqa: F401 (registers the pytest fixture)

    def test_x(s3_server):
        url = s3_server.upload(local_path, "ckpts/model.safetensors")   # -> "s3://ckptfix-test/ckpts/model.safetensors"

The fixture is session-scoped: one server for the run, with the environment a real client reads
(``AWS_ENDPOINT_URL``, dummy ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``) set for the
session (so ``ckptfix`` subprocesses and s3fs in this process find it) and restored after. Every test gets a
fresh key prefix from ``s3_server.prefix()`` if it wants isolation; the bucket is shared.

The server counts requests (``requests``, ``bytes_sent``, by method) and can add a fixed latency per request
(the benchmarks' simulated 20 ms) and inject faults through ``fault`` (a callable that sees the WSGI environ and
returns an HTTP status to answer with instead, or None): the upload tests fail a multipart upload that way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

BUCKET = "ckptfix-test"
_DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # no ~/.aws/config or credentials from the machine running the tests
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}

Fault = Callable[[dict[str, Any]], "int | None"]


def have_s3() -> bool:
    """Whether moto's server and s3fs are importable (the remote tests skip cleanly without them)."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


class _Middleware:
    """WSGI wrapper: counts requests and bytes, adds latency, injects faults."""

    def __init__(self, app: Any, server: S3Server) -> None:
        self.app = app
        self.server = server

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        srv = self.server
        with srv._lock:
            srv.requests += 1
            srv.by_method[environ.get("REQUEST_METHOD", "?")] += 1
            srv.log.append(
                tuple(environ.get(k, "") for k in ("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "HTTP_RANGE"))  # type: ignore[arg-type]
            )
        if srv.latency:
            time.sleep(srv.latency)
        fault = srv.fault
        status = fault(environ) if fault is not None else None
        if status is not None:
            # drain the request body so the client sees the answer, not a reset
            length = int(environ.get("CONTENT_LENGTH") or 0)
            stream = environ.get("wsgi.input")
            while length > 0 and stream is not None:
                chunk = stream.read(min(length, 1 << 20))
                if not chunk:
                    break
                length -= len(chunk)
            body = (
                b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
                b"<Message>injected fault</Message></Error>"
            )
            reason = {500: "Internal Server Error", 503: "Slow Down", 403: "Forbidden"}.get(status, "Error")
            headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))]
            start_response(f"{status} {reason}", headers)
            return [body]
        return self._count(self.app(environ, start_response))

    def _count(self, body: Iterable[bytes]) -> Iterator[bytes]:
        try:
            for chunk in body:
                with self.server._lock:
                    self.server.bytes_sent += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


class S3Server:
    """moto's S3 in server mode on 127.0.0.1:<free port>, with one bucket (``BUCKET``)."""

    def __init__(self, *, latency: float = 0.0, bucket: str = BUCKET) -> None:
        self.latency = latency
        self.bucket = bucket
        self.fault: Fault | None = None
        self.requests = 0
        self.bytes_sent = 0
        self.by_method: Counter[str] = Counter()
        self.log: list[tuple[str, str, str, str]] = []
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.endpoint = ""
        self._saved_env: dict[str, str | None] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> S3Server:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log line per request on stderr
        app = _Middleware(DomainDispatcherApplication(create_backend_app), self)
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-s3", daemon=True)
        self._thread.start()
        self._client().create_bucket(Bucket=self.bucket)
        self.reset_counts()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = None

    def env(self) -> dict[str, str]:
        """The environment a client needs to reach this server (credentials are dummies)."""
        return {**_DUMMY_ENV, "AWS_ENDPOINT_URL": self.endpoint, "AWS_ENDPOINT_URL_S3": self.endpoint}

    def set_env(self) -> None:
        for k, v in self.env().items():
            self._saved_env.setdefault(k, os.environ.get(k))
            os.environ[k] = v

    def restore_env(self) -> None:
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved_env.clear()

    def __enter__(self) -> S3Server:
        self.start()
        self.set_env()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore_env()
        self.stop()

    # ------------------------------------------------------------------ client side
    def fs(self) -> Any:
        """A fresh s3fs filesystem on this server (no instance cache, no listing cache)."""
        import s3fs

        return s3fs.S3FileSystem(
            key="testing",
            secret="testing",
            endpoint_url=self.endpoint,
            client_kwargs={"region_name": "us-east-1"},
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    def prefix(self, name: str = "t") -> str:
        """A fresh key prefix (``<name>-<hex>``) so tests sharing the bucket never see each other's objects."""
        return f"{name}-{uuid.uuid4().hex[:10]}"

    def upload(self, local: str | os.PathLike[str], key: str) -> str:
        """Upload a file, or a folder recursively (a DCP folder, a sharded index folder), under ``key``; the URL."""
        src = Path(local)
        fs = self.fs()
        dest = f"{self.bucket}/{key.strip('/')}"
        if src.is_dir():
            for f in sorted(src.rglob("*")):
                if f.is_file():
                    fs.put_file(str(f), f"{dest}/{f.relative_to(src).as_posix()}")
        else:
            fs.put_file(str(src), dest)
        return f"s3://{dest}"

    def put_bytes(self, key: str, data: bytes) -> str:
        self.fs().pipe_file(f"{self.bucket}/{key.lstrip('/')}", data)
        return self.url(key)

    def get_bytes(self, key_or_url: str) -> bytes:
        return bytes(self.fs().cat_file(self._path(key_or_url)))

    def exists(self, key_or_url: str) -> bool:
        return bool(self.fs().exists(self._path(key_or_url)))

    def keys(self, prefix: str = "") -> list[str]:
        fs = self.fs()
        base = f"{self.bucket}/{prefix.strip('/')}" if prefix else self.bucket
        try:
            found = fs.find(base)
        except FileNotFoundError:
            return []
        return sorted(k[len(self.bucket) + 1 :] for k in found)

    def pending_uploads(self) -> list[dict[str, Any]]:
        """Multipart uploads begun and neither completed nor aborted (a failed commit must leave none)."""
        return list(self._client().list_multipart_uploads(Bucket=self.bucket).get("Uploads", []))

    def _client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def _path(self, key_or_url: str) -> str:
        if key_or_url.startswith("s3://"):
            return key_or_url[len("s3://") :]
        return f"{self.bucket}/{key_or_url.lstrip('/')}"

    def reset_counts(self) -> None:
        with self._lock:
            self.requests = 0
            self.bytes_sent = 0
            self.by_method.clear()
            self.log.clear()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server for the session (skips when moto[server]/s3fs are not installed); env set while it runs."""
    if not have_s3():
        pytest.skip('needs moto[server] and s3fs (pip install ".[remote]" "moto[server]")')
    server = S3Server()
    with server:
        yield server


@pytest.fixture
def s3(s3_server: S3Server) -> Iterator[S3Server]:
    """The session's server with counters reset and no fault injected, per test."""
    s3_server.reset_counts()
    s3_server.fault = None
    s3_server.latency = 0.0
    yield s3_server
    s3_server.fault = None
    s3_server.latency = 0.0
