"""Remote reads (issue #26): ckptfix.files.source / .remote against fsspec's memory:// and a local HTTP server.

The HTTP server (tests/rangeserver.py) answers Range requests and injects faults: a dropped connection, a 503
then success, a short read, the object changing between requests (ETag), 403, 404.  Each must end in a retry
or the typed error, never a wrong result.  ``inspect --json`` / ``scan --json`` of a URL must equal the local
run on the same file apart from the path, and read little: counted in requests and bytes, never timed.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest

fsspec = pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from ckptfix.errors import (  # noqa: E402
    CorruptCheckpointError,
    RemoteAccessDeniedError,
    RemoteChangedError,
    RemoteDriverMissingError,
    RemoteNotFoundError,
    RemoteThrottledError,
    RemoteUnavailableError,
)
from ckptfix.files import source  # noqa: E402
from ckptfix.files.remote import file as rfile  # noqa: E402
from ckptfix.files.remote.stats import Stats, collect  # noqa: E402
from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint  # noqa: E402

from helpers import CkptFactory, run_cli  # noqa: E402
from rangeserver import RangeServer, serving  # noqa: E402


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_BACKOFF", "0")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "3")
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "20")
    rfile._PINS.clear()  # the served files' versions go back to 0 between tests: no pin carried over


# --------------------------------------------------------------------------- the files served


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every container kind, built at test time (never committed), in one folder the server serves."""
    import torch

    root = tmp_path_factory.mktemp("served")
    f = CkptFactory(root)
    f.plain("plain.pt")
    f.dataparallel("legacy_dp.pt", legacy=True)
    f.lightning("lit.ckpt")
    f.safetensors("model.safetensors", prefix="model.")
    f.sharded_bin("hf_bin")
    f.sharded_safetensors("hf_st")
    f.dcp("dcp_ckpt")
    f.torchscript("scripted.pt")
    f.evil("evil.pt")
    f.evil("evil_legacy.pt", mode="legacy")
    f.evil("evil.pkl", mode="pickle")
    with open(root / "plain.pkl", "wb") as fh:
        pickle.dump({"lr": 0.1, "steps": [1, 2, 3]}, fh, protocol=4)
    # a larger archive: 24 tensors of 2 MiB (48 MiB) so that the tail, the head and the middle differ
    g = torch.Generator().manual_seed(0)
    big = {f"layer{i}.weight": torch.randn(512, 1024, generator=g) for i in range(24)}
    torch.save({"model": big, "step": 7}, root / "big.pt")
    torch.save(big, root / "big_legacy.pt", _use_new_zipfile_serialization=False)
    from safetensors.torch import save_file

    save_file(big, str(root / "big.safetensors"))
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({k: big[k] for k in list(big)[:12]}, checkpoint_id=str(root / "big_dcp"), no_dist=True)
    return root


@pytest.fixture(scope="module")
def server(tree: Path):
    with serving(str(tree)) as srv:
        yield srv


@pytest.fixture
def srv(server: RangeServer) -> RangeServer:
    server.reset()
    server.version = 0
    server.honor_if_match = True
    return server


def _norm(doc: Any, *prefixes: str) -> Any:
    text = json.dumps(doc, sort_keys=True, default=str)
    for p in prefixes:
        text = text.replace(p.rstrip("/") + "/", "").replace(p.rstrip("/"), "")
    out = json.loads(text)
    if isinstance(out, dict):
        out.pop("path", None)
    return out


LOCAL_VS_REMOTE = [
    "plain.pt",
    "legacy_dp.pt",
    "lit.ckpt",
    "model.safetensors",
    "hf_bin/pytorch_model.bin.index.json",
    "hf_bin",
    "hf_st/",
    "dcp_ckpt",
    "scripted.pt",
    "evil.pt",
    "evil_legacy.pt",
    "evil.pkl",
    "plain.pkl",
    "big.pt",
    "big_legacy.pt",
    "big.safetensors",
    "big_dcp",
]


