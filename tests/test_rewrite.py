"""strip-prefix / add-prefix / align on disk: content preserved, atomic output, crash safety, round trips."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ckptfix.cli import main
from ckptfix.errors import KeyConflictError, OutputError
from ckptfix.ops.inspect import inspect_checkpoint
from ckptfix.ops.prefixes import strip_prefix_report
from ckptfix.ops.rewrite import rewrite_checkpoint

from helpers import (
    IS_ROOT,
    TinyNet,
    assert_one_line_error,
    assert_same_tensors,
    run_cli,
    sample_input,
    sha256,
    tiny_model,
)

pytestmark = pytest.mark.filterwarnings("ignore")

SHARDED = Path(__file__).parent / "fixtures" / "ckpt" / "sharded"


LAYOUTS = ["top", "nested"]


def _save_layout(sd, path, layout, legacy=False):
    obj = sd if layout == "top" else {"model": sd, "epoch": 1}
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)


def _sd_of(obj, layout):
    if layout == "nested":
        assert obj["epoch"] == 1
        return obj["model"]
    return obj


def _stripped(expected, prefix):
    return {k[len(prefix) :]: v for k, v in expected.items()}


def _tload(path, **kw):
    return torch.load(path, weights_only=True, map_location="cpu", **kw)


def _cli(capsys, *args):
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _dir_listing(d):
    return sorted(os.listdir(d))


# --------------------------------------------------------------------------- strip-prefix per format


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_strip_training_checkpoint_preserves_everything(ckpt, capsys, legacy):
    b = ckpt.wrapped(legacy=legacy)
    h0 = sha256(b.path)
    rc, out, err = _cli(capsys, "strip-prefix", b.path)
    assert rc == 0, err
    dst = Path(out.strip())
    assert dst == b.path.with_name("wrapped.stripped.pt")
    assert "stripped 'module.'" in err
    assert sha256(b.path) == h0  # input untouched
    obj = _tload(dst, mmap=True)  # zip output, mmap-able, weights_only-clean
    assert_same_tensors(obj["model"], _stripped(b.expected, "module."))
    assert obj["epoch"] == 5 and obj["best"] == 0.25 and obj["note"] == "hi"
    opt = obj["optimizer"]
    want = b.extra["optimizer"]
    assert opt["param_groups"] == want["param_groups"]
    for sid, st in want["state"].items():
        assert torch.equal(opt["state"][sid]["momentum_buffer"], st["momentum_buffer"])
    meta = obj["model"]._metadata
    assert "fc1" in meta and "bn" in meta and not any(k.startswith("module") for k in meta)
    assert meta["bn"] == {"version": 2}
    m = TinyNet().eval()
    m.load_state_dict(obj["model"], strict=True)
    x = sample_input()
    assert torch.equal(m(x), b.model(x))
    if legacy:
        assert inspect_checkpoint(dst).format == "torch-zip"
    import zipfile

    with zipfile.ZipFile(dst) as zf:
        assert zf.testzip() is None  # every record's CRC-32 right (computed while copying, for legacy input)


def test_strip_lightning_ckpt(ckpt, capsys):
    b = ckpt.lightning()
    h0 = sha256(b.path)
    rc, out, err = _cli(capsys, "strip-prefix", b.path)
    assert rc == 0, err
    dst = Path(out.strip())
    assert dst.name == "lit.stripped.ckpt"
    assert sha256(b.path) == h0
    obj = torch.load(dst, weights_only=False, mmap=True)  # Namespace needs weights_only=False
    assert_same_tensors(obj["state_dict"], _stripped(b.expected, "model."))
    assert obj["epoch"] == 3 and obj["global_step"] == 120
    assert obj["pytorch-lightning_version"] == "2.1.0"
    assert obj["optimizer_states"][0]["param_groups"][0]["lr"] == 0.01
    import argparse

    assert obj["hyper_parameters"] == argparse.Namespace(lr=0.01, hidden=3, name="tiny")
    assert not any(k.startswith("model") for k in obj["state_dict"]._metadata)


def test_strip_safetensors(ckpt, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    b = ckpt.safetensors("m.safetensors", prefix="module.", metadata={"format": "pt", "who": "me"})
    h0 = sha256(b.path)
    rc, out, err = _cli(capsys, "strip-prefix", b.path)
    assert rc == 0, err
    dst = Path(out.strip())
    assert dst.name == "m.stripped.safetensors"
    assert sha256(b.path) == h0
    assert_same_tensors(load_file(str(dst)), _stripped(b.expected, "module."))
    with safe_open(str(dst), "pt") as f:
        assert f.metadata() == {"format": "pt", "who": "me"}


def test_rewrites_keep_data_at_its_place_in_the_page(ckpt, capsys, tmp_path):
    """The copied region keeps its offsets modulo 64 KiB (kernel copies whole folios) and 64-byte alignment."""
    import zipfile

    from ckptfix.formats.safetensors_fmt import read_header

    b = ckpt.dataparallel()
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "-o", tmp_path / "s.pt")
    assert rc == 0, err

    def data_offsets(path):
        with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
            offs = {}
            for i in zf.infolist():
                f.seek(i.header_offset + 26)
                n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                offs[i.filename.split("/", 1)[1]] = i.header_offset + 30 + n + m
            return offs

    old, new = data_offsets(b.path), data_offsets(tmp_path / "s.pt")
    records = [k for k in old if k.startswith("data/")]
    assert records
    for k in records:
        assert new[k] % 64 == 0 and (new[k] - old[k]) % 65536 == 0, k
    torch.load(tmp_path / "s.pt", mmap=True, weights_only=True)

    s = ckpt.safetensors("m.safetensors", prefix="module.")
    rc, out, err = _cli(capsys, "strip-prefix", s.path, "-o", tmp_path / "s.safetensors")
    assert rc == 0, err
    (_, a), (_, c) = read_header(str(s.path)), read_header(str(tmp_path / "s.safetensors"))
    assert (c - a) % 65536 == 0 and c % 8 == 0


def test_strip_safetensors_map_location_is_refused(ckpt, capsys):
    b = ckpt.safetensors("m.safetensors", prefix="module.")
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "--map-location", "cpu")
    assert rc == 8 and err.startswith("Error: ")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_strip_keeps_tied_storage_shared(ckpt, capsys, tmp_path, legacy, layout):
    torch.manual_seed(0)
    src = ckpt.tied(legacy=legacy)
    # wrap it like DataParallel would
    sd = torch.load(src.path, weights_only=True)
    wrapped = {"module." + k: v for k, v in sd.items()}
    p = tmp_path / "tied_dp.pt"
    _save_layout(wrapped, p, layout, legacy)
    rc, out, err = _cli(capsys, "strip-prefix", p)
    assert rc == 0, err
    got = _sd_of(_tload(out.strip(), mmap=True), layout)
    assert_same_tensors(got, src.expected)
    assert got["emb.weight"].data_ptr() == got["head.weight"].data_ptr()
    assert inspect_checkpoint(out.strip()).shared == [["emb.weight", "head.weight"]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strip_keeps_dtypes(ckpt, capsys, tmp_path, layout):
    sd = {
        "module.h": torch.randn(3).half(),
        "module.b": torch.randn(3).bfloat16(),
        "module.i8": torch.arange(4, dtype=torch.int8),
        "module.bool": torch.tensor([True, False]),
        "module.d": torch.randn(2).double(),
        "module.c": torch.randn(2, dtype=torch.complex64),
        "module.view": torch.arange(10.0)[2:7:2],
    }
    p = tmp_path / "dtypes.pt"
    _save_layout(sd, p, layout)
    rc, out, err = _cli(capsys, "strip-prefix", p)
    assert rc == 0, err
    got = _sd_of(_tload(out.strip(), mmap=True), layout)
    assert_same_tensors(got, _stripped(sd, "module."))
    assert got["view"].stride() == (2,)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_strip_keeps_cuda_tags_unless_map_location(ckpt, capsys, tmp_path, legacy, layout):
    from helpers import Built, tagged

    m = tiny_model()
    sd = nn.DataParallel(m).state_dict()
    b = Built(tmp_path / "c0.pt", {k: v.clone() for k, v in sd.items()}, m)
    with tagged("cuda:0"):
        _save_layout(sd, b.path, layout, legacy)
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "-o", tmp_path / "kept.pt")
    assert rc == 0, err
    assert inspect_checkpoint(tmp_path / "kept.pt").locations == {"cuda:0": 9}
    # kept, and said (plain torch.load of the output fails on a CPU box): issue #38 item 4
    assert "note: storages stay on cuda:0; pass --map-location cpu to retag\n" in err
    assert out.strip() == str(tmp_path / "kept.pt")  # stdout stays the path alone
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "-o", tmp_path / "cpu.pt", "--map-location", "cpu")
    assert rc == 0, err
    assert "cuda:0 -> cpu" in err
    assert "storages stay" not in err
    assert inspect_checkpoint(tmp_path / "cpu.pt").locations == {"cpu": 9}
    got = _sd_of(_tload(tmp_path / "cpu.pt", mmap=True), layout)  # loads without CUDA
    assert_same_tensors(got, _stripped(b.expected, "module."))
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "-o", tmp_path / "map.pt", "--map-location", "cuda:0=cuda:3")
    assert rc == 0, err
    assert inspect_checkpoint(tmp_path / "map.pt").locations == {"cuda:3": 9}


def test_kept_cuda_tags_are_said_by_add_prefix_sharded_and_sanitize(capsys, tmp_path):
    """Every rewrite that keeps CUDA tags says so, in --json's notes too (issue #38 item 4)."""
    import argparse

    from helpers import tagged

    sd = tiny_model().state_dict()
    with tagged("cuda:3"):
        torch.save(sd, tmp_path / "c3.pt")
        torch.save({"model": sd, "args": argparse.Namespace(lr=0.1)}, tmp_path / "ns.pt")
    rc, out, err = _cli(capsys, "add-prefix", tmp_path / "c3.pt", "--prefix", "module.", "--json")
    assert rc == 0, err
    assert "storages stay on cuda:3; pass --map-location cpu to retag" in json.loads(out)["notes"]
    rc, out, err = _cli(capsys, "sanitize", tmp_path / "ns.pt")
    assert rc == 0, err
    assert "note: storages stay on cuda:3; torch.load needs map_location='cpu' where that device is missing" in err
    shards = tmp_path / "sh"
    shards.mkdir()
    names = list(sd)
    with tagged("cuda:1"):
        torch.save({k: sd[k] for k in names[:4]}, shards / "pytorch_model-00001-of-00002.bin")
        torch.save({k: sd[k] for k in names[4:]}, shards / "pytorch_model-00002-of-00002.bin")
    wm = {k: f"pytorch_model-0000{1 if i < 4 else 2}-of-00002.bin" for i, k in enumerate(names)}
    (shards / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    rc, out, err = _cli(
        capsys, "add-prefix", shards / "pytorch_model.bin.index.json", "--prefix", "m.", "-o", tmp_path / "out"
    )
    assert rc == 0, err
    assert "note: storages stay on cuda:1; pass --map-location cpu to retag" in err


def test_map_location_only_rewrites_tags(ckpt, capsys, tmp_path):
    b = ckpt.cuda_tagged("c7.pt", device="cuda:7")  # no prefix: only tags change
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "--map-location", "cpu")
    assert rc == 0, err
    got = _tload(out.strip())
    assert_same_tensors(got, b.expected)


