"""sanitize: everything beside the tensors becomes plain data; the output loads with weights_only=True.

The oracle is torch itself: ``torch.load(weights_only=True)`` must accept the output, and the tensors it
returns must equal what ``torch.load(weights_only=False)`` returns for the input.
"""

from __future__ import annotations

import argparse
import collections
import enum
import json
import os
import sys
import types
from collections import OrderedDict

import pytest
import torch

from ckptfix.errors import OutputError, UnsupportedError, VerificationError
from ckptfix.ops.sanitize import Plainer, normalise_global, sanitize_checkpoint

from helpers import assert_one_line_error, run_cli

np = pytest.importorskip("numpy")

pytestmark = pytest.mark.filterwarnings("ignore")


def _wo_fails(path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - torch's UnpicklingError
        return True
    return False


def _tensors(obj, prefix=""):
    """{path: tensor} for every tensor in a loaded object."""
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


class Color(enum.Enum):
    RED = 1


class Plain:
    def __init__(self):
        self.a = 1
        self.b = [1.5, "x"]


def _attrdict_cls():
    """A Lightning-style AttributeDict, importable by name while the test saves it."""
    mod = types.ModuleType("lightning_standin_utilities_data")

    class AttributeDict(dict):
        def __getattr__(self, k):
            return self[k]

    AttributeDict.__module__ = mod.__name__
    AttributeDict.__qualname__ = "AttributeDict"
    mod.AttributeDict = AttributeDict
    sys.modules[mod.__name__] = mod
    return AttributeDict


def _kinds():
    AD = _attrdict_cls()
    from omegaconf import OmegaConf

    return {
        "namespace": argparse.Namespace(lr=0.1, name="run", layers=[1, 2]),
        "numpy_array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "numpy_fortran_bigendian": np.asfortranarray(np.arange(6, dtype=">i4").reshape(2, 3)),
        "numpy_uint16": np.arange(4, dtype=np.uint16),
        "numpy_scalars": {"f": np.float64(0.25), "i": np.int32(-3), "b": np.bool_(True)},
        "numpy_strings": np.array(["a", "bcd"]),
        "numpy_objects": np.array([1, "x", None], dtype=object),
        "numpy_dtype": np.dtype("float16"),
        "omegaconf": OmegaConf.create({"model": {"dim": 8, "names": ["a", "b"]}, "lr": 0.5, "ref": "${lr}"}),
        "attributedict": AD(lr=0.1, nested=AD(x=1)),
        "class_refs": {"dtype": int, "kind": str, "fn": os.path.join},
        "enum_and_object": {"color": Color.RED, "obj": Plain()},
        "frozenset_range_slice": {"fs": frozenset([1, 2]), "r": range(3), "s": slice(1, 5, 2)},
        "collections": {"dd": collections.defaultdict(list, a=[1]), "dq": collections.deque([1, 2])},
    }


KINDS = [
    "namespace",
    "numpy_array",
    "numpy_fortran_bigendian",
    "numpy_uint16",
    "numpy_scalars",
    "numpy_strings",
    "numpy_objects",
    "numpy_dtype",
    "omegaconf",
    "attributedict",
    "class_refs",
    "enum_and_object",
    "frozenset_range_slice",
    "collections",
]


@pytest.fixture(scope="module")
def omegaconf_available():
    return pytest.importorskip("omegaconf")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_each_kind_loads_with_weights_only(tmp_path, kind, legacy, omegaconf_available):
    value = _kinds()[kind]
    w = torch.randn(3, 4)
    src = tmp_path / "ckpt.pt"
    torch.save(
        {"state_dict": {"w": w, "w_view": w[1]}, "extra": value, "epoch": 3},
        src,
        _use_new_zipfile_serialization=not legacy,
    )
    assert _wo_fails(src)
    rep = sanitize_checkpoint(src, tmp_path / "out.pt")
    assert rep.changed and rep.verified and rep.changes
    assert rep.globals_after == []
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    ref = torch.load(src, weights_only=False)
    assert torch.equal(out["state_dict"]["w"], w)
    # storage sharing kept: the view is still a view of w
    sd = out["state_dict"]
    assert sd["w_view"].untyped_storage().data_ptr() == sd["w"].untyped_storage().data_ptr()
    assert out["epoch"] == 3
    _check_plain(kind, ref["extra"], out["extra"])


def _check_plain(kind, ref, got):
    if kind == "namespace":
        assert got == vars(ref)
    elif kind.startswith("numpy_") and isinstance(ref, np.ndarray) and ref.dtype.kind in "fiub":
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(ref).astype(ref.dtype.newbyteorder("="))))
    elif kind == "numpy_scalars":
        assert got == {k: v.item() for k, v in ref.items()}
        assert type(got["f"]) is float and type(got["i"]) is int and type(got["b"]) is bool
    elif kind in ("numpy_strings", "numpy_objects"):
        assert got == ref.tolist()
    elif kind == "numpy_dtype":
        assert got == "float16"
    elif kind == "omegaconf":
        from omegaconf import OmegaConf

        assert got == {"model": {"dim": 8, "names": ["a", "b"]}, "lr": 0.5, "ref": "${lr}"}
        assert OmegaConf.create(got).ref == 0.5  # the interpolation still works once re-created
    elif kind == "attributedict":
        assert got == {"lr": 0.1, "nested": {"x": 1}} and type(got) is dict
    elif kind == "class_refs":
        assert got == {"dtype": "builtins.int", "kind": "builtins.str", "fn": "posixpath.join"}
    elif kind == "enum_and_object":
        # by value ``Color(1)``, or by name ``getattr(Color, "RED")`` as Python 3.12 and some 3.11 builds pickle it
        assert got["color"] in (
            {"__class__": f"{__name__}.Color", "__args__": [1]},
            {"__class__": "builtins.getattr", "__args__": [f"{__name__}.Color", "RED"]},
        )
        assert got["obj"] == {"__class__": f"{__name__}.Plain", "a": 1, "b": [1.5, "x"]}
    elif kind == "collections":
        assert got == {"dd": {"a": [1]}, "dq": [1, 2]} and type(got["dd"]) is dict
    elif kind == "frozenset_range_slice":
        assert got["fs"] == {1, 2}
        assert got["r"] == {"__class__": "builtins.range", "start": 0, "stop": 3, "step": 1}
        assert got["s"] == {"__class__": "builtins.slice", "start": 1, "stop": 5, "step": 2}