@pytest.mark.parametrize("name", LOCAL_VS_REMOTE)
def test_inspect_and_scan_of_a_url_equal_the_local_run(tree: Path, srv: RangeServer, name: str) -> None:
    local = str(tree / name.rstrip("/"))
    url = f"{srv.url}/{name}"
    for fn in (inspect_checkpoint, scan_checkpoint):
        want = _norm(fn(local).to_dict(), str(tree))
        got = _norm(fn(url).to_dict(), srv.url)
        if name in ("dcp_ckpt", "big_dcp") and fn is inspect_checkpoint:
            # a local DCP folder also names its framework layout (ckptfix.ops.frameworks reads local folders only)
            assert want.pop("framework")["framework"] == "torch.distributed.checkpoint"
            assert got.pop("framework") is None
        if name in ("dcp_ckpt", "big_dcp") and fn is scan_checkpoint:
            assert want.pop("notes") == [
                "torch.distributed.checkpoint folder (torch-dcp): 1 checkpoint file(s) scanned"
            ]
            assert got.pop("notes") == []
        assert got == want, (fn.__name__, name)


@pytest.mark.parametrize("name", ["big.pt", "big_legacy.pt", "big.safetensors"])
def test_inspect_and_scan_read_little(srv: RangeServer, tree: Path, name: str) -> None:
    """A 48 MiB checkpoint: well under 1 MB transferred, in few requests (counted by the server and by Stats)."""
    size = (tree / name).stat().st_size
    assert size > 40 << 20
    for fn in (inspect_checkpoint, scan_checkpoint):
        srv.reset()
        with collect() as st:
            fn(f"{srv.url}/{name}")
        sent = srv.sent()
        hits = srv.requests()
        assert sent < 1 << 20, (fn.__name__, sent)
        assert st.bytes_read == sent
        assert st.requests == len(hits)
        # the size/ETag request, the head, the tail (zip directory, safetensors header) and for a legacy stream
        # the object pickle: no request per tensor record
        assert len(hits) <= 5, [(h.method, h.range) for h in hits]


def test_scan_of_a_remote_dcp_folder_reads_the_items_ends_not_the_tensors(srv: RangeServer, tree: Path) -> None:
    """A DCP folder at a URL: .metadata says where each item lies; only each item's ends are fetched."""
    size = sum(p.stat().st_size for p in (tree / "big_dcp").iterdir())
    assert size > 20 << 20
    with collect() as st:
        rep = scan_checkpoint(f"{srv.url}/big_dcp")
    assert rep.verdict == "safe"
    assert st.bytes_read < 1 << 20, st.line()
    assert st.requests <= 30, st.line()  # about one (parallel) request per item boundary, never the whole file
    with collect() as st:
        inspect_checkpoint(f"{srv.url}/big_dcp")
    assert st.bytes_read < 256 << 10 and st.requests <= 6, st.line()


def test_cli_stats_line_and_json(srv: RangeServer) -> None:
    url = f"{srv.url}/big.pt"
    p = run_cli("inspect", url, "--stats")
    assert p.returncode == 0, p.stderr
    assert "read " in p.stderr and " bytes in " in p.stderr and "requests" in p.stderr
    p = run_cli("scan", url, "--json", "--stats")
    doc = json.loads(p.stdout)
    assert doc["stats"]["requests"] >= 2 and 0 < doc["stats"]["bytes_read"] < 1 << 20
    assert doc["stats"]["files"] == 1
    p = run_cli("inspect", url, "--json")
    assert "stats" not in json.loads(p.stdout)  # only with --stats: existing outputs unchanged


def test_cli_json_validates_against_the_schemas(srv: RangeServer) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    repo = Path(__file__).resolve().parents[1]
    for cmd in ("inspect", "scan"):
        schema = json.loads((repo / "docs" / "schemas" / f"{cmd}.schema.json").read_text())
        p = run_cli(cmd, f"{srv.url}/plain.pt", "--json", "--stats")
        jsonschema.validate(json.loads(p.stdout), schema)


def test_local_stats_say_nothing_went_over_the_network(tree: Path) -> None:
    p = run_cli("inspect", str(tree / "plain.pt"), "--stats")
    assert p.returncode == 0
    assert "read 0 bytes in 0 requests" in p.stderr


# --------------------------------------------------------------------------- faults


def _bytes_of(tree: Path, name: str) -> bytes:
    return (tree / name).read_bytes()


@pytest.mark.parametrize("kind", ["drop", "503", "500", "short", "429"])
def test_transient_faults_are_retried_and_the_bytes_are_right(tree: Path, srv: RangeServer, kind: str) -> None:
    data = _bytes_of(tree, "big.pt")
    with collect() as st, source.open_source(f"{srv.url}/big.pt") as src:
        srv.fault(kind, "/big.pt", count=2)
        assert src.pread(100_000, 20_000_000) == data[20_000_000:20_100_000]
    assert st.retries == 2


