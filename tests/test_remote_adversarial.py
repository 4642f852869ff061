"""An adversarial pass on remote inputs (issue #26): hostile servers and hostile checkpoint authors.

Each test serves something crafted (a lying HTTP server from this file, or tests/rangeserver.py's folder server)
and checks the promise: a typed one-line error or the right answer, bounded memory, nothing outside the
checkpoint's folder read, no payload run.  Memory is measured with :mod:`tracemalloc` (peaks, never times).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import tracemalloc
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from ckptfix.errors import RemoteUnavailableError
from ckptfix.files.remote import file as rfile
from ckptfix.files.remote.file import RemoteFile

from helpers import run_cli
from rangeserver import RangeServer, serving

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


# --------------------------------------------------------------------------- a hostile checkpoint on an honest server


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[tuple[Path, RangeServer]]:
    """A served folder with a "secret" checkpoint next to ``ckpt/``: members of ``ckpt/`` must never reach it."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "ckpt").mkdir()
    save_file({"secret": torch.arange(3.0)}, str(tmp_path / "secret.safetensors"))
    save_file({"w": torch.ones(3)}, str(tmp_path / "ckpt" / "ok.safetensors"))
    with serving(str(tmp_path)) as srv:
        yield tmp_path, srv


def _outside_hits(srv: RangeServer) -> list[str]:
    return [h.path for h in srv.requests() if not h.path.startswith("/ckpt/")]


@pytest.mark.parametrize(
    "shard",
    [
        "%2e%2e/secret.safetensors",  # the client turns it into ../ (yarl normalises the path)
        "..%2Fsecret.safetensors",  # the server decodes %2F, then normalises (http.server, many others)
        "sub/%2e%2e/%2e%2e/secret.safetensors",
        "%252e%252e/secret.safetensors",  # decoded twice
        "ok.safetensors?x=../secret.safetensors",
        "http://127.0.0.1:9/secret.safetensors",
    ],
)
def test_a_remote_index_cannot_name_a_shard_outside_its_folder(outside: tuple[Path, RangeServer], shard: str) -> None:
    root, srv = outside
    (root / "ckpt" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"secret": shard}}))
    srv.reset()
    r = run_cli("inspect", f"{srv.url}/ckpt/model.safetensors.index.json", "--json")
    assert r.rc == 8, (r.rc, r.out, r.err)
    assert r.err.startswith("Error: ") and r.err.count("\n") == 1 and "refused" in r.err
    from ckptfix.errors import UnsupportedError
    from ckptfix.ops.load import load_anywhere

    rfile._PINS.clear()
    with pytest.raises(UnsupportedError):  # the loader reads the same index: the same refusal
        load_anywhere(f"{srv.url}/ckpt/model.safetensors.index.json")
    assert _outside_hits(srv) == []


