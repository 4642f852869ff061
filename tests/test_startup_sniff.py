"""The tar check of ``sniffing.tar_opens`` decides without importing tarfile only where tarfile refuses the file."""

from __future__ import annotations

import io
import os
import random
import tarfile
import zipfile
from pathlib import Path

import pytest

from ckptfix.formats import sniffing


def _tarfile_says(path: Path) -> bool | None:
    """What tar_opens answered before the fast path: tarfile itself."""
    with open(path, "rb") as f:
        try:
            with tarfile.open(fileobj=sniffing._Capped(f), mode="r:", format=tarfile.PAX_FORMAT):
                return True
        except tarfile.TarError:
            return False
        except Exception:  # noqa: BLE001
            return None


def _with_checksum(block: bytearray, value: int, *, signed: bool = False, fmt: str = "%06o\0 ") -> bytearray:
    block[148:156] = b" " * 8
    total = 256 + sum(block[:148]) + sum(block[156:])
    if signed:
        total -= 256 * sum(1 for b in block[:148] + block[156:] if b >= 128)
    block[148:156] = (fmt % (total + value)).encode()[:8].ljust(8, b"\0")
    return block


def _blocks() -> list[bytes]:
    rng = random.Random(25)
    out: list[bytes] = [b"", b"x", bytes(511), bytes(512), bytes(1024)]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00." * 100)
    out.append(buf.getvalue())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        info = tarfile.TarInfo("pickle")
        info.size = 3
        t.addfile(info, io.BytesIO(b"abc"))
    good = buf.getvalue()
    out.append(good)
    for _ in range(200):
        out.append(bytes(rng.randrange(256) for _ in range(rng.choice([512, 700, 1500]))))
    high = bytearray(rng.randrange(128, 256) for _ in range(512))
    for base in (bytearray(good[:512]), bytearray(512), high):
        for signed in (False, True):
            for delta in (0, 1, -1):
                for fmt in ("%06o\0 ", "%07o\0", " %o ", "%o", "+%o", "0o%o", "%o\0garbage"):
                    out.append(bytes(_with_checksum(bytearray(base), delta, signed=signed, fmt=fmt)) + good[512:])
    for field in (b"\x80" + bytes(7), b"\xff" * 8, b"1_0\0    ", b"\xc3\xa9\0     ", b"        ", b"\0" * 8):
        b = bytearray(good)
        b[148:156] = field
        out.append(bytes(b))
    return out


@pytest.mark.parametrize("i", range(0, 400, 40))
def test_tar_opens_answers_as_tarfile_does(i, tmp_path):
    for n, block in enumerate(_blocks()[i : i + 40]):
        p = tmp_path / f"f{n}"
        p.write_bytes(block)
        expected = _tarfile_says(p)
        if sniffing._bad_tar_checksum(block[:512]):
            assert expected is False, (i + n, block[:160])
        assert sniffing.tar_opens(str(p)) == expected, (i + n, block[:160])


def test_a_torch_zip_is_refused_without_importing_tarfile(tmp_path):
    p = tmp_path / "m.pt"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    assert sniffing._bad_tar_checksum(p.read_bytes()[:512]) is True
    assert sniffing.tar_opens(os.fspath(p)) is False
