"""ckptfix's format sniffer against torch's own dispatch (issue 21, items 1, 5 and 10).

torch is the oracle: :func:`torch_branch` calls ``torch.load(path, weights_only=True)`` with the readers
behind each branch replaced by stubs that only say which branch was taken (nothing is unpickled), so every
crafted polyglot and random prefix is classified as torch.load classifies it.  Where a payload must really
run to prove a reading is live, torch.load(weights_only=False) runs in a subprocess and the payload only
touches a marker file in tmp_path.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from unittest import mock

import hostile
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfix.errors import CkptfixError, CorruptCheckpointError
from ckptfix.formats import Format, sniff
from ckptfix.formats import sniffing as sniffing_mod
from ckptfix.ops.inspect import scan_checkpoint


class _Branch(Exception):
    pass


def torch_branch(path: str | Path) -> str:
    """The branch torch.load(path) takes: safetensors, zip, torchscript, zip-error, tar, tar-error or pickle."""
    import torch.serialization as ser

    def stop(name):
        def f(*a, **k):
            raise _Branch(name)

        return f

    with (
        mock.patch.object(ser, "_load", stop("zip")),
        mock.patch.object(ser._weights_only_unpickler, "load", stop("pickle")),
        mock.patch("safetensors.torch.load_file", stop("safetensors")),
    ):
        try:
            torch.load(str(path), weights_only=True)
        except _Branch as b:
            return str(b)
        except RuntimeError as e:
            msg = str(e)
            if "TorchScript" in msg:
                return "torchscript"
            if "legacy .tar format" in msg:
                return "tar"
            if "zip archive" in msg or "PytorchStreamReader" in msg or "central directory" in msg:
                return "zip-error"
            raise
        except Exception as e:  # noqa: BLE001 - tarfile's own errors that torch lets through
            return f"tar-error:{type(e).__name__}"
    return "loaded"  # pragma: no cover - every branch is stubbed


#: ckptfix's format -> the branch torch.load takes for it (safetensors: by name, else its pickle reader fails)
EXPECTED = {
    Format.TORCH_ZIP: "zip",
    Format.TORCHSCRIPT: "torchscript",
    Format.TORCH_TAR: "tar",
    Format.TORCH_LEGACY: "pickle",
    Format.PICKLE: "pickle",
}


def ckptfix_kind(path: Path) -> Format | None:
    try:
        return sniff(str(path))
    except CorruptCheckpointError:
        return None


def assert_agrees(path: Path) -> None:
    """ckptfix and torch classify ``path`` alike: the same branch, or ckptfix refuses what torch fails on."""
    got = ckptfix_kind(path)
    want = torch_branch(path)
    if got == Format.SAFETENSORS:
        named = path.with_name(path.stem + ".safetensors")
        named.write_bytes(path.read_bytes())
        assert torch_branch(named) == "safetensors"
        # not named *.safetensors, torch unpickles it, and no pickle reader gets past its first bytes
        assert want == "pickle"
        with pytest.raises(Exception):  # noqa: B017 - whatever the unpickler raises
            pickle.loads(path.read_bytes())
        return
    if got is None:
        # refused: torch's branch fails too (no checkpoint there for torch either)
        assert want in ("pickle", "zip-error", "tar") or want.startswith("tar-error"), (path, want)
        if want == "pickle":
            assert not sniffing_mod.starts_like_pickle(str(path)), path
        return
    assert EXPECTED[got] == want, (path, got, want)


# --------------------------------------------------------------------------- builders


def tar_header(name: bytes, size: int) -> bytes:
    """A ustar header with raw ``name`` bytes (which may start a pickle or a zip) and a valid checksum."""
    info = tarfile.TarInfo("x")
    info.size = size
    h = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    h[0:100] = name.ljust(100, b"\0")
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def tar_member(name: bytes, data: bytes) -> bytes:
    return tar_header(name, len(data)) + data + b"\0" * (-len(data) % 512)


def tar_pickle_polyglot(storages: bytes, first_name: bytes = b"\x80\x02}.") -> bytes:
    """A pre-0.4 torch tar archive whose first member's *name* is a complete benign pickle."""
    return (
        tar_member(first_name, b"")
        + tar_member(b"sys_info", pickle.dumps({"little_endian": True}, protocol=2))
        + tar_member(b"storages", storages)
        + tar_member(b"tensors", pickle.dumps(0, protocol=2))
        + tar_member(b"pickle", pickle.dumps({}, protocol=2))
        + b"\0" * 1024
    )


