"""``convert ... -o s3://... --force`` over an existing sharded or DCP checkpoint (issue #33 §2).

A store has no rename: the new objects go under names that do not collide with the old version's, the index
(``.metadata``) last, the old objects are deleted only after it.  Each test fails (or SIGKILLs) the upload at
every mutating request against moto's S3 server and checks, with the framework's own loaders (safetensors over
the index's weight_map; torch's DCP loader over a copy of the folder), that the old version or the new one loads,
whole, never a mix and never neither.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import REPO, assert_one_line_error
from s3server import S3Server

pytest.importorskip("s3fs")
torch = pytest.importorskip("torch")

from ckptfix.errors import RemoteWriteError  # noqa: E402

MUTATING = ("PUT", "POST", "DELETE")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, generator=g) for i in range(6)}


def _save(tmp: Path, seed: int) -> Path:
    from safetensors.torch import save_file

    p = tmp / f"v{seed}.safetensors"
    save_file(_state(seed), str(p))
    return p


def _load_sharded(s3: S3Server, index_url: str) -> dict[str, Any]:
    """The framework's reading of a sharded checkpoint: the index's weight_map, each shard by safetensors."""
    from safetensors.torch import load

    index = json.loads(s3.get_bytes(index_url))
    base = index_url.rsplit("/", 1)[0]
    out: dict[str, Any] = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = load(s3.get_bytes(f"{base}/{shard}"))
        out.update(part)
    assert set(out) == set(index["weight_map"]), "the index names tensors its shards do not hold"
    return out


def _load_dcp(s3: S3Server, url: str, tmp: Path) -> dict[str, Any]:
    """torch's DCP loader over a local copy of the folder's objects."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    d = tmp / f"dl-{os.urandom(4).hex()}"
    d.mkdir()
    prefix = url[len("s3://") :].split("/", 1)[1]
    for key in s3.keys(prefix):
        (d / key[len(prefix) + 1 :]).write_bytes(s3.get_bytes(key))
    dcp_to_torch_save(str(d), str(tmp / "flat.pt"))
    return dict(torch.load(tmp / "flat.pt", weights_only=True))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _which(got: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> str:
    if _same(got, old):
        return "old"
    if _same(got, new):
        return "new"
    raise AssertionError("the store holds neither the old version nor the new one")


def _mutations(s3: S3Server, pre: str) -> int:
    return sum(1 for m, p, _q, _r in s3.log if m in MUTATING and f"/{pre}/" in p)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    e = {**os.environ, "PYTHONPATH": str(REPO), "CKPTFIX_REMOTE_BACKOFF": "0", "CKPTFIX_REMOTE_RETRIES": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "ckptfix", *args],
        env={**e, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


KINDS = ["sharded", "dcp"]


def _target(s3: S3Server, kind: str) -> tuple[str, str, list[str]]:
    pre = s3.prefix("ow")
    if kind == "sharded":
        return pre, s3.url(pre + "/model.safetensors"), ["--max-shard-size", "600"]
    return pre, s3.url(pre + "/run.dcp"), ["--to", "dcp", "--shards", "2"]


def _read(s3: S3Server, kind: str, url: str, tmp: Path) -> dict[str, Any]:
    return _load_sharded(s3, url + ".index.json") if kind == "sharded" else _load_dcp(s3, url, tmp)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_overwrite_leaves_the_old_version_at_every_step(s3: S3Server, tmp_path: Path, kind: str) -> None:
    old, new = _save(tmp_path, 1), _save(tmp_path, 2)
    pre, url, opts = _target(s3, kind)
    p = _cli("convert", str(old), "-o", url, *opts)
    assert p.wait(120) == 0, p.communicate()[1]
    v_old, v_new = _state(1), _state(2)
    assert _which(_read(s3, kind, url, tmp_path), v_old, v_new) == "old"
    # how many mutating requests a whole overwrite makes; then back to the old version
    s3.reset_counts()
    p = _cli("convert", str(new), "-o", url, *opts, "--force")
    assert p.wait(120) == 0, p.communicate()[1]
    steps = _mutations(s3, pre)
    assert _which(_read(s3, kind, url, tmp_path), v_old, v_new) == "new"
    assert steps >= 3
    p = _cli("convert", str(old), "-o", url, *opts, "--force")
    assert p.wait(120) == 0, p.communicate()[1]
    seen = set()
    for n in range(1, steps + 1):
        count = [0]

        def fault(environ: dict[str, Any], n: int = n, count: list[int] = count) -> int | None:
            if environ["REQUEST_METHOD"] in MUTATING and f"/{pre}/" in environ.get("PATH_INFO", ""):
                count[0] += 1
                if count[0] == n:
                    return 403
            return None

        s3.fault = fault
        p = _cli("convert", str(new), "-o", url, *opts, "--force")
        out, err = p.communicate(timeout=120)
        s3.fault = None
        got = _which(_read(s3, kind, url, tmp_path), v_old, v_new)
        seen.add(got)
        if p.returncode != 0:
            assert p.returncode == RemoteWriteError.exit_code, err
            assert err.startswith("Error: ") and err.count("\n") == 1, err
            if got == "old":
                assert "the old version" in err and "untouched" in err, err
        else:
            assert got == "new"
        if got == "new":  # back to the old version for the next step
            p = _cli("convert", str(old), "-o", url, *opts, "--force")
            assert p.wait(120) == 0, p.communicate()[1]
            assert _which(_read(s3, kind, url, tmp_path), v_old, v_new) == "old"
    assert "old" in seen


@pytest.mark.parametrize("kind", KINDS)
def test_a_killed_overwrite_leaves_one_whole_version_at_every_step(s3: S3Server, tmp_path: Path, kind: str) -> None:
    old, new = _save(tmp_path, 1), _save(tmp_path, 2)
    pre, url, opts = _target(s3, kind)
    p = _cli("convert", str(old), "-o", url, *opts)
    assert p.wait(120) == 0, p.communicate()[1]
    v_old, v_new = _state(1), _state(2)
    s3.reset_counts()
    p = _cli("convert", str(new), "-o", url, *opts, "--force")
    assert p.wait(120) == 0, p.communicate()[1]
    steps = _mutations(s3, pre)
    p = _cli("convert", str(old), "-o", url, *opts, "--force")
    assert p.wait(120) == 0
    seen = []
    for n in range(1, steps + 1):
        count = [0]
        box: dict[str, Any] = {}

        def fault(
            environ: dict[str, Any], n: int = n, count: list[int] = count, box: dict[str, Any] = box
        ) -> int | None:
            if environ["REQUEST_METHOD"] in MUTATING and f"/{pre}/" in environ.get("PATH_INFO", ""):
                count[0] += 1
                if count[0] == n:
                    box["p"].send_signal(signal.SIGKILL)
                    box["p"].wait(30)
                    return 503
            return None

        s3.fault = fault
        box["p"] = p = _cli("convert", str(new), "-o", url, *opts, "--force")
        p.communicate(timeout=120)
        s3.fault = None
        got = _which(_read(s3, kind, url, tmp_path), v_old, v_new)
        seen.append(got)
        if got == "new":
            p = _cli("convert", str(old), "-o", url, *opts, "--force")
            assert p.wait(120) == 0, p.communicate()[1]
    assert "old" in seen, seen


def test_the_old_shards_are_deleted_after_a_complete_overwrite(s3: S3Server, tmp_path: Path) -> None:
    """Once the new index is committed, the old version's shards go; objects the old index never named stay."""
    old, new = _save(tmp_path, 1), _save(tmp_path, 2)
    pre, url, opts = _target(s3, "sharded")
    assert _cli("convert", str(old), "-o", url, *opts).wait(120) == 0
    s3.put_bytes(pre + "/README.md", b"mine")
    for src in (new, old, new):
        p = _cli("convert", str(src), "-o", url, *opts, "--force")
        assert p.wait(120) == 0, p.communicate()[1]
        index = json.loads(s3.get_bytes(url + ".index.json"))
        names = {f"{pre}/{n}" for n in index["weight_map"].values()}
        assert set(s3.keys(pre)) == names | {f"{pre}/model.safetensors.index.json", f"{pre}/README.md"}
    assert _same(_load_sharded(s3, url + ".index.json"), _state(2))


def test_a_failed_dcp_overwrite_error_says_what_is_left(s3: S3Server, tmp_path: Path) -> None:
    old, new = _save(tmp_path, 1), _save(tmp_path, 2)
    pre, url, opts = _target(s3, "dcp")
    assert _cli("convert", str(old), "-o", url, *opts).wait(120) == 0
    s3.fault = lambda e: 403 if e["REQUEST_METHOD"] == "PUT" and e["PATH_INFO"].endswith("/.metadata") else None
    p = _cli("convert", str(new), "-o", url, *opts, "--force")
    out, err = p.communicate(timeout=120)
    s3.fault = None

    class R:
        returncode = p.returncode
        stderr = err
        stdout = out

    assert_one_line_error(R, RemoteWriteError.exit_code)  # type: ignore[arg-type]
    assert "the old version" in err and "untouched" in err
    assert _same(_load_dcp(s3, url, tmp_path), _state(1))
    assert set(s3.keys(pre)) == {k for k in s3.keys(pre)}  # listing works
    assert not [k for k in s3.keys(pre) if ".v" in k.rsplit("/", 1)[-1]], "this run's objects were left"
