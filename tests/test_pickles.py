"""The restricted reader and writer: resource bounds, tensor-record validation, names that round-trip.

Memory is measured in a child process (``ru_maxrss`` of the children), never time.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

from ckptfix.errors import CorruptCheckpointError, ResourceLimitError
from ckptfix.formats import read_checkpoint
from ckptfix.pickles import (
    PickleLimits,
    Stub,
    check_depth,
    dumps,
    global_name,
    global_pair,
    globals_resolvable,
    loads_records,
    resolve_global,
    stub_class,
    stub_dtype,
)

from helpers import REPO, run_cli

pytestmark = pytest.mark.filterwarnings("ignore")

RSS_BUDGET_MIB = 256


def _zip_with_pickle(tmp_path, name: str, make_pkl) -> os.PathLike:
    """torch.save a small checkpoint, then replace its data.pkl by make_pkl(original data.pkl)."""
    src = tmp_path / f"src_{name}"
    torch.save({"state_dict": {"module.w": torch.ones(3)}, "epoch": 1}, src)
    out = tmp_path / name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            body = zin.read(info.filename)
            if info.filename.endswith("data.pkl"):
                body = make_pkl(body)
            zout.writestr(info, body)
    return out


def _with_entry(payload: bytes):
    """Add key 'bomb' -> payload (opcodes leaving one value) to the top-level dict of a torch data.pkl."""

    def make(body: bytes) -> bytes:
        assert body.endswith(b".")
        return body[:-1] + b"X\x04\x00\x00\x00bomb" + payload + b"s."

    return make


def _rss_cli(*args: str, env: dict | None = None) -> tuple[int, float, str]:
    """Run ``python -m ckptfix ARGS`` in a child; (exit code, peak RSS MiB, stderr)."""
    code = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run([sys.executable, '-m', 'ckptfix'] + sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stderr.write(p.stderr)\n"
        "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=600, env=e, cwd=str(REPO)
    )
    rc, kib = p.stdout.split()
    return int(rc), int(kib) / 1024, p.stderr


# --------------------------------------------------------------------------- the bombs of issue 10 item 3

BOMB_LONG_BINPUT = b"\x80\x02]r" + struct.pack("<I", 2**27) + b"."  # memo index 2**27 on a tiny pickle
BOMB_BYTEARRAY = b"cbuiltins\nbytearray\n\x8a\x05\x00\x00\x00\x80\x00\x85R"  # bytearray(2**31)
BOMB_FROZENSET = b"cbuiltins\nfrozenset\ncbuiltins\nrange\n\x8a\x06\x00\x10\xa5\xd4\xe8\x00\x85R\x85R"
BOMB_SET_RANGE = b"c__builtin__\nset\nc__builtin__\nxrange\nJ\x00-1\x01\x85R\x85R"  # set(range(2e7)), protocol 2


def test_bomb_sizes_as_filed():
    assert len(BOMB_LONG_BINPUT) == 9  # (18 bytes with the zip-free framing the issue used)
    assert len(b"\x80\x02" + BOMB_BYTEARRAY + b".") <= 41
    assert len(b"\x80\x02" + BOMB_FROZENSET + b".") <= 61


def test_long_binput_refused_before_allocation(tmp_path):
    p = tmp_path / "memo.pkl"
    p.write_bytes(BOMB_LONG_BINPUT)
    with pytest.raises(ResourceLimitError) as ei:
        loads_records(BOMB_LONG_BINPUT)
    assert "memo entry at index 134217728" in str(ei.value)
    rc, rss, err = _rss_cli("inspect", p)
    assert rc == 12 and err.startswith("Error: ") and rss < RSS_BUDGET_MIB, (rc, rss, err)
    rc, rss, err = _rss_cli("scan", p)
    assert rc == 11 and rss < RSS_BUDGET_MIB, (rc, rss, err)


@pytest.mark.parametrize(
    "payload,global_",
    [(BOMB_BYTEARRAY, "builtins.bytearray"), (BOMB_FROZENSET, "builtins.frozenset"), (BOMB_SET_RANGE, "builtins.set")],
    ids=["bytearray_2e31", "frozenset_range_1e12", "set_range_2e7"],
)
def test_container_bombs_become_placeholders_in_every_command(tmp_path, payload, global_):
    p = _zip_with_pickle(tmp_path, "bomb.pt", _with_entry(payload))
    cf = read_checkpoint(p)
    bomb = cf.obj["bomb"]
    assert isinstance(bomb, Stub) and bomb.full_name == global_
    for args in (["inspect", "--json", p], ["scan", p], ["strip-prefix", p, "-o", tmp_path / "out.pt"]):
        rc, rss, err = _rss_cli(*args)
        assert rss < RSS_BUDGET_MIB, (args, rss)
        assert rc in (0, 11), (args, rc, err)
        assert "Traceback" not in err
    # the rewrite wrote the same call back, unevaluated: torch reads it as plain torch would
    raw = zipfile.ZipFile(tmp_path / "out.pt")
    data = raw.read(next(n for n in raw.namelist() if n.endswith("data.pkl")))
    assert len(data) < 4096
    assert (
        globals_resolvable(
            data, zipfile.ZipFile(p).read(next(n for n in zipfile.ZipFile(p).namelist() if n.endswith("data.pkl")))
        )
        == []
    )


def test_small_containers_are_built_for_real():
    data = pickle.dumps({"s": {1, 2}, "f": frozenset([3]), "b": bytearray(b"xy"), "r": range(5)}, protocol=2)
    obj, up = loads_records(data)
    assert obj == {"s": {1, 2}, "f": frozenset([3]), "b": bytearray(b"xy"), "r": range(5)}
    assert up.notes == []


def test_placeholder_note_names_the_variable():
    data = b"\x80\x02" + BOMB_FROZENSET + b"."
    obj, up = loads_records(data)
    assert isinstance(obj, Stub)
    assert any("CKPTFIX_MAX_PICKLE_ITEMS" in n for n in up.notes)
    assert "builtins.frozenset" in up.stubbed
    # lifting the limit builds it (a small one, to keep the test cheap)
    obj, _ = loads_records(b"\x80\x02cbuiltins\nbytearray\nK\x10\x85R.", limits=PickleLimits(max_items=1))
    assert isinstance(obj, bytearray) and len(obj) == 16
    obj, _ = loads_records(b"\x80\x02cbuiltins\nbytearray\nK\x11\x85R.", limits=PickleLimits(max_items=1))
    assert isinstance(obj, Stub)


def test_many_distinct_globals_refused(tmp_path):
    n = 12_000
    body = b"\x80\x02(" + b"".join(b"cmod%d\nName%d\n" % (i, i) for i in range(n)) + b"l."
    with pytest.raises(ResourceLimitError) as ei:
        loads_records(body)
    assert "CKPTFIX_MAX_PICKLE_GLOBALS" in str(ei.value)
    p = tmp_path / "globals.pkl"
    p.write_bytes(body)
    rc, rss, err = _rss_cli("inspect", p)
    assert rc == 12 and rss < RSS_BUDGET_MIB, (rc, rss, err)
    rc, rss, err = _rss_cli("inspect", p, env={"CKPTFIX_MAX_PICKLE_GLOBALS": "20000"})
    assert rc != 12, err


@pytest.mark.parametrize(
    "body",
    [
        b"\x80\x02](" + b"}" * 5_000_000 + b"e.",  # 5 MB of bytes, ~350 MB of dicts
        b"\x80\x02](" + b"N" * 40_000_000 + b"e.",  # 40M values on the stack
        b"\x80\x04N" + b"\x94" * 40_000_000 + b".",  # 40M memo entries
    ],
    ids=["dicts", "stack", "memo"],
)
def test_object_budget_refuses_many_small_objects(tmp_path, body):
    with pytest.raises(ResourceLimitError) as ei:
        loads_records(body)
    assert "CKPTFIX_MAX_PICKLE_MB" in str(ei.value)
    p = tmp_path / "many.pkl"
    p.write_bytes(body)
    rc, rss, err = _rss_cli("inspect", p)
    assert rc == 12 and rss < RSS_BUDGET_MIB, (rc, rss, err)
    rc, rss, err = _rss_cli("scan", p)
    assert rc == 11 and rss < RSS_BUDGET_MIB, (rc, rss, err)


@pytest.mark.parametrize(
    "payload",
    [b"]" * 5000 + b"a" * 4999, b")" + b"\x85" * 5000, b"(" * 3000 + b"\x91" * 3000],
    ids=["lists", "tuples", "frozensets"],
)
def test_deep_nesting_is_a_resource_error_not_recursion(payload):
    with pytest.raises(ResourceLimitError) as ei:
        loads_records(b"\x80\x04" + payload + b".")
    assert "CKPTFIX_MAX_PICKLE_DEPTH" in str(ei.value)


def test_check_depth_handles_shared_and_cyclic_objects():
    leaf: list = []
    shared = [leaf]
    obj = {"a": shared, "b": [shared], "c": None}
    check_depth(obj, 4)
    with pytest.raises(ResourceLimitError):
        check_depth(obj, 3)
    cyc: list = []
    cyc.append(cyc)
    check_depth(cyc, 2)


def test_huge_integer_is_a_clean_error(tmp_path):
    big = b"\x80\x02\x8b" + struct.pack("<i", 4000) + b"\x01" * 4000 + b"."
    with pytest.raises(ResourceLimitError):
        loads_records(big)
    p = tmp_path / "int.pkl"
    p.write_bytes(big)
    assert run_cli("inspect", p).returncode == 12


# --------------------------------------------------------------------------- tensor records (issue 10 item 8)


def _patch_first(body: bytes, old: bytes, new: bytes) -> bytes:
    assert old in body, body
    return body.replace(old, new, 1)


@pytest.mark.parametrize(
    "old,new,why",
    [
        (b"QK\x00", b"QJ\xff\xff\xff\xff", "negative storage offset"),
        (b"K\x03\x85", b"J\xfd\xff\xff\xff\x85", "negative size"),
        (b"K\x01\x85", b"J\xff\xff\xff\xff\x85", "negative stride"),
        (b"QK\x00", b"QK\x02", "needs"),  # offset 2 of a 3-element storage, 3 elements: out of bounds
        (b"K\x03\x85", b"\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x40\x85", "more than a tensor can hold"),
    ],
    ids=["negative_offset", "negative_shape", "negative_stride", "out_of_storage", "2e62_elements"],
)
def test_invalid_tensor_records_are_corrupt_in_every_command(tmp_path, old, new, why):
    p = _zip_with_pickle(tmp_path, "bad.pt", lambda b: _patch_first(b, old, new))
    with pytest.raises(CorruptCheckpointError) as ei:
        read_checkpoint(p)
    assert why in str(ei.value)
    for args in (
        ["inspect", p],
        ["strip-prefix", p, "-o", tmp_path / "o.pt"],
        ["convert", p, "-o", tmp_path / "o.safetensors"],
    ):
        proc = run_cli(*map(str, args))
        assert proc.returncode == 4, (args, proc.stderr)
        assert proc.stderr.startswith("Error: ") and "Traceback" not in proc.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_stride0_expanded_tensor_is_valid(tmp_path):
    p = tmp_path / "exp.pt"
    torch.save({"w": torch.zeros(1).expand(1000, 1000)}, p)
    cf = read_checkpoint(p)
    assert cf.obj["w"].stride == (0, 0) and cf.obj["w"].numel == 10**6


# --------------------------------------------------------------------------- names that round-trip (issue 11 item 2)


def test_protocol2_python2_names_resolve_like_the_unpickler():
    data = pickle.dumps({"dtype": int, "kind": str, "r": range}, protocol=2)
    assert b"__builtin__\nlong" in data or b"__builtin__" in data
    obj, up = loads_records(data)
    assert set(up.globals_seen) == {"builtins.int", "builtins.str", "builtins.range"}
    out = dumps(obj)
    assert pickle.loads(out) == {"dtype": int, "kind": str, "r": range}
    assert globals_resolvable(out, data) == []


def test_torch_file_with_int_str_range_round_trips(tmp_path):
    src = tmp_path / "c.pt"
    torch.save({"state_dict": {"module.w": torch.zeros(2)}, "cfg": {"dtype": int, "kind": str, "r": range}}, src)
    cf = read_checkpoint(src)
    assert "builtins.long" not in cf.globals_seen and "builtins.int" in cf.globals_seen
    new = dumps(cf.obj)
    assert globals_resolvable(new, cf.details.data_pkl) == []
    p = run_cli("strip-prefix", src)
    assert p.returncode == 0, p.stderr
    out = tmp_path / "c.stripped.pt"
    got = torch.load(out, weights_only=False)
    assert got["cfg"] == {"dtype": int, "kind": str, "r": range}
    assert torch.equal(got["state_dict"]["w"], torch.zeros(2))
    with torch.serialization.safe_globals([int, str, range]):  # what the input itself needs
        assert torch.load(out, weights_only=True)["cfg"] == {"dtype": int, "kind": str, "r": range}
        assert torch.load(src, weights_only=True)["cfg"]["dtype"] is int


def test_scan_and_inspect_report_resolved_names(tmp_path):
    src = tmp_path / "c.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "cfg": {"dtype": int, "kind": str}}, src)
    doc = json.loads(run_cli("scan", "--json", src).stdout)
    assert "builtins.int" in doc["globals"] and "builtins.str" in doc["globals"]
    assert not any("long" in g or "unicode" in g for g in doc["globals"])
    doc = json.loads(run_cli("inspect", "--json", src).stdout)
    assert "builtins.int" in doc["globals"] and "builtins.long" not in doc["globals"]


def test_globals_resolvable_finds_what_would_fail():
    assert globals_resolvable(b"\x80\x02cbuiltins\nlong\n.") != []
    assert globals_resolvable(b"\x80\x02c__builtin__\nlong\n.") == []
    assert globals_resolvable(b"\x80\x03c__builtin__\nlong\n.") != []  # no mapping at protocol 3
    assert globals_resolvable(b"\x80\x02ccollections\nOrderedDict\n.") == []
    assert globals_resolvable(b"\x80\x02cmodels\nArgs\n.", b"\x80\x02cmodels\nArgs\n.") == []
    assert globals_resolvable(b"\x80\x02cmodels\nArgs2\n.", b"\x80\x02cmodels\nArgs\n.") != []
    assert globals_resolvable(b"\x80\x02cmodels\nArgs\n.", [("models", "Args")]) == []
    assert globals_resolvable(b"\x80\x02cmodels\nArgs\n") != []  # malformed


def test_resolve_global_is_what_pickle_does():
    for proto in range(6):
        for mod, name in [
            ("__builtin__", "long"),
            ("copy_reg", "_reconstructor"),
            ("UserDict", "UserDict"),
            ("__builtin__", "xrange"),
            ("builtins", "int"),
            ("torch", "Size"),
        ]:
            u = pickle._Unpickler(io.BytesIO(b""))  # type: ignore[attr-defined]
            u.proto = proto
            expected = (mod, name)
            if proto < 3:
                import _compat_pickle

                expected = _compat_pickle.NAME_MAPPING.get((mod, name)) or (
                    _compat_pickle.IMPORT_MAPPING.get(mod, mod),
                    name,
                )
            assert resolve_global(mod, name, proto) == expected


def test_ordereddict_and_collections_unchanged():
    data = pickle.dumps(collections.OrderedDict(a=1), protocol=2)
    obj, _ = loads_records(data)
    assert obj == collections.OrderedDict(a=1)


# --------------------------------------------------------------------------- placeholders


class _Obj:
    """A class the reader keeps as a placeholder: state through BUILD, items through APPENDS / SETITEMS."""

    def __init__(self) -> None:
        self.lr = 0.5


class _ListSub(list):
    pass


class _DictSub(dict):
    pass


def test_placeholders_expose_what_the_pickle_recorded():
    """``stub.module / name / full_name / args / state / listitems / dictitems / via_newobj``: the same values
    CPython's own ``__reduce_ex__`` hands the pickler, read back without running the class."""
    import argparse

    src = {
        "obj": _Obj(),
        "ns": argparse.Namespace(a=1),
        "lst": _ListSub([1, 2]),
        "dct": _DictSub(k="v"),
        "dtype": torch.float16,
    }
    obj, _ = loads_records(pickle.dumps(src, protocol=2))
    o = obj["obj"]
    assert (o.module, o.name, o.full_name) == (__name__, "_Obj", f"{__name__}._Obj")
    assert o.state == {"lr": 0.5} and o.args == () and o.kwargs == {} and o.via_newobj
    assert obj["ns"].state == {"a": 1} and obj["ns"].full_name == "argparse.Namespace"
    assert obj["lst"].listitems == [1, 2] and list(obj["lst"]) == [1, 2]
    assert obj["dct"].dictitems == {"k": "v"} and dict(obj["dct"].items()) == {"k": "v"} and obj["dct"]["k"] == "v"
    assert global_pair(type(o)) == (__name__, "_Obj") and global_name(type(o)) == f"{__name__}._Obj"
    assert global_pair(collections.OrderedDict) == ("collections", "OrderedDict")
    assert stub_dtype(obj["dtype"]) == "float16"
    # what the writer writes is what was recorded: a round trip through dumps gives CPython's objects back
    back = pickle.loads(dumps(obj))
    assert back["obj"].lr == 0.5 and back["ns"] == argparse.Namespace(a=1)
    assert back["lst"] == [1, 2] and type(back["lst"]) is _ListSub and back["dct"] == {"k": "v"}


