"""``convert ... -o s3://...`` against moto's S3 server: verified locally, then committed all or nothing (issue #26)."""

from __future__ import annotations

import _thread
import asyncio
import json
import threading
from pathlib import Path

import pytest

from ckptfix.errors import OutputError, RemoteWriteError

from helpers import CkptFactory, assert_one_line_error, run_cli
from s3server import S3Server

pytest.importorskip("s3fs")


def _big_checkpoint(path: Path, mib: int = 12) -> Path:
    """A state dict whose safetensors output is over ``mib`` MiB (a multipart upload with 5 MiB parts)."""
    import torch

    g = torch.Generator().manual_seed(0)
    torch.save({"w": torch.randn(mib << 18, generator=g), "b": torch.arange(7, dtype=torch.float32)}, path)
    return path


def test_convert_to_s3_is_the_local_output(s3: S3Server, ckpt: CkptFactory, tmp_path: Path) -> None:
    from ckptfix.ops.convert import convert

    b = ckpt.dataparallel()
    url = s3.url(s3.prefix("w") + "/model.safetensors")
    rep = convert(b.path, url)
    assert rep.outputs == [url]
    assert rep.verified
    local = tmp_path / "local.safetensors"
    convert(b.path, local)
    assert s3.get_bytes(url) == local.read_bytes()
    assert not list(tmp_path.glob("*.tmp*"))


def test_existing_object_needs_force(s3: S3Server, ckpt: CkptFactory) -> None:
    from ckptfix.ops.convert import convert

    b = ckpt.plain()
    url = s3.put_bytes(s3.prefix("w") + "/model.safetensors", b"old")
    with pytest.raises(OutputError, match="--force"):
        convert(b.path, url)
    assert s3.get_bytes(url) == b"old"
    convert(b.path, url, force=True)
    assert s3.get_bytes(url)[:8] != b"old"


def test_sharded_output_commits_the_index_last(s3: S3Server, ckpt: CkptFactory) -> None:
    from ckptfix.ops.convert import convert

    b = ckpt.plain()
    pre = s3.prefix("w")
    url = s3.url(pre + "/model.safetensors")
    s3.reset_counts()
    rep = convert(b.path, url, max_shard_size=60)
    assert len(rep.outputs) > 1 and rep.index == url + ".index.json"
    # (this test's own keys: a part PUT of an earlier test's aborted upload may still land in the shared log)
    puts = [p for m, p, _q, _r in s3.log if m == "PUT" and f"/{pre}/" in p]
    assert puts[-1].endswith("model.safetensors.index.json")
    assert set(s3.keys(pre)) == {k.split("/", 3)[-1] for k in [*rep.outputs, rep.index]}
    index = json.loads(s3.get_bytes(rep.index))
    assert set(index["weight_map"].values()) == {o.rsplit("/", 1)[-1] for o in rep.outputs}