def test_a_large_read_goes_in_parallel_parts_and_survives_a_drop(tree: Path, srv: RangeServer) -> None:
    data = _bytes_of(tree, "big.pt")
    with source.open_source(f"{srv.url}/big.pt") as src:
        srv.reset()
        srv.fault("drop", "/big.pt")
        buf = bytearray(20 << 20)
        src.readinto(memoryview(buf), 1000)  # type: ignore[call-arg]
        assert bytes(buf) == data[1000 : 1000 + (20 << 20)]
        assert src.rf.readinto(memoryview(buf), 1000, jobs=4) == len(buf)  # type: ignore[attr-defined]
        assert bytes(buf) == data[1000 : 1000 + (20 << 20)]
    parts = [h for h in srv.requests() if h.method == "GET" and h.status == 206]
    assert len(parts) >= 6  # 8 MiB parts


def test_persistent_5xx_is_unavailable_and_persistent_429_throttled(srv: RangeServer) -> None:
    with source.open_source(f"{srv.url}/big.pt") as src:
        srv.fault("500", "/big.pt", count=10)
        with pytest.raises(RemoteUnavailableError, match="after 3 retries"):
            src.pread(10, 30_000_000)
        srv.reset()
        srv.fault("429", "/big.pt", count=10)
        with pytest.raises(RemoteThrottledError) as ei:
            src.pread(10, 31_000_000)
    assert ei.value.exit_code == 42


def test_the_object_changing_between_requests_is_an_error_never_a_mixed_read(srv: RangeServer) -> None:
    with source.open_source(f"{srv.url}/big.pt") as src:
        src.pread(10, 0)
        srv.fault("change", "/big.pt")
        with pytest.raises(RemoteChangedError) as ei:
            src.pread(10, 30_000_000)
    assert ei.value.exit_code == 44


def test_a_server_that_ignores_if_match_is_caught_by_the_etag_check(srv: RangeServer) -> None:
    srv.honor_if_match = False
    with source.open_source(f"{srv.url}/big.pt") as src:
        src.pread(10, 0)
        srv.fault("change", "/big.pt")
        with pytest.raises(RemoteChangedError, match="ETag"):
            src.pread(10, 30_000_000)
        srv.fault("stale-etag", "/big.pt")
        with pytest.raises(RemoteChangedError):
            src.pread(10, 40_000_000)


def test_inspect_of_an_object_that_changes_mid_read_fails_with_44(srv: RangeServer) -> None:
    srv.fault("change", "/big.pt", count=1)  # the first GET (after HEAD) sees a new version
    p = run_cli("inspect", f"{srv.url}/big.pt")
    assert p.returncode == 44, p.stderr
    assert p.stderr.startswith("Error: ") and p.stderr.count("\n") == 1
    assert "changed" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(("kind", "code"), [("403", 41), ("404", 40)])
def test_denied_and_missing_are_typed_one_line_errors(srv: RangeServer, kind: str, code: int) -> None:
    srv.fault(kind, "/plain.pt", method="HEAD")
    p = run_cli("inspect", f"{srv.url}/plain.pt")
    assert p.returncode == code, p.stderr
    assert p.stderr.startswith("Error: ") and p.stderr.count("\n") == 1
    srv.fault(kind, "/plain.pt", method="HEAD")
    with pytest.raises(RemoteAccessDeniedError if kind == "403" else RemoteNotFoundError):
        source.open_source(f"{srv.url}/plain.pt")
    p = run_cli("scan", f"{srv.url}/nothing-here.pt")
    assert p.returncode == 40, p.stderr
    assert p.stderr.count("\n") == 1


def test_a_server_without_ranges_is_refused_not_downloaded(srv: RangeServer) -> None:
    srv.fault("ignore-range", "/big.pt", count=1)
    with collect() as st, pytest.raises(RemoteUnavailableError, match="range"):
        with source.open_source(f"{srv.url}/big.pt") as src:
            src.pread(10, 30_000_000)
    assert st.bytes_read == 0 and st.retries == 0  # the 200's body was never read, nor asked again


def test_a_truncated_range_request_past_the_end_is_corrupt(srv: RangeServer) -> None:
    with source.open_source(f"{srv.url}/plain.pt") as src:
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            src.pread(10, src.size - 5)


# --------------------------------------------------------------------------- the layer itself (memory://)


