"""Remote checkpoints without torch (issue #26): ``pip install ".[remote]"`` against moto's S3 server.

.ci/run runs this file in a venv with only the ``[remote]`` extra, ``moto[server]`` and pytest (no torch, no
numpy); the CLI subprocesses block torch in the main venv too.  Skipped when s3fs or moto are absent.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Iterator

import pytest
from notorch_helpers import CKPT, clean_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the S3 server helper
from s3server import S3Server, have_s3

pytestmark = pytest.mark.skipif(not have_s3(), reason='needs s3fs and moto[server] (pip install ".[remote]")')

INPUTS = ["ddp.pth", "legacy.pth", "lightning.ckpt", "model.safetensors", "sharded"]


@pytest.fixture(scope="module")
def srv() -> Iterator[S3Server]:
    with S3Server() as s:
        for name in INPUTS:
            s.upload(CKPT / name, f"fixtures/{name}")
        yield s


def _url(srv: S3Server, name: str) -> str:
    if name == "sharded":
        idx = next(p.name for p in (CKPT / "sharded").iterdir() if p.name.endswith(".index.json"))
        return srv.url(f"fixtures/sharded/{idx}")
    return srv.url(f"fixtures/{name}")


def _local(name: str) -> Path:
    if name == "sharded":
        return next(p for p in (CKPT / "sharded").iterdir() if p.name.endswith(".index.json"))
    return CKPT / name


@pytest.mark.parametrize("name", INPUTS)
def test_convert_from_s3_is_the_local_conversion(cli, srv: S3Server, tmp_path: Path, name: str) -> None:
    env = clean_env(tmp_path, **srv.env())
    remote = cli("convert", _url(srv, name), "-o", "remote.safetensors", "--stats", env=env)
    assert remote.rc == 0, remote.err
    assert re.search(r"^read [\d,]+ bytes in [\d,]+ requests?", remote.err, re.M), remote.err
    local = cli("convert", str(_local(name)), "-o", "local.safetensors", env=env)
    assert local.rc == 0, local.err
    assert (cli.work / "remote.safetensors").read_bytes() == (cli.work / "local.safetensors").read_bytes()
    assert not [p for p in cli.work.iterdir() if p.name not in ("remote.safetensors", "local.safetensors")]


def test_convert_from_s3_jobs_and_json_stats(cli, srv: S3Server, tmp_path: Path) -> None:
    env = clean_env(tmp_path, **srv.env())
    r = cli("convert", _url(srv, "ddp.pth"), "-o", "j.safetensors", "--jobs", "4", "--stats", "--json", env=env)
    assert r.rc == 0, r.err
    stats = r.json()["stats"]
    assert stats["requests"] >= 1 and stats["bytes_read"] > 0
    one = cli("convert", str(CKPT / "ddp.pth"), "-o", "one.safetensors", env=env)
    assert one.rc == 0, one.err
    assert (cli.work / "j.safetensors").read_bytes() == (cli.work / "one.safetensors").read_bytes()


def test_convert_to_s3(cli, srv: S3Server, tmp_path: Path) -> None:
    env = clean_env(tmp_path, **srv.env())
    url = srv.url(srv.prefix("out") + "/ddp.safetensors")
    r = cli("convert", str(CKPT / "ddp.pth"), "-o", url, env=env)
    assert r.rc == 0, r.err
    assert r.out.strip() == url
    local = cli("convert", str(CKPT / "ddp.pth"), "-o", "ddp.safetensors", env=env)
    assert local.rc == 0, local.err
    assert srv.get_bytes(url) == (cli.work / "ddp.safetensors").read_bytes()


def test_missing_object_is_one_line(cli, srv: S3Server, tmp_path: Path) -> None:
    env = clean_env(tmp_path, **srv.env())
    r = cli("convert", srv.url("fixtures/nope.pth"), "-o", "x.safetensors", env=env)
    assert r.rc == 40, r.err
    assert r.err.startswith("Error: ") and len(r.err.strip().splitlines()) == 1, r.err
    assert not (cli.work / "x.safetensors").exists()
