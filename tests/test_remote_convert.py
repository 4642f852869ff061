"""``convert URL`` and ``load_anywhere(URL)`` against moto's S3 server and a Range-serving HTTP server (issue #26).

Every container converts from a URL to the same bytes as from the local file and loads to the same tensors;
faults (5xx, dropped connections, short reads, an object replaced mid-read, a damaged object) give a retry
or a typed error, never a wrong tensor, and nothing under the output name.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from ckptfix import load_anywhere
from ckptfix.errors import CorruptCheckpointError, RemoteChangedError, RemoteThrottledError, RemoteUnavailableError
from ckptfix.ops.convert import convert

from helpers import CkptFactory, assert_one_line_error, assert_same_tensors, run_cli
from rangeserver import serving
from s3server import S3Server

pytest.importorskip("s3fs")

CONTAINERS: dict[str, Callable[[CkptFactory], Any]] = {
    "zip": lambda f: f.dataparallel(),
    "legacy": lambda f: f.legacy(),
    "safetensors": lambda f: f.safetensors(),
    "sharded-safetensors": lambda f: f.sharded_safetensors(),
    "sharded-bin": lambda f: f.sharded_bin(),
    "dcp": lambda f: f.dcp(),
    "torchscript": lambda f: f.torchscript(),
    "tied": lambda f: f.tied(),
    "lightning": lambda f: f.lightning(),
}


def _upload(s3: S3Server, path: Path, kind: str) -> str:
    pre = s3.prefix(kind)
    if kind.startswith("sharded"):
        return s3.upload(path.parent, pre) + "/" + path.name
    return s3.upload(path, f"{pre}/{path.name}")


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_BACKOFF", "0.01")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "4")


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_convert_and_load_from_s3_match_local(s3: S3Server, ckpt: CkptFactory, tmp_path: Path, kind: str) -> None:
    b = CONTAINERS[kind](ckpt)
    url = _upload(s3, b.path, kind)
    remote, local = tmp_path / "remote.safetensors", tmp_path / "local.safetensors"
    rep = convert(url, remote)
    convert(b.path, local)
    assert rep.verified and rep.source == url
    assert remote.read_bytes() == local.read_bytes()
    assert_same_tensors(load_anywhere(url), load_anywhere(b.path))


def _big(path: Path, mib: int = 20) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    sd = {
        "big": torch.randn(mib << 18, generator=g),
        "t": torch.randn(300, 200, generator=g).t(),  # a strided view: gathered from its span
        "small": torch.arange(10, dtype=torch.int64),
    }
    torch.save(sd, path)
    return sd


def _ranged_gets(s3: S3Server, min_bytes: int = 1 << 20) -> list[tuple[int, int]]:
    out = []
    for m, _p, _q, r in s3.log:
        got = re.match(r"bytes=(\d+)-(\d+)", r or "")
        if m == "GET" and got and int(got[2]) - int(got[1]) + 1 >= min_bytes:
            out.append((int(got[1]), int(got[2])))
    return out


def test_big_tensor_in_parallel_ranges_same_bytes(s3: S3Server, tmp_path: Path) -> None:
    src = tmp_path / "big.pt"
    sd = _big(src)
    url = s3.upload(src, s3.prefix("big") + "/big.pt")
    local = tmp_path / "local.safetensors"
    convert(src, local)
    for jobs in (1, 4):
        out = tmp_path / f"j{jobs}.safetensors"
        s3.reset_counts()
        convert(url, out, jobs=jobs)
        assert out.read_bytes() == local.read_bytes()
        assert len(_ranged_gets(s3)) >= 2  # the 80 MB tensor came as several range requests, not one GET
        assert s3.bytes_sent < src.stat().st_size * 1.3  # no second pass over the object
    assert_same_tensors(load_anywhere(url), sd)


def test_stats_on_the_cli(s3: S3Server, ckpt: CkptFactory) -> None:
    b = ckpt.dataparallel()
    url = s3.upload(b.path, s3.prefix("st") + "/dp.pt")
    p = run_cli("convert", url, "-o", str(b.path.parent / "out.safetensors"), "--stats", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["stats"]["requests"] >= 1 and doc["stats"]["bytes_read"] > 0
    from jsonschema import Draft202012Validator, ValidationError

    schema = json.loads((Path(__file__).parents[1] / "docs" / "schemas" / "convert.schema.json").read_text())
    Draft202012Validator(schema).validate(doc)
    with pytest.raises(ValidationError):
        Draft202012Validator(schema).validate({**doc, "stats": {"bytes_read": -1, "requests": 0, "retries": 0}})
    assert re.search(r"^read [\d,]+ bytes in [\d,]+ requests?", p.stderr, re.M)


def test_503_on_data_ranges_is_retried(s3: S3Server, tmp_path: Path, fast_retries: None) -> None:
    src = tmp_path / "big.pt"
    _big(src)
    url = s3.upload(src, s3.prefix("f") + "/big.pt")
    local = tmp_path / "local.safetensors"
    convert(src, local)
    left = {"n": 3}

    def fault(environ: dict) -> int | None:
        r = re.match(r"bytes=(\d+)-(\d+)", environ.get("HTTP_RANGE", ""))
        if environ["REQUEST_METHOD"] == "GET" and r and int(r[2]) - int(r[1]) >= 1 << 20 and left["n"] > 0:
            left["n"] -= 1
            return 503
        return None

    s3.fault = fault
    out = tmp_path / "out.safetensors"
    convert(url, out, jobs=2)
    assert left["n"] == 0
    assert out.read_bytes() == local.read_bytes()


@pytest.mark.parametrize("fmt", ["zip", "safetensors"])
def test_object_replaced_mid_read_is_44_and_no_output(
    s3: S3Server, tmp_path: Path, fast_retries: None, fmt: str
) -> None:
    """The object is overwritten between two range requests: the ETag pinned at open stops the read (exit 44).

    (A torch zip would also be caught by its stored CRC-32; a safetensors file has none: only the pin saves it.)
    """
    from safetensors.torch import save_file

    src = tmp_path / ("big.pt" if fmt == "zip" else "big.safetensors")
    sd = _big(tmp_path / "tmp.pt")
    sd = {k: v.contiguous() for k, v in sd.items()}
    other = {k: torch.zeros_like(v) for k, v in sd.items()}
    other_path = tmp_path / ("other" + src.suffix)
    if fmt == "zip":
        torch.save(sd, src)
        torch.save(other, other_path)
    else:
        save_file(sd, str(src))
        save_file(other, str(other_path))
    key = s3.prefix("chg") + "/" + src.name
    url = s3.upload(src, key)
    done = {"swapped": False}

    def fault(environ: dict) -> int | None:
        r = re.match(r"bytes=(\d+)-(\d+)", environ.get("HTTP_RANGE", ""))
        if environ["REQUEST_METHOD"] == "GET" and r and int(r[2]) - int(r[1]) >= 1 << 20 and not done["swapped"]:
            done["swapped"] = True
            s3.fault = None
            s3.fs().put_file(str(other_path), f"{s3.bucket}/{key}")  # overwritten between requests
        return None

    s3.fault = fault
    out = tmp_path / "out.safetensors"
    with pytest.raises(RemoteChangedError):
        convert(url, out)
    assert done["swapped"]
    assert not out.exists()
    assert list(tmp_path.glob("out*")) == []


def test_damaged_object_never_gives_a_wrong_tensor(s3: S3Server, ckpt: CkptFactory, tmp_path: Path) -> None:
    """A byte flipped inside a tensor of a torch zip: the stored CRC-32 catches it over the bytes received."""
    b = ckpt.plain()
    data = bytearray(b.path.read_bytes())
    with zipfile.ZipFile(b.path) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size >= 16)
    h = info.header_offset
    start = h + 30 + int.from_bytes(data[h + 26 : h + 28], "little") + int.from_bytes(data[h + 28 : h + 30], "little")
    data[start + 3] ^= 0xFF
    url = s3.put_bytes(s3.prefix("bad") + "/plain.pt", bytes(data))
    out = tmp_path / "out.safetensors"
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        convert(url, out)
    assert not out.exists()


@pytest.mark.parametrize("kind", ["drop", "short", "503"])
def test_http_faults_mid_range_are_retried(ckpt: CkptFactory, tmp_path: Path, fast_retries: None, kind: str) -> None:
    pytest.importorskip("aiohttp")
    src = tmp_path / "srv" / "big.pt"
    src.parent.mkdir()
    _big(src)
    local = tmp_path / "local.safetensors"
    convert(src, local)
    with serving(str(src.parent)) as srv:
        srv.fault(kind, "big.pt", count=2)
        out = tmp_path / "out.safetensors"
        convert(f"{srv.url}/big.pt", out, jobs=2)
    assert out.read_bytes() == local.read_bytes()


def test_http_always_failing_is_typed_and_no_output(tmp_path: Path, fast_retries: None) -> None:
    pytest.importorskip("aiohttp")
    src = tmp_path / "srv" / "big.pt"
    src.parent.mkdir()
    _big(src, mib=12)
    with serving(str(src.parent)) as srv:
        srv.fault("503", "big.pt", count=10_000)
        out = tmp_path / "out.safetensors"
        with pytest.raises((RemoteUnavailableError, RemoteThrottledError)):  # 503 is S3's "slow down" too
            convert(f"{srv.url}/big.pt", out)
    assert not out.exists() and list(tmp_path.glob("out*")) == []


def test_cli_changed_object_is_one_line(s3: S3Server, ckpt: CkptFactory, tmp_path: Path) -> None:
    b = ckpt.plain()
    key = s3.prefix("cli") + "/p.pt"
    url = s3.upload(b.path, key)
    # every request sees the object replaced first: the ETag pinned at open never matches again

    def fault(environ: dict) -> None:
        if environ["REQUEST_METHOD"] == "GET":
            s3.fs().pipe_file(f"{s3.bucket}/{key}", b"x" * 100)

    s3.fault = fault
    p = run_cli("convert", url, "-o", str(tmp_path / "o.safetensors"), env={"CKPTFIX_REMOTE_BACKOFF": "0.01"})
    s3.fault = None
    assert p.returncode in (RemoteChangedError.exit_code, CorruptCheckpointError.exit_code), p.stderr
    assert_one_line_error(p, p.returncode)
    assert not (tmp_path / "o.safetensors").exists()


def test_memory_stays_flat_whatever_the_size(tmp_path: Path) -> None:
    """Python's peak allocation while converting from a URL does not grow with the checkpoint (bounded pieces)."""
    pytest.importorskip("aiohttp")
    import tracemalloc

    root = tmp_path / "srv"
    root.mkdir()
    peaks = {}
    with serving(str(root)) as srv:
        for mib in (24, 96):
            torch.save({"w": torch.ones(mib << 18), "b": torch.arange(5.0)}, root / f"m{mib}.pt")
            tracemalloc.start()
            try:
                convert(f"{srv.url}/m{mib}.pt", tmp_path / f"o{mib}.safetensors", jobs=2)
                peaks[mib] = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            (root / f"m{mib}.pt").unlink()
            (tmp_path / f"o{mib}.safetensors").unlink()
    assert peaks[96] < peaks[24] + (16 << 20), {k: v >> 20 for k, v in peaks.items()}
    assert peaks[96] < (72 << 20)


