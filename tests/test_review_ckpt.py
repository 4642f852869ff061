"""Second-pass review: odd but real artefacts for the rewrite / convert code paths.

Each test pins one bug found by building the artefact with torch (or by hand) and running the command.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile

import pytest
import torch

from ckptfix.formats.zipfmt import ALIGN
from ckptfix.inspecting import scan_checkpoint
from ckptfix.pickles import classify_global
from ckptfix.prefixes import strip_prefix_report
from ckptfix.rewrite import rewrite_checkpoint

from helpers import assert_one_line_error, run_cli, sha256

pytestmark = pytest.mark.filterwarnings("ignore")


def _leftovers(d):
    return sorted(n for n in os.listdir(d) if n.startswith(".") or n.endswith(".tmp"))


def _data_offsets(path):
    out = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            f.seek(info.header_offset + 26)
            n, e = struct.unpack("<HH", f.read(4))
            out[info.filename] = info.header_offset + 30 + n + e
    return out


def _rezip(src, dst, compress_for=lambda name: zipfile.ZIP_STORED, order=None):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        names = order(zin.namelist()) if order else zin.namelist()
        for n in names:
            zout.writestr(zipfile.ZipInfo(n), zin.read(n), compress_type=compress_for(n))


def _dp_sd():
    torch.manual_seed(0)
    return {f"module.l{i}.weight": torch.randn(5, 3) for i in range(6)}


# --------------------------------------------------------------------------- classification


def test_untyped_storage_is_weights_only_safe(tmp_path):
    """torch.save writes torch.storage.UntypedStorage for uint16/float8...; weights_only loads it, so it is safe."""
    p = tmp_path / "u16.pt"
    torch.save({"a": torch.zeros(3, dtype=torch.uint16), "b": torch.ones(2).to(torch.float8_e4m3fn)}, p)
    torch.load(p, weights_only=True)  # torch agrees
    assert classify_global("torch.storage.UntypedStorage") == "safe"
    r = scan_checkpoint(str(p))
    assert not r.unknown and not r.dangerous, r.to_dict()
    assert run_cli("scan", p).returncode == 0


def test_every_weights_only_global_is_safe():
    import torch._weights_only_unpickler as wo

    assert [g for g in wo._get_allowed_globals() if classify_global(g) != "safe"] == []


# --------------------------------------------------------------------------- zip layouts


def test_rezipped_archive_gets_aligned_records(tmp_path):
    """data.pkl first but records unaligned (re-zipped by Python): the rewrite must still align every record."""
    src = tmp_path / "base.pt"
    torch.save({"state_dict": _dp_sd(), "epoch": 1}, src)
    rz = tmp_path / "rz.pt"
    _rezip(src, rz, lambda n: zipfile.ZIP_DEFLATED if n.endswith("data.pkl") else zipfile.ZIP_STORED)
    assert any(off % ALIGN for n, off in _data_offsets(rz).items() if "/data/" in n)  # the premise
    rep = rewrite_checkpoint(str(rz), lambda sd: strip_prefix_report(sd), output=str(tmp_path / "out.pt"))
    bad = {n: off for n, off in _data_offsets(rep.output).items() if off % ALIGN}
    assert bad == {}
    got = torch.load(rep.output, weights_only=True, mmap=True)["state_dict"]
    assert all(torch.equal(got[k[len("module.") :]], v) for k, v in _dp_sd().items())


def test_compressed_storage_record_is_unsupported_with_a_fix(tmp_path):
    src = tmp_path / "base.pt"
    torch.save({"state_dict": _dp_sd()}, src)
    rz = tmp_path / "deflated.pt"
    _rezip(src, rz, lambda n: zipfile.ZIP_DEFLATED)
    p = run_cli("strip-prefix", rz)
    assert_one_line_error(p, 8)
    assert "compressed" in p.stderr and "zip -0" in p.stderr
    assert _leftovers(tmp_path) == []


def test_unreadable_non_storage_record_is_a_clean_error(tmp_path):
    """A damaged small record (here: an unknown compression method on 'version') is exit 4, not a crash."""
    src = tmp_path / "base.pt"
    torch.save({"state_dict": _dp_sd()}, src)
    rz = tmp_path / "rz.pt"
    _rezip(src, rz, lambda n: zipfile.ZIP_DEFLATED if n.endswith("/version") else zipfile.ZIP_STORED)
    data = bytearray(rz.read_bytes())
    with zipfile.ZipFile(rz) as zf:
        info = zf.getinfo([n for n in zf.namelist() if n.endswith("/version")][0])
    # the compression method, in the local header and in the central directory, becomes 99 (AES)
    data[info.header_offset + 8 : info.header_offset + 10] = struct.pack("<H", 99)
    pos = data.find(b"PK\x01\x02")
    while pos >= 0:
        nlen = struct.unpack("<H", data[pos + 28 : pos + 30])[0]
        if data[pos + 46 : pos + 46 + nlen].decode().endswith("/version"):
            data[pos + 10 : pos + 12] = struct.pack("<H", 99)
        pos = data.find(b"PK\x01\x02", pos + 4)
    rz.write_bytes(bytes(data))
    p = run_cli("strip-prefix", rz)
    assert_one_line_error(p, 4)
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------- hostile / odd pickles


def _inject(src, dst, payload: bytes):
    """Add ``"evil": <payload>`` to the top-level dict of data.pkl."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for n in zin.namelist():
            data = zin.read(n)
            if n.endswith("data.pkl"):
                assert data.endswith(b".")
                data = data[:-1] + b"X\x04\x00\x00\x00evil" + payload + b"s."
            zout.writestr(zipfile.ZipInfo(n), data)