def torch_zip_bytes(obj=None) -> bytes:
    buf = io.BytesIO()
    torch.save(obj if obj is not None else {"w": torch.zeros(2)}, buf)
    return buf.getvalue()


def safetensors_with_header_len(n: int) -> bytes:
    """A valid safetensors file whose JSON header is exactly ``n`` bytes (padded with spaces)."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    assert n >= len(header)
    return struct.pack("<Q", n) + header + b" " * (n - len(header)) + b"\0\0\0\0"


def canary_cmd(tmp_path: Path) -> tuple[Path, bytes]:
    canary = tmp_path / "canary"
    return canary, hostile.global_reduce("os", "system", f"touch {canary}", proto=2) + b"."


def run_torch_load_unsafe(path: Path) -> None:
    """torch.load(weights_only=False) in a subprocess: proves which reading torch runs (payloads only touch files)."""
    code = f"import torch\ntry:\n    torch.load({str(path)!r}, weights_only=False)\nexcept Exception:\n    pass\n"
    subprocess.run([sys.executable, "-c", code], timeout=120, check=False, capture_output=True)


# --------------------------------------------------------------------------- item 1: tar/pickle polyglot


def test_tar_pickle_polyglot_is_a_tar_and_never_safe(tmp_path):
    canary, payload = canary_cmd(tmp_path)
    p = tmp_path / "poly.pt"
    p.write_bytes(tar_pickle_polyglot(payload))
    assert pickle.loads(p.read_bytes()) == {}  # a benign pickle to pickle.load ...
    assert torch_branch(p) == "tar"  # ... a tar archive to torch.load
    run_torch_load_unsafe(p)
    assert canary.exists()  # and torch's tar loader runs the storages member
    canary.unlink()
    assert sniff(str(p)) == Format.TORCH_TAR
    r = scan_checkpoint(p)
    assert r.verdict == "dangerous" and "os.system" in r.dangerous, r.to_dict()
    assert any("polyglot" in n for n in r.notes)
    assert not canary.exists()


@pytest.mark.parametrize("name", ["model.ckpt", "pytorch_model-00001-of-00002.bin"])
def test_tar_pickle_polyglot_as_shard_and_ckpt(tmp_path, name):
    canary, payload = canary_cmd(tmp_path)
    p = tmp_path / name
    p.write_bytes(tar_pickle_polyglot(payload))
    if name.endswith(".bin"):
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
        target = tmp_path / "pytorch_model.bin.index.json"
    else:
        target = p
    assert _cli_rc(["scan", str(target)]) == 11
    rc = _cli_rc(["inspect", str(target)])
    assert rc != 0
    assert not canary.exists()


def _cli_rc(argv: list[str]) -> int:
    r = subprocess.run([sys.executable, "-m", "ckptfix", *argv], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode


def test_cli_scan_says_dangerous_for_tar_polyglot(tmp_path):
    canary, payload = canary_cmd(tmp_path)
    p = tmp_path / "poly.pt"
    p.write_bytes(tar_pickle_polyglot(payload))
    r = subprocess.run([sys.executable, "-m", "ckptfix", "scan", str(p)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 11 and "dangerous" in r.stdout, (r.stdout, r.stderr)
    r = subprocess.run(
        [sys.executable, "-m", "ckptfix", "inspect", str(p)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0 and "weights_only ok" not in r.stdout
    assert not canary.exists()


# --------------------------------------------------------------------------- the differential table


def _cases(tmp: Path) -> dict[str, bytes]:
    _, payload = canary_cmd(tmp)
    zip_bytes = torch_zip_bytes()
    legacy = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    tar_of_zip = io.BytesIO()
    with tarfile.open(fileobj=tar_of_zip, mode="w") as tar:
        info = tarfile.TarInfo("archive.pt")
        info.size = len(zip_bytes)
        tar.addfile(info, io.BytesIO(zip_bytes))
    return {
        "torch-zip": zip_bytes,
        "legacy": legacy.getvalue(),
        "bare-pickle": pickle.dumps({"a": 1}, protocol=2),
        "proto0-pickle": pickle.dumps({"a": 1}, protocol=0),
        "proto1-pickle": pickle.dumps({"a": 1}, protocol=1),
        "proto0-global-reduce": b"cos\nsystem\n(S'true'\ntR.",
        "tar/pickle": tar_pickle_polyglot(payload),
        "tar/pickle-benign-storages": tar_pickle_polyglot(pickle.dumps(0, protocol=2)),
        "tar/proto0-pickle-name": tar_pickle_polyglot(payload, first_name=b"N."),
        "tar/zip-name": tar_pickle_polyglot(payload, first_name=b"PK\x03\x04"),
        "zip-inside-tar": tar_of_zip.getvalue(),
        "zip-inside-tar-named-PK": tar_member(b"PK\x03\x04", zip_bytes) + b"\0" * 1024,
        "pickle+zip": pickle.dumps({"a": 1}, protocol=2) + zip_bytes,
        "zip+pickle": zip_bytes + payload,
        "safetensors": safetensors_with_header_len(0x100),
        "safetensors-len-0x280": safetensors_with_header_len(0x280),
        "safetensors-len-0x480": safetensors_with_header_len(0x480),
        "safetensors/pickle-head": b"\x80\x02}." + b"\0" * 4 + b"{}",
        "text": b"hello world, not a checkpoint\n" * 3,
        "python-source": b"class Foo:\n    x = 1\n",
        "zeros": b"\0" * 2048,
    }


def test_differential_crafted(tmp_path):
    for name, data in _cases(tmp_path).items():
        p = tmp_path / f"{name.replace('/', '_')}.pt"
        p.write_bytes(data)
        try:
            assert_agrees(p)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


PREFIXES = [b"", b"\x80", b"\x80\x02", b"\x80\x05", b"PK", b"PK\x03\x04", b"(", b"c", b"}", b"{", b"\0" * 8]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    prefix=st.one_of(st.sampled_from(PREFIXES), st.binary(max_size=24)),
    body=st.sampled_from(["torch-zip", "legacy", "bare-pickle", "proto0-pickle", "tar/pickle", "safetensors"]),
    cut=st.integers(min_value=0, max_value=600),
)
def test_differential_random_prefixes(tmp_path_factory, prefix, body, cut):
    tmp = tmp_path_factory.mktemp("rnd")
    data = _BODIES.setdefault(body, _cases(tmp)[body])
    p = tmp / "x.pt"
    p.write_bytes(prefix + data[cut:])
    if p.stat().st_size == 0:
        return
    try:
        assert_agrees(p)
    except CkptfixError:
        pass  # a typed refusal (resource limits on crafted sizes) is never a disagreement about the branch


_BODIES: dict[str, bytes] = {}


# --------------------------------------------------------------------------- item 5: protocol 0/1 pickles


def _proto01_payloads(canary: Path) -> dict[str, bytes]:
    cmd = f"touch {canary}"
    s = hostile._str_arg(cmd)
    return {
        "inst": b"(" + s + b"ios\nsystem\n.",
        "obj": b"(cos\nsystem\n" + s + b"o.",
        "global+reduce": b"cos\nsystem\n(" + s + b"tR.",
        "proto1-global+reduce": b"cos\nsystem\n(" + s + b"tR}.",  # BINUNICODE-free proto 1 mix: STOP ends it
        "legacy-stream-first": b"cos\nsystem\n(" + s + b"tR." + pickle.dumps(1001, protocol=2),
    }


@pytest.mark.parametrize("route", ["inst", "obj", "global+reduce", "proto1-global+reduce", "legacy-stream-first"])
def test_protocol0_pickles_are_pickles(tmp_path, route):
    canary = tmp_path / "canary"
    p = tmp_path / "old.pt"
    p.write_bytes(_proto01_payloads(canary)[route])
    assert torch_branch(p) == "pickle"
    run_torch_load_unsafe(p)
    assert canary.exists()  # torch.load runs it
    canary.unlink()
    assert sniff(str(p)) in (Format.PICKLE, Format.TORCH_LEGACY)
    r = subprocess.run([sys.executable, "-m", "ckptfix", "scan", str(p)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 11 and "dangerous" in r.stdout and "text file" not in r.stderr, (r.stdout, r.stderr)
    assert not canary.exists()


def test_text_is_still_text(tmp_path):
    for data in (b"hello world\n", b"class Foo:\n    x = 1\n", b"cat\n", b"import os\n"):
        p = tmp_path / "t.pt"
        p.write_bytes(data)
        with pytest.raises(CorruptCheckpointError, match="text file"):
            sniff(str(p))


# --------------------------------------------------------------------------- item 10: safetensors header lengths


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n=st.one_of(
        st.integers(min_value=0, max_value=1 << 20),
        # lengths whose first two bytes read as PROTO 2..5 (0x280, 0x380 ... 0xf0580)
        st.builds(lambda hi, b: (hi << 16) | (b << 8) | 0x80, st.integers(0, 15), st.integers(2, 5)),
    )
)
def test_safetensors_any_header_length_is_safetensors(tmp_path_factory, n):
    from ckptfix.formats import read_checkpoint

    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    p = tmp_path_factory.mktemp("st") / "m.bin"
    if n < len(header):
        # too short for a valid header: whatever it is, it is not read as a pickle unless it is one
        p.write_bytes(struct.pack("<Q", n) + b"{" + b" " * 40 + b"\0\0\0\0")
        try:
            kind = sniff(str(p))
        except CorruptCheckpointError:
            return
        if kind in (Format.PICKLE, Format.TORCH_LEGACY):
            assert sniffing_mod.starts_like_pickle(str(p))
        return
    p.write_bytes(safetensors_with_header_len(n))
    assert sniff(str(p)) == Format.SAFETENSORS
    cf = read_checkpoint(p)
    assert list(cf.state_root) == ["w"]


@pytest.mark.parametrize("n", [0x280, 0x380, 0x480, 0x580, 0x10280])
def test_safetensors_header_length_like_proto_cli(tmp_path, n):
    p = tmp_path / "m.safetensors"
    p.write_bytes(safetensors_with_header_len(n))
    assert p.read_bytes()[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
    for argv in (["inspect", str(p)], ["convert", str(p), "-o", str(tmp_path / f"o{n}.pt"), "--to", "pt"]):
        r = subprocess.run([sys.executable, "-m", "ckptfix", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (argv, r.stderr)
    r = subprocess.run([sys.executable, "-m", "ckptfix", "scan", str(p)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "safe" in r.stdout, (r.stdout, r.stderr)


def test_safetensors_lookalike_header_over_limit_is_a_pickle(tmp_path):
    """A header length over safetensors' own limit is no safetensors file: the pickle reading is torch's."""
    p = tmp_path / "x.pt"
    p.write_bytes(b"\x80\x02}." + b"\0" * 4 + b"{}")
    assert torch_branch(p) == "pickle"
    assert sniff(str(p)) == Format.PICKLE


# --------------------------------------------------------------------------- zip appended to a pickle


def test_pickle_with_zip_appended_scans_both_readings(tmp_path):
    canary, _ = canary_cmd(tmp_path)
    evil = hostile.wrap_dict(hostile.global_reduce("os", "system", f"touch {canary}", proto=0))
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("archive/data.pkl", evil)
    p = tmp_path / "x.pt"
    p.write_bytes(pickle.dumps({"a": 1}, protocol=2) + inner.getvalue())
    assert torch_branch(p) == "pickle" and sniff(str(p)) == Format.PICKLE
    r = scan_checkpoint(p)
    assert r.verdict == "dangerous", r.to_dict()
    assert not canary.exists()


def test_sniff_bounds_tar_long_name(tmp_path):
    """A GNU long-name header whose size field asks for gigabytes is refused, not read into memory."""
    info = tarfile.TarInfo("././@LongLink")
    info.type = tarfile.GNUTYPE_LONGNAME
    info.size = 1 << 40
    p = tmp_path / "x.pt"
    p.write_bytes(info.tobuf(format=tarfile.GNU_FORMAT) + b"\0" * 1024)
    with pytest.raises(CkptfixError):
        sniff(str(p))
    assert os.path.getsize(p) < 4096


# --------------------------------------------------------------------------- a zip that is also a tar


def zip_tar_polyglot(tar_rest: bytes) -> bytes:
    """A torch zip whose first 512 bytes are also a valid tar header (member size 0), ``tar_rest`` after it.

    The zip's first member (stored) holds ``tar_rest``; its local header's extra field carries the tar
    header's fields, so torch.load reads a zip and tarfile reads the tar members in ``tar_rest``.
    """

    def build(extra: bytes) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            info = zipfile.ZipInfo("archive/junk", date_time=(2020, 1, 1, 0, 0, 0))
            info.extra = extra
            zf.writestr(info, tar_rest)
            for name, data in (
                ("archive/data.pkl", pickle.dumps({}, protocol=2)),
                ("archive/byteorder", b"little"),
                ("archive/version", b"3\n"),
            ):
                zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data)
        return buf.getvalue()

    name_end = 30 + len("archive/junk")
    block = struct.pack("<HH", 0xCAFE, 512 - name_end - 4)
    first = bytearray(build(block + b"\0" * (512 - name_end - 4))[:512])
    info = tarfile.TarInfo("x")
    info.size = 0
    tar = info.tobuf(format=tarfile.USTAR_FORMAT)
    first[100:512] = tar[100:512]
    first[148:156] = b" " * 8
    first[148:156] = b"%06o\0 " % sum(first)
    data = build(bytes(first[name_end:512]))
    assert data[:512] == bytes(first)
    return data


def test_zip_tar_polyglot_scans_both_readings(tmp_path):
    canary, payload = canary_cmd(tmp_path)
    rest = (
        tar_member(b"storages", payload)
        + tar_member(b"tensors", pickle.dumps(0, protocol=2))
        + tar_member(b"pickle", pickle.dumps({}, protocol=2))
        + b"\0" * 1024
    )
    p = tmp_path / "zt.pt"
    p.write_bytes(zip_tar_polyglot(rest))
    with tarfile.open(p) as t:  # a tar to tarfile (and to torch before 1.6) ...
        assert "storages" in t.getnames()
    assert torch_branch(p) == "zip"  # ... a zip to torch.load
    assert_agrees(p)
    assert sniff(str(p)) == Format.TORCH_ZIP
    r = scan_checkpoint(p)
    assert r.verdict == "dangerous" and "os.system" in r.dangerous, r.to_dict()
    assert not canary.exists()


def test_zip_header_where_torchs_tar_reader_stopped(tmp_path):
    """torch checks for a zip at the offset its failed tar reader left the file (512), not at 0: a pickle there
    is never unpickled ("is a zip archive"); ckptfix refuses it too (hypothesis found b"\\x80" + a cut zip)."""
    p = tmp_path / "x.pt"
    p.write_bytes(pickle.dumps({"a": 1}, protocol=2).ljust(512, b"\0") + b"PK\x03\x04" + b"\0" * 64)
    assert torch_branch(p) == "zip-error"
    assert sniffing_mod.torch_branch(str(p)) == "zip-error"
    with pytest.raises(CorruptCheckpointError, match="is a zip archive"):
        sniff(str(p))
    q = tmp_path / "cut.pt"
    q.write_bytes(b"\x80" + torch_zip_bytes()[339:])
    assert_agrees(q)