def test_url_default_output_is_here_and_other_directions_refused(
    s3: S3Server, ckpt: CkptFactory, tmp_path: Path
) -> None:
    b = ckpt.safetensors()
    url = s3.upload(b.path, s3.prefix("d") + "/model.safetensors")
    work = tmp_path / "work"
    work.mkdir()
    p = run_cli("convert", url, cwd=work)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "model.safetensors"
    from safetensors.torch import load_file

    assert_same_tensors(load_file(work / "model.safetensors"), load_file(b.path))
    for args in (["-o", "back.pth"], ["--to", "dcp", "-o", "x.dcp"]):
        p = run_cli("convert", url, *args, cwd=work)
        assert_one_line_error(p, 8)
        assert "a URL converts to safetensors" in p.stderr
    assert sorted(x.name for x in work.iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize("kind", ["zip", "legacy", "safetensors", "dcp"])
def test_load_over_http_ranges(ckpt: CkptFactory, kind: str) -> None:
    """``load_anywhere("https://...")`` of a server with Range support: the local tensors, no local copy."""
    pytest.importorskip("aiohttp")
    b = CONTAINERS[kind](ckpt)
    with serving(str(b.path.parent)) as srv:
        got = load_anywhere(f"{srv.url}/{b.path.name}")
        assert all(h.method in ("HEAD", "GET") for h in srv.requests())
    assert_same_tensors(got, load_anywhere(b.path))


def test_object_replaced_between_reading_and_copying_is_44(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header is read from one version, the tensors must come from the same one: same-layout new bytes = 44."""
    from safetensors.torch import save_file

    import ckptfix.ops.convert.write as write_mod

    sd = {"w": torch.randn(300, 300), "b": torch.randn(300)}
    save_file(sd, str(tmp_path / "a.safetensors"))
    save_file({k: torch.zeros_like(v) for k, v in sd.items()}, str(tmp_path / "b.safetensors"))  # same header
    key = s3.prefix("pin") + "/m.safetensors"
    url = s3.upload(tmp_path / "a.safetensors", key)
    original = write_mod.Writer.write

    def replaced_first(self, *a, **k):  # type: ignore[no-untyped-def]
        s3.fs().put_file(str(tmp_path / "b.safetensors"), f"{s3.bucket}/{key}")
        return original(self, *a, **k)

    monkeypatch.setattr(write_mod.Writer, "write", replaced_first)
    out = tmp_path / "out.safetensors"
    with pytest.raises(RemoteChangedError):
        convert(url, out)
    assert not out.exists()