def test_a_remote_dcp_data_file_name_cannot_leave_the_folder(tmp_path: Path) -> None:
    """A ``.metadata`` whose ``relative_path`` is ``..%2F__0_0.distcp`` (no ``/``: the local check passes it):
    served, the server decodes and normalises it to the folder's parent."""
    import pickle
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    data = [p.name for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp"]
    for name in data:  # the data files move to the parent: only an escaping name reaches them
        (tmp_path / "dcp" / name).rename(tmp_path / name)
    mpath = tmp_path / "dcp" / ".metadata"
    meta = pickle.loads(mpath.read_bytes())
    for info in meta.storage_data.values():
        info.relative_path = "..%2F" + info.relative_path
    mpath.write_bytes(pickle.dumps(meta))
    with serving(str(tmp_path)) as srv:
        r = run_cli("inspect", f"{srv.url}/dcp", "--json")
        assert r.rc == 5, (r.rc, r.out, r.err)
        assert r.err.startswith("Error: ") and r.err.count("\n") == 1 and "leave the checkpoint folder" in r.err
        rfile._PINS.clear()
        local = run_cli("scan", str(tmp_path / "dcp"), "--json")
        remote = run_cli("scan", f"{srv.url}/dcp", "--json")  # scans what the folder holds, as locally
        assert remote.rc == local.rc
        assert [h.path for h in srv.requests() if h.path.endswith(".distcp")] == []


def test_a_slow_loris_server_is_bounded_by_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte every 0.2 s never trips a per-read timeout of 1 s: the whole request still has a deadline."""
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "1")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    stop = threading.Event()

    def answer(h: http.server.BaseHTTPRequestHandler, start: int, end: int) -> None:
        _head206(h, start, end, 2 * MiB, Content_Length=str(end - start))
        for _ in range(end - start):
            if stop.wait(0.2):
                return
            h.wfile.write(b"x")
            h.wfile.flush()

    box: list[Any] = []

    def read() -> None:
        try:
            box.append(RemoteFile(url).pread(100, 0))
        except Exception as e:  # noqa: BLE001 - checked below
            box.append(e)

    with lying(answer) as url:
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(120)  # a hang catcher only: the deadline is minutes under it
        stop.set()
    assert box, "the read never ended"
    assert isinstance(box[0], RemoteUnavailableError), box[0]


def test_hostile_names_in_a_remote_listing_are_never_printed_raw(tmp_path: Path) -> None:
    """Names with a terminal escape and a newline (a listing is the server's, or the uploader's, text): the error
    stays one line and carries no control character."""
    (tmp_path / "ckpt").mkdir()
    for name in ("\x1b]0;pwned\x07a.index.json", "b\nError: all good.index.json"):
        (tmp_path / "ckpt" / name).write_text(json.dumps({"weight_map": {"w": "x.safetensors"}}))
    with serving(str(tmp_path)) as srv:
        for where in (f"{srv.url}/ckpt/", str(tmp_path / "ckpt")):  # the same rule for a local folder
            r = run_cli("inspect", where)  # locally: several indexes (4); remotely such names are no members (3)
            assert r.rc in (3, 4), (r.rc, r.out, r.err)
            assert r.err.startswith("Error: ") and r.err.count("\n") == 1, r.err
            assert not any(ord(c) < 32 and c != "\n" or ord(c) == 127 for c in r.err), repr(r.err)


def test_a_listing_name_that_decodes_to_a_path_is_not_a_member(tmp_path: Path) -> None:
    """An uploaded file literally named ``..%2Fsecret.index.json``: listed (quoted), decoded once it reads as a
    name, but joined to the folder's URL the server decodes it again to the folder's parent."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "secret.index.json").write_text(json.dumps({"weight_map": {"w": "secret.safetensors"}}))
    (tmp_path / "ckpt" / "..%2Fsecret.index.json").write_text("{}")
    with serving(str(tmp_path)) as srv:
        r = run_cli("inspect", f"{srv.url}/ckpt/")
        assert r.rc != 0
        assert [h.path for h in srv.requests() if h.path.startswith("/secret")] == []
        assert r.err.startswith("Error: ") and r.err.count("\n") == 1, r.err


# --------------------------------------------------------------------------- polyglots: the same verdict remotely


def _polyglots(tmp: Path) -> tuple[Path, dict[str, bytes]]:
    import io
    import pickle
    import zipfile

    import hostile
    from test_sniff_differential import _cases, canary_cmd, tar_member, zip_tar_polyglot

    canary, payload = canary_cmd(tmp)
    cases = _cases(tmp)
    cases["zip/tar"] = zip_tar_polyglot(
        tar_member(b"storages", payload)
        + tar_member(b"tensors", pickle.dumps(0, protocol=2))
        + tar_member(b"pickle", pickle.dumps({}, protocol=2))
        + b"\0" * 1024
    )
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("archive/data.pkl", hostile.wrap_dict(hostile.global_reduce("os", "system", f"touch {canary}")))
    cases["pickle+evil-zip"] = pickle.dumps({"a": 1}, protocol=2) + inner.getvalue()
    return canary, cases


def _outcome(fn: Callable[[str], Any], where: str) -> Any:
    """``fn(where)``, or the name of the error it raised (the same typed error is expected remotely)."""
    try:
        return fn(where)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__


def _verdict(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: doc.get(k) for k in ("format", "verdict", "dangerous", "unknown")}


def test_polyglots_get_the_same_scan_verdict_remotely_and_never_run(tmp_path: Path) -> None:
    from ckptfix.formats import sniff
    from ckptfix.ops.inspect import scan_checkpoint
    from ckptfix.ops.load import load_anywhere

    canary, cases = _polyglots(tmp_path)
    (tmp_path / "served").mkdir()
    for name, data in cases.items():
        (tmp_path / "served" / f"{name.replace('/', '_')}.pt").write_bytes(data)
    with serving(str(tmp_path / "served")) as srv:
        for p in sorted((tmp_path / "served").iterdir()):
            url = f"{srv.url}/{p.name}"
            rfile._PINS.clear()
            assert _outcome(sniff, url) == _outcome(sniff, str(p)), p.name
            scan = lambda w: _verdict(scan_checkpoint(w).to_dict())  # noqa: E731
            assert _outcome(scan, url) == _outcome(scan, str(p)), p.name
            for where in (str(p), url):  # the loader's policy: a payload never runs, local or remote
                with contextlib.suppress(Exception):
                    load_anywhere(where)
            assert not canary.exists(), p.name


# --------------------------------------------------------------------------- bad URLs: one line, the right code


def test_an_invalid_http_url_is_a_one_line_40_not_retried() -> None:
    r = run_cli("inspect", "http://127.0.0.1:99999/a.pt", CKPTFIX_REMOTE_RETRIES="3")
    assert r.rc == 40, (r.rc, r.err)
    assert r.err.startswith("Error: ") and r.err.count("\n") == 1 and "check the URL" in r.err
    assert "retries" not in r.err


@pytest.mark.parametrize("out", ["s3://", "s3:///", "memory://"])
def test_an_output_url_that_names_no_object_is_a_usage_error(tmp_path: Path, out: str) -> None:
    import torch

    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    r = run_cli("convert", str(tmp_path / "m.pt"), "-o", out)
    assert r.rc == 9, (r.rc, r.err)
    assert r.err.startswith("Error: ") and r.err.count("\n") == 1 and "internal error" not in r.err


def test_an_s3_output_without_credentials_is_41_not_an_internal_error(tmp_path: Path) -> None:
    import os

    import torch

    pytest.importorskip("s3fs")
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",  # nothing is sent: signing fails first
        "CKPTFIX_REMOTE_RETRIES": "0",
    }
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # fsspec caches file systems: one made without credentials ...
    try:
        r = run_cli("convert", str(tmp_path / "m.pt"), "-o", "s3://some-bucket/m.safetensors", env=env)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()  # ... must not serve the next test's moto server
    assert r.rc == 41, (r.rc, r.err)
    assert r.err.startswith("Error: ") and r.err.count("\n") == 1 and "AWS_ACCESS_KEY_ID" in r.err


