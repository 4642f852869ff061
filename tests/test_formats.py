"""ckptfix.formats: containers read the same way torch reads them, or refused, in every command.

Each hostile container is run through inspect, scan, strip-prefix, add-prefix, convert (CLI, in
process) and load_anywhere (library), expecting one typed error; torch.load is the oracle where
it has an opinion.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import hostile
import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptfix import load_anywhere
from ckptfix.cli import main
from ckptfix.errors import CkptfixError, CorruptCheckpointError, UnsupportedError
from ckptfix.formats import read_checkpoint, sniff
from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint

from helpers import run_cli

COMMANDS = ("inspect", "scan", "strip-prefix", "add-prefix", "convert")


def _cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _argv(cmd: str, path: Path, tmp_path: Path) -> list:
    out = tmp_path / f"out-{cmd}"
    if cmd == "strip-prefix":
        return [cmd, path, "-o", out, "--force"]
    if cmd == "add-prefix":
        return [cmd, path, "--prefix", "m.", "-o", out, "--force"]
    if cmd == "convert":
        return [cmd, path, "-o", str(out) + ".safetensors", "--force"]
    return [cmd, path]


#: scan reads pickles only: a damaged tensor record is not its business (it may pass or refuse)
RECORD_LEVEL = (0, 4)


def every_command(
    capsys, path: Path, tmp_path: Path, code: int, *, scan_codes: tuple[int, ...] | None = None, contains: str = ""
) -> None:
    """Every command refuses ``path`` with one ``Error:`` line and ``code``; load_anywhere raises the same."""
    for cmd in COMMANDS:
        rc, out, err = _cli(capsys, *_argv(cmd, path, tmp_path))
        if cmd == "scan" and scan_codes is not None:
            assert rc in scan_codes, (cmd, rc, err)
            if rc == 0:
                continue
        else:
            assert rc == code, (cmd, rc, err)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in err, (cmd, err)
        assert contains in err, (cmd, err)
    with pytest.raises(Exception) as ei:
        load_anywhere(path)
    assert getattr(ei.value, "exit_code", None) == code, repr(ei.value)


def _tensor_zip(path: Path, **kw) -> Path:
    rec = hostile.RecTensor("0", 4, 0, (4,), (1,))
    return hostile.torch_zip(path, hostile.torch_pickle({"w": rec}), {"0": b"\0" * 16}, **kw)


# --------------------------------------------------------------------------- ambiguous zip names


def test_two_members_named_data_pkl_refused_everywhere(tmp_path, capsys):
    good = hostile.torch_pickle({"w": hostile.RecTensor("0", 4, 0, (4,), (1,))})
    evil = hostile.payloads(str(tmp_path / "canary"))["os.system"]
    p = tmp_path / "dup.pth"
    hostile.write_zip(
        p,
        [
            ("archive/data.pkl", evil),
            ("archive/data.pkl", good),
            ("archive/byteorder", b"little"),
            ("archive/data/0", b"\0" * 16),
            ("archive/version", b"3\n"),
        ],
    )
    every_command(capsys, p, tmp_path, 4, contains="twice")
    assert not (tmp_path / "canary").exists()


def test_names_differing_only_in_case_refused(tmp_path, capsys):
    p = _tensor_zip(tmp_path / "case.pth", extra=[("archive/DATA.pkl", b"\x80\x02}.")])
    every_command(capsys, p, tmp_path, 4, contains="ignores case")


def test_local_header_name_differs_from_central_directory(tmp_path, capsys):
    p = _tensor_zip(tmp_path / "hdr.pth")
    raw = bytearray(p.read_bytes())
    i = raw.index(b"archive/data.pkl")  # the first occurrence is the local header's
    raw[i : i + 16] = b"archive/data.pkX"
    p.write_bytes(bytes(raw))
    every_command(capsys, p, tmp_path, 4)


def test_data_pkl_outside_the_first_entrys_folder_refused(tmp_path, capsys):
    good = hostile.torch_pickle({"w": hostile.RecTensor("0", 4, 0, (4,), (1,))})
    p = tmp_path / "roots.pth"
    hostile.write_zip(
        p,
        [
            ("other/readme.txt", b"x"),
            ("archive/data.pkl", good),
            ("archive/byteorder", b"little"),
            ("archive/data/0", b"\0" * 16),
        ],
    )
    every_command(capsys, p, tmp_path, 4)


def test_valid_archive_with_any_root_name_still_reads(tmp_path):
    p = tmp_path / "ok.pth"
    torch.save({"w": torch.arange(4.0)}, p)
    raw = p.read_bytes().replace(b"ok/", b"zz/")
    p.write_bytes(raw)
    assert torch.equal(load_anywhere(p)["w"], torch.arange(4.0))


# --------------------------------------------------------------------------- inflation limits


def _bomb_zip(path: Path, member: str, size: int) -> Path:
    """A torch zip whose ``member`` is deflated zeros inflating to ``size`` bytes (compressed ~size/1000)."""
    good = hostile.torch_pickle({"w": hostile.RecTensor("0", 4, 0, (4,), (1,))})
    entries = []
    for name, d in (("archive/data.pkl", good), ("archive/byteorder", b"little"), ("archive/data/0", b"\0" * 16)):
        if name == member:
            data, crc = hostile.deflated_zeros(size)
            entries.append((name, data, 8, crc, size))
        else:
            entries.append((name, d, 0, zlib.crc32(d), len(d)))
    return hostile.write_raw_zip(path, entries)


@pytest.mark.parametrize("member", ["archive/byteorder", "archive/data.pkl"])
def test_deflate_bomb_refused_with_the_env_var_named(tmp_path, capsys, member, monkeypatch):
    monkeypatch.setenv("CKPTFIX_MAX_PICKLE_MB", "4")
    p = _bomb_zip(tmp_path / "bomb.pth", member, 16 << 20)
    assert p.stat().st_size < 100_000
    every_command(capsys, p, tmp_path, 12, contains="CKPTFIX_MAX_PICKLE_MB")


def test_default_limit_bounds_memory_on_a_1_5_gb_bomb(tmp_path):
    """A ~1.5 MB zip inflating to 1.5 GB: refused by the default limit without inflating it."""
    p = _bomb_zip(tmp_path / "bomb.pth", "archive/byteorder", 1536 << 20)
    assert p.stat().st_size < 2_000_000
    code = textwrap.dedent(f"""
        import re, sys
        from ckptfix.cli import main
        rcs = [main([c, {str(p)!r}]) for c in ("inspect", "scan")]
        # VmHWM: this process's own peak (ru_maxrss would include the parent's, inherited over fork+exec)
        print(rcs, int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) // 1024)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    rcs, rss = r.stdout.rsplit("]", 1)
    assert rcs.strip("[ ") == "12, 12", r.stdout + r.stderr
    assert int(rss) < 256, f"peak RSS {rss} MiB; {r.stderr}"


