"""strip-prefix / add-prefix / align / sanitize with a URL input or a URL output (issue #26: every command
takes URLs): the object is staged locally (one pinned version), the local rewrite runs, nothing is left."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import CkptFactory, assert_one_line_error, run_cli
from s3server import S3Server

pytest.importorskip("s3fs")


def _no_stage_left(*dirs: Path) -> None:
    for d in dirs:
        assert not list(Path(d).glob("ckptfix-stage-*")), list(Path(d).iterdir())


def test_strip_prefix_of_a_url_is_the_local_rewrite(s3: S3Server, ckpt: CkptFactory, tmp_path: Path) -> None:
    from ckptfix.ops.rewrite.keys import strip_prefix_checkpoint

    b = ckpt.dataparallel()
    url = s3.put_bytes(s3.prefix("r") + "/ddp.pth", Path(b.path).read_bytes())
    rep = strip_prefix_checkpoint(url, output=str(tmp_path / "remote.pth"))
    assert rep.source == url and rep.changed
    local = strip_prefix_checkpoint(b.path, output=str(tmp_path / "local.pth"))
    assert local.changed
    assert (tmp_path / "remote.pth").read_bytes() == (tmp_path / "local.pth").read_bytes()
    _no_stage_left(tmp_path)


def test_cli_default_output_of_a_url_is_here(s3: S3Server, ckpt: CkptFactory, tmp_path: Path) -> None:
    b = ckpt.dataparallel()
    url = s3.put_bytes(s3.prefix("r") + "/ddp.pth", Path(b.path).read_bytes())
    r = run_cli("strip-prefix", url, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ddp.stripped.pth").is_file()
    _no_stage_left(tmp_path)


def test_rewrite_into_s3_uploads_the_verified_output(s3: S3Server, ckpt: CkptFactory, tmp_path: Path) -> None:
    from ckptfix.ops.rewrite.keys import strip_prefix_checkpoint

    b = ckpt.dataparallel()
    out = s3.url(s3.prefix("w") + "/fixed.pth")
    rep = strip_prefix_checkpoint(b.path, output=out)
    assert rep.output == out
    strip_prefix_checkpoint(b.path, output=str(tmp_path / "local.pth"))
    assert s3.get_bytes(out) == (tmp_path / "local.pth").read_bytes()
    r = run_cli("strip-prefix", b.path, "-o", out)  # exists now: --force to replace
    assert_one_line_error(r, 9)
    _no_stage_left(tmp_path, Path(b.path).parent)


def test_in_place_and_folders_at_urls_are_refused(s3: S3Server, ckpt: CkptFactory) -> None:
    b = ckpt.dataparallel()
    pre = s3.prefix("r")
    url = s3.put_bytes(pre + "/ddp.pth", Path(b.path).read_bytes())
    assert_one_line_error(run_cli("strip-prefix", url, "--in-place"), 8)
    idx = s3.put_bytes(pre + "/model.safetensors.index.json", b'{"weight_map": {"a": "m.safetensors"}}')
    r = run_cli("strip-prefix", idx, "-o", os.devnull + ".x")
    assert_one_line_error(r, 8)
    assert "ckptfix convert" in r.stderr


def test_sanitize_of_a_url(s3: S3Server, ckpt: CkptFactory, tmp_path: Path) -> None:
    from ckptfix.ops.sanitize import sanitize_checkpoint

    b = ckpt.lightning()
    url = s3.put_bytes(s3.prefix("r") + "/model.ckpt", Path(b.path).read_bytes())
    rep = sanitize_checkpoint(url, str(tmp_path / "remote.ckpt"))
    loc = sanitize_checkpoint(b.path, str(tmp_path / "local.ckpt"))
    assert rep.source == url and (rep.output is None) == (loc.output is None)
    if loc.output is not None:
        assert (tmp_path / "remote.ckpt").read_bytes() == (tmp_path / "local.ckpt").read_bytes()
    _no_stage_left(tmp_path)
