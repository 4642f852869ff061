"""scan: the opcode simulation against CPython's own unpicklers, the attack reproductions, and every container.

Ground truth is CPython (tests/oracle_pickle.py): whatever global the C unpickler
(what torch.load uses) or the pure-Python one would ask for must be in the scan,
or the scan must say it could not follow the pickle (verdict unknown).
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import struct
import zipfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle_pickle import c_imports, py_imports

from ckptfix.errors import CorruptCheckpointError, UnsupportedError
from ckptfix.ops.inspect import scan_checkpoint
from ckptfix.pickles import resolve_global, scan_globals, scan_pickle_sequence
from ckptfix.pickles.policy import classify_global

from helpers import run_cli

pytestmark = pytest.mark.filterwarnings("ignore")


# --------------------------------------------------------------------------- opcode assembly


def u(s: str) -> bytes:
    """SHORT_BINUNICODE s"""
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def binu(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


PROTO = lambda p: b"\x80" + bytes([p])  # noqa: E731
STOP, MARK, POP, POP_MARK, DUP, MEMOIZE = b".", b"(", b"0", b"1", b"2", b"\x94"
STACK_GLOBAL, REDUCE, TUPLE1, EMPTY_DICT, NONE = b"\x93", b"R", b"\x85", b"}", b"N"
BINPUT = lambda i: b"q" + bytes([i])  # noqa: E731
BINGET = lambda i: b"h" + bytes([i])  # noqa: E731
LONG_BINPUT = lambda i: b"r" + struct.pack("<I", i)  # noqa: E731


def covered(data: bytes) -> tuple[bool, list]:
    """Is every global CPython's unpicklers ask for in the scan (or the scan says unknown)?"""
    r = scan_globals(data)
    raw = {(m, n) for (m, n, _p) in r.raw}
    missing = [g for g in c_imports(data) if g not in raw]
    missing += [g for g in py_imports(data) if g[0] and g not in r.pairs]
    return (not missing) or bool(r.unresolved), missing


# --------------------------------------------------------------------------- issue 10 item 2 (a) (b)


def payload_popped_strings() -> bytes:
    """(a) the real pair stays on the stack; a decoy pair is pushed and popped before STACK_GLOBAL."""
    return (
        PROTO(4)
        + u("os")
        + u("system")
        + u("collections")
        + u("OrderedDict")
        + POP
        + POP
        + STACK_GLOBAL
        + u("echo pwned")
        + TUPLE1
        + REDUCE
        + POP
        + EMPTY_DICT
        + STOP
    )


def payload_memo_mix() -> bytes:
    """(b) BINPUT then MEMOIZE: MEMOIZE stores at len(memo), not at a private counter."""
    return (
        PROTO(4)
        + u("collections")
        + BINPUT(0)
        + u("OrderedDict")
        + BINPUT(1)
        + POP
        + POP
        + u("pad")
        + BINPUT(7)
        + POP
        + u("os")
        + MEMOIZE
        + POP
        + u("system")
        + MEMOIZE
        + POP
        + BINGET(3)
        + BINGET(4)
        + STACK_GLOBAL
        + u("id")
        + TUPLE1
        + REDUCE
        + POP
        + EMPTY_DICT
        + STOP
    )


@pytest.mark.parametrize("make", [payload_popped_strings, payload_memo_mix])
def test_attack_payloads_resolve_exactly(make):
    data = make()
    assert c_imports(data) == [("os", "system")]  # what CPython would import
    r = scan_globals(data)
    assert dict(r.globals) == {"os.system": 1}, r
    assert r.error is None and not r.unresolved


def _zip_with_pickle(tmp_path, name: str, data_pkl: bytes):
    """A torch zip whose data.pkl is replaced (what an attacker ships)."""
    torch = pytest.importorskip("torch")
    src = tmp_path / "src.pt"
    torch.save({"w": torch.zeros(2)}, src)
    out = tmp_path / name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            body = data_pkl if info.filename.endswith("data.pkl") else zin.read(info.filename)
            zout.writestr(info, body)
    return out