def test_bad_limit_env_var_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CKPTFIX_MAX_PICKLE_MB", "lots")
    p = _tensor_zip(tmp_path / "ok.pth")
    rc, _, err = _cli(capsys, "inspect", p)
    assert rc == 12 and "CKPTFIX_MAX_PICKLE_MB" in err


def test_compressed_tensor_record_still_refused(tmp_path):
    src = tmp_path / "c.pth"
    torch.save({"w": torch.arange(8.0)}, src)
    members = hostile.zip_members(src)
    p = tmp_path / "re.pth"
    hostile.write_zip(p, members, compress=frozenset(n for n, _ in members if "/data/" in n))
    with pytest.raises(UnsupportedError, match="compressed"):
        read_checkpoint(p)


# --------------------------------------------------------------------------- record sizes


def test_record_shorter_than_the_pickle_declares_refused_like_torch(tmp_path, capsys):
    src = tmp_path / "s.pth"
    torch.save({"w": torch.arange(8.0)}, src)
    members = [(n, d[:12] if n.endswith("/data/0") else d) for n, d in hostile.zip_members(src)]
    p = tmp_path / "short.pth"
    hostile.write_zip(p, members)
    with pytest.raises(RuntimeError):
        torch.load(p, weights_only=True)  # the oracle refuses it too
    every_command(capsys, p, tmp_path, 4, contains="truncated", scan_codes=RECORD_LEVEL)