def test_with_state_copies_a_placeholder():
    obj, _ = loads_records(pickle.dumps(_DictSub(k=1), protocol=2))
    new = obj.with_state({"extra": True})
    assert type(new) is type(obj) and new.state == {"extra": True} and new.dictitems == {"k": 1}
    assert obj.state is None and new.via_newobj == obj.via_newobj and new.args == obj.args
    new.dictitems["j"] = 2
    assert "j" not in obj.dictitems


def test_writer_names_placeholder_globals_once_and_forgets_them():
    """``dumps`` runs CPython's C pickler, which must find a global by importing it; a placeholder's module
    is never imported, so the writer lends each class a random name while it writes and renames it
    after: the pickle names the real global once (memoized), and nothing is left behind."""
    import pickletools

    import ckptfix.pickles as pk

    obj, _ = loads_records(pickle.dumps({"a": _Obj(), "b": [_Obj(), _Obj()]}, protocol=2))
    data = dumps(obj)
    assert pk._WRITING.__name__.encode() not in data
    named = [arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"]
    assert named.count(f"{__name__} _Obj") == 1
    back = pickle.loads(data)
    assert [type(x) for x in [back["a"], *back["b"]]] == [_Obj] * 3 and back["b"][1].lr == 0.5
    assert not [k for k in vars(pk._WRITING) if not k.startswith("__")]
    from ckptfix.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="newline"):  # a failed dump forgets its names too
        dumps([stub_class("argparse", "Namespace")(), stub_class("m", "a\nb")()])
    assert not [k for k in vars(pk._WRITING) if not k.startswith("__")]
    with pytest.raises(ValueError, match="protocol 2 or 3"):
        dumps(obj, protocol=4)