def test_an_endless_folder_listing_is_refused_in_bounded_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder URL whose listing page is 256 MiB of links: refused at the limit (ResourceLimitError, exit 10's
    class), never read whole."""
    from ckptfix.errors import ResourceLimitError
    from ckptfix.files import source
    from ckptfix.files.remote import file as backends

    monkeypatch.setattr(backends, "MAX_LISTING", 1 * MiB, raising=False)
    line = b"".join(b'<a href="f%d.distcp">x</a>\n' % i for i in range(40_000))  # about 1 MiB

    def answer(h: http.server.BaseHTTPRequestHandler, start: int, end: int) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/html")
        h.send_header("Content-Length", str(256 * len(line)))
        h.end_headers()
        for _ in range(256):
            h.wfile.write(line)

    with lying(answer) as url:
        out, peak = _peak_of(lambda: source.listdir(url.rsplit("/", 1)[0] + "/dcp/"))
    assert isinstance(out, ResourceLimitError), out
    assert "folder listing" in str(out)
    assert peak < 32 * MiB, f"peak {peak / MiB:.0f} MiB"


def test_a_folder_output_url_for_a_file_is_refused_as_locally(tmp_path: Path) -> None:
    """``-o s3://bucket/prefix/`` for a safetensors output: exit 9 as ``-o DIR/`` is locally, not an object
    named ``prefix/prefix`` without an extension."""
    import torch

    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    local = run_cli("convert", str(tmp_path / "m.pt"), "-o", str(tmp_path / "newdir") + "/")
    r = run_cli("convert", str(tmp_path / "m.pt"), "-o", "memory://advr-out/prefix/")
    assert local.rc == 9 and r.rc == 9, (local.err, r.rc, r.err)
    assert r.err.startswith("Error: ") and r.err.count("\n") == 1 and "-o" in r.err
    import fsspec

    assert not fsspec.filesystem("memory").exists("/advr-out/prefix/prefix")


@pytest.mark.parametrize("where", ["file:///etc/passwd", "loop"])
def test_a_redirect_to_a_local_file_or_in_a_loop_is_refused_at_once(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "3")
    seen: list[str] = []

    class Redirect(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            seen.append(self.path)
            self.send_response(302)
            self.send_header("Location", where if where != "loop" else self.path + "x")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        r = run_cli("inspect", f"http://127.0.0.1:{srv.server_address[1]}/m.pt")
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.rc == 43, (r.rc, r.err)
    assert r.err.startswith("Error: ") and r.err.count("\n") == 1 and "redirects" in r.err and "retries" not in r.err
    assert len(seen) <= 11  # one chain of redirects (aiohttp follows at most 10), not one per retry


def test_a_listed_name_that_would_name_another_object_is_not_a_member(tmp_path: Path) -> None:
    """A file uploaded as ``..%2Fevil.index.json`` next to the real index: listed, it is not one of the folder's
    files (joined to the URL the server decodes it to the parent's ``evil.index.json``)."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "ckpt").mkdir()
    save_file({"w": torch.ones(3)}, str(tmp_path / "ckpt" / "ok.safetensors"))
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "ok.safetensors"}}))
    (tmp_path / "ckpt" / "..%2Fevil.index.json").write_text("{}")
    (tmp_path / "evil.index.json").write_text(json.dumps({"weight_map": {"w": "ckpt/ok.safetensors"}}))
    with serving(str(tmp_path)) as srv:
        r = run_cli("inspect", f"{srv.url}/ckpt/", "--json")
        assert r.rc == 0, (r.rc, r.err)
        assert json.loads(r.out)["format"] == "sharded"
        assert [h.path for h in srv.requests() if "evil" in h.path] == []