def test_record_not_a_whole_number_of_elements(tmp_path, capsys):
    rec = hostile.RecTensor("0", 2, 0, (2,), (1,))
    p = hostile.torch_zip(tmp_path / "odd.pth", hostile.torch_pickle({"w": rec}), {"0": b"\0" * 9})
    # 9 bytes hold the 8 that 2 floats need: torch reads the first 8, and so does ckptfix
    assert torch.equal(load_anywhere(p)["w"], torch.zeros(2))
    rec = hostile.RecTensor("0", 3, 0, (3,), (1,))
    p2 = hostile.torch_zip(tmp_path / "odd2.pth", hostile.torch_pickle({"w": rec}), {"0": b"\0" * 9})
    every_command(capsys, p2, tmp_path, 4, scan_codes=RECORD_LEVEL)


def test_negative_storage_size_refused(tmp_path, capsys):
    rec = hostile.RecTensor("0", -4, 0, (4,), (1,))
    p = hostile.torch_zip(tmp_path / "neg.pth", hostile.torch_pickle({"w": rec}), {"0": b"\0" * 16})
    every_command(capsys, p, tmp_path, 4, scan_codes=RECORD_LEVEL)


def test_negative_stride_refused_by_convert(tmp_path, capsys):
    rec = hostile.RecTensor("0", 4, 3, (4,), (-1,))
    p = hostile.torch_zip(tmp_path / "negstride.pth", hostile.torch_pickle({"w": rec}), {"0": b"\0" * 16})
    rc, _, err = _cli(capsys, "convert", p, "-o", tmp_path / "o.safetensors")
    assert rc == 4 and err.startswith("Error: ") and "negative" in err


def test_huge_stride0_dimension_is_a_resource_error(tmp_path, capsys):
    rec = hostile.RecTensor("0", 1, 0, (1 << 62,), (0,))
    p = hostile.torch_zip(tmp_path / "huge.pth", hostile.torch_pickle({"w": rec}), {"0": b"\0" * 4})
    rc, _, err = _cli(capsys, "convert", p, "-o", tmp_path / "o.safetensors")
    # 2**62 float32 elements are more bytes than int64 counts: the reader's validation refuses the record
    assert rc == 4 and err.count("\n") == 1 and "more than a tensor can hold" in err, err


# --------------------------------------------------------------------------- pre-0.4 tar


def test_tar_checkpoint_is_its_own_format(tmp_path, capsys):
    canary = tmp_path / "canary"
    p = hostile.tar_checkpoint(tmp_path / "old.pt", hostile.payloads(str(canary))["os.system"])
    assert sniff(str(p)) == "torch-tar"
    r = scan_checkpoint(p)  # never "safe": torch.load would unpickle its members (the object pickle is scanned)
    assert r.verdict == "dangerous" and any("tar" in n for n in r.unknown + r.errors + r.notes)
    with pytest.raises(UnsupportedError):
        inspect_checkpoint(p)
    for cmd in COMMANDS:
        rc, out, err = _cli(capsys, *_argv(cmd, p, tmp_path))
        assert rc == (11 if cmd == "scan" else 8), (cmd, rc, err)
        assert "weights_only=False" not in err and "tar" in out + err
    with pytest.raises(UnsupportedError):
        load_anywhere(p)
    assert not canary.exists()