def test_training_args_namespace_top_level(tmp_path):
    src = tmp_path / "training_args.bin"
    torch.save(argparse.Namespace(output_dir="out", learning_rate=5e-5, seed=42), src)
    rep = sanitize_checkpoint(src, tmp_path / "ta.bin")
    assert [c.to_dict() for c in rep.changes] == [{"path": "(top level)", "was": "argparse.Namespace", "now": "dict"}]
    assert torch.load(tmp_path / "ta.bin", weights_only=True) == {
        "output_dir": "out",
        "learning_rate": 5e-5,
        "seed": 42,
    }


def test_cuda_tags_and_records_copied_by_range(tmp_path, monkeypatch):
    """Tensor records are copied byte for byte (torch-free); a cuda:1 tag stays as it was."""
    src = tmp_path / "c.pt"
    sd = OrderedDict(a=torch.randn(5), b=torch.arange(7))
    torch.save({"model": sd, "cfg": argparse.Namespace(x=np.float32(2.0))}, src)
    sanitize_checkpoint(src, tmp_path / "o.pt")
    import zipfile

    with zipfile.ZipFile(src) as a, zipfile.ZipFile(tmp_path / "o.pt") as b:
        ra = {n.split("/", 1)[1]: a.read(n) for n in a.namelist() if "/data/" in n}
        rb = {n.split("/", 1)[1]: b.read(n) for n in b.namelist() if "/data/" in n}
    assert ra == rb
    out = torch.load(tmp_path / "o.pt", weights_only=True)
    assert out["cfg"] == {"x": 2.0}
    assert all(torch.equal(out["model"][k], sd[k]) for k in sd)