def test_placeholders_share_no_item_containers():
    """Items live in per-instance containers made on first use; the class defaults are read-only."""
    cls = stub_class("argparse", "Namespace")
    a, b = cls(), cls()
    a.append(1)
    a["k"] = "v"
    assert a.listitems == [1] and a.dictitems == {"k": "v"}
    assert list(b.listitems) == [] and dict(b.dictitems) == {} and b.state is None
    with pytest.raises(TypeError):
        b.dictitems["x"] = 1  # type: ignore[index]


def test_stub_classes_are_one_per_global():
    assert stub_class("argparse", "Namespace") is stub_class("argparse", "Namespace")
    ns = stub_class("argparse", "Namespace")()
    assert ns.full_name == "argparse.Namespace" and not ns.via_newobj
    assert "argparse.Namespace" in repr(ns)


# --- moved from test_review_ckpt.py: classifying globals, and nesting limits of the pickle reader


def test_untyped_storage_is_weights_only_safe(tmp_path):
    """torch.save writes torch.storage.UntypedStorage for uint16/float8...; weights_only loads it, so it is safe."""
    from ckptfix.ops.inspect import scan_checkpoint
    from ckptfix.pickles import classify_global

    p = tmp_path / "u16.pt"
    torch.save({"a": torch.zeros(3, dtype=torch.uint16), "b": torch.ones(2).to(torch.float8_e4m3fn)}, p)
    torch.load(p, weights_only=True)  # torch agrees
    assert classify_global("torch.storage.UntypedStorage") == "safe"
    r = scan_checkpoint(str(p))
    assert not r.unknown and not r.dangerous, r.to_dict()
    assert run_cli("scan", p).returncode == 0