def test_tar_checkpoint_loads_only_with_trust(tmp_path):
    p = tmp_path / "old.pt"
    with open(p, "wb") as f:  # what torch.load accepts as the tar format: build it with its own writer
        import pickle
        import tarfile

        with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:

            def add(name, data):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

            add(
                "sys_info",
                pickle.dumps(
                    {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}},
                    protocol=2,
                ),
            )
            add("storages", pickle.dumps(0, protocol=2) + pickle.dumps([], protocol=2))
            add("tensors", pickle.dumps(0, protocol=2))
            add("pickle", pickle.dumps({"epoch": 3}, protocol=2))
    assert sniff(str(p)) == "torch-tar"
    with pytest.raises(UnsupportedError):
        load_anywhere(p)
    # trusted, torch's own loader reads it (this one holds no tensors, which is then what is said)
    with pytest.warns(UserWarning), pytest.raises(CkptfixError, match="state dict|tensors"):
        load_anywhere(p, trust=True)


def test_plain_tar_is_not_a_checkpoint(tmp_path, capsys):
    import tarfile

    p = tmp_path / "x.tar"
    with tarfile.open(p, "w") as tar:
        info = tarfile.TarInfo("readme.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    rc, _, err = _cli(capsys, "inspect", p)
    assert rc == 4 and "tar archive" in err


# --------------------------------------------------------------------------- TorchScript


def _code_archive(tmp_path: Path, code: str) -> Path:
    m = torch.jit.script(torch.nn.Linear(3, 2))
    src = tmp_path / "ts.pt"
    torch.jit.save(m, str(src))
    members = hostile.zip_members(src)
    name = next(n for n, _ in members if "/code/" in n and n.endswith(".py"))
    return hostile.replace_member(src, name, code.encode(), tmp_path / "ts2.pt")


def test_torchscript_code_parse_is_linear(tmp_path):
    """20,000 unclosed ``__parameters__ = [`` lines (424 KB): the old regex took 43 s."""
    from ckptfix.formats.zipfmt import _script_members

    text = "class Linear(Module):\n" + "  __parameters__ = [\n" * 20000
    assert 400_000 < len(text) < 450_000
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
        "from ckptfix.formats.zipfmt import _script_members\n"
        "text = 'class Linear(Module):\\n' + '  __parameters__ = [\\n' * 20000\n"
        "print(len(_script_members({'a/code/__torch__/m.py': text * 4}, 'a/')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr
    assert _script_members(
        {
            "a/code/__torch__/m.py": 'class A(Module):\n  __parameters__ = ["w", "b", ]\n'
            '  __buffers__ = ["r", ]\nclass B(Module):\n'
            '  __parameters__ = [\n    "x",\n    "y"]\n'
        },
        "a/",
    ) == {"__torch__.m.A": (["w", "b"], ["r"]), "__torch__.m.B": (["x", "y"], [])}


def test_torchscript_tensors_get_their_own_storage(tmp_path):
    m = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Linear(1000, 1000)))
    p = tmp_path / "ts.pt"
    torch.jit.save(m, str(p))
    sd = load_anywhere(p)
    assert torch.equal(sd["0.weight"], m.state_dict()["0.weight"])
    buf = io.BytesIO()
    torch.save(sd["0.weight"], buf)
    assert len(buf.getvalue()) < 10_000


def test_torchscript_bad_record_size_is_typed(tmp_path, capsys):
    m = torch.jit.script(torch.nn.Linear(3, 2))
    src = tmp_path / "ts.pt"
    torch.jit.save(m, str(src))
    members = hostile.zip_members(src)
    name = next(n for n, d in members if "/data/" in n and len(d) == 24)  # the 2x3 float weight
    p = hostile.replace_member(src, name, b"\0" * 23, tmp_path / "bad.pt")
    for cmd in ("inspect", "convert", "strip-prefix"):
        rc, _, err = _cli(capsys, *_argv(cmd, p, tmp_path))
        assert rc == 4, (cmd, err)
    with pytest.raises(CorruptCheckpointError):
        load_anywhere(p)


