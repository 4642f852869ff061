"""``ckptfix.files.zipdir.open_zip`` (start-up): what ``zipfile.ZipFile`` gives, for plain and odd archives."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest

from ckptfix.files.zipdir import ZipDir, open_zip

FIELDS = ("filename", "orig_filename", "header_offset", "file_size", "compress_size", "CRC", "compress_type")
FIELDS += ("flag_bits", "extract_version")


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the type and message are what is compared
        return (type(e).__name__, str(e))


def _view(z: Any) -> Any:
    infos = z.infolist()
    out: list[Any] = [z.namelist(), [tuple(getattr(i, f) for f in FIELDS) for i in infos]]
    for i in infos:
        out.append(_outcome(lambda i=i: z.read(i.filename)))
        out.append(_outcome(lambda i=i: z.open(i).read(2)))

        def parts(i: Any = i) -> list[bytes]:
            with z.open(i) as f:
                return [f.read(5000), f.read(1), f.read(), f.read()]

        out.append(_outcome(parts))
    out.append(_outcome(lambda: z.getinfo("nope")))
    return out


def _both(data: bytes, tmp_path: Path, plain: bool) -> None:
    p = tmp_path / "a.zip"
    p.write_bytes(data)
    want = _outcome(lambda: _view(zipfile.ZipFile(p)))
    for src in (str(p), p, io.BytesIO(data)):
        z = _outcome(lambda src=src: open_zip(src))
        if z[0] != "ok":
            assert z == want
            continue
        assert isinstance(z[1], ZipDir) == plain
        with z[1] as zz:
            assert _outcome(lambda zz=zz: _view(zz)) == want


def _zip(members: dict[str, bytes], **kw: Any) -> bytes:
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", **kw) as z:
        for n, d in members.items():
            z.writestr(n, d)
    return b.getvalue()


BIG = bytes(range(256)) * 40  # over 4 KiB: raw reads in two steps
MEMBERS = {"m/data.pkl": b"\x80\x02}q\x00.", "m/data/0": BIG, "m/empty": b"", "m/ünï": b"x" * 4095}


def _zip64(members: dict[str, bytes]) -> bytes:
    """What torch.save writes: a ZIP64 end record and locator before the end record."""
    b = bytearray(_zip(members))
    end = b.rindex(b"PK\x05\x06")
    (n, size, off) = struct.unpack_from("<HLL", b, end + 10)
    rec = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, size, off)
    loc = struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1)
    return bytes(b[:end]) + rec + loc + bytes(b[end:])


def _patch(data: bytes, find: bytes, new: bytes, nth: int = 0) -> bytes:
    i = -1
    for _ in range(nth + 1):
        i = data.index(find, i + 1)
    return data[:i] + new + data[i + len(new) :]


PLAIN = {
    "stored": _zip(MEMBERS),
    "zip64 end record": _zip64(MEMBERS),
    "repeated name": _patch(_zip({"m/a": b"1", "m/b": b"2"}), b"m/b", b"m/a", 1),  # central: the last one wins
    "cp437 name": _zip({"m/Z": b"1"}).replace(b"m/Z", b"m/\x82"),  # no UTF-8 flag: read as cp437
    "bad crc": _patch(_zip(MEMBERS), b"\x80\x02}q", b"\x80\x03"),
    "bad crc, big member": _patch(_zip(MEMBERS), BIG[:8], b"\xff" * 8),
    "local name differs": _patch(_zip(MEMBERS), b"m/data.pkl", b"m/DATA.pkl", 0),
    "local header damaged": _patch(_zip(MEMBERS), b"PK\x03\x04", b"PK\x03\x05", 1),
}


def _forced_zip64() -> bytes:
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w") as z, z.open("m/data.pkl", "w", force_zip64=True) as f:
        f.write(b"\x80\x02K\x01.")
    return b.getvalue()


PLAIN["zip64 extra field in the local header only"] = _forced_zip64()
ODD = {
    "deflated": _zip(MEMBERS, compression=zipfile.ZIP_DEFLATED),
    "comment": _zip(MEMBERS) + b"",
    "data before": b"junk" * 10 + _zip(MEMBERS),
    "truncated": _zip(MEMBERS)[:-30],
    "empty file": b"",
    "not a zip": b"hello" * 50,
    "central directory damaged": _patch(_zip(MEMBERS), b"PK\x01\x02", b"PK\x01\x03", 1),
}


def _with_comment() -> bytes:
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w") as z:
        z.writestr("a", b"1")
        z.comment = b"hi"
    return b.getvalue()


ODD["comment"] = _with_comment()


@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_archives_read_without_zipfile_as_zipfile_reads_them(name, tmp_path):
    _both(PLAIN[name], tmp_path, plain=True)


@pytest.mark.parametrize("name", list(ODD))
def test_other_archives_go_to_zipfile(name, tmp_path):
    _both(ODD[name], tmp_path, plain=False)


def test_a_torch_save_archive_is_plain(tmp_path):
    from tests.helpers import CkptFactory

    path = CkptFactory(tmp_path).plain().path
    _both(Path(path).read_bytes(), tmp_path, plain=True)


def test_members_read_from_several_threads_get_their_own_bytes(tmp_path):
    import threading

    members = {f"m/data/{i}": bytes([i]) * 50_000 for i in range(4)}
    p = tmp_path / "a.zip"
    p.write_bytes(_zip64(members))
    got: dict[str, bytes] = {}
    with open_zip(p) as z:
        assert isinstance(z, ZipDir)

        def read(name: str) -> None:
            with z.open(name) as f:
                parts = []
                while chunk := f.read(4099):
                    parts.append(chunk)
                got[name] = b"".join(parts)

        threads = [threading.Thread(target=read, args=(n,)) for n in members]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert got == members