@pytest.mark.parametrize(
    "payload",
    [b"]" * 100_000 + b"a" * 99_999, b"}" + b"X\x01\x00\x00\x00k}" * 99_999 + b"s" * 99_999],
    ids=["lists", "dicts"],
)
def test_deeply_nested_pickle_is_a_clean_error(tmp_path, payload):
    """A pickle nested 100,000 deep is refused by the reader: exit 12 naming the limit's variable, input untouched."""
    from helpers import assert_one_line_error, inject_into_data_pkl, leftovers, sha256

    src = tmp_path / "good.pt"
    torch.save({"state_dict": {"module.w": torch.ones(3)}}, src)
    deep = tmp_path / "deep.pt"
    inject_into_data_pkl(src, deep, payload)
    h = sha256(deep)
    p = run_cli("strip-prefix", deep)
    assert_one_line_error(p, 12)  # ResourceLimitError: refused by the reader, before any recursive walk
    assert "nested more than" in p.stderr and "CKPTFIX_MAX_PICKLE_DEPTH" in p.stderr
    assert sha256(deep) == h and leftovers(tmp_path) == []


def test_paused_gc_restores_the_collector_as_it_found_it():
    import gc

    from ckptfix.pickles import paused_gc

    assert gc.isenabled()
    with pytest.raises(KeyError):
        with paused_gc():
            assert not gc.isenabled()
            raise KeyError
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # it was off: it stays off
    finally:
        gc.enable()