@pytest.mark.parametrize(
    "payload",
    [b"]" * 100_000 + b"a" * 99_999, b"}" + b"X\x01\x00\x00\x00k}" * 99_999 + b"s" * 99_999],
    ids=["lists", "dicts"],
)
def test_deeply_nested_pickle_is_a_clean_error(tmp_path, payload):
    src = tmp_path / "good.pt"
    torch.save({"state_dict": {"module.w": torch.ones(3)}}, src)
    deep = tmp_path / "deep.pt"
    _inject(src, deep, payload)
    h = sha256(deep)
    p = run_cli("strip-prefix", deep)
    assert_one_line_error(p, 12)  # ResourceLimitError: refused by the reader, before any recursive walk
    assert "nested more than" in p.stderr and "CKPTFIX_MAX_PICKLE_DEPTH" in p.stderr
    assert sha256(deep) == h and _leftovers(tmp_path) == []


def test_non_string_state_dict_key_is_a_clean_error(tmp_path):
    p0 = tmp_path / "intkey.pt"
    torch.save({"module.a": torch.ones(2), 3: torch.zeros(1)}, p0)
    p = run_cli("strip-prefix", p0)
    assert_one_line_error(p, 8)
    assert "not a string" in p.stderr and "3" in p.stderr


# --------------------------------------------------------------------------- legacy stream


def test_legacy_negative_storage_size_is_corrupt(tmp_path):
    src = tmp_path / "legacy.pt"
    torch.save({"state_dict": {"module.w": torch.ones(3)}}, src, _use_new_zipfile_serialization=False)
    data = bytearray(src.read_bytes())
    # the storage's 8-byte element count sits just before its 12 data bytes at the end of the file
    at = len(data) - 12 - 8
    assert struct.unpack("<q", data[at : at + 8])[0] == 3
    for bad in (-3, 1 << 62):
        data[at : at + 8] = struct.pack("<q", bad)
        src.write_bytes(bytes(data))
        for cmd in (["strip-prefix", src, "--force"], ["inspect", src], ["convert", src, "--force"]):
            assert_one_line_error(run_cli(*cmd), 4)
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------- safetensors headers that lie


def _write_st(path, header, data, raw=None):
    h = raw if raw is not None else json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