# --------------------------------------------------------------------------- output handling


def test_output_option_and_force(ckpt, capsys, tmp_path):
    b = ckpt.dataparallel()
    dst = tmp_path / "out" / "x.pt"
    dst.parent.mkdir()
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "-o", dst)
    assert rc == 0 and out.strip() == str(dst)
    h1 = sha256(dst)
    dst.write_bytes(b"old")
    before = _dir_listing(dst.parent)
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "-o", dst)
    assert rc == 9 and "--force" in err and out == ""
    assert dst.read_bytes() == b"old" and _dir_listing(dst.parent) == before
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "-o", dst, "--force")
    assert rc == 0 and sha256(dst) == h1


def test_output_equal_to_input_is_refused(ckpt, capsys):
    b = ckpt.dataparallel()
    h0 = sha256(b.path)
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "-o", b.path, "--force")
    assert rc == 9 and "--in-place" in err
    assert sha256(b.path) == h0


def test_default_output_refuses_to_overwrite(ckpt):
    b = ckpt.dataparallel()
    p = run_cli("strip-prefix", b.path)
    assert p.returncode == 0 and p.stdout.strip().endswith("dp.stripped.pt")
    p = run_cli("strip-prefix", b.path)
    assert_one_line_error(p, 9)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_in_place_keeps_backup(ckpt, capsys, layout):
    b = ckpt.dataparallel()
    _save_layout(torch.load(b.path, weights_only=True), b.path, layout)
    h0 = sha256(b.path)
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "--in-place")
    assert rc == 0, err
    assert out.strip() == str(b.path)
    bak = Path(str(b.path) + ".bak")
    assert bak.exists() and sha256(bak) == h0
    assert_same_tensors(_sd_of(_tload(b.path, mmap=True), layout), _stripped(b.expected, "module."))
    assert not [n for n in os.listdir(b.path.parent) if n.endswith(".tmp")]
    # a second in-place run on the already stripped file changes nothing
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "--in-place")
    assert rc == 0 and "nothing to change" in err


