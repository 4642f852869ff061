"""Bad input: every broken file gives one ``Error:`` line and a distinct exit code; fuzzing never crashes."""

from __future__ import annotations

import json
import os
import random
import struct
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfix.cli import main
from ckptfix.errors import CheckpointNotFoundError, CkptfixError, CorruptCheckpointError
from ckptfix.formats import read_checkpoint, sniff
from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint
from ckptfix.pickles import scan_globals

from helpers import CkptFactory, assert_one_line_error, run_cli

pytestmark = pytest.mark.filterwarnings("ignore")


# --------------------------------------------------------------------------- builders of broken files


def _missing(tmp_path, ckpt):
    return tmp_path / "does_not_exist.pt"


def _empty_dir(tmp_path, ckpt):
    d = tmp_path / "emptydir"
    d.mkdir()
    (d / "README.txt").write_text("nothing here")
    return d


def _empty_file(tmp_path, ckpt):
    p = tmp_path / "empty.pt"
    p.write_bytes(b"")
    return p


def _truncated_zip(tmp_path, ckpt):
    b = ckpt.plain("full.pt")
    data = b.path.read_bytes()
    p = tmp_path / "truncated.pt"
    p.write_bytes(data[: len(data) // 2])
    return p


def _random_bytes(tmp_path, ckpt):
    p = tmp_path / "random.pt"
    p.write_bytes(bytes(random.Random(0).randrange(1, 256) for _ in range(4096)).replace(b"\x80", b"\x81"))
    return p


def _text_file(tmp_path, ckpt):
    p = tmp_path / "notes.pt"
    p.write_text("this is not a checkpoint\nsecond line\n" * 20)
    return p


def _st_corrupt_header(tmp_path, ckpt):
    b = ckpt.safetensors("good.safetensors")
    data = bytearray(b.path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 + n // 2 : 8 + n // 2 + 6] = b'\x00}{]"\x01'
    p = tmp_path / "bad_header.safetensors"
    p.write_bytes(bytes(data))
    return p


def _st_huge_header(tmp_path, ckpt):
    b = ckpt.safetensors("good2.safetensors")
    data = b.path.read_bytes()
    p = tmp_path / "huge_header.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 62) + data[8:])
    return p


def _st_truncated(tmp_path, ckpt):
    b = ckpt.safetensors("good3.safetensors")
    data = b.path.read_bytes()
    p = tmp_path / "short.safetensors"
    p.write_bytes(data[:-20])
    return p


def _sharded_missing(tmp_path, ckpt):
    b = ckpt.sharded_bin("hf_missing")
    os.unlink(b.extra["dir"] / b.extra["shards"][1])
    return b.path


def _json_not_index(tmp_path, ckpt):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"hidden": 3}))
    return p


def _zip_without_data_pkl(tmp_path, ckpt):
    import zipfile

    p = tmp_path / "other.zip"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("hello.txt", "hi")
    return p


def _legacy_truncated(tmp_path, ckpt):
    b = ckpt.legacy("legacy_full.pt")
    data = b.path.read_bytes()
    p = tmp_path / "legacy_trunc.pt"
    p.write_bytes(data[:-10])
    return p


BAD = [
    ("missing", _missing, 3),
    ("empty_dir", _empty_dir, 3),
    ("empty_file", _empty_file, 4),
    ("truncated_zip", _truncated_zip, 4),
    ("random_bytes", _random_bytes, 4),
    ("text_file", _text_file, 4),
    ("st_corrupt_header", _st_corrupt_header, 4),
    ("st_huge_header", _st_huge_header, 4),
    ("st_truncated", _st_truncated, 4),
    ("sharded_missing_shard", _sharded_missing, 3),
    ("json_not_index", _json_not_index, 4),
    ("zip_without_data_pkl", _zip_without_data_pkl, 4),
    ("legacy_truncated", _legacy_truncated, 4),
]