def test_paused_gc_overlapping_threads_leave_the_collector_on(monkeypatch):
    """Two threads' pauses overlap; the first ends while the second is between reading and pausing the collector.

    Each pause remembering its own "was it on" would read "off" in the second thread, and pause it
    again after the first turned it back on: the collector would stay off for the rest of the process.
    """
    import threading

    import ckptfix.pickles as pk

    class FakeGc:
        enabled = True

        def isenabled(self) -> bool:
            return self.enabled

        def enable(self) -> None:
            self.enabled = True

        def disable(self) -> None:
            if threading.current_thread().name == "second":
                second_pausing.set()
                first_done.wait(0.5)  # the first thread ends its pause here, unless paused_gc serialises them
            self.enabled = False

    fake = FakeGc()
    monkeypatch.setattr(pk.stub, "gc", fake)  # paused_gc lives in ckptfix.pickles.stub
    first_in, second_pausing, first_done = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with pk.paused_gc():
            first_in.set()
            second_pausing.wait(0.5)
        first_done.set()

    def second() -> None:
        first_in.wait(2)
        with pk.paused_gc():
            pass

    threads = [threading.Thread(target=first, name="first"), threading.Thread(target=second, name="second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert fake.enabled


@pytest.mark.parametrize("module", ["a\nb", "a\ud800"], ids=["newline", "lone_surrogate"])
def test_unwritable_global_name_is_a_typed_error_and_nothing_is_left_lent(module):
    """A STACK_GLOBAL may name any string; protocol 2's GLOBAL holds neither a newline nor a lone surrogate."""
    import ckptfix.pickles as pk
    from ckptfix.errors import UnsupportedError

    before = set(vars(pk._WRITING))
    with pytest.raises(UnsupportedError) as e:
        pk.dumps({"x": pk.stub_class(module, "n")()})
    assert "\n" not in str(e.value)
    assert set(vars(pk._WRITING)) == before


@pytest.mark.parametrize(
    "module, code",
    [(b"a\nb", 8), (b"a\xed\xa0\x80", 4)],  # a lone surrogate: refused by the reader's pre-flight already
    ids=["newline", "lone_surrogate"],
)
def test_strip_prefix_of_an_unwritable_global_is_a_one_line_error(tmp_path, module, code):
    from helpers import assert_one_line_error, inject_into_data_pkl, leftovers

    src = tmp_path / "good.pt"
    torch.save({"module.w": torch.ones(3)}, src)
    bad = tmp_path / "bad.pt"
    inject_into_data_pkl(src, bad, b"\x8c" + bytes([len(module)]) + module + b"\x8c\x01n\x93")
    p = run_cli("strip-prefix", bad, "--prefix", "module.", "-o", tmp_path / "out.pt")
    assert_one_line_error(p, code)
    assert not (tmp_path / "out.pt").exists() and leftovers(tmp_path) == []


def test_codecs_encode_itself_is_written_as_the_codecs_global():
    """The reader's ``_codecs.encode`` stand-in, written as a value, names ``_codecs.encode`` (as CPython's does)."""
    import pickletools

    import ckptfix.pickles.policy as policy

    data = dumps([policy.codecs_encode, policy.codecs_encode])
    assert [arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"] == ["_codecs encode"]
    back = pickle.loads(data)
    assert back[0] is back[1] and back[0](b"ab".decode(), "latin1") == b"ab"
    assert not [k for k in vars(policy) if k.startswith("g") and "_" in k and k[1:].split("_")[0].isdigit()]


def test_bounded_calls_share_one_byte_budget():
    """Each ``bytearray(n)`` call is under the per-call limit, but 20 of them in a few hundred bytes of pickle
    must not build 20 MB: once what bounded calls built reaches the byte budget, the rest stay placeholders."""
    from ckptfix.pickles import PickleLimits

    one = b"c__builtin__\nbytearray\nJ" + struct.pack("<i", 1_000_000) + b"\x85R"
    data = b"\x80\x02(" + one * 20 + b"l."
    limits = PickleLimits(max_bytes=8 << 20, max_items=1 << 20)
    obj, up = loads_records(data, limits=limits)
    built = [x for x in obj if type(x) is bytearray]
    assert 0 < len(built) and sum(map(len, built)) <= limits.max_bytes
    kept = [x for x in obj if type(x) is not bytearray]
    assert kept and all(x.args == (1_000_000,) for x in kept) and up.notes
    assert [len(x) for x in pickle.loads(dumps(obj))] == [1_000_000] * 20  # written back as the same calls