@pytest.mark.parametrize("where", ["part", "complete"])
def test_failed_multipart_upload_leaves_nothing(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An upload that fails (a part refused, or the completion refused): no object, no pending upload."""
    from ckptfix.files.remote import upload
    from ckptfix.ops.convert import convert

    monkeypatch.setattr(upload, "PART_SIZE", 5 << 20)
    src = _big_checkpoint(tmp_path / "big.pt")
    key = s3.prefix("w") + "/big.safetensors"

    def fault(environ: dict) -> int | None:
        q = environ.get("QUERY_STRING", "")
        if where == "part" and environ["REQUEST_METHOD"] == "PUT" and "partNumber=2" in q:
            return 403
        if where == "complete" and environ["REQUEST_METHOD"] == "POST" and "uploadId=" in q:
            return 403
        return None

    s3.fault = fault
    with pytest.raises(RemoteWriteError, match="nothing was written"):
        convert(src, s3.url(key))
    s3.fault = None
    assert not s3.exists(key)
    assert s3.keys(key.split("/")[0]) == []
    assert [u for u in s3.pending_uploads() if u["Key"] == key] == []
    assert any("uploadId" in q for _m, _p, q, _r in s3.log), "the upload was not a multipart upload"


def test_multipart_upload_round_trip(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptfix.files.remote import upload
    from ckptfix.ops.convert import convert

    monkeypatch.setattr(upload, "PART_SIZE", 5 << 20)
    src = _big_checkpoint(tmp_path / "big.pt")
    url = s3.url(s3.prefix("w") + "/big.safetensors")
    convert(src, url)
    local = tmp_path / "big.safetensors"
    convert(src, local)
    assert s3.get_bytes(url) == local.read_bytes()
    assert any("partNumber=3" in q for _m, _p, q, _r in s3.log)


def test_cli_convert_to_s3_and_a_failed_upload(s3: S3Server, ckpt: CkptFactory) -> None:
    b = ckpt.plain()
    url = s3.url(s3.prefix("w") + "/m.safetensors")
    p = run_cli("convert", str(b.path), "-o", url)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == url
    s3.fault = lambda environ: 403 if environ["REQUEST_METHOD"] == "PUT" else None
    url2 = s3.url(s3.prefix("w") + "/m.safetensors")
    p = run_cli("convert", str(b.path), "-o", url2)
    s3.fault = None
    assert_one_line_error(p, RemoteWriteError.exit_code)
    assert "nothing was written" in p.stderr
    assert not s3.exists(url2)


def test_staging_folder_is_removed(s3: S3Server, ckpt: CkptFactory, tmp_path: Path, monkeypatch) -> None:
    from ckptfix.ops.convert import convert

    stage = tmp_path / "stage"
    stage.mkdir()
    monkeypatch.setenv("CKPTFIX_TMPDIR", str(stage))
    b = ckpt.plain()
    s3.fault = lambda environ: 403 if environ["REQUEST_METHOD"] == "PUT" else None
    with pytest.raises(RemoteWriteError):
        convert(b.path, s3.url(s3.prefix("w") + "/m.safetensors"))
    s3.fault = None
    convert(b.path, s3.url(s3.prefix("w") + "/m.safetensors"))
    assert list(stage.iterdir()) == []


def test_read_write_read_in_one_process(s3: S3Server, ckpt: CkptFactory, tmp_path: Path) -> None:
    """Reading an object, replacing it with -o URL --force, reading it again: the new version, not exit 44."""
    from ckptfix import load_anywhere
    from ckptfix.ops.convert import convert

    from helpers import assert_same_tensors

    a, b = ckpt.plain("a.pt", seed=1), ckpt.plain("b.pt", seed=2)
    url = s3.url(s3.prefix("rw") + "/m.safetensors")
    convert(a.path, url)
    assert_same_tensors(load_anywhere(url), a.expected)
    convert(b.path, url, force=True)
    assert_same_tensors(load_anywhere(url), b.expected)


def test_dcp_output_to_s3_metadata_last(s3: S3Server, ckpt: CkptFactory, tmp_path: Path) -> None:
    """``-o s3://.../run.dcp``: the folder's data files, then its .metadata; it loads back as the source."""
    from ckptfix import load_anywhere
    from ckptfix.ops.convert import convert

    from helpers import assert_same_tensors

    b = ckpt.safetensors()
    pre = s3.prefix("dcp")
    url = s3.url(pre + "/run.dcp")
    s3.reset_counts()
    rep = convert(b.path, url, shards=2)
    assert rep.outputs == [url]
    keys = s3.keys(pre)
    assert f"{pre}/run.dcp/.metadata" in keys and any(k.endswith(".distcp") for k in keys)
    # (this test's own keys: a part PUT of an earlier test's aborted upload may still land in the shared log)
    puts = [p for m, p, _q, _r in s3.log if m == "PUT" and f"/{pre}/" in p]
    assert puts[-1].endswith("/run.dcp/.metadata")
    assert_same_tensors(load_anywhere(url), load_anywhere(b.path))


def test_interrupted_multipart_upload_is_aborted(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the middle of the parts: the multipart upload is aborted (no parts kept), no object."""
    import s3fs

    from ckptfix.files.remote import upload
    from ckptfix.ops.convert import convert

    monkeypatch.setattr(upload, "PART_SIZE", 5 << 20)
    src = _big_checkpoint(tmp_path / "big.pt")
    key = s3.prefix("int") + "/big.safetensors"
    original = s3fs.S3FileSystem._upload_file_part_concurrent

    started = threading.Event()

    async def slow_parts(self, *a, **k):  # type: ignore[no-untyped-def]
        started.set()  # the multipart upload exists now; the user presses Ctrl-C while the parts go up
        await asyncio.sleep(20)
        return await original(self, *a, **k)

    monkeypatch.setattr(s3fs.S3FileSystem, "_upload_file_part_concurrent", slow_parts)
    threading.Thread(target=lambda: started.wait(30) and _thread.interrupt_main(), daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        convert(src, s3.url(key))
    assert not s3.exists(key)
    assert [u for u in s3.pending_uploads() if u["Key"] == key] == []


_UPLOAD_PEAK = r"""
import os, sys, tracemalloc
from ckptfix.files.remote import upload
upload.PART_SIZE = 5 << 20
from ckptfix.files.remote.url import filesystem
filesystem(sys.argv[2])  # the driver imported and its client made before the count starts
tracemalloc.start()
upload.commit_file(sys.argv[1], sys.argv[2])
print(tracemalloc.get_traced_memory()[1])
"""


def test_a_multipart_upload_holds_a_few_parts_not_the_file(s3: S3Server, tmp_path: Path) -> None:
    """A 64 MiB file in 5 MiB parts (issue #33 §5b): the uploading process's Python allocations peak at a few
    parts, whatever the file's size (measured in a subprocess: moto's server in this one holds the parts), and the
    object is bit-equal, in parts."""
    import os
    import subprocess
    import sys

    local = tmp_path / "big.bin"
    local.write_bytes(os.urandom(64 << 20))
    url = s3.url(s3.prefix("rss") + "/big.bin")
    env = {**os.environ, **s3.env(), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run(
        [sys.executable, "-c", _UPLOAD_PEAK, str(local), url], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    peak = int(r.stdout.split()[-1])
    # 2 parts in flight, each read once and copied about twice on its way out (botocore, aiohttp): 34 MiB here,
    # the same for 20 or 128 MiB; s3fs' default held 10 parts at once (116 MiB for this file)
    assert peak < 8 * (5 << 20), f"peak {peak / 2**20:.0f} MiB for 5 MiB parts"
    assert s3.get_bytes(url) == local.read_bytes()
    assert any("partNumber=13" in q for _m, _p, q, _r in s3.log)
    local.unlink()