@pytest.mark.parametrize("make", [payload_popped_strings, payload_memo_mix])
def test_attack_payloads_scan_exit_11(tmp_path, make):
    p = _zip_with_pickle(tmp_path, "evil.pt", make())
    proc = run_cli("scan", "--json", p)
    assert proc.returncode == 11, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["verdict"] == "dangerous" and doc["dangerous"] == ["os.system"]
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- hand-written adversarial cases

ADVERSARIAL = {
    "dup": PROTO(4) + u("os") + u("system") + DUP + POP + STACK_GLOBAL + EMPTY_DICT + STOP,
    "pop_mark_hides_decoy": PROTO(4)
    + u("os")
    + u("system")
    + MARK
    + u("collections")
    + u("OrderedDict")
    + POP_MARK
    + STACK_GLOBAL
    + EMPTY_DICT
    + STOP,
    "pop_of_empty_frame_pops_mark": PROTO(4) + u("os") + MARK + POP + u("system") + STACK_GLOBAL + STOP,
    "dup_module": PROTO(4) + u("os") + DUP + POP + u("system") + STACK_GLOBAL + STOP,
    "memo_overwrite": PROTO(4)
    + u("collections")
    + BINPUT(0)
    + u("os")
    + BINPUT(0)
    + POP
    + POP
    + BINGET(0)
    + u("system")
    + STACK_GLOBAL
    + STOP,
    "memoize_after_gap": PROTO(4)
    + u("a")
    + BINPUT(5)
    + u("os")
    + MEMOIZE
    + POP
    + POP
    + BINGET(1)
    + u("system")
    + STACK_GLOBAL
    + STOP,
    "memoize_overwrites_explicit": PROTO(4)
    + u("x")
    + BINPUT(1)
    + u("os")
    + MEMOIZE
    + POP
    + u("collections")
    + BINPUT(0)
    + POP
    + BINGET(1)
    + u("system")
    + STACK_GLOBAL
    + STOP,
    "long_binput": PROTO(4)
    + u("os")
    + LONG_BINPUT(3)
    + POP
    + b"j"
    + struct.pack("<I", 3)
    + u("system")
    + STACK_GLOBAL
    + STOP,
    "text_put_get": PROTO(2) + u("os") + b"p0\n" + POP + b"g0\n" + u("system") + STACK_GLOBAL + STOP,
    "binunicode": PROTO(4) + binu("os") + binu("system") + STACK_GLOBAL + STOP,
    "short_binstring": PROTO(2) + b"U\x02os" + b"U\x06system" + STACK_GLOBAL + STOP,
    "string_op": b"S'os'\nS'system'\n\x93.",
    "unicode_op": b"Vos\nVsystem\n\x93.",
    "global_proto0": b"cos\nsystem\n.",
    "inst": b"(S'ls'\nios\nsystem\n.",
    "frame": PROTO(4) + b"\x95" + struct.pack("<Q", 12) + u("os") + u("system") + STACK_GLOBAL + STOP,
    "frames_split_inside_op": PROTO(4)
    + b"\x95"
    + struct.pack("<Q", 3)
    + u("os")
    + b"\x95"
    + struct.pack("<Q", 1)
    + u("system")
    + STACK_GLOBAL
    + STOP,
    "proto_switch_maps_names": PROTO(4) + PROTO(2) + b"c__builtin__\neval\n" + STOP,
    "py2_names": PROTO(2) + b"c__builtin__\nlong\n" + b"ccopy_reg\n_reconstructor\n" + POP + STOP,
    "py2_names_at_proto3": PROTO(3) + b"c__builtin__\nlong\n" + STOP,
    "dotted_name": PROTO(4) + u("os") + u("path.join") + STACK_GLOBAL + STOP,
    "tuple_of_strings_is_not_a_name": PROTO(4) + u("os") + u("system") + b"\x86" + u("x") + STACK_GLOBAL + STOP,
    "nested_global_calls": PROTO(2)
    + b"cbuiltins\ngetattr\n"
    + b"cbuiltins\n__import__\n"
    + u("os")
    + TUPLE1
    + REDUCE
    + u("system")
    + b"\x86"
    + REDUCE
    + STOP,
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_cases_match_cpython(name):
    data = ADVERSARIAL[name]
    ok, missing = covered(data)
    assert ok, (name, missing, scan_globals(data))


def test_expected_names_of_adversarial_cases():
    g = lambda k: dict(scan_globals(ADVERSARIAL[k]).globals)  # noqa: E731
    for k in (
        "dup",
        "pop_mark_hides_decoy",
        "pop_of_empty_frame_pops_mark",
        "dup_module",
        "memo_overwrite",
        "memoize_after_gap",
        "memoize_overwrites_explicit",
        "long_binput",
        "text_put_get",
        "binunicode",
        "short_binstring",
        "string_op",
        "unicode_op",
        "global_proto0",
        "inst",
        "frame",
    ):
        assert g(k) == {"os.system": 1}, (k, g(k))
    # an opcode split across FRAMEs: the file reader reads other bytes (issue 33 §0): named, and never safe
    split = scan_globals(ADVERSARIAL["frames_split_inside_op"])
    assert "os.system" in split.globals and not split.followed
    assert g("proto_switch_maps_names") == {"builtins.eval": 1}
    assert g("py2_names") == {"builtins.int": 1, "copyreg._reconstructor": 1}
    assert g("py2_names_at_proto3") == {"__builtin__.long": 1}
    assert g("dotted_name") == {"os.path.join": 1}
    assert classify_global("os.path.join") == "dangerous"


def test_tuple_operands_are_malformed_not_safe():
    r = scan_globals(ADVERSARIAL["tuple_of_strings_is_not_a_name"])
    assert r.error and "STACK_GLOBAL requires str" in r.error


def test_dynamic_stack_global_is_unresolved():
    r = scan_globals(ADVERSARIAL["nested_global_calls"])
    assert {"builtins.getattr", "builtins.__import__"} <= set(r.globals)
    data = PROTO(4) + b"cos\ngetcwd\n" + b")" + REDUCE + u("system") + STACK_GLOBAL + STOP
    r = scan_globals(data)
    assert r.unresolved and not r.followed
    assert classify_global(r.unresolved[0]) == "unknown"


def test_ext_codes_are_unresolved():
    r = scan_globals(PROTO(2) + b"\x82\x05" + STOP)
    assert r.unresolved == ["<extension code 5 (copyreg registry)>"]


def test_memo_miss_is_unresolved():
    r = scan_globals(PROTO(4) + BINGET(3) + u("system") + STACK_GLOBAL + STOP)
    assert r.unresolved and r.error


def test_resolve_global_matches_compat_pickle():
    assert resolve_global("__builtin__", "long", 2) == ("builtins", "int")
    assert resolve_global("__builtin__", "unicode", 2) == ("builtins", "str")
    assert resolve_global("__builtin__", "xrange", 0) == ("builtins", "range")
    assert resolve_global("copy_reg", "_reconstructor", 2) == ("copyreg", "_reconstructor")
    assert resolve_global("__builtin__", "long", 3) == ("__builtin__", "long")
    assert resolve_global("torch._utils", "_rebuild_tensor_v2", 2) == ("torch._utils", "_rebuild_tensor_v2")


@pytest.mark.parametrize("proto", range(6))
def test_real_pickles_every_protocol(proto):
    obj = {
        "a": [1, 2.0, "x", range(3), int, str, collections.OrderedDict(a=1), b"by", bytearray(b"ba")],
        "b": os.path.join,
        "s": {1, 2},
        "f": frozenset([1]),
        "c": complex(1, 2),
        "t": ((1,), (2, (3,))),
    }
    data = pickle.dumps(obj, protocol=proto)
    ok, missing = covered(data)
    assert ok, missing
    r = scan_globals(data)
    assert r.followed and "builtins.int" in r.globals and "builtins.long" not in r.globals


# --------------------------------------------------------------------------- differential fuzz

_NAMES = [
    "os",
    "system",
    "builtins",
    "eval",
    "collections",
    "OrderedDict",
    "__builtin__",
    "long",
    "copy_reg",
    "_reconstructor",
    "posix",
    "getattr",
    "path.join",
    "subprocess",
    "Popen",
    "torch._utils",
]

_op = st.one_of(
    st.sampled_from(_NAMES).map(lambda s: ("str", s)),
    st.sampled_from(
        [
            "MARK",
            "POP",
            "POP_MARK",
            "DUP",
            "MEMOIZE",
            "STACK_GLOBAL",
            "TUPLE",
            "TUPLE1",
            "TUPLE2",
            "EMPTY_TUPLE",
            "EMPTY_LIST",
            "EMPTY_DICT",
            "APPEND",
            "APPENDS",
            "SETITEM",
            "SETITEMS",
            "REDUCE",
            "NONE",
            "BUILD",
            "LIST",
            "DICT",
            "NEWOBJ",
            "OBJ",
            "BINPERSID",
        ]
    ).map(lambda s: (s,)),
    st.tuples(st.sampled_from(["BINPUT", "LONG_BINPUT", "PUT", "BINGET", "LONG_BINGET", "GET"]), st.integers(0, 6)),
    st.tuples(st.just("PROTO"), st.integers(0, 5)),
    st.tuples(st.just("BININT1"), st.integers(0, 255)),
    st.tuples(st.sampled_from(["GLOBAL", "INST"]), st.sampled_from(_NAMES), st.sampled_from(_NAMES)),
    st.tuples(st.just("strop"), st.sampled_from(["U", "S", "V", "X", "C"]), st.sampled_from(_NAMES)),
)

_SIMPLE = {
    "MARK": b"(",
    "POP": b"0",
    "POP_MARK": b"1",
    "DUP": b"2",
    "MEMOIZE": b"\x94",
    "STACK_GLOBAL": b"\x93",
    "TUPLE": b"t",
    "TUPLE1": b"\x85",
    "TUPLE2": b"\x86",
    "EMPTY_TUPLE": b")",
    "EMPTY_LIST": b"]",
    "EMPTY_DICT": b"}",
    "APPEND": b"a",
    "APPENDS": b"e",
    "SETITEM": b"s",
    "SETITEMS": b"u",
    "REDUCE": b"R",
    "NONE": b"N",
    "BUILD": b"b",
    "LIST": b"l",
    "DICT": b"d",
    "NEWOBJ": b"\x81",
    "OBJ": b"o",
    "BINPERSID": b"Q",
}


def _assemble(ops, frame_at: int | None) -> bytes:
    parts = []
    for op in ops:
        k = op[0]
        if k == "str":
            parts.append(u(op[1]))
        elif k in _SIMPLE:
            parts.append(_SIMPLE[k])
        elif k == "BINPUT":
            parts.append(b"q" + bytes([op[1]]))
        elif k == "LONG_BINPUT":
            parts.append(b"r" + struct.pack("<I", op[1]))
        elif k == "PUT":
            parts.append(b"p%d\n" % op[1])
        elif k == "BINGET":
            parts.append(b"h" + bytes([op[1]]))
        elif k == "LONG_BINGET":
            parts.append(b"j" + struct.pack("<I", op[1]))
        elif k == "GET":
            parts.append(b"g%d\n" % op[1])
        elif k == "PROTO":
            parts.append(b"\x80" + bytes([op[1]]))
        elif k == "BININT1":
            parts.append(b"K" + bytes([op[1]]))
        elif k == "GLOBAL":
            parts.append(b"c" + op[1].encode() + b"\n" + op[2].encode() + b"\n")
        elif k == "INST":
            parts.append(b"i" + op[1].encode() + b"\n" + op[2].encode() + b"\n")
        elif k == "strop":
            kind, s = op[1], op[2].encode()
            parts.append(
                {
                    "U": b"U" + bytes([len(s)]) + s,
                    "S": b"S'" + s + b"'\n",
                    "V": b"V" + s + b"\n",
                    "X": b"X" + struct.pack("<I", len(s)) + s,
                    "C": b"C" + bytes([len(s)]) + s,
                }[kind]
            )
    body = b"".join(parts) + STOP
    if frame_at is not None:
        cut = min(frame_at, len(parts))
        head = b"".join(parts[:cut])
        rest = body[len(head) :]
        body = head + b"\x95" + struct.pack("<Q", len(rest)) + rest
    return body


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=40), frame_at=st.one_of(st.none(), st.integers(0, 40)), proto=st.integers(0, 5))
def test_differential_against_cpython(ops, frame_at, proto):
    data = PROTO(proto) + _assemble(ops, frame_at)
    ok, missing = covered(data)
    assert ok, (data, missing)


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=300))
def test_differential_random_bytes(data):
    for d in (data, b"\x80\x04" + data, b"\x80\x02" + data + b"."):
        ok, missing = covered(d)
        assert ok, (d, missing)