@pytest.fixture
def mem():
    fs = fsspec.filesystem("memory")
    data = bytes(range(256)) * 40_000  # 10 MB
    with fs.open("/rcore-test/blob.bin", "wb") as fh:
        fh.write(data)
    fs.mkdir("/rcore-test/dir")
    with fs.open("/rcore-test/dir/a.json", "wb") as fh:
        fh.write(b"{}")
    yield data
    fs.rm("/rcore-test", recursive=True)


def test_memory_pread_ranges_fileobj_and_cache(mem: bytes) -> None:
    data = mem
    with collect() as st:
        src = source.open_source("memory://rcore-test/blob.bin")
        assert src.size == len(data) and src.local_path is None
        assert src.pread(10, 5) == data[5:15]
        n = st.requests
        assert src.pread(100, 1000) == data[1000:1100]  # in the head window: no new request
        assert st.requests == n
        out = list(src.read_ranges([(5_000_000, 10), (0, 5), (5_000_100, 20), (9_000_000, 7)], jobs=3))
        assert out == [
            (5_000_000, data[5_000_000:5_000_010]),
            (0, data[:5]),
            (5_000_100, data[5_000_100:5_000_120]),
            (9_000_000, data[9_000_000:9_000_007]),
        ]
        with src.fileobj() as fh:
            fh.seek(-10, 2)
            assert fh.read() == data[-10:]
            fh.seek(3)
            assert fh.read(4) == data[3:7]
        with pytest.raises(CorruptCheckpointError):
            src.pread(10, len(data) - 5)
    assert st.files == 1


def test_memory_folders(mem: bytes) -> None:
    assert source.isdir("memory://rcore-test/dir")
    assert not source.isdir("memory://rcore-test/blob.bin")
    assert source.isfile("memory://rcore-test/blob.bin")
    assert source.exists("memory://rcore-test/dir/a.json")
    assert not source.exists("memory://rcore-test/nope")
    assert source.listdir("memory://rcore-test") == ["blob.bin", "dir"]
    assert source.join("memory://rcore-test/", "dir", "a.json") == "memory://rcore-test/dir/a.json"
    with pytest.raises(RemoteNotFoundError) as ei:
        source.open_source("memory://rcore-test/nope")
    assert ei.value.exit_code == 40 and isinstance(ei.value, FileNotFoundError)


def test_the_window_cache_is_bounded(mem: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rfile, "CACHE_BYTES", 256 << 10)
    with source.open_source("memory://rcore-test/blob.bin") as src:
        for off in range(1 << 20, 9 << 20, 300_000):
            assert src.pread(16, off) == mem[off : off + 16]
        rf = src.rf  # type: ignore[attr-defined]
        assert rf._cached <= (256 << 10) + rfile.READ_AHEAD_MAX


def test_http_folders(srv: RangeServer) -> None:
    assert source.isdir(f"{srv.url}/hf_bin")
    assert source.isdir(f"{srv.url}/hf_bin/")
    assert not source.isdir(f"{srv.url}/plain.pt")
    assert source.isfile(f"{srv.url}/plain.pt")
    assert not source.exists(f"{srv.url}/nope.pt")
    assert "pytorch_model.bin.index.json" in source.listdir(f"{srv.url}/hf_bin")


def test_local_sources_are_plain_descriptors(tree: Path) -> None:
    p = tree / "plain.pt"
    data = p.read_bytes()
    with source.open_source(p) as src:
        assert src.local_path == str(p) and src.size == len(data)
        assert src.pread(10, 3) == data[3:13]
        assert list(src.read_ranges([(0, 4), (8, 2)])) == [(0, data[:4]), (8, data[8:10])]
        with pytest.raises(CorruptCheckpointError):
            src.pread(10, len(data) - 3)
        with src.fileobj() as fh:
            assert fh.read(4) == data[:4]


