"""One retry owner (issue #32 §6): ckptfix retries a failed request, the drivers under it (s3fs, botocore, fsspec's
HTTP, huggingface_hub) do not, so ``CKPTFIX_REMOTE_RETRIES=N`` is N+1 requests at the server and the error says so.
Requests are counted by the servers the tests start (moto's S3 server, tests/rangeserver.py, tests/hubserver.py);
nothing is timed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fsspec")

from ckptfix.errors import RemoteThrottledError, RemoteUnavailableError
from ckptfix.files.remote import file as rfile
from ckptfix.files.remote.file import RemoteFile

from s3server import S3Server

MiB = 1 << 20
BLOB = bytes(range(256)) * (8 * 1024)  # 2 MiB


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_BACKOFF", "0")
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "20")
    rfile._PINS.clear()


@pytest.mark.parametrize("n", [0, 2])
def test_s3_a_failing_range_read_is_n_plus_1_gets(s3: S3Server, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", str(n))
    url = s3.put_bytes(f"{s3.prefix()}/blob.bin", BLOB)
    rf = RemoteFile(url)
    s3.reset_counts()
    s3.fault = lambda env: 500 if env.get("REQUEST_METHOD") == "GET" and env.get("HTTP_RANGE") else None
    with pytest.raises(RemoteUnavailableError) as ei:
        rf.pread(100, 1_500_000)
    gets = [e for e in s3.log if e[0] == "GET" and e[3]]
    assert len(gets) == n + 1, gets
    assert f"({n + 1} request{'s' if n else ''})" in str(ei.value), str(ei.value)


def test_s3_throttling_is_n_plus_1_gets(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    url = s3.put_bytes(f"{s3.prefix()}/blob.bin", BLOB)
    rf = RemoteFile(url)
    s3.reset_counts()
    s3.fault = lambda env: 503 if env.get("REQUEST_METHOD") == "GET" and env.get("HTTP_RANGE") else None
    with pytest.raises((RemoteThrottledError, RemoteUnavailableError)) as ei:
        rf.pread(100, 1_500_000)
    assert len([e for e in s3.log if e[0] == "GET" and e[3]]) == 2
    assert "(2 requests)" in str(ei.value)


def test_s3_a_failing_open_is_n_plus_1_heads(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    url = s3.put_bytes(f"{s3.prefix()}/blob.bin", BLOB)
    s3.reset_counts()
    s3.fault = lambda env: 500 if env.get("REQUEST_METHOD") == "HEAD" else None
    with pytest.raises(RemoteUnavailableError):
        RemoteFile(url)
    assert s3.by_method["HEAD"] == 2, s3.log


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("aiohttp")
    from rangeserver import serving

    root = tmp_path_factory.mktemp("served")
    (root / "blob.bin").write_bytes(BLOB)
    with serving(str(root)) as srv:
        yield srv


def test_http_a_failing_range_read_is_n_plus_1_gets(served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "2")
    served.reset()
    rf = RemoteFile(f"{served.url}/blob.bin")
    served.fault("500", "blob.bin", count=100)
    with pytest.raises(RemoteUnavailableError) as ei:
        rf.pread(100, 1_500_000)
    assert len([h for h in served.requests() if h.method == "GET"]) == 3
    assert "(3 requests)" in str(ei.value)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("huggingface_hub")
    from hubserver import serving

    root = tmp_path_factory.mktemp("hub") / "main"
    root.mkdir()
    (root / "blob.bin").write_bytes(BLOB)
    with serving({"user/repo": {"main": str(root)}}) as srv:
        yield srv


@pytest.fixture
def hf(hub: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    hub.reset()
    from huggingface_hub import HfFileSystem

    HfFileSystem.clear_instance_cache()
    return hub


def test_hf_a_failing_range_read_is_n_plus_1_gets(hf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "2")
    rf = RemoteFile("hf://user/repo/blob.bin")
    hf.reset()
    hf.fault(500, count=100)
    with pytest.raises(RemoteUnavailableError) as ei:
        rf.pread(100, 1_500_000)
    assert len([h for h in hf.requests() if h.method == "GET"]) == 3
    assert "(3 requests)" in str(ei.value)


def test_hf_a_failing_open_is_n_plus_1_tries_of_each_request(hf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's own backoff (5 retries, 1-8 s apart) would make this 6 requests per try."""
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    hf.reset()
    hf.fault(500, count=100)
    with pytest.raises(RemoteUnavailableError):
        RemoteFile("hf://user/repo/blob.bin")
    assert len(hf.requests()) == 2, [(h.method, h.path) for h in hf.requests()]


def test_a_remote_zip_of_many_small_tensors_is_fetched_once(s3: S3Server, tmp_path: Path) -> None:
    """convert of a torch zip of 200 tensors of 64 KiB from S3: the bytes served are about the file, not 2x
    (with --no-verify too)."""
    torch = pytest.importorskip("torch")
    from helpers import run_cli

    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(16 * 1024, generator=g) for i in range(200)}
    torch.save(sd, tmp_path / "many.pt")
    size = (tmp_path / "many.pt").stat().st_size
    url = s3.upload(tmp_path / "many.pt", f"{s3.prefix()}/many.pt")
    for extra in ([], ["--no-verify"]):
        s3.reset_counts()
        out = tmp_path / f"out{len(extra)}.safetensors"
        r = run_cli("convert", url, "-o", str(out), *extra)
        assert r.rc == 0, r.err
        assert s3.bytes_sent < 1.1 * size, (extra, s3.bytes_sent / size)