def test_in_place_keeps_backup(tmp_path):
    src = tmp_path / "m.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "args": argparse.Namespace(a=1)}, src)
    before = src.read_bytes()
    rep = sanitize_checkpoint(src, in_place=True)
    assert rep.output == str(src) and rep.backup and open(rep.backup, "rb").read() == before
    assert torch.load(src, weights_only=True)["args"] == {"a": 1}


def test_already_safe_writes_nothing(tmp_path):
    src = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2)}, src)
    rep = sanitize_checkpoint(src, tmp_path / "o.pt")
    assert not rep.changed and rep.output is None and not (tmp_path / "o.pt").exists()


def test_refusals(tmp_path):
    src = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2), "a": argparse.Namespace(x=1)}, src)
    (tmp_path / "o.pt").write_bytes(b"keep")
    with pytest.raises(OutputError):
        sanitize_checkpoint(src, tmp_path / "o.pt")
    assert (tmp_path / "o.pt").read_bytes() == b"keep"
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    with pytest.raises(UnsupportedError):
        sanitize_checkpoint(tmp_path / "m.safetensors")


def test_verification_stops_an_unsafe_output(tmp_path, monkeypatch):
    """If the converter let an unsafe global through, nothing is written."""
    src = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2), "a": argparse.Namespace(x=1)}, src)
    monkeypatch.setattr(Plainer, "_stub", lambda self, v, path, depth: v)
    with pytest.raises(VerificationError, match="argparse.Namespace"):
        sanitize_checkpoint(src, tmp_path / "o.pt")
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]


def test_cli_json_and_text(tmp_path):
    src = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2), "shift": np.arange(3.0)}, src)
    p = run_cli("sanitize", src, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["changes"] == [{"path": "shift", "was": "numpy.ndarray float64 [3]", "now": "tensor (storage 1)"}]
    assert doc["output"].endswith("m.sanitized.pt")
    p = run_cli("sanitize", src)  # exists now
    assert_one_line_error(p, 9)
    p = run_cli("sanitize", src, "--force")
    assert p.returncode == 0 and p.stdout.strip().endswith("m.sanitized.pt")
    assert "shift: numpy.ndarray float64 [3] -> tensor" in p.stderr


def test_sanitize_never_imports_torch(tmp_path):
    src = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2), "shift": np.arange(3.0), "a": argparse.Namespace(x=1)}, src)
    code = (
        "import sys; from ckptfix.ops.sanitize import sanitize_checkpoint; "
        f"sanitize_checkpoint({str(src)!r}, {str(tmp_path / 'o.pt')!r}); "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'imported'"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "name,want",
    [
        ("builtins.long", "builtins.int"),
        ("builtins.unicode", "builtins.str"),
        ("builtins.xrange", "builtins.range"),
        ("copy_reg._reconstructor", "copyreg._reconstructor"),
        ("collections.OrderedDict", "collections.OrderedDict"),
    ],
)
def test_normalise_global(name, want):
    assert normalise_global(name) == want