# --------------------------------------------------------------------------- sharded indexes


def _shards(tmp_path: Path) -> Path:
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"a": torch.ones(2)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(2)}, str(d / "model-00002-of-00002.safetensors"))
    return d


def _index(d: Path, weight_map) -> Path:
    p = d / "model.safetensors.index.json"
    p.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return p


@pytest.mark.parametrize(
    "shard, code",
    [("../outside.safetensors", 8), ("/etc/passwd", 8), ("../../etc/passwd", 8), ("sub/../../outside.safetensors", 8)],
)
def test_shard_names_leaving_the_directory_refused(tmp_path, capsys, shard, code):
    d = _shards(tmp_path)
    save_file({"b": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    p = _index(d, {"a": "model-00001-of-00002.safetensors", "b": shard})
    every_command(capsys, p, tmp_path, code, contains="outside")


def test_symlinked_shard_pointing_out_refused(tmp_path, capsys):
    d = _shards(tmp_path)
    save_file({"b": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    os.symlink(tmp_path / "outside.safetensors", d / "link.safetensors")
    p = _index(d, {"a": "model-00001-of-00002.safetensors", "b": "link.safetensors"})
    every_command(capsys, p, tmp_path, 8, contains="outside")


def test_hub_cache_layout_with_blob_symlinks_allowed(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    save_file({"a": torch.ones(2)}, str(repo / "blobs" / "h1"))
    save_file({"b": torch.zeros(2)}, str(repo / "blobs" / "h2"))
    os.symlink("../../blobs/h1", snap / "model-00001-of-00002.safetensors")
    os.symlink("../../blobs/h2", snap / "model-00002-of-00002.safetensors")
    (repo / "blobs" / "hi").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    os.symlink("../../blobs/hi", snap / "model.safetensors.index.json")
    sd = load_anywhere(snap)
    assert torch.equal(sd["a"], torch.ones(2)) and torch.equal(sd["b"], torch.zeros(2))


def test_index_listing_itself_is_corrupt(tmp_path, capsys):
    d = _shards(tmp_path)
    p = _index(d, {"a": "model.safetensors.index.json"})
    every_command(capsys, p, tmp_path, 4)
    q = d / "other.bin"
    q.write_text(json.dumps({"weight_map": {"a": "model.safetensors.index.json"}}))
    _index(d, {"a": "other.bin"})
    every_command(capsys, p, tmp_path, 4)


@pytest.mark.parametrize("wm", [[], {}, "x", None, {"a": 3}])
def test_bad_weight_maps(tmp_path, capsys, wm):
    d = _shards(tmp_path)
    p = _index(d, wm)
    every_command(capsys, p, tmp_path, 4)


def test_deeply_nested_json_is_corrupt_not_recursion(tmp_path, capsys):
    d = _shards(tmp_path)
    p = d / "model.safetensors.index.json"
    p.write_text('{"weight_map": {}, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    every_command(capsys, p, tmp_path, 4)
    st = tmp_path / "deep.safetensors"
    st.write_bytes(
        hostile.safetensors_bytes({}, b"")[:0] + _st_raw('{"__metadata__": ' + "[" * 100_000 + "]" * 100_000 + "}")
    )
    every_command(capsys, st, tmp_path, 4)


def _st_raw(text: str) -> bytes:
    b = text.encode()
    b += b" " * (-len(b) % 8)
    return len(b).to_bytes(8, "little") + b


def test_valid_sharded_index_still_converts(tmp_path):
    d = _shards(tmp_path)
    _index(d, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    from ckptfix.ops.convert import convert_to_safetensors

    convert_to_safetensors(str(d), str(tmp_path / "one.safetensors"))
    sd = load_file(str(tmp_path / "one.safetensors"))
    assert torch.equal(sd["a"], torch.ones(2))


# --------------------------------------------------------------------------- convert: strided gather, expansion


def _views() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "t": torch.randn(37, 53, generator=g).t(),
        "step": torch.arange(1000, dtype=torch.int16)[::7],
        "exp": torch.randn(3, 1, 5, generator=g).expand(3, 4, 5),
        "col": torch.randn(5, 1, generator=g).expand(5, 300),
        "perm": torch.randn(4, 5, 6, 7, generator=g).permute(2, 0, 3, 1),
        "u8": torch.randint(0, 255, (50, 40), dtype=torch.uint8, generator=g).t()[::2, 1::3],
        "f64": torch.randn(9, 11, dtype=torch.float64, generator=g).t()[1:],
        "bf16": torch.randn(64, 3, generator=g).to(torch.bfloat16).t(),
        "rows": torch.randn(2, 3, generator=g)[:, :, None].expand(2, 3, 1000),
        "zeros": torch.zeros(1).expand(300, 300),
        "tall": torch.randn(3, 3000, generator=g).t(),
    }


@pytest.mark.parametrize("chunk", [8 << 20, 64, 24])
@pytest.mark.parametrize("legacy", [False, True])
def test_strided_views_gathered_equal_torch(tmp_path, monkeypatch, chunk, legacy):
    import ckptfix.ops.convert as C
    import ckptfix.ops.convert.items

    monkeypatch.setattr(ckptfix.ops.convert.items, "CHUNK", chunk)
    views = _views()
    src = tmp_path / "v.pth"
    torch.save(views, src, _use_new_zipfile_serialization=not legacy)
    C.convert_to_safetensors(str(src), str(tmp_path / "v.safetensors"), allow_expand=True)
    back = load_file(str(tmp_path / "v.safetensors"))
    for k, v in views.items():
        assert torch.equal(back[k], v.contiguous()), k


def test_gather_needs_no_numpy(tmp_path):
    src = tmp_path / "v.pth"
    views = {k: v for k, v in _views().items() if k != "zeros"}
    torch.save(views, src)
    code = textwrap.dedent(f"""
        import sys
        sys.modules["numpy"] = None  # import numpy -> ImportError
        from ckptfix.ops.convert import convert_to_safetensors
        convert_to_safetensors({str(src)!r}, {str(tmp_path / "v.safetensors")!r})
        assert "torch" not in sys.modules
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    back = load_file(str(tmp_path / "v.safetensors"))
    assert all(torch.equal(back[k], v.contiguous()) for k, v in views.items())


def test_expanded_tensor_refused_quickly_unless_allowed(tmp_path, capsys):
    src = tmp_path / "e.pth"
    torch.save({"w": torch.zeros(1).expand(20000, 20000)}, src)
    assert src.stat().st_size < 4096
    from helpers import run_cli

    r = run_cli("convert", src, "-o", tmp_path / "e.safetensors")
    assert r.returncode == 12 and "'w'" in r.stderr and "--allow-expand" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "e.safetensors").exists()
    torch.save({"w": torch.arange(3.0)[:, None].expand(3, 300_000)}, src)  # 3.6 MB: inside the 64 MiB slack
    rc, _, err = _cli(capsys, "convert", src, "-o", tmp_path / "ok.safetensors")
    assert rc == 0, err
    big = torch.arange(4.0)[:, None].expand(4, 5_000_000)  # 80 MB from ~1.5 KB
    torch.save({"w": big}, src)
    rc, _, err = _cli(capsys, "convert", src, "-o", tmp_path / "big.safetensors")
    assert rc == 12 and "--allow-expand" in err
    rc, _, err = _cli(capsys, "convert", src, "-o", tmp_path / "big.safetensors", "--allow-expand")
    assert rc == 0, err
    assert torch.equal(load_file(str(tmp_path / "big.safetensors"))["w"], big.contiguous())


def test_oversized_index_refused_without_parsing(tmp_path, capsys):
    d = _shards(tmp_path)
    p = d / "model.safetensors.index.json"
    filler = ",".join(f'"k{i}": "model-00001-of-00002.safetensors"' for i in range(900_000))
    p.write_text('{"weight_map": {' + filler + "}}")
    assert p.stat().st_size > 32 << 20
    every_command(capsys, p, tmp_path, 12, contains="CKPTFIX_MAX_JSON_MB")


def test_oversized_safetensors_header_refused_with_the_env_var_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CKPTFIX_MAX_JSON_MB", "1")
    hdr = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(30_000)}
    p = tmp_path / "wide.safetensors"
    p.write_bytes(hostile.safetensors_bytes(hdr))
    assert p.stat().st_size > 1 << 20
    every_command(capsys, p, tmp_path, 12, scan_codes=(0, 12), contains="CKPTFIX_MAX_JSON_MB")
    monkeypatch.setenv("CKPTFIX_MAX_JSON_MB", "8")
    assert inspect_checkpoint(p).tensor_count == 30_000


# --- moved from test_review_ckpt.py: damaged zip records, legacy streams and safetensors headers that lie


def test_unreadable_non_storage_record_is_a_clean_error(tmp_path):
    """A damaged small record (here: an unknown compression method on 'version') is exit 4, not a crash."""
    import struct
    import zipfile

    from helpers import assert_one_line_error, dp_state_dict, leftovers, rezip, run_cli

    src = tmp_path / "base.pt"
    torch.save({"state_dict": dp_state_dict()}, src)
    rz = tmp_path / "rz.pt"
    rezip(src, rz, lambda n: zipfile.ZIP_DEFLATED if n.endswith("/version") else zipfile.ZIP_STORED)
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
    assert leftovers(tmp_path) == []


def test_legacy_storage_with_a_negative_or_absurd_size_is_corrupt(tmp_path):
    """A legacy stream whose storage size is negative or absurd is corrupt (exit 4).

    strip-prefix, inspect and convert all say so in one line and write nothing.
    """
    import struct

    from helpers import assert_one_line_error, leftovers, run_cli

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
    assert leftovers(tmp_path) == []


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
    from safetensors import SafetensorError, safe_open

    from helpers import assert_one_line_error, run_cli, sha256, write_raw_safetensors

    header, n = LYING[name]
    p = tmp_path / "m.safetensors"
    write_raw_safetensors(p, header, bytes(range(n)))
    with pytest.raises(SafetensorError):
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


def test_key_pointing_at_a_tensor_names_it_in_user_terms(tmp_path):
    """``--key`` that names a tensor says so (with its shape) and suggests the enclosing key."""
    from ckptfix.errors import KeyConflictError
    from ckptfix.formats import read_checkpoint

    p = tmp_path / "c.pt"
    torch.save({"model": {"a": torch.ones(2)}, "w": torch.zeros(3)}, p)
    cf = read_checkpoint(p)
    with pytest.raises(KeyConflictError, match=r"holds a tensor \(shape \[2\]\), not a state dict; try --key 'model'"):
        cf.state_dict("model/a")
    with pytest.raises(KeyConflictError, match=r"holds a tensor \(shape \[3\]\)"):
        cf.state_dict("w")


def test_a_directory_lists_real_checkpoints_before_probe_sidecars(tmp_path):
    d = tmp_path / "runs"
    d.mkdir()
    for n in ("a_epoch1.probe.pt", "a_epoch2.probe.pt", "b_epoch1.probe.pt", "z_epoch1.pt", "z_epoch2.pt"):
        torch.save({"x": torch.zeros(1)}, d / n)
    r = run_cli("inspect", "runs", cwd=tmp_path)
    assert r.rc == 3
    assert "it holds z_epoch1.pt, z_epoch2.pt, a_epoch1.probe.pt and 2 more: pass one of them" in r.err, r.err