def test_in_place_second_backup_gets_new_name(ckpt, capsys, tmp_path):
    b = ckpt.dataparallel()
    Path(str(b.path) + ".bak").write_bytes(b"older backup")
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "--in-place")
    assert rc == 0
    assert Path(str(b.path) + ".bak").read_bytes() == b"older backup"
    assert Path(str(b.path) + ".bak1").exists()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_in_place_no_backup(ckpt, capsys, layout):
    b = ckpt.dataparallel()
    _save_layout(torch.load(b.path, weights_only=True), b.path, layout)
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "--in-place", "--no-backup")
    assert rc == 0, err
    assert _dir_listing(b.path.parent) == ["dp.pt"]
    assert_same_tensors(_sd_of(_tload(b.path), layout), _stripped(b.expected, "module."))


def test_output_dir_missing_exit_9(ckpt, tmp_path):
    b = ckpt.dataparallel()
    p = run_cli("strip-prefix", b.path, "-o", tmp_path / "no" / "such" / "dir" / "x.pt")
    assert_one_line_error(p, 9)
    assert "does not exist" in p.stderr


@pytest.mark.skipif(IS_ROOT, reason="root ignores directory permissions")
def test_unwritable_output_dir_exit_9(ckpt, tmp_path):
    b = ckpt.dataparallel()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        p = run_cli("strip-prefix", b.path, "-o", ro / "x.pt")
        assert_one_line_error(p, 9)
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o700)


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize(
    "builder,kw",
    [("dataparallel", {}), ("dataparallel", {"legacy": True}), ("safetensors", {"prefix": "module."})],
    ids=["zip", "legacy", "safetensors"],
)
@pytest.mark.parametrize("in_place", [False, True], ids=["output", "in-place"])
def test_disk_full_leaves_nothing_behind(ckpt, monkeypatch, builder, kw, in_place):
    b = getattr(ckpt, builder)(**kw)
    d = b.path.parent
    h0 = sha256(b.path)
    before = _dir_listing(d)
    monkeypatch.setattr(os, "copy_file_range", _enospc, raising=False)
    monkeypatch.setattr(os, "pwrite", _enospc)
    with pytest.raises(OutputError, match="space"):
        rewrite_checkpoint(str(b.path), lambda sd: strip_prefix_report(sd), in_place=in_place)
    assert _dir_listing(d) == before  # no partial output, no temp file, no backup
    assert sha256(b.path) == h0


def test_disk_full_on_plain_write(ckpt, monkeypatch):
    """ENOSPC from an ordinary write() (the pickle / header part) is an OutputError too."""
    import io

    b = ckpt.dataparallel()
    d = b.path.parent
    before = _dir_listing(d)
    real_fdopen = os.fdopen

    class Full(io.BufferedRandom):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def fdopen(fd, mode="r", *a, **k):
        f = real_fdopen(fd, mode, *a, **k)
        if "w" in mode:
            raw = f.detach()
            return Full(raw)
        return f

    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(OutputError):
        rewrite_checkpoint(str(b.path), lambda sd: strip_prefix_report(sd))
    assert _dir_listing(d) == before