def test_whole_pickled_module(tmp_path):
    """torch.save(model): every module becomes a dict of its state; the parameters stay tensors."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    torch.save(net, tmp_path / "m.pt")
    rep = sanitize_checkpoint(tmp_path / "m.pt", tmp_path / "o.pt")
    assert {c.was for c in rep.changes} >= {"torch.nn.modules.container.Sequential", "torch.nn.modules.linear.Linear"}
    out = torch.load(tmp_path / "o.pt", weights_only=True)
    assert out["__class__"] == "torch.nn.modules.container.Sequential"
    lin = out["_modules"]["0"]
    assert torch.equal(lin["_parameters"]["weight"], net[0].weight.detach())
    assert torch.equal(out["_modules"]["1"]["_buffers"]["running_mean"], net[1].running_mean)


def test_legacy_file_already_safe_is_left_alone(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt", _use_new_zipfile_serialization=False)
    rep = sanitize_checkpoint(tmp_path / "m.pt", tmp_path / "o.pt")
    assert not rep.changed and not (tmp_path / "o.pt").exists()
    torch.load(tmp_path / "m.pt", weights_only=True)


def test_protocol5_numpy_arrays_become_tensors(tmp_path):
    """numpy pickles arrays as ``numpy._core.numeric._frombuffer(buf, dtype, shape, order)`` under protocol 5."""
    p = tmp_path / "p5.pt"
    arrays = {
        "a": np.arange(6, dtype=np.int64).reshape(2, 3),
        "f": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "b": np.arange(4, dtype=">f4"),
    }
    torch.save({"w": torch.ones(2), **arrays}, p, pickle_protocol=5)
    rep = sanitize_checkpoint(p)
    got = torch.load(rep.output, weights_only=True)
    for k, a in arrays.items():
        assert isinstance(got[k], torch.Tensor), (k, got[k])
        assert torch.equal(got[k], torch.from_numpy(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("=")))), k


def test_object_array_with_a_lying_shape_is_bounded(tmp_path):
    """A few bytes declaring a (10**8, 2) object array holding two elements must not build 10**8 lists."""
    import pickle

    rd = np.zeros(1).__reduce__()

    class Fake:
        def __reduce__(self):
            return (rd[0], rd[1], (1, (10**8, 2), np.dtype(object), False, [1, 2]))

    pl = Plainer(arrays="tensor")
    from ckptfix.pickles import loads_records

    obj, _ = loads_records(pickle.dumps({"a": Fake()}, protocol=2))
    out = pl.convert(obj)
    assert not isinstance(out["a"], list) or len(out["a"]) <= 2


def test_empty_numpy_arrays_become_empty_tensors(tmp_path):
    """Protocol 2 pickles an empty array's data as ``bytes()`` (a call, not a bytes literal)."""
    p = tmp_path / "z.pt"
    torch.save({"w": torch.ones(2), "a": np.zeros(0), "b": np.zeros((0, 3), dtype=np.float32)}, p)
    rep = sanitize_checkpoint(p)
    got = torch.load(rep.output, weights_only=True)
    assert got["a"].shape == (0,) and got["a"].dtype == torch.float64
    assert got["b"].shape == (0, 3) and got["b"].dtype == torch.float32


class _MySubclass(torch.Tensor):
    pass


def test_tensor_subclass_becomes_a_plain_tensor(tmp_path):
    """A tensor subclass (``torch._tensor._rebuild_from_type_v2`` naming a user class) is outside the allowlist:
    sanitize writes the plain tensor, same values and sharing, and lists the change."""
    p = tmp_path / "sub.pt"
    t = torch.arange(6.0).as_subclass(_MySubclass)
    torch.save({"t": t, "again": t, "w": torch.ones(2)}, p)
    rep = sanitize_checkpoint(p)
    got = torch.load(rep.output, weights_only=True)
    assert type(got["t"]) is torch.Tensor and torch.equal(got["t"], torch.arange(6.0))
    assert got["again"] is got["t"]
    assert any(c.path == "t" and "_MySubclass" in c.was and c.now == "tensor" for c in rep.changes)


@pytest.mark.parametrize("depth", [390, 1000])
def test_deep_nesting_is_a_one_line_error_not_a_crash(tmp_path, depth):
    """Nesting that torch.load reads (a class reference 390 or 1000 lists deep) must not end in an internal
    RecursionError: sanitize writes it or says it is too deep (ResourceLimitError, exit 12)."""
    nested: list = [int]
    for _ in range(depth):
        nested = [nested]
    p = tmp_path / "deep.pt"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        torch.save({"w": torch.ones(1), "deep": nested}, p)
    finally:
        sys.setrecursionlimit(limit)
    r = run_cli("sanitize", str(p))
    if r.returncode != 0:
        assert_one_line_error(r, 12)


