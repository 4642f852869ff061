"""scan never says "safe" of a pickle CPython's unpickler runs code from (issue 33 §0, issue 39 §5).

Two shapes peers' suites found false safe, rebuilt here at test time:

* picklescan's ``tests/data/malicious6.pkl``: ``pickle.dumps(["a", "b", "c"]) + pickle.dumps(obj)`` whose
  second pickle calls ``requests.api.get``; ``pickle.load`` called twice on the file runs it;
* fickling's ``frame_boundary_divergence``: an opcode whose argument runs past the end of a ``FRAME``.  The C
  unpickler reading a file (``torch.load`` hands it a zip's ``data.pkl`` as an ``io.BytesIO``) drops the rest
  of the frame and reads on after it, so it runs opcodes that a reader of the byte string never sees.

The oracle is CPython itself: each hostile pickle calls a harmless recording global
(``oracle_record.hit``) instead of ``os.system``; the test loads it with the real unpickler the way each
loader does, sees whether the call ran, and requires the scan to be "dangerous" or "unknown" whenever it did.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import types
import zipfile

import pytest

from ckptfix.ops.inspect import scan_checkpoint
from ckptfix.pickles import scan_globals, scan_pickle_sequence

from helpers import run_cli

pytestmark = pytest.mark.filterwarnings("ignore")

# --------------------------------------------------------------------------- the oracle

CALLS: list[tuple] = []


def _hit(*args):
    CALLS.append(args)
    return 0


_rec = types.ModuleType("oracle_record")
_rec.hit = _hit  # type: ignore[attr-defined]
sys.modules["oracle_record"] = _rec


def runs_code(data: bytes) -> bool:
    """Does any CPython reading of ``data`` call the recorder: ``pickle.loads`` (bytes), ``pickle.load`` on a
    file object without ``peek`` (what torch.load does with a zip's data.pkl) and on a buffered file, each
    called again on what follows a first pickle (``pickle.load`` twice)?"""
    CALLS.clear()
    readers = [lambda d: io.BytesIO(d), lambda d: io.BufferedReader(io.BytesIO(d), buffer_size=8192)]
    try:
        pickle.loads(data)
    except Exception:  # noqa: BLE001
        pass
    for make in readers:
        f = make(data)
        for _ in range(8):
            try:
                pickle.load(f)
            except Exception:  # noqa: BLE001
                break
    return bool(CALLS)


def hostile_global(proto: int = 2) -> bytes:
    """The body of a pickle calling ``oracle_record.hit('pwned')`` (no PROTO, no STOP)."""
    return b"coracle_record\nhit\n" + b"X\x05\x00\x00\x00pwned" + b"\x85R"


def frame_divergence(hidden: bytes) -> bytes:
    """fickling's frame_boundary_divergence: BINBYTES declares 0x107 bytes inside a 2-byte FRAME, so a reader
    of the bytes sees one long bytestring while a file reader runs ``hidden``."""
    return (
        b"\x80\x05N"
        + b"V"
        + b"a" * (8192 * 16 - 17)
        + b"\n0"  # push the frame past the read buffer
        + b"("
        + b"\x95"
        + struct.pack("<Q", 2)
        + b"B"
        + b"\x07\x01\x00\x00"
        + b"\x00\x00"
        + (hidden + b"(").ljust(256 + 5, b"N")
        + b"1."
    )


def verdict(tmp_path, data: bytes, name: str = "x.pkl") -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return scan_checkpoint(p).verdict


# --------------------------------------------------------------------------- the two files


def test_malicious6_second_pickle_is_scanned(tmp_path):
    """picklescan's malicious6.pkl: a benign pickle, then one calling requests.api.get."""

    class Get:
        def __reduce__(self):
            import requests.api

            return requests.api.get, ("https://example.invalid",)

    pytest.importorskip("requests")
    data = pickle.dumps(["a", "b", "c"]) + pickle.dumps(Get())
    rep = scan_checkpoint(_write(tmp_path / "malicious6.pkl", data))
    assert "requests.api.get" in rep.globals, rep.globals
    assert rep.verdict != "safe"
    assert any("after the first pickle" in n for n in rep.notes), rep.notes


def test_two_pickles_second_runs_os_system(tmp_path):
    """issue 39 §5: the CLI names os.system in the second pickle and says what follows the first STOP."""
    data = pickle.dumps({"w": 1}, protocol=2) + b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R."
    p = _write(tmp_path / "two.pkl", data)
    r = run_cli("scan", str(p))
    assert "os.system" in r.stdout, r.stdout
    assert "dangerous" in r.stdout
    r = run_cli("scan", str(p), "--json")
    import json

    doc = json.loads(r.stdout)
    assert doc["verdict"] == "dangerous" and "os.system" in doc["dangerous"]
    assert len(doc["pickles"]) == 2, doc["pickles"]


def test_trailing_bytes_after_a_pickle_are_reported(tmp_path):
    data = pickle.dumps([1, 2], protocol=2) + b"\xff\xfe not a pickle"
    rep = scan_checkpoint(_write(tmp_path / "tail.pkl", data))
    assert rep.verdict != "safe"
    assert any("after the first pickle" in n for n in rep.notes), rep.notes


def test_frame_boundary_divergence_is_not_safe(tmp_path):
    """fickling's payload with os.system: the scan names it (the file reading is simulated too)."""
    data = frame_divergence(b"cos\nsystem\nV echo pwned\n\x85R")
    rep = scan_checkpoint(_write(tmp_path / "frame.pkl", data))
    assert rep.verdict == "dangerous", (rep.verdict, rep.globals)
    assert "os.system" in rep.dangerous
    # and the same inside a torch zip's data.pkl, which torch.load reads through io.BytesIO
    zp = tmp_path / "frame.pt"
    with zipfile.ZipFile(zp, "w") as z:
        z.writestr("archive/data.pkl", data)
        z.writestr("archive/version", "3\n")
    assert scan_checkpoint(zp).verdict == "dangerous"


def test_frame_divergence_oracle_really_runs(tmp_path):
    """The rebuilt payload does what the issue says: CPython's file reader runs it, pickle.loads does not."""
    data = frame_divergence(hostile_global())
    CALLS.clear()
    pickle.loads(data)
    assert not CALLS
    pickle.load(io.BytesIO(data))
    assert CALLS
    assert runs_code(data)
    r = scan_globals(data)
    assert "oracle_record.hit" in r.globals and not r.followed


# fickling's straddle variants: each opcode's argument split across a FRAME end
def _framed(body: bytes, declared: int) -> bytes:
    return b"\x80\x05\x95" + struct.pack("<Q", declared) + body


STRADDLES = {
    "SHORT_BINUNICODE": _framed(b"\x8c\x14" + b"A" * 20, 3),
    "GLOBAL module": _framed(b"cmacos\nsystem\n", 4),
    "GLOBAL attr": _framed(b"cos\nsystem\n", 7),
    "UNICODE": _framed(b"Vhello world\n", 5),
    "BININT": _framed(b"J" + struct.pack("<i", 7), 2),
    "frame in a frame": b"\x80\x05\x95" + struct.pack("<Q", 30) + b"N\x95" + struct.pack("<Q", 2) + b"N",
}


@pytest.mark.parametrize("name", sorted(STRADDLES))
def test_straddle_variants_never_safe(tmp_path, name):
    data = STRADDLES[name] + b"."
    rep = scan_checkpoint(_write(tmp_path / "s.pkl", data))
    assert rep.verdict != "safe", (name, rep.globals)


def test_bytes_data_after_a_frame_is_safe(tmp_path):
    """fickling also flags BINBYTES whose data follows its frame: every CPython reader agrees on it (the data is
    read with _Unpickler_ReadInto, which takes the frame's rest first), and the pickler writes large bytes so."""
    data = _framed(b"B" + struct.pack("<I", 20) + b"A" * 20, 5) + b"."
    assert not runs_code(data) and pickle.load(io.BytesIO(data)) == b"A" * 20
    assert scan_globals(data).followed
    assert verdict(tmp_path, data) == "safe"


def test_well_formed_frames_stay_safe(tmp_path):
    """No false alarm: real pickles with frames, large unframed bytes between frames, many frames."""
    for obj in ([1, 2, 3], b"x" * 100000, [1, b"y" * 100000, 2], list(range(200000)), {"a": [1, {"b": (3, 4)}]}):
        for proto in (4, 5):
            data = pickle.dumps(obj, protocol=proto)
            r = scan_globals(data)
            assert r.followed and not r.globals, (proto, r.globals, r.unresolved)
            _, parts = scan_pickle_sequence(data)
            assert len(parts) == 1


# --------------------------------------------------------------------------- many shapes, 0 false safe


def _shapes() -> dict[str, bytes]:
    g = hostile_global()
    arg = b"X\x05\x00\x00\x00pwned"
    sg = b"\x8c\roracle_record\x94\x8c\x03hit\x94\x93"  # STACK_GLOBAL, names memoized
    out = {
        "GLOBAL+REDUCE p0": b"coracle_record\nhit\n(Vpwned\ntR.",
        "GLOBAL+REDUCE p2": b"\x80\x02" + g + b".",
        "STACK_GLOBAL p4": b"\x80\x04" + sg + arg + b"\x85R.",
        "STACK_GLOBAL memo-built names": b"\x80\x04\x8c\roracle_record\x94\x8c\x03hit\x94N0h\x00h\x01\x93"
        + arg
        + b"\x85R.",
        "INST": b"(Vpwned\nioracle_record\nhit\n.",
        "OBJ": b"\x80\x02(coracle_record\nhit\n" + arg + b"o.",
        "NEWOBJ": b"\x80\x02coracle_record\nhit\n" + arg + b"\x85\x81.",
        "NEWOBJ_EX": b"\x80\x04" + sg + arg + b"\x85}\x92.",
        "BUILD setstate": b"\x80\x02" + g + b"}b.",
        "in a dict": b"\x80\x02}X\x01\x00\x00\x00w" + g + b"s.",
        "second pickle": pickle.dumps([1]) + b"\x80\x02" + g + b".",
        "third pickle": pickle.dumps([1]) + pickle.dumps("a") + b"\x80\x02" + g + b".",
        "framed p5": b"\x80\x05\x95" + struct.pack("<Q", len(sg + arg) + 3) + sg + arg + b"\x85R.",
        "frame divergence": frame_divergence(g),
        "frame divergence, global name split": frame_divergence(b"coracle_record\nhit\n" + b"N\x85R"),
    }
    for proto in range(0, 6):
        try:
            out[f"dumps p{proto}"] = pickle.dumps(_Evil(), protocol=proto)
        except Exception:  # noqa: BLE001
            pass
    return out


class _Evil:
    def __reduce__(self):
        return _hit, ("pwned",)


_Evil.__reduce__.__qualname__ = "x"
_hit.__module__ = "oracle_record"
_hit.__qualname__ = "hit"


def test_hostile_shapes_zero_false_safe(tmp_path):
    """Every shape the real unpickler executes is dangerous or unknown: bare, in a torch zip, as a legacy file."""
    from hostile import legacy_file

    false_safe = []
    ran = 0
    for name, data in _shapes().items():
        if not runs_code(data):
            continue
        ran += 1
        if verdict(tmp_path, data) == "safe":
            false_safe.append(("bare", name))
        zp = tmp_path / "z.pt"
        with zipfile.ZipFile(zp, "w") as z:
            z.writestr("archive/data.pkl", data)
            z.writestr("archive/version", "3\n")
        if scan_checkpoint(zp).verdict == "safe":
            false_safe.append(("zip", name))
    assert ran >= 15, ran
    assert not false_safe, false_safe
    lp = legacy_file(tmp_path / "legacy.pt", obj_pickle=b"\x80\x02" + hostile_global() + b".")
    assert scan_checkpoint(lp).verdict == "dangerous" or "oracle_record.hit" in scan_checkpoint(lp).globals


def _write(p, data: bytes):
    p.write_bytes(data)
    return p


def test_oracle_module_is_harmless():
    assert os.environ.get("CKPTFIX_NO_SUCH") is None
    _hit("x")
    assert CALLS[-1] == ("x",)