def test_url_detection_and_missing_drivers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert source.is_url("s3://b/k") and source.is_url("HTTPS://x/y") and source.is_url("hf://org/repo/f")
    assert not source.is_url("/tmp/x.pt") and not source.is_url("C:/x.pt") and not source.is_url("ftp://x")
    import builtins

    real = builtins.__import__

    def no_gcsfs(name: str, *a: Any, **k: Any) -> Any:
        if name == "gcsfs":
            raise ImportError("No module named 'gcsfs'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_gcsfs)
    with pytest.raises(RemoteDriverMissingError, match="pip install gcsfs") as ei:
        source.open_source("gs://bucket/model.pt")
    assert ei.value.exit_code == 45


def test_stats_line() -> None:
    st = Stats()
    st.add(nbytes=412_345, requests=5, files=1)
    assert st.line() == "read 412,345 bytes in 5 requests"
    st.add(requests=1, retries=1)
    assert st.line() == "read 412,345 bytes in 6 requests (1 retry)"


def test_a_zip_whose_local_header_disagrees_is_still_refused_remotely(tree: Path, srv: RangeServer) -> None:
    """The remote path reads the local headers in batches: the name check must hold there too."""
    src = tree / "plain.pt"
    bad = tree / "renamed_header.pt"
    raw = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as zf:
        info = zf.infolist()[-1]
    off = info.header_offset
    (nlen,) = struct.unpack_from("<H", raw, off + 26)
    name_at = off + 30
    raw[name_at + nlen - 1] ^= 0x01  # one letter of the local name differs from the central directory
    bad.write_bytes(bytes(raw))
    try:
        with pytest.raises(CorruptCheckpointError) as local:
            inspect_checkpoint(str(bad))
        with pytest.raises(CorruptCheckpointError) as remote:
            inspect_checkpoint(f"{srv.url}/renamed_header.pt")
        assert str(remote.value).split(":", 2)[-1] == str(local.value).split(":", 1)[-1] or "named" in str(remote.value)
    finally:
        bad.unlink()


def test_inputs_are_never_modified(tree: Path, srv: RangeServer) -> None:
    before = {p: p.stat().st_mtime_ns for p in tree.rglob("*") if p.is_file()}
    for name in ("plain.pt", "dcp_ckpt", "hf_st"):
        inspect_checkpoint(f"{srv.url}/{name}")
    assert before == {p: p.stat().st_mtime_ns for p in tree.rglob("*") if p.is_file()}
    assert not shutil.which("nonexistent-binary-rcore")
    assert os.listdir(tree)


# --------------------------------------------------------------------------- S3 (moto's server, when installed)


@pytest.fixture(scope="module")
def s3(tree: Path):
    """A moto S3 server on a free local port with bucket ``rcore`` holding the served files (torn down after)."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    mp = pytest.MonkeyPatch()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "FSSPEC_S3_ENDPOINT_URL": endpoint,
    }.items():
        mp.setenv(k, v)
    mp.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint})
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing", skip_instance_cache=True)
    fs.mkdir("rcore")
    for name in ("plain.pt", "big.pt", "big_legacy.pt", "model.safetensors"):
        fs.put(str(tree / name), f"rcore/{name}")
    fs.put(str(tree / "hf_st"), "rcore/hf_st", recursive=True)
    try:
        yield fs
    finally:
        mp.undo()
        srv.stop()


@pytest.mark.parametrize("name", ["plain.pt", "big.pt", "big_legacy.pt", "model.safetensors", "hf_st"])
def test_s3_inspect_and_scan_equal_local_and_read_little(tree: Path, s3: Any, name: str) -> None:
    for fn in (inspect_checkpoint, scan_checkpoint):
        with collect() as st:
            got = _norm(fn(f"s3://rcore/{name}").to_dict(), "s3://rcore")
        assert got == _norm(fn(str(tree / name)).to_dict(), str(tree)), (fn.__name__, name)
        assert st.bytes_read < 1 << 20


def test_s3_object_replaced_mid_read_is_44(tree: Path, s3: Any) -> None:
    s3.put(str(tree / "big.pt"), "rcore/replaced.pt")
    with source.open_source("s3://rcore/replaced.pt") as src:
        assert src.etag
        src.pread(16, 0)
        s3.put(str(tree / "big_legacy.pt"), "rcore/replaced.pt")  # a new version under the same key
        with pytest.raises(RemoteChangedError):
            src.pread(16, 30_000_000)


def test_s3_missing_object_and_bucket_are_40(s3: Any) -> None:
    for url in ("s3://rcore/none.pt", "s3://no-such-bucket-rcore/none.pt"):
        p = run_cli("inspect", url)
        assert p.returncode == 40, p.stderr
        assert p.stderr.startswith("Error: ") and p.stderr.count("\n") == 1


def test_local_reads_never_import_fsspec(tree: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys; from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint; "
        f"inspect_checkpoint({str(tree / 'plain.pt')!r}); scan_checkpoint({str(tree / 'legacy_dp.pt')!r}); "
        "print('fsspec' in sys.modules, 'aiohttp' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_drivers_client_errors_are_retried_then_unavailable(mem: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """hf:// (httpx), gs:// ... raise their HTTP client's own errors, not OSError: still typed, never "internal"."""
    ConnectError = type("ConnectError", (Exception,), {"__module__": "httpx"})
    calls = []

    def boom(*a: Any, **k: Any) -> Any:
        calls.append(1)
        raise ConnectError("Name or service not known")

    fs = fsspec.filesystem("memory")
    with monkeypatch.context() as m, pytest.raises(RemoteUnavailableError, match="ConnectError") as ei:
        m.setattr(type(fs), "info", boom)
        source.open_source("memory://rcore-test/blob.bin")
    assert ei.value.exit_code == 43 and len(calls) == 4  # 1 + CKPTFIX_REMOTE_RETRIES=3


def test_random_reads_under_random_faults_are_right_or_typed(tree: Path, srv: RangeServer) -> None:
    """Seeded random reads (small, cached, large parallel, coalesced) while the server drops, shortens and fails:
    every answer is the file's bytes or a typed error, never other bytes."""
    import random

    data = _bytes_of(tree, "big.pt")
    rng = random.Random(26)
    typed = (RemoteUnavailableError, RemoteThrottledError)
    right = errors = 0
    with source.open_source(f"{srv.url}/big.pt") as src:
        for _ in range(60):
            srv.fault(rng.choice(["drop", "short", "500", "503", "429"]), "/big.pt", count=rng.choice([0, 1, 2, 5]))
            kind = rng.random()
            try:
                if kind < 0.6:
                    n = rng.choice([1, 7, 4096, 70_000, 300_000, 2_000_000])
                    off = rng.randrange(0, len(data) - n)
                    assert src.pread(n, off) == data[off : off + n]
                elif kind < 0.8:
                    ranges = [(o, rng.randrange(1, 5000)) for o in rng.sample(range(0, len(data) - 5000), 5)]
                    for o, got in src.read_ranges(ranges, jobs=3):
                        n = dict(ranges)[o]
                        assert got == data[o : o + n]
                else:
                    n = rng.choice([9 << 20, 17 << 20])
                    off = rng.randrange(0, len(data) - n)
                    buf = bytearray(n)
                    src.rf.readinto(memoryview(buf), off, jobs=4)  # type: ignore[attr-defined]
                    assert bytes(buf) == data[off : off + n]
                right += 1
            except typed:
                errors += 1
            srv.reset()
    assert right > 30 and right + errors == 60


def test_a_stalled_answer_times_out_and_is_retried(
    tree: Path, srv: RangeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that stops sending mid-body: the read times out (CKPTFIX_REMOTE_TIMEOUT) and is retried, no hang."""
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "1")
    data = _bytes_of(tree, "big.pt")
    with collect() as st, source.open_source(f"{srv.url}/big.pt") as src:
        srv.fault("stall", "/big.pt")
        assert src.pread(50_000, 25_000_000) == data[25_000_000:25_050_000]
    assert st.retries == 1


def test_retry_after_is_read_in_seconds_and_capped() -> None:
    assert rfile._retry_after({"Retry-After": "3"}) == 3.0
    assert rfile._retry_after({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None
    assert rfile._retry_after({}) is None
    assert rfile.MAX_RETRY_AFTER <= 60


def test_no_credentials_is_access_denied_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("s3fs")
    NoCredentialsError = type("NoCredentialsError", (Exception,), {"__module__": "botocore.exceptions"})
    err = rfile._FsBackend(None, "bkt/x.pt", "s3://bkt/x.pt")._map(NoCredentialsError("Unable to locate credentials"))
    assert isinstance(err, RemoteAccessDeniedError) and err.exit_code == 41
    assert "AWS_ACCESS_KEY_ID" in str(err) and "\n" not in str(err)


def test_a_second_open_that_finds_another_version_is_44_once(srv: RangeServer) -> None:
    """A reader that opens the object again (a convert's tensor copy after its header read) must not mix versions."""
    url = f"{srv.url}/plain.pt"
    with source.open_source(url) as src:
        src.pread(8, 0)
    srv.version += 1  # the object is replaced between the two opens
    with pytest.raises(RemoteChangedError, match="since this process first read it"):
        source.open_source(url)
    with source.open_source(url) as src:  # running it again starts from the new version
        assert src.pread(2, 0) == b"PK"