@pytest.mark.parametrize("proto", [3, 4, 5])
@pytest.mark.parametrize("legacy", [False, True])
def test_protocol_3_plus_pickles_are_rewritten(tmp_path, proto, legacy):
    """torch's weights-only unpickler reads protocol-2 opcodes only (no FRAME, SHORT_BINUNICODE, BINBYTES ...):
    a file whose globals are all allowed but which torch.save wrote with pickle_protocol>=3 still fails
    ``torch.load(weights_only=True)``, so sanitize must not call it already loadable."""
    p = tmp_path / "p.pt"
    torch.save(
        {"w": torch.arange(3.0), "b": b"xy", "s": {1, 2}, "name": "x"},
        p,
        pickle_protocol=proto,
        _use_new_zipfile_serialization=not legacy,
    )
    assert _wo_fails(p)
    rep = sanitize_checkpoint(p)
    assert rep.output is not None
    got = torch.load(rep.output, weights_only=True)
    assert torch.equal(got["w"], torch.arange(3.0)) and got["b"] == b"xy" and got["s"] == {1, 2}


def test_numpy_arrays_follow_a_big_endian_archives_byte_order(tmp_path):
    """An archive whose ``byteorder`` record says big (saved on s390x): torch byte-swaps every storage on load,
    so the tensors made from numpy arrays must be written big-endian too."""
    import zipfile

    src = tmp_path / "le.pt"
    torch.save({"w": torch.arange(4.0), "a": np.arange(3.0), "b": np.arange(2, dtype=">i4")}, src)
    big = tmp_path / "be.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(big, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename:
                data = np.frombuffer(data, dtype="<f4").astype(">f4").tobytes()  # w's storage
            zout.writestr(info, data)
    assert torch.equal(torch.load(big, weights_only=False)["w"], torch.arange(4.0))
    rep = sanitize_checkpoint(big)
    got = torch.load(rep.output, weights_only=True)
    assert torch.equal(got["w"], torch.arange(4.0))
    assert torch.equal(got["a"], torch.arange(3, dtype=torch.float64))
    assert torch.equal(got["b"], torch.arange(2, dtype=torch.int32))


def test_new_storages_never_reuse_the_name_of_an_unreferenced_member(tmp_path):
    """An archive may hold a storage member nothing references (edited by another tool); a numpy array's new
    storage must not be given that name: the zip would hold the name twice and torch would read the old bytes."""
    import zipfile

    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2), "a": np.arange(3.0)}, src)
    orphan = tmp_path / "orphan.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(orphan, "w", zipfile.ZIP_STORED) as zout:
        root = zin.namelist()[0].split("/")[0]
        for info in zin.infolist():
            zout.writestr(info, zin.read(info))
        zout.writestr(f"{root}/data/1", b"\xff" * 24)  # what storage 1 would be, but nothing refers to it
    rep = sanitize_checkpoint(orphan)
    with zipfile.ZipFile(rep.output) as z:
        names = z.namelist()
    assert len(names) == len(set(names))
    got = torch.load(rep.output, weights_only=True)
    assert torch.equal(got["a"], torch.arange(3, dtype=torch.float64))


def test_an_array_with_a_non_integer_shape_is_not_a_crash(tmp_path):
    import pickle

    from ckptfix.pickles import loads_records

    rd = np.zeros(1).__reduce__()

    class Fake:
        def __reduce__(self):
            return (rd[0], rd[1], (1, ("x",), np.dtype("f8"), False, b"\0" * 8))

    obj, _ = loads_records(pickle.dumps({"a": Fake()}, protocol=2))
    out = Plainer(arrays="tensor").convert(obj)
    assert isinstance(out["a"], dict)