def test_a_weak_etag_is_compared_not_sent_as_if_match() -> None:
    """``W/"v1"`` (nginx, CDNs): If-Match compares strongly, so a weak ETag never matches (412 on every read, a
    false "changed"); it is still checked on each answer."""
    data = bytes(range(256)) * 8192  # 2 MiB

    class Weak(_Lying):
        def do_HEAD(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", 'W/"v1"')
            self.end_headers()

    def answer(h: http.server.BaseHTTPRequestHandler, start: int, end: int) -> None:
        if h.headers.get("If-Match", "").startswith("W/"):  # RFC 9110: a weak ETag never matches If-Match
            h.send_response(412)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        h.send_response(206)
        h.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        h.send_header("ETag", 'W/"v1"')
        h.send_header("Content-Length", str(end - start))
        h.end_headers()
        h.wfile.write(data[start:end])

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Weak)
    srv.daemon_threads = True
    srv.answer = answer  # type: ignore[attr-defined]
    srv.size = len(data)  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        rf = RemoteFile(f"http://127.0.0.1:{srv.server_address[1]}/f.bin")
        assert rf.pread(1000, 5000) == data[5000:6000]
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("total", ["abc", "-5", "1e3", ""])
def test_a_malformed_content_range_at_open_is_a_one_line_error(total: str) -> None:
    """No HEAD (405): the size comes from a one-byte GET's Content-Range, which says ``bytes 0-0/<total>``."""

    class NoHead(_Lying):
        def do_HEAD(self) -> None:
            self.send_response(405)
            self.send_header("Content-Length", "0")
            self.end_headers()

    def answer(h: http.server.BaseHTTPRequestHandler, start: int, end: int) -> None:
        h.send_response(206)
        h.send_header("Content-Range", f"bytes 0-0/{total}")
        h.send_header("Content-Length", "1")
        h.end_headers()
        h.wfile.write(b"x")

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoHead)
    srv.daemon_threads = True
    srv.answer = answer  # type: ignore[attr-defined]
    srv.size = 1  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        r = run_cli("inspect", f"http://127.0.0.1:{srv.server_address[1]}/m.pt")
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.rc == 43, (r.rc, r.err)
    assert r.err.startswith("Error: ") and r.err.count("\n") == 1 and "internal error" not in r.err