# --------------------------------------------------------------------------- crash safety


@pytest.fixture(scope="module")
def big_dp_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    g = torch.Generator().manual_seed(0)
    sd = {f"module.layer{i}.weight": torch.randn(4 << 20, generator=g) for i in range(6)}  # ~96 MiB
    p = d / "big.pt"
    torch.save({"model": sd, "epoch": 1}, p)
    return p, sha256(p), {k[len("module.") :]: v for k, v in sd.items()}


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.6])
def test_in_place_survives_sigkill(big_dp_ckpt, tmp_path, delay):
    src, h0, stripped = big_dp_ckpt
    p = tmp_path / "big.pt"
    shutil.copyfile(src, p)
    from helpers import cli_argv

    proc = subprocess.Popen(
        cli_argv("strip-prefix", str(p), "--in-place"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=600)
    assert p.exists()
    if sha256(p) != h0:  # the rename happened: it must be the complete stripped file
        got = _tload(p, mmap=True)["model"]
        assert sorted(got) == sorted(stripped)
        for k, v in stripped.items():
            assert torch.equal(got[k], v), k
    else:
        got = _tload(p, mmap=True)["model"]
        assert len(got) == len(stripped)
    bak = Path(str(p) + ".bak")
    if bak.exists():
        assert sha256(bak) == h0


# --------------------------------------------------------------------------- refusals


def test_partial_collision_exit_6_nothing_written(tmp_path, capsys):
    p = tmp_path / "col.pt"
    torch.save({"module.a": torch.ones(2), "a": torch.zeros(2), "module.b": torch.ones(1)}, p)
    before = _dir_listing(tmp_path)
    h0 = sha256(p)
    rc, out, err = _cli(capsys, "strip-prefix", p, "--partial")
    assert rc == 6, err
    assert err.startswith("Error: ") and "'a'" in err
    assert _dir_listing(tmp_path) == before and sha256(p) == h0
    with pytest.raises(KeyConflictError):
        rewrite_checkpoint(str(p), lambda sd: strip_prefix_report(sd, partial=True), in_place=True)
    assert _dir_listing(tmp_path) == before and sha256(p) == h0


def test_explicit_prefix_no_key_has(ckpt):
    b = ckpt.dataparallel()
    p = run_cli("strip-prefix", b.path, "--prefix", "encoder.")
    assert_one_line_error(p, 6)
    assert "encoder." in p.stderr and "module." in p.stderr  # says what it did find
    assert _dir_listing(b.path.parent) == ["dp.pt"]


def test_non_writable_formats_refused(ckpt, capsys):
    for b in (ckpt.torchscript(),):  # DCP directories are renamed by ckptfix.ops.rewrite.dcp (tests/test_dcp.py)
        rc, out, err = _cli(capsys, "strip-prefix", b.path)
        assert rc == 8, (b.path, err)


# --------------------------------------------------------------------------- sharded indexes


@pytest.mark.parametrize("kind", ["sharded_bin", "sharded_safetensors"])
def test_strip_sharded_index_writes_a_new_directory(ckpt, capsys, kind):
    b = getattr(ckpt, kind)(prefix="module.")
    d = b.extra["dir"]
    before = {n: sha256(d / n) for n in os.listdir(d)}
    rc, out, err = _cli(capsys, "strip-prefix", b.path)
    assert rc == 0, err
    new_idx = Path(out.strip())
    out_dir = Path(f"{d}.stripped")
    assert new_idx == out_dir / b.path.name
    assert sorted(os.listdir(out_dir)) == sorted([b.path.name, *b.extra["shards"]])  # same file names
    assert {n: sha256(d / n) for n in os.listdir(d)} == before  # input untouched
    doc = json.loads(new_idx.read_text())
    assert doc["metadata"] == {"total_size": 0}
    assert all(not k.startswith("module.") for k in doc["weight_map"])
    from ckptfix import load_anywhere

    sd = load_anywhere(str(new_idx))
    assert_same_tensors(sd, _stripped(b.expected, "module."))
    m = TinyNet().eval()
    m.load_state_dict(sd, strict=True)
    assert torch.equal(m(sample_input()), b.model.eval()(sample_input()))
    for shard in b.extra["shards"]:  # every shard still readable on its own by the usual loaders
        if shard.endswith(".bin"):
            part = torch.load(out_dir / shard, weights_only=True, mmap=True)
        else:
            from safetensors.torch import load_file

            part = load_file(str(out_dir / shard))
        assert part and all(doc["weight_map"][k] == shard for k in part)


def test_sharded_output_options(ckpt, capsys, tmp_path):
    b = ckpt.sharded_bin(prefix="module.")
    rc, out, err = _cli(capsys, "add-prefix", b.path, "--prefix", "encoder.", "-o", tmp_path / "enc")
    assert rc == 0, err
    doc = json.loads((tmp_path / "enc" / b.path.name).read_text())
    assert all(k.startswith("encoder.module.") for k in doc["weight_map"])
    rc, out, err = _cli(capsys, "add-prefix", b.path, "--prefix", "encoder.", "-o", tmp_path / "enc")
    assert rc == 9 and "--force" in err  # the directory's files exist
    rc, out, err = _cli(capsys, "add-prefix", b.path, "--prefix", "encoder.", "-o", tmp_path / "enc", "--force")
    assert rc == 0, err
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "--in-place")
    assert rc == 8 and "-o DIR" in err
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "-o", b.extra["dir"])
    assert rc == 9 and "input" in err
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "--map-location", "cpu", "-o", tmp_path / "cpu", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["format_in"] == "sharded" and rep["renamed"] == len(b.expected)