@pytest.mark.parametrize("name,make,code", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("cmd", ["inspect", "scan", "strip-prefix"])
def test_bad_input_one_line_error_in_process(tmp_path, ckpt, capsys, name, make, code, cmd, request):
    path = make(tmp_path, ckpt)
    before = sorted(os.listdir(tmp_path))
    rc = main([cmd, str(path)])
    cap = capsys.readouterr()
    if cmd == "scan" and name == "legacy_truncated":  # scan reads the pickles only: they are whole and safe
        assert rc == 0 and cap.err == "", (rc, cap.err)
        return
    assert rc == code, (rc, cap.err)
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), cap.err
    assert "Traceback" not in cap.err and "internal error" not in cap.err
    assert sorted(os.listdir(tmp_path)) == before  # nothing written


@pytest.mark.parametrize("name,make,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_library_raises_ckptfix_errors(tmp_path, ckpt, name, make, code):
    path = make(tmp_path, ckpt)
    with pytest.raises(CkptfixError) as ei:
        read_checkpoint(path)
    assert ei.value.exit_code == code
    with pytest.raises(CkptfixError) as ei:
        inspect_checkpoint(path)
    assert ei.value.exit_code == code


@pytest.mark.parametrize("name,make,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_load_anywhere_raises_ckptfix_errors(tmp_path, ckpt, name, make, code):
    from ckptfix.ops.load import load_anywhere

    path = make(tmp_path, ckpt)
    with pytest.raises(CkptfixError) as ei:
        load_anywhere(path)
    assert ei.value.exit_code == code


def test_error_classes_match_builtins(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError):
        read_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(ValueError):
        read_checkpoint(_empty_file(tmp_path, ckpt))
    with pytest.raises(CheckpointNotFoundError):
        sniff(str(_empty_dir(tmp_path, ckpt)))
    with pytest.raises(CorruptCheckpointError):
        sniff(str(_text_file(tmp_path, ckpt)))


def test_subprocess_errors_have_no_traceback(tmp_path, ckpt):
    """Through the real entry point: stderr is one line, codes are distinct per cause."""
    cases = [(_missing, 3), (_empty_file, 4), (_st_huge_header, 4), (_sharded_missing, 3)]
    for make, code in cases:
        p = run_cli("inspect", make(tmp_path, ckpt))
        assert_one_line_error(p, code)
        assert p.stdout == ""


def test_pickle_calling_os_system_inspect_and_scan(tmp_path, ckpt, capsys):
    b = ckpt.evil("evil.pt")
    p = run_cli("scan", b.path)
    assert p.returncode == 11 and "Traceback" not in p.stderr
    assert "dangerous" in p.stdout
    p = run_cli("inspect", b.path)
    assert p.returncode == 0, p.stderr
    assert "placeholder" in p.stdout
    assert not b.extra["marker"].exists()


def test_debug_flag_shows_traceback(tmp_path, ckpt):
    p = run_cli("--debug", "inspect", _empty_file(tmp_path, ckpt))
    assert p.returncode == 4
    assert "Traceback" in p.stderr and "Error: " in p.stderr


# --------------------------------------------------------------------------- fuzzing

_FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)

_prefixes = st.sampled_from(
    [
        b"",
        b"PK\x03\x04",
        b"PK\x05\x06",
        b"\x80\x02",
        b"\x80\x04",
        b"{",
        struct.pack("<Q", 16) + b"{",
        struct.pack("<Q", 3) + b'{"a',
        b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.",
    ]
)


def _call_expect_ckptfix(fn, p) -> None:
    try:
        fn(p)
    except CkptfixError:
        pass


def _write_tmp(data: bytes) -> str:
    fd, p = tempfile.mkstemp(suffix=".pt")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return p


@_FUZZ
@given(prefix=_prefixes, body=st.binary(max_size=600))
def test_fuzz_sniff_and_read_raise_only_ckptfix_errors(prefix, body):
    p = _write_tmp(prefix + body)
    try:
        for fn in (sniff, read_checkpoint, scan_checkpoint, inspect_checkpoint):
            _call_expect_ckptfix(fn, p)
    finally:
        os.unlink(p)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=800))