def test_credentials_in_a_url_are_not_repeated_in_the_error_line() -> None:
    r = run_cli("inspect", "http://alice:s3cr3t-token@127.0.0.1:9/a.pt", CKPTFIX_REMOTE_RETRIES="0")
    assert r.rc == 43, (r.rc, r.err)
    assert "s3cr3t-token" not in r.err and "http://***@127.0.0.1:9/a.pt" in r.err


def test_an_http_output_is_refused_not_posted(tmp_path: Path) -> None:
    """``-o http://...``: fsspec would POST the file to any server (no all-or-nothing commit): refused, exit 9,
    before anything is sent."""
    import torch

    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    seen: list[str] = []

    def answer(h: http.server.BaseHTTPRequestHandler, start: int, end: int) -> None:
        seen.append(h.command)

    with lying(answer) as url:
        r = run_cli("convert", str(tmp_path / "m.pt"), "-o", url.replace("f.bin", "out.safetensors"))
    assert r.rc == 9, (r.rc, r.err)
    assert r.err.startswith("Error: ") and r.err.count("\n") == 1 and "read-only" in r.err


def test_a_head_that_claims_4_gib_for_a_tiny_object_is_one_line_with_a_fix(tmp_path: Path) -> None:
    """HEAD says 4 GiB; the object is 2 KiB and ranges past it are 416: refused, nothing big allocated."""
    data = bytes(2048)

    def answer(h: http.server.BaseHTTPRequestHandler, start: int, end: int) -> None:
        if start >= len(data):
            h.send_response(416)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        _head206(h, start, min(end, len(data)), len(data), Content_Length=str(min(end, len(data)) - start))
        h.wfile.write(data[start:end])

    with lying(answer, size=4 << 30) as url:
        r = run_cli("inspect", url)
        out, peak = _peak_of(lambda: RemoteFile(url).pread(100, (4 << 30) - 100))
    assert r.rc == 43, (r.rc, r.err)
    assert r.err.startswith("Error: ") and r.err.count("\n") == 1 and "run the command" in r.err
    assert isinstance(out, RemoteUnavailableError) and peak < 32 * MiB
    assert "download the file" in str(out)  # a 416 past the real end: says what to do, not just the status


def test_a_slow_loris_s3_endpoint_is_bounded_by_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same drip from an S3 endpoint (s3fs and botocore): botocore's read timeout is per read, so the request
    needs the deadline too (issue #33 §3); one typed line naming the URL."""
    pytest.importorskip("s3fs")
    from s3server import _DUMMY_ENV

    for k, v in _DUMMY_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "1")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    stop = threading.Event()

    def answer(h: http.server.BaseHTTPRequestHandler, start: int, end: int) -> None:
        _head206(h, start, end, 2 * MiB, Content_Length=str(end - start))
        for _ in range(end - start):
            if stop.wait(0.2):
                return
            h.wfile.write(b"x")
            h.wfile.flush()

    box: list[Any] = []

    def read() -> None:
        try:
            box.append(RemoteFile("s3://bucket/f.bin").pread(100, 1_500_000))
        except Exception as e:  # noqa: BLE001 - checked below
            box.append(e)

    with lying(answer) as url:
        endpoint = url.rsplit("/", 1)[0]
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(60)  # a hang catcher only
        stop.set()
    assert box, "the read never ended"
    assert isinstance(box[0], RemoteUnavailableError), repr(box[0])
    assert "s3://bucket/f.bin" in str(box[0]) and "deadline" in str(box[0])