def test_sharded_failure_leaves_no_directory(ckpt, monkeypatch, tmp_path):
    import ckptfix.ops.rewrite.sharded as rw

    b = ckpt.sharded_safetensors(prefix="module.")
    calls = []
    real = rw.write_file

    def second_fails(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OutputError("disk full (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(rw, "write_file", second_fails)
    with pytest.raises(OutputError):
        rewrite_checkpoint(str(b.path), lambda sd: strip_prefix_report(sd), output=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_align_sharded_to_model(ckpt, tmp_path):
    b = ckpt.sharded_safetensors(prefix="model.")
    p = run_cli("align", b.path, "--to", ckpt.plain().path, "-o", tmp_path / "al")
    assert p.returncode == 0, p.stderr
    from ckptfix import load_anywhere

    TinyNet().load_state_dict(load_anywhere(str(tmp_path / "al" / b.path.name)), strict=True)


# --------------------------------------------------------------------------- add-prefix / align


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_add_prefix_round_trip_into_dataparallel(ckpt, capsys, legacy, layout):
    b = ckpt.plain(legacy=legacy)
    _save_layout(torch.load(b.path, weights_only=True), b.path, layout, legacy)
    rc, out, err = _cli(capsys, "add-prefix", b.path, "--prefix", "module.")
    assert rc == 0, err
    assert Path(out.strip()).name == "plain.prefixed.pt"
    dp = nn.DataParallel(TinyNet().eval())
    dp.load_state_dict(_sd_of(_tload(out.strip(), mmap=True), layout), strict=True)
    x = sample_input()
    assert torch.equal(dp.module(x), b.model(x))
    # and back
    rc, out2, err = _cli(capsys, "strip-prefix", out.strip())
    assert rc == 0
    assert_same_tensors(_sd_of(_tload(out2.strip()), layout), b.expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_align_to_checkpoint(ckpt, capsys, tmp_path, layout):
    b = ckpt.compiled()
    _save_layout(torch.load(b.path, weights_only=True), b.path, layout)
    target = ckpt.dataparallel()
    rc, out, err = _cli(capsys, "align", b.path, "--to", target.path, "-o", tmp_path / "al.pt")
    assert rc == 0, err
    got = _sd_of(_tload(tmp_path / "al.pt"), layout)
    assert sorted(got) == sorted(target.expected)
    dp = nn.DataParallel(TinyNet().eval())
    dp.load_state_dict(got, strict=True)
    assert torch.equal(dp.module(sample_input()), b.model(sample_input()))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_align_to_factory_on_pythonpath(ckpt, tmp_path, layout):
    pkg = tmp_path / "pp" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(
        "import torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc1 = nn.Linear(4, 3)\n"
        "        self.bn = nn.BatchNorm1d(3)\n"
        "        self.fc2 = nn.Linear(3, 2)\n"
        "def build():\n"
        "    return Net()\n"
        "def build_bigger():\n"
        "    n = Net()\n"
        "    n.extra = nn.Linear(2, 2)\n"
        "    return n\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "pp"), os.environ["PYTHONPATH"]])}
    b = ckpt.dataparallel()
    _save_layout(torch.load(b.path, weights_only=True), b.path, layout)
    p = run_cli("align", b.path, "--to", "mypkg.nets:build", "-o", tmp_path / "al.pt", **env)
    assert p.returncode == 0, p.stderr
    m = TinyNet().eval()
    m.load_state_dict(_sd_of(_tload(tmp_path / "al.pt"), layout), strict=True)
    assert torch.equal(m(sample_input()), b.model(sample_input()))
    # not exact: exit 10, the output is still written and the missing keys listed
    p = run_cli("align", b.path, "--to", "mypkg.nets:build_bigger", "-o", tmp_path / "al2.pt", **env)
    assert p.returncode == 10, p.stderr
    assert "Traceback" not in p.stderr and "extra.weight" in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("Error: ")
    # an unimportable factory
    p = run_cli("align", b.path, "--to", "nopkg.nets:build", "-o", tmp_path / "al3.pt", **env)
    assert_one_line_error(p, 3)


def test_align_exit_10_shape_mismatch(ckpt, tmp_path, capsys):
    b = ckpt.dataparallel()
    other = tmp_path / "other.pt"
    sd = tiny_model().state_dict()
    sd["fc2.weight"] = torch.zeros(5, 3)
    torch.save(sd, other)
    rc, out, err = _cli(capsys, "align", b.path, "--to", other, "-o", tmp_path / "al.pt")
    assert rc == 10
    assert "fc2.weight" in err


# --------------------------------------------------------------------------- wrapper round trips


def _round_trip(sd_wrapped, tmp_path, capsys, model, layout):
    p = tmp_path / "wrapped_rt.pt"
    _save_layout(sd_wrapped, p, layout)
    rc, out, err = _cli(capsys, "strip-prefix", p)
    assert rc == 0, err
    fresh = TinyNet().eval()
    fresh.load_state_dict(_sd_of(_tload(out.strip(), mmap=True), layout), strict=True)
    x = sample_input()
    assert torch.equal(fresh(x), model(x))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dataparallel_round_trip(tmp_path, capsys, layout):
    m = tiny_model()
    _round_trip(nn.DataParallel(m).state_dict(), tmp_path, capsys, m, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ddp_round_trip(tmp_path, capsys, layout):
    m = tiny_model()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(m)
        sd = ddp.state_dict()
    finally:
        dist.destroy_process_group()
    assert all(k.startswith("module.") for k in sd)
    _round_trip(sd, tmp_path, capsys, m, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compile_round_trip(tmp_path, capsys, layout):
    m = tiny_model()
    cm = torch.compile(m, backend="eager")
    sd = cm.state_dict()
    assert all(k.startswith("_orig_mod.") for k in sd)
    _round_trip(sd, tmp_path, capsys, m, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_dataparallel_round_trip(tmp_path, capsys, layout):
    m = tiny_model()
    cm = torch.compile(nn.DataParallel(m), backend="eager")
    sd = cm.state_dict()
    assert all(k.startswith("_orig_mod.module.") for k in sd)
    _round_trip(sd, tmp_path, capsys, m, layout)


def test_json_output(ckpt, capsys):
    b = ckpt.dataparallel()
    rc, out, err = _cli(capsys, "strip-prefix", b.path, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["output"].endswith("dp.stripped.pt") and doc["renamed"] == 9 and doc["format_out"] == "torch-zip"


def test_outputs_get_normal_modes_and_in_place_keeps_the_mode(tmp_path):
    """mkstemp makes 0600 files; written outputs must look like any other file, in-place ones keep their mode."""
    import stat

    sd = torch.nn.DataParallel(torch.nn.Linear(2, 2)).state_dict()
    src = tmp_path / "m.pt"
    torch.save({"model": sd}, src)
    os.chmod(src, 0o640)
    old = os.umask(0o022)
    try:
        rep = rewrite_checkpoint(str(src), lambda d: strip_prefix_report(d))
        assert stat.S_IMODE(os.stat(rep.output).st_mode) == 0o644
        rewrite_checkpoint(str(src), lambda d: strip_prefix_report(d), in_place=True, backup=False)
        assert stat.S_IMODE(os.stat(src).st_mode) == 0o640
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- verified before the rename (issue 11)


def _py2_names_ckpt(path):
    """torch.save's protocol 2 names int/str as __builtin__ long/unicode."""
    torch.save({"state_dict": {"module.w": torch.zeros(2)}, "cfg": {"dtype": int, "kind": str}}, path)


def test_py2_builtin_names_written_loadable(tmp_path):
    src = tmp_path / "c.pt"
    _py2_names_ckpt(src)
    rep = rewrite_checkpoint(str(src), lambda sd: strip_prefix_report(sd, None), output=str(tmp_path / "o.pt"))
    assert torch.load(rep.output, weights_only=False)["cfg"] == {"dtype": int, "kind": str}


@pytest.mark.parametrize("in_place", [False, True])
def test_rewrite_never_writes_a_file_torch_cannot_load(tmp_path, in_place):
    """Either the output loads with plain torch, or nothing is written/replaced and exit 7 says why."""
    src = tmp_path / "c.pt"
    _py2_names_ckpt(src)
    before = src.read_bytes()
    args = ["strip-prefix", src, "--in-place"] if in_place else ["strip-prefix", src]
    p = run_cli(*args)
    out = src if in_place else tmp_path / "c.stripped.pt"
    if p.returncode == 0:
        assert torch.load(out, weights_only=False)["cfg"] == {"dtype": int, "kind": str}
    else:
        assert_one_line_error(p, 7)
        assert "builtins.long" in p.stderr and "nothing was replaced" in p.stderr
        assert src.read_bytes() == before
        assert sorted(os.listdir(tmp_path)) == ["c.pt"]  # no output, no backup, no temp file


def test_check_written_catches_a_bad_global(tmp_path):
    from ckptfix.errors import VerificationError
    from ckptfix.formats import read_checkpoint
    from ckptfix.ops.rewrite import check_written

    src = tmp_path / "a.pt"
    torch.save({"w": torch.ones(2), "n": 3}, src)
    cf = read_checkpoint(str(src))
    bad = tmp_path / "b.pt"  # the same archive naming a global the input did not
    import argparse

    torch.save({"w": torch.ones(2), "n": argparse.Namespace()}, bad)
    with pytest.raises(VerificationError, match="argparse.Namespace, which the input did not name"):
        check_written(str(bad), cf, expect_obj=cf.obj, what="out.pt")
    assert check_written(str(src), cf, expect_obj=cf.obj, what="out.pt") == set()


def test_check_written_catches_a_short_record(tmp_path):
    from ckptfix.errors import VerificationError
    from ckptfix.formats import read_checkpoint
    from ckptfix.ops.rewrite import check_written

    src = tmp_path / "a.pt"
    torch.save({"w": torch.ones(4)}, src)
    cf = read_checkpoint(str(src))
    other = tmp_path / "b.pt"
    torch.save({"w": torch.ones(3)}, other)
    with pytest.raises(VerificationError, match="storage '0' reads back as 12 bytes, expected 16"):
        check_written(str(other), cf, expect_obj=cf.obj, what="out.pt")


@pytest.mark.parametrize(
    "cmd", [["strip-prefix"], ["add-prefix", "--prefix", "module."], ["strip-prefix", "--map-location", "cpu"]]
)
def test_every_rewrite_is_checked_before_the_rename(tmp_path, cmd, monkeypatch):
    """A writer bug (here: a record dropped from the archive) never reaches the user's file."""
    from ckptfix.cli import main
    from ckptfix.ops.rewrite import writers as rw

    src = tmp_path / "m.pt"
    torch.save({"module.w": torch.ones(3), "module.b": torch.zeros(2)}, src)
    before = src.read_bytes()
    real = rw.write_checkpoint_zip

    def broken(cf, obj, f, new_storages=None):
        real(cf, obj, f, new_storages=new_storages)
        f.truncate(f.tell() - 200)  # lose the central directory

    monkeypatch.setattr(rw, "write_checkpoint_zip", broken)
    assert main([*cmd, str(src), "--in-place"]) == 7
    assert src.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["m.pt"]


def test_rewrite_reports_progress_up_to_the_input_size(tmp_path):
    """strip-prefix copies tensor data chunk by chunk and says so through ``progress(done, total)``."""
    src = tmp_path / "big.pt"
    torch.save({"module.w": torch.zeros(3 << 20), "module.b": torch.ones(5)}, src)
    calls = []
    rep = rewrite_checkpoint(
        str(src),
        lambda sd: strip_prefix_report(sd, None),
        output=str(tmp_path / "o.pt"),
        progress=lambda d, t: calls.append((d, t)),
    )
    total = src.stat().st_size
    assert calls and calls[-1] == (total, total)
    assert all(t == total for _, t in calls) and [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert any(d < total for d, _ in calls)  # real steps, not only the final call
    assert set(torch.load(rep.output, weights_only=True)) == {"w", "b"}


def test_backup_never_written_through_a_dangling_symlink(tmp_path):
    """A ``CKPT.bak`` symlink to a missing file must not make --in-place create that file elsewhere."""
    from ckptfix.files.atomic import make_backup

    src = tmp_path / "c.pt"
    src.write_bytes(b"x" * 10)
    elsewhere = tmp_path / "elsewhere" / "planted"
    elsewhere.parent.mkdir()
    os.symlink(elsewhere, str(src) + ".bak")
    bak = make_backup(str(src))
    assert not elsewhere.exists()
    assert bak != str(src) + ".bak" and Path(bak).read_bytes() == b"x" * 10
    assert os.path.islink(str(src) + ".bak")


# --- moved from test_review_ckpt.py: zip layouts, odd keys, --map-location, sharded output, ckptfix-written safetensors


def test_rezipped_archive_gets_aligned_records(tmp_path):
    """data.pkl first but records unaligned (re-zipped by Python): the rewrite must still align every record."""
    import zipfile

    from ckptfix.formats.zipfmt import ALIGN

    from helpers import dp_state_dict, rezip, zip_data_offsets

    src = tmp_path / "base.pt"
    torch.save({"state_dict": dp_state_dict(), "epoch": 1}, src)
    rz = tmp_path / "rz.pt"
    rezip(src, rz, lambda n: zipfile.ZIP_DEFLATED if n.endswith("data.pkl") else zipfile.ZIP_STORED)
    assert any(off % ALIGN for n, off in zip_data_offsets(rz).items() if "/data/" in n)  # the premise
    rep = rewrite_checkpoint(str(rz), lambda sd: strip_prefix_report(sd), output=str(tmp_path / "out.pt"))
    bad = {n: off for n, off in zip_data_offsets(rep.output).items() if off % ALIGN}
    assert bad == {}
    got = torch.load(rep.output, weights_only=True, mmap=True)["state_dict"]
    assert all(torch.equal(got[k[len("module.") :]], v) for k, v in dp_state_dict().items())


def test_compressed_storage_record_is_unsupported_with_a_fix(tmp_path):
    """A deflated tensor record cannot be copied through: exit 8 saying to re-zip with `zip -0`, nothing left behind."""
    import zipfile

    from helpers import dp_state_dict, leftovers, rezip

    src = tmp_path / "base.pt"
    torch.save({"state_dict": dp_state_dict()}, src)
    rz = tmp_path / "deflated.pt"
    rezip(src, rz, lambda n: zipfile.ZIP_DEFLATED)
    p = run_cli("strip-prefix", rz)
    assert_one_line_error(p, 8)
    assert "compressed" in p.stderr and "zip -0" in p.stderr
    assert leftovers(tmp_path) == []


def test_non_string_state_dict_key_is_a_clean_error(tmp_path):
    """A state dict with an int key is refused (exit 8), naming the key."""
    p0 = tmp_path / "intkey.pt"
    torch.save({"module.a": torch.ones(2), 3: torch.zeros(1)}, p0)
    p = run_cli("strip-prefix", p0)
    assert_one_line_error(p, 8)
    assert "not a string" in p.stderr and "3" in p.stderr


def test_metadata_named_tensor_is_a_key_conflict(tmp_path):
    """'__metadata__' is reserved in a safetensors header: a rename or a conversion onto it is an error."""
    from safetensors.torch import save_file

    st = tmp_path / "m.safetensors"
    save_file({"module.__metadata__": torch.ones(2), "module.b": torch.zeros(2)}, str(st))
    assert_one_line_error(run_cli("strip-prefix", st), 6)
    pt = tmp_path / "plain.pt"
    torch.save({"__metadata__": torch.ones(2), "b": torch.zeros(2)}, pt)
    p = run_cli("convert", pt)
    assert_one_line_error(p, 6)
    assert "__metadata__" in p.stderr and ".tmp" not in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors", "plain.pt"]


def test_sharded_index_cannot_write_outside_the_output_directory(tmp_path):
    """A weight_map naming '../outside.safetensors' is refused (exit 8) before any directory is created."""
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    save_file({"module.a": torch.ones(2)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"module.b": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    (d / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {},
                "weight_map": {"module.a": "model-00001-of-00002.safetensors", "module.b": "../outside.safetensors"},
            }
        )
    )
    out = tmp_path / "a" / "b"
    p = run_cli("strip-prefix", d, "-o", out)
    assert_one_line_error(p, 8)
    assert not (tmp_path / "a").exists()
    assert sorted(os.listdir(tmp_path)) == ["hf", "outside.safetensors"]


@pytest.mark.parametrize("spec", ["bogus", "cpu=", "cpu=cuda:0, cuda:1", "cuda:x", "cuda:"])
def test_map_location_that_torch_cannot_load_is_refused(tmp_path, spec):
    """A tag torch.load cannot restore would make an unloadable file: refuse it, write nothing."""
    from helpers import dp_state_dict

    src = tmp_path / "m.pt"
    torch.save({"state_dict": dp_state_dict()}, src)
    p = run_cli("strip-prefix", src, "--map-location", spec)
    assert_one_line_error(p, 8)
    assert "--map-location" in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]


@pytest.mark.parametrize("spec", ["cpu", "cuda:1", "cpu=cuda:0", "cuda:7=cuda:0,cpu=cpu"])
def test_map_location_valid_specs_are_written(tmp_path, spec):
    """Every device spec torch.load can restore is accepted and written."""
    from helpers import dp_state_dict

    src = tmp_path / "m.pt"
    torch.save({"state_dict": dp_state_dict()}, src)
    rep = rewrite_checkpoint(str(src), lambda sd: strip_prefix_report(sd), map_location=spec)
    assert rep.output and os.path.exists(rep.output)


def _tied_ckpt(path):
    torch.manual_seed(0)
    w = torch.randn(4, 3)
    sd = {
        "module.z_last": torch.ones(2),
        "module.w": w,
        "module.tied": w,
        "module.row": w[1],
        "module.a_first": torch.zeros(3),
    }
    torch.save(sd, path)
    return {k[len("module.") :]: v for k, v in sd.items()}


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_strip_prefix_on_converted_safetensors_keeps_aliases_views_and_order(tmp_path, sharded):
    """convert stores tied tensors once (aliases in the metadata): a rename must rename those names too,
    or converting back loses the tied key."""
    expected = _tied_ckpt(tmp_path / "m.pt")
    if sharded:
        (tmp_path / "hf").mkdir()
        p = run_cli(
            "convert", tmp_path / "m.pt", "-o", tmp_path / "hf" / "model.safetensors", "--max-shard-size", "20B"
        )
        assert p.returncode == 0, p.stderr
        p = run_cli("strip-prefix", tmp_path / "hf", "-o", tmp_path / "out")
        assert p.returncode == 0, p.stderr
        stripped = tmp_path / "out"
    else:
        assert run_cli("convert", tmp_path / "m.pt").returncode == 0
        p = run_cli("strip-prefix", tmp_path / "m.safetensors")
        assert p.returncode == 0, p.stderr
        stripped = tmp_path / "m.stripped.safetensors"
    p = run_cli("convert", stripped, "-o", tmp_path / "back.pt")
    assert p.returncode == 0, p.stderr
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert list(back) == list(expected)
    assert all(torch.equal(back[k], v) for k, v in expected.items())
    assert back["w"].data_ptr() == back["tied"].data_ptr()
    assert back["row"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()


def test_strip_prefix_renames_hugging_face_style_aliases(tmp_path):
    """Hugging Face's alias metadata (tied name -> stored name) is renamed with the keys."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ckptfix.ops.convert import restore_aliases

    p = tmp_path / "m.safetensors"
    save_file(
        {"module.emb.weight": torch.ones(2, 2)},
        str(p),
        metadata={"format": "pt", "module.head.weight": "module.emb.weight"},
    )
    rep = rewrite_checkpoint(str(p), lambda sd: strip_prefix_report(sd))
    with safe_open(rep.output, "pt") as f:
        meta = f.metadata()
        sd = {k: f.get_tensor(k) for k in f.keys()}
    assert meta == {"format": "pt", "head.weight": "emb.weight"}
    assert sorted(restore_aliases(sd, meta)) == ["emb.weight", "head.weight"]


def test_rename_onto_an_alias_name_is_a_collision(tmp_path):
    """An alias is a key of the original state dict: renaming another key onto it must collide."""
    from safetensors.torch import save_file

    p = tmp_path / "m.safetensors"
    save_file(
        {"module.a": torch.ones(2), "b": torch.zeros(2)},
        str(p),
        metadata={"format": "pt", "ckptfix.aliases": json.dumps({"a": "b"})},
    )
    r = run_cli("strip-prefix", p, "--prefix", "module.")
    assert_one_line_error(r, 6)
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


@pytest.mark.parametrize("cmd", ["strip-prefix", "convert"])
def test_output_with_a_trailing_slash_is_not_written_as_a_file(tmp_path, cmd):
    """'-o newdir/' names a directory that does not exist: refused (exit 9), no file called 'newdir' written."""
    from helpers import dp_state_dict

    src = tmp_path / "m.pt"
    torch.save({"state_dict": dp_state_dict()}, src)
    p = run_cli(cmd, src, "-o", str(tmp_path / "newdir") + "/")
    assert_one_line_error(p, 9)
    assert "directory" in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]


def test_sharded_rewrite_note_names_the_directory_as_typed(tmp_path):
    shutil.copytree(SHARDED, tmp_path / "sharded")
    r = run_cli("add-prefix", "sharded/pytorch_model.bin.index.json", "--prefix", "module.", "-o", "out", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "note: wrote 2 shard(s) and the index to out" in r.err and str(tmp_path) not in r.err + r.out