# --------------------------------------------------------------------------- legacy sequences


def test_scan_pickle_sequence_reads_on_after_bare_pickle():
    # issue 39 §5: pickle.load called again on the file unpickles what follows the first STOP
    data = pickle.dumps({"a": 1}, protocol=2) + b"cos\nsystem\n."
    r, parts = scan_pickle_sequence(data)
    assert len(parts) == 2 and "os.system" in r.globals


def test_scan_pickle_sequence_reads_all_five_legacy_pickles():
    from ckptfix.pickles import LEGACY_MAGIC_NUMBER

    parts = [
        pickle.dumps(LEGACY_MAGIC_NUMBER, protocol=2),
        pickle.dumps(1001, protocol=2),
        pickle.dumps({"little_endian": True}, protocol=2),
        pickle.dumps({"a": 1}, protocol=2),
        b"\x80\x02cos\nsystem\n.",
    ]
    r, got = scan_pickle_sequence(b"".join(parts) + b"\x00" * 16)
    assert len(got) == 5 and r.globals["os.system"] == 1


def test_scan_file_object_leaves_position_after_stop(tmp_path):
    p = tmp_path / "two.pkl"
    p.write_bytes(pickle.dumps(1, protocol=2) + pickle.dumps(2, protocol=2))
    with open(p, "rb") as f:
        r = scan_globals(f)
        assert r.value == 1 and f.tell() == r.end
        assert scan_globals(f).value == 2