def test_objects_that_contain_themselves_keep_their_cycles(tmp_path):
    """The pickle memo lets a list, a dict or an object hold itself, and ``torch.load(weights_only=True)`` rebuilds
    such cycles of lists and dicts: sanitize keeps them (an object becomes a dict that holds itself) instead of
    refusing the file as nested too deeply, and reports only what became plain data."""
    lst: list = []
    lst.append(lst)
    d: dict = {"k": 1}
    d["self"] = d
    ns = argparse.Namespace(lr=0.1)
    ns.me = ns
    ns.lst = lst
    box = [1]
    tup = (box,)
    box.append(tup)  # tuple -> list -> the tuple
    p = tmp_path / "cyc.pt"
    torch.save({"w": torch.arange(3.0), "l": lst, "d": d, "ns": ns, "t": tup}, p)
    r = run_cli("sanitize", str(p), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert [(c["path"], c["was"], c["now"]) for c in rep["changes"]] == [("ns", "argparse.Namespace", "dict")]
    got = torch.load(rep["output"], weights_only=True)
    assert torch.equal(got["w"], torch.arange(3.0))
    assert got["l"][0] is got["l"] and got["d"]["self"] is got["d"] and got["d"]["k"] == 1
    assert got["ns"]["me"] is got["ns"] and got["ns"]["lst"] is got["l"] and got["ns"]["lr"] == 0.1
    assert got["t"][0][0] == 1 and got["t"][0][1][0] is got["t"][0]


def test_a_cycle_no_plain_container_can_hold_becomes_a_reported_string(tmp_path):
    """A numpy object array that holds itself becomes a list, which cannot be the array: the reference back
    becomes ``"<cycle: back to PATH>"``, listed in the changes; the tensor is kept."""
    a = np.empty(2, dtype=object)
    a[0], a[1] = "x", a
    p = tmp_path / "objcyc.pt"
    torch.save({"w": torch.ones(2), "a": a}, p)
    rep = sanitize_checkpoint(p)
    got = torch.load(rep.output, weights_only=True)
    assert torch.equal(got["w"], torch.ones(2))
    assert got["a"] == ["x", "<cycle: back to a>"]
    assert any(c.path == "a/1" and c.was == "reference back to a (a cycle)" and c.now == "str" for c in rep.changes)


def test_plain_data_for_json_replaces_every_cycle():
    """``arrays="list"`` (what convert writes into JSON metadata) cannot hold a cycle: each reference back to an
    object being converted becomes a string naming where it points, and the result is JSON."""
    import pickle

    from ckptfix.pickles import loads_records

    lst: list = [1]
    lst.append(lst)
    ns = argparse.Namespace(lr=0.1, lst=lst)
    ns.me = ns
    obj, _ = loads_records(pickle.dumps({"ns": ns}, protocol=2))
    pl = Plainer(arrays="list", sep=".")
    out = pl.convert(obj)
    assert json.loads(json.dumps(out)) == {
        "ns": {"lr": 0.1, "lst": [1, "<cycle: back to ns.lst>"], "me": "<cycle: back to ns>"}
    }
    assert {c.path for c in pl.changes if c.now == "str"} == {"ns.lst.1", "ns.me"}
    kept = Plainer(arrays="list", keep_cycles=True).convert(obj)
    assert kept["ns"]["me"] is kept["ns"]


def test_a_python2_legacy_file_with_text_int_opcodes_is_not_called_weights_only_loadable(tmp_path):
    """Python 2's cPickle wrote ints past 32 bits as INT (text) even at protocol 2 (cdpam's checkpoint on PyPI:
    the optimizer's param ids); torch's weights-only unpickler refuses that opcode, so inspect says FAILS and
    sanitize rewrites the file, which torch.load(weights_only=True) then reads with the same values."""
    import pickle

    from helpers import run_cli

    big = 139832181927520
    src, out = tmp_path / "py2.pt", tmp_path / "plain.pt"
    torch.save({"state": {"w": torch.arange(4.0)}, "optim": {"ids": [big]}}, src, _use_new_zipfile_serialization=False)
    raw = src.read_bytes()
    long1 = b"\x8a" + bytes([len(pickle.encode_long(big))]) + pickle.encode_long(big)
    assert raw.count(long1) == 1
    src.write_bytes(raw.replace(long1, b"I%d\n" % big))  # the opcode Python 2 wrote
    with pytest.raises(pickle.UnpicklingError):
        torch.load(src, weights_only=True)  # the oracle: torch refuses the file
    r = run_cli("inspect", str(src))
    assert "weights_only  FAILS" in r.stdout and "INT" in r.stdout
    r = run_cli("sanitize", str(src), "-o", str(out))
    assert r.returncode == 0, r.stderr
    got = torch.load(out, weights_only=True)
    assert got["optim"]["ids"] == [big] and torch.equal(got["state"]["w"], torch.arange(4.0))