LYING = {
    "overlap": (
        {
            "module.a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "module.b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
        },
        24,
    ),
    "gap": (
        {
            "module.a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "module.b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
        },
        24,
    ),
    "trailing": ({"module.a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 16),
    "negative_shape": ({"module.a": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}}, 8),
    "bool_shape": ({"module.a": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, 8),
    "float_offsets": ({"module.a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}, 8),
    "metadata_not_str": (
        {"__metadata__": {"x": 1}, "module.a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
        8,
    ),
    "shape_overflow": ({"module.a": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}, 0),
}


@pytest.mark.parametrize("name", sorted(LYING))
def test_lying_safetensors_header_is_refused_everywhere(tmp_path, name):
    """safetensors itself refuses these files: strip-prefix must not write one, convert must not crash."""
    from safetensors import safe_open

    header, n = LYING[name]
    p = tmp_path / "m.safetensors"
    _write_st(p, header, bytes(range(n)))
    with pytest.raises(Exception):
        safe_open(str(p), framework="pt")
    h = sha256(p)
    for cmd in (
        ["strip-prefix", p],
        ["convert", p, "-o", tmp_path / "m.pth"],
        ["convert", p, "-o", tmp_path / "m2.safetensors"],
        ["inspect", p],
    ):
        assert_one_line_error(run_cli(*cmd), 4)
    assert sha256(p) == h
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


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


# --------------------------------------------------------------------------- file system


def test_in_place_through_a_symlink_fixes_the_target(tmp_path):
    real_dir = tmp_path / "store"
    real_dir.mkdir()
    real = real_dir / "real.pt"
    torch.save({"state_dict": _dp_sd()}, real)
    link = tmp_path / "link.pt"
    link.symlink_to(os.path.relpath(real, tmp_path))
    p = run_cli("strip-prefix", link, "--in-place")
    assert p.returncode == 0, p.stderr
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    assert list(torch.load(real, weights_only=True)["state_dict"]) == [f"l{i}.weight" for i in range(6)]
    assert (real_dir / "real.pt.bak").is_file() and not (real_dir / "real.pt.bak").is_symlink()
    assert list(torch.load(real_dir / "real.pt.bak", weights_only=True)["state_dict"])[0] == "module.l0.weight"


def test_in_place_on_a_hard_linked_file_says_so(tmp_path):
    a = tmp_path / "a.pt"
    torch.save({"state_dict": _dp_sd()}, a)
    b = tmp_path / "b.pt"
    os.link(a, b)
    rep = rewrite_checkpoint(str(a), lambda sd: strip_prefix_report(sd), in_place=True, backup=False)
    assert any("hard link" in n for n in rep.notes)
    assert list(torch.load(b, weights_only=True)["state_dict"])[0] == "module.l0.weight"  # b is the old file


def test_output_that_is_a_directory_is_refused_without_suggesting_force(tmp_path):
    src = tmp_path / "m.pt"
    torch.save({"state_dict": _dp_sd()}, src)
    d = tmp_path / "out"
    d.mkdir()
    for extra in ([], ["--force"]):
        p = run_cli("strip-prefix", src, "-o", d, *extra)
        assert_one_line_error(p, 9)
        assert "is a directory" in p.stderr and "--force" not in p.stderr
    assert os.listdir(d) == [] and _leftovers(tmp_path) == []


def test_output_that_is_the_input_through_a_symlink_is_refused(tmp_path):
    src = tmp_path / "m.pt"
    torch.save({"state_dict": _dp_sd()}, src)
    link = tmp_path / "link.pt"
    link.symlink_to(src)
    h = sha256(src)
    p = run_cli("strip-prefix", link, "-o", src, "--force")
    assert_one_line_error(p, 9)
    assert "is the input" in p.stderr and sha256(src) == h


def test_sharded_index_cannot_write_outside_the_output_directory(tmp_path):
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


# --------------------------------------------------------------------------- --map-location


@pytest.mark.parametrize("spec", ["bogus", "cpu=", "cpu=cuda:0, cuda:1", "cuda:x", "cuda:"])
def test_map_location_that_torch_cannot_load_is_refused(tmp_path, spec):
    """A tag torch.load cannot restore would make an unloadable file: refuse it, write nothing."""
    src = tmp_path / "m.pt"
    torch.save({"state_dict": _dp_sd()}, src)
    p = run_cli("strip-prefix", src, "--map-location", spec)
    assert_one_line_error(p, 8)
    assert "--map-location" in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]


@pytest.mark.parametrize("spec", ["cpu", "cuda:1", "cpu=cuda:0", "cuda:7=cuda:0,cpu=cpu"])
def test_map_location_valid_specs_still_work(tmp_path, spec):
    src = tmp_path / "m.pt"
    torch.save({"state_dict": _dp_sd()}, src)
    rep = rewrite_checkpoint(str(src), lambda sd: strip_prefix_report(sd), map_location=spec)
    assert rep.output and os.path.exists(rep.output)


# --------------------------------------------------------------------------- ckptfix-written safetensors


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
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ckptfix.convert import restore_aliases

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
    src = tmp_path / "m.pt"
    torch.save({"state_dict": _dp_sd()}, src)
    p = run_cli(cmd, src, "-o", str(tmp_path / "newdir") + "/")
    assert_one_line_error(p, 9)
    assert "directory" in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]