# --------------------------------------------------------------------------- every container, opcodes only


def test_scan_never_unpickles_any_container(ckpt, monkeypatch):
    import ckptfix.pickles as pk

    def refuse(*a, **k):
        raise AssertionError("scan unpickled something")

    built = (
        ckpt.plain(),
        ckpt.legacy(),
        ckpt.lightning(),
        ckpt.sharded_bin(),
        ckpt.sharded_safetensors(),
        ckpt.dcp(),
        ckpt.torchscript(),
        ckpt.evil("e1.pt"),
        ckpt.evil("e2.pt", mode="legacy"),
        ckpt.evil("e3.pt", mode="pickle"),
    )
    monkeypatch.setattr(pk.RecordingUnpickler, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    for b in built:
        r = scan_checkpoint(b.path)
        assert r.pickles or b.path.parent.name == "hf_st", b.path
        assert r.verdict in ("safe", "unknown", "dangerous"), (b.path, r.errors)


def test_scan_legacy_reports_every_pickle(ckpt):
    r = scan_checkpoint(ckpt.evil("ev.pt", mode="legacy").path)
    assert r.format == "torch-legacy" and len(r.pickles) == 5
    assert r.verdict == "dangerous"
    r = scan_checkpoint(ckpt.evil("ev2.pt", mode="pickle").path)
    assert r.format == "pickle" and len(r.pickles) == 1 and r.verdict == "dangerous"


def test_scan_dcp_byte_item_with_payload(tmp_path):
    """A DCP BYTE_IO item is torch.load-ed by dcp.load: a payload in it must show up."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from helpers import Evil

    d = tmp_path / "evil_dcp"
    marker = tmp_path / "pwned"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(2), "extra": {"payload": Evil(str(marker))}}, checkpoint_id=str(d), no_dist=True)
    r = scan_checkpoint(d)
    assert r.verdict == "dangerous", r.globals
    assert any(p.startswith("__0_0.distcp@") for p in r.pickles)
    assert not marker.exists()
    assert run_cli("scan", d).returncode == 11


def test_scan_dcp_metadata_payload_is_dangerous(ckpt):
    b = ckpt.dcp("dcp_evil")
    meta = b.path / ".metadata"
    body = meta.read_bytes()
    assert body[:2] == b"\x80\x02" or body[:1] == b"\x80"
    evil = body[:2] + b"ctorch.distributed.checkpoint.filesystem\nos.system\n(X\x02\x00\x00\x00idtR0" + body[2:]
    meta.write_bytes(evil)
    r = scan_checkpoint(b.path)
    assert r.verdict == "dangerous"
    assert r.globals["torch.distributed.checkpoint.filesystem.os.system"]["class"] == "dangerous"
    assert classify_global("torch.distributed.checkpoint.format_utils.torch_save_to_dcp", "dcp") != "safe"


def test_scan_dcp_raw_bytes_are_unknown_not_safe(ckpt):
    b = ckpt.dcp("dcp_raw")
    shard = next(b.path.glob("*.distcp"))
    with open(shard, "ab") as f:
        f.write(b"\x80\x02cos\nsystem\n.")  # bytes no torch archive holds
    r = scan_checkpoint(b.path)
    assert r.verdict == "unknown" and any("belong to no torch archive" in g for g in r.unknown)


def test_scan_zip_with_two_data_pkl_members(tmp_path):
    torch = pytest.importorskip("torch")
    src = tmp_path / "ok.pt"
    torch.save({"w": torch.zeros(2)}, src)
    out = tmp_path / "dup.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            if info.filename.endswith("data.pkl"):
                zout.writestr(info.filename, payload_popped_strings())
            zout.writestr(info, zin.read(info.filename))
    import warnings

    warnings.simplefilter("ignore")
    # refused as by every other command (torch's reader and zipfile would read different members)
    with pytest.raises(CorruptCheckpointError, match="twice"):
        scan_checkpoint(out)


def test_scan_sharded_index_reads_shards_by_opcodes_and_refuses_escapes(ckpt, tmp_path):
    b = ckpt.sharded_bin()
    idx = json.loads(b.path.read_text())
    first = next(iter(idx["weight_map"]))
    idx["weight_map"][first] = "../../etc/passwd"
    b.path.write_text(json.dumps(idx))
    with pytest.raises(UnsupportedError, match="outside the index's directory"):
        scan_checkpoint(b.path)
    assert run_cli("scan", b.path).returncode == 8  # refused as by every command (formats.sharded.load_index)


def test_scan_tar_checkpoint_is_not_safe(tmp_path):
    import tarfile

    p = tmp_path / "old.tar"
    inner = tmp_path / "pickle"
    inner.write_bytes(b"\x80\x02cos\nsystem\n.")
    with tarfile.open(p, "w") as t:
        t.add(inner, arcname="pickle")
    # a tar without torch's members is no checkpoint torch could load: refused as corrupt, never "safe"
    with pytest.raises(CorruptCheckpointError, match="tar"):
        scan_checkpoint(p)
    assert run_cli("scan", p).returncode == 4


@pytest.mark.parametrize("where", ["module", "name"])
def test_stack_global_with_a_lone_surrogate_is_malformed_and_every_command_says_so(tmp_path, where):
    """BINUNICODE decodes with surrogatepass, so a STACK_GLOBAL may name a string no module or attribute has:
    CPython fails to import it; the scan calls the pickle malformed (a name that could not be printed either)."""
    sur = b"\x8c\x04a\xed\xa0\x80"
    plain = b"\x8c\x02os"
    data = b"\x80\x04" + (sur + b"\x8c\x01n" if where == "module" else plain + sur) + b"\x93."
    with pytest.raises((ModuleNotFoundError, AttributeError)):  # CPython: nothing can be found by that name
        pickle.loads(data)
    r = scan_globals(data)
    assert r.error and "surrogate" in r.error
    import torch

    from helpers import assert_one_line_error, inject_into_data_pkl

    src = tmp_path / "good.pt"
    torch.save({"module.w": torch.ones(3)}, src)
    bad = tmp_path / "bad.pt"
    inject_into_data_pkl(src, bad, data[2:-1])
    for cmd in (["inspect"], ["convert", "-o", str(tmp_path / "o.safetensors")]):
        assert_one_line_error(run_cli(cmd[0], bad, *cmd[1:]), 4)
    p = run_cli("scan", bad)
    assert p.returncode == 4 and "Traceback" not in p.stderr and "internal error" not in p.stderr