def test_fuzz_scan_globals_never_raises(data):
    r = scan_globals(data)
    assert isinstance(r.globals, dict)
    r2 = scan_globals(b"\x80\x02" + data)
    assert r2.error is None or isinstance(r2.error, str)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=200), cut=st.integers(0, 200))
def test_fuzz_scan_globals_on_truncated_real_pickle(data, cut):
    import pickle

    real = pickle.dumps({"a": [1, 2.0, "x"], "b": os.path.join}, protocol=4)
    r = scan_globals(real[:cut] + data)
    assert isinstance(r.globals, dict)


@pytest.fixture(scope="module")
def _valid_small(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzsrc")
    f = CkptFactory(root)
    return {
        "zip": f.plain().path.read_bytes(),
        "legacy": f.legacy().path.read_bytes(),
        "safetensors": f.safetensors().path.read_bytes(),
        "lightning": f.lightning().path.read_bytes(),
    }


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    which=st.sampled_from(["zip", "legacy", "safetensors", "lightning"]),
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=8),
    truncate=st.one_of(st.none(), st.floats(0, 1)),
)
def test_fuzz_mutated_checkpoints(_valid_small, which, flips, truncate):
    data = bytearray(_valid_small[which])
    for pos, val in flips:
        data[int(pos * len(data))] = val
    if truncate is not None:
        data = data[: int(truncate * len(data))]
    p = _write_tmp(bytes(data))
    try:
        for fn in (read_checkpoint, scan_checkpoint, inspect_checkpoint):
            _call_expect_ckptfix(fn, p)
    finally:
        os.unlink(p)


def test_mutated_pickle_region_of_zip(_valid_small):
    """Every single-byte corruption inside data.pkl: only ckptfix errors (deterministic sweep)."""
    import zipfile

    data = _valid_small["zip"]
    p0 = _write_tmp(data)
    try:
        zf = zipfile.ZipFile(p0)
        info = next(i for i in zf.infolist() if i.filename.endswith("data.pkl"))
        hdr = data[info.header_offset : info.header_offset + 30]
        nlen, elen = struct.unpack("<HH", hdr[26:30])
        start = info.header_offset + 30 + nlen + elen
    finally:
        os.unlink(p0)
    rng = random.Random(1)
    for i in range(start, start + info.compress_size, 3):
        d = bytearray(data)
        d[i] = rng.randrange(256)
        p = _write_tmp(bytes(d))
        try:
            for fn in (read_checkpoint, scan_checkpoint):
                _call_expect_ckptfix(fn, p)
        finally:
            os.unlink(p)


# --------------------------------------------------------------------------- regressions found by fuzzing


def _zip_parts(data: bytes, member_suffix: str):
    """(local header offset, central header offset) of the member whose name ends with member_suffix."""
    import io
    import zipfile

    zf = zipfile.ZipFile(io.BytesIO(data))
    info = next(i for i in zf.infolist() if i.filename.endswith(member_suffix))
    cd = data.find(b"PK\x01\x02" + data[info.header_offset + 4 : info.header_offset + 6])
    while cd != -1:
        nlen = struct.unpack("<H", data[cd + 28 : cd + 30])[0]
        if data[cd + 46 : cd + 46 + nlen].decode() == info.filename:
            break
        cd = data.find(b"PK\x01\x02", cd + 4)
    return info.header_offset, cd


def _corrupt_local_name(data, suffix):
    d = bytearray(data)
    lh, _ = _zip_parts(data, suffix)
    d[lh + 30 + 1] = 0xC3  # flag bit 11 (utf-8) is set: the local name no longer decodes
    d[lh + 30 + 2] = 0x28
    return bytes(d)


def _unsupported_version(data, suffix):
    d = bytearray(data)
    _, cd = _zip_parts(data, suffix)
    d[cd + 6] = 0xFF  # "version needed to extract" 25.5: zipfile raises NotImplementedError
    return bytes(d)


def _unsupported_method(data, suffix):
    d = bytearray(data)
    lh, cd = _zip_parts(data, suffix)
    d[cd + 10] = 99  # compression method 99 (AES): zipfile raises NotImplementedError
    d[lh + 8] = 99
    return bytes(d)


def _renamed_local(data, suffix):
    d = bytearray(data)
    lh, _ = _zip_parts(data, suffix)
    nlen = struct.unpack("<H", data[lh + 26 : lh + 28])[0]
    d[lh + 30 + nlen - 1] = ord("X")  # local name differs from the central directory: BadZipFile
    return bytes(d)


def _bad_cd_offset(data, suffix):
    d = bytearray(data)
    eocd = data.rfind(b"PK\x05\x06")
    z64 = data.rfind(b"PK\x06\x06")
    if z64 != -1:
        off = struct.unpack("<Q", data[z64 + 48 : z64 + 56])[0]
        d[z64 + 48 : z64 + 56] = struct.pack("<Q", off + 100000)
    off = struct.unpack("<I", data[eocd + 16 : eocd + 20])[0]
    if off != 0xFFFFFFFF:
        d[eocd + 16 : eocd + 20] = struct.pack("<I", off + 100000)
    return bytes(d)  # every header offset becomes negative: seek() fails with EINVAL


_ZIP_BUGS = [
    (
        "data.pkl local name not utf-8",
        "plain",
        _corrupt_local_name,
        "data.pkl",
        "read_zip: zf.read(data.pkl) raises UnicodeDecodeError, not caught",
    ),
    (
        "data.pkl unsupported compression",
        "plain",
        _unsupported_method,
        "data.pkl",
        "read_zip: zf.read(data.pkl) raises NotImplementedError('That compression method is not supported')",
    ),
    (
        "central dir unsupported zip version",
        "plain",
        _unsupported_version,
        "data.pkl",
        "_open_zip: zipfile.ZipFile raises NotImplementedError('zip file version 25.5'), not caught",
    ),
    (
        "byteorder local name differs",
        "plain",
        _renamed_local,
        "byteorder",
        "read_zip: zf.read(root+'byteorder') is unguarded: BadZipFile('File name in directory ... differ')",
    ),
    (
        "byteorder local name not utf-8",
        "plain",
        _corrupt_local_name,
        "byteorder",
        "read_zip: zf.read(root+'byteorder') is unguarded: UnicodeDecodeError",
    ),
    (
        "torchscript code file damaged",
        "torchscript",
        _renamed_local,
        ".py",
        "read_zip: code_files dict comprehension zf.read(n) is unguarded: BadZipFile",
    ),
    (
        "central dir offset too large",
        "plain",
        _bad_cd_offset,
        "data.pkl",
        "members(): f.seek(negative header_offset) raises OSError EINVAL, not caught",
    ),
]


@pytest.mark.parametrize("what,builder,mutate,suffix,why", _ZIP_BUGS, ids=[b[0] for b in _ZIP_BUGS])
def test_damaged_zip_member_is_a_ckptfix_error(tmp_path, ckpt, what, builder, mutate, suffix, why, request):
    b = getattr(ckpt, builder)()
    p = tmp_path / "damaged.pt"
    p.write_bytes(mutate(b.path.read_bytes(), suffix))
    leaked = []
    for fn in (read_checkpoint, inspect_checkpoint, scan_checkpoint):
        try:
            fn(p)
        except CkptfixError:
            pass
        except Exception as e:  # noqa: BLE001
            leaked.append(f"{fn.__name__}: {type(e).__name__}: {e}")
    assert not leaked, leaked
    assert main(["inspect", str(p)]) == 4


@pytest.mark.parametrize("url", ["HTTP://127.0.0.1:1/x.pt", "Http://127.0.0.1:1/x.pt"])
def test_an_upper_case_url_scheme_is_read_as_its_lower_case(url):
    """fsspec knows lower-case protocols only: "Protocol not known: HTTP" was an internal error, exit 1 (an
    outside pass, F6); the URL is read as written in lower case (here: nothing listens, exit 43)."""
    for cmd in ("inspect", "scan"):
        r = run_cli(cmd, url, CKPTFIX_REMOTE_RETRIES="0")
        assert r.rc == 43, r.err
        assert len(r.err.strip().splitlines()) == 1 and "internal error" not in r.err, r.err
