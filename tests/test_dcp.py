"""ckptfix.formats.dcp: torch.distributed.checkpoint directories read, assembled, converted and renamed safely.

Sharded inputs are made two ways: a real gloo process group (FSDP2 ``fully_shard`` and DTensor
``Shard(1)``, uneven rows) and :func:`write_dcp`, which writes what DCP's file-system writer writes
(``torch.save`` chunk archives at byte ranges of per-rank ``.distcp`` files, torch's own metadata
classes) for any chunk layout; torch's ``dcp.load`` is the oracle that it reads back right.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfix import load_anywhere
from ckptfix.cli import main
from ckptfix.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafePickleError, UnsupportedError
from ckptfix.ops.convert import convert
from ckptfix.ops.load import load_checkpoint

from helpers import Evil, assert_one_line_error, run_cli

dcp = pytest.importorskip("torch.distributed.checkpoint")


# --------------------------------------------------------------------------- writing DCP directories


def grid(shape: tuple[int, ...], cuts: dict[int, list[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Chunks of ``shape`` cut at the given positions per dim (uneven on purpose)."""
    bounds = []
    for d, n in enumerate(shape):
        pts = [0] + sorted(cuts.get(d, [])) + [n]
        bounds.append([(a, b - a) for a, b in itertools.pairwise(pts)])
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    for dim in bounds:
        out = [(o + (a,), s + (n,)) for o, s in out for a, n in dim]
    return out


def write_dcp(
    d: Path, entries: list[tuple[tuple, torch.Tensor, list]], objects: dict[tuple, Any] | None = None, nranks: int = 3
) -> Path:
    """A DCP directory as torch's FileSystemWriter lays it out, with the given chunks (round-robin over ranks)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    d.mkdir(parents=True, exist_ok=True)
    streams = [io.BytesIO() for _ in range(nranks)]

    def put(rank: int, data: bytes) -> Any:
        s = streams[rank]
        off = s.tell()
        s.write(data)
        return _StorageInfo(f"__{rank}_0.distcp", off, len(data))

    sdm: dict = {}
    planner: dict = {}
    storage: dict = {}
    k = 0
    for path, t, chunks in entries:
        fqn = ".".join(map(str, path))
        planner[fqn] = path
        cms = []
        for i, (off, size) in enumerate(chunks):
            piece = t[tuple(slice(o, o + s) for o, s in zip(off, size, strict=False))].clone()
            buf = io.BytesIO()
            torch.save(piece, buf)
            storage[MetadataIndex(fqn, torch.Size(off), i)] = put(k % nranks, buf.getvalue())
            k += 1
            cms.append(ChunkStorageMetadata(torch.Size(off), torch.Size(size)))
        sdm[fqn] = TensorStorageMetadata(TensorProperties.create_from_tensor(t), t.size(), cms)
    for path, obj in (objects or {}).items():
        fqn = ".".join(map(str, path))
        planner[fqn] = path
        buf = io.BytesIO()
        torch.save(obj, buf)
        storage[MetadataIndex(fqn)] = put(k % nranks, buf.getvalue())
        k += 1
        sdm[fqn] = BytesStorageMetadata()
    for r, s in enumerate(streams):
        if s.tell():
            (d / f"__{r}_0.distcp").write_bytes(s.getvalue())
    with open(d / ".metadata", "wb") as f:
        pickle.dump(Metadata(sdm, planner_data=planner, storage_data=storage), f)
    return d


def torch_load_dcp(d: Path, template: dict) -> dict:
    """The oracle: torch's own dcp.load into a template of the right shapes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, checkpoint_id=str(d), no_dist=True)
    return template


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


#: name -> (shape, dtype, cuts): row-uneven, column, 2-D grid, 3-D along the last dim, replicated, scalar, empty
LAYOUTS = {
    "rows_uneven": ((7, 5), torch.float32, {0: [3, 6]}),
    "columns": ((4, 9), torch.float32, {1: [3, 5]}),
    "grid": ((7, 10), torch.bfloat16, {0: [3], 1: [4, 7]}),
    "last_dim_3d": ((3, 4, 5), torch.float16, {2: [2, 4]}),
    "middle_dim_3d": ((2, 6, 3), torch.int64, {1: [1, 4], 2: [2]}),
    "replicated": ((5, 3), torch.int32, {}),
    "vector": ((11,), torch.float64, {0: [4, 8]}),
    "scalar": ((), torch.float32, {}),
    "bool_cols": ((3, 8), torch.bool, {1: [5]}),
    "empty": ((0, 4), torch.float32, {}),
}


def layout_dir(tmp_path: Path, name: str, prefix: str = "") -> tuple[Path, dict[str, torch.Tensor]]:
    shape, dtype, cuts = LAYOUTS[name]
    t = _rand(shape, dtype, 1)
    other = _rand((6, 4), torch.float32, 2)
    d = write_dcp(
        tmp_path / f"{name}.dcp",
        [(("model", prefix + "w"), t, grid(shape, cuts)), (("model", prefix + "b"), other, grid((6, 4), {0: [1]}))],
        {("epoch",): 3},
    )
    return d, {prefix + "w": t, prefix + "b": other}


# --------------------------------------------------------------------------- load_anywhere


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_load_anywhere_any_sharding_matches_torch(tmp_path, name):
    d, ref = layout_dir(tmp_path, name)
    oracle = torch_load_dcp(d, {"model": {k: torch.zeros_like(v) for k, v in ref.items()}})["model"]
    got = load_anywhere(d)
    assert list(got) == list(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(got[k], v) and torch.equal(got[k], oracle[k])
    assert load_checkpoint(d).checkpoint["epoch"] == 3


def test_load_checkpoint_whole_nesting_and_objects(tmp_path):
    w = _rand((5, 4), torch.float32, 3)
    d = write_dcp(
        tmp_path / "run",
        [
            (("model", "fc.weight"), w, grid((5, 4), {0: [2]})),
            (("optim", "state", 0, "exp_avg"), w * 2, grid((5, 4), {1: [1]})),
        ],
        {("optim", "param_groups", 0, "lr"): 0.5, ("optim", "param_groups", 0, "params"): [0], ("step",): 17},
    )
    lc = load_checkpoint(d)
    assert lc.format == "dcp" and lc.key_path == ("model",)
    ck = lc.checkpoint
    assert torch.equal(ck["optim"]["state"][0]["exp_avg"], w * 2)
    assert ck["optim"]["param_groups"] == [{"lr": 0.5, "params": [0]}] and ck["step"] == 17


def test_load_without_numpy(tmp_path):
    d, ref = layout_dir(tmp_path, "grid")
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import torch\nfrom ckptfix import load_anywhere\n"
        f"sd = load_anywhere({str(d)!r})\n"
        "print(sorted(sd), sd['w'].float().sum().item())"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("]")[0] + "]" == str(sorted(ref))
    assert abs(float(p.stdout.split()[-1]) - ref["w"].float().sum().item()) < 1e-3


# --------------------------------------------------------------------------- convert


def _save_file_bytes(tmp_path: Path, sd: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save_file

    p = tmp_path / "oracle.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(p), metadata={"format": "pt"})
    return p.read_bytes()


@pytest.mark.parametrize("block", [None, 16, 1])
@pytest.mark.parametrize("name", sorted(n for n in LAYOUTS if n != "empty"))
def test_convert_byte_identical_to_save_file(tmp_path, monkeypatch, name, block):
    from ckptfix.ops.convert import dcp_in as consolidate

    if block:  # tiny blocks force row groups, per-row recursion and run assembly
        monkeypatch.setattr(consolidate, "BLOCK_BYTES", block)
    d, ref = layout_dir(tmp_path, name)
    out = tmp_path / "out.safetensors"
    r = convert(d, out, ckptfix_metadata=False)
    assert r.verified and r.tensors == 2 and r.source_format == "dcp"
    assert out.read_bytes() == _save_file_bytes(tmp_path, ref)


def test_convert_needs_no_torch(tmp_path):
    d, ref = layout_dir(tmp_path, "grid", prefix="module.")
    out = tmp_path / "o.safetensors"
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "from ckptfix.ops.convert import convert\nfrom ckptfix.ops.inspect import inspect_checkpoint\n"
        f"r = convert({str(d)!r}, {str(out)!r}, strip_prefix=True)\n"
        f"i = inspect_checkpoint({str(d)!r})\n"
        "from ckptfix.cli import main\n"
        f"assert main(['strip-prefix', {str(d)!r}, '-o', {str(d) + '.stripped'!r}]) == 0\n"
        f"assert main(['scan', {str(d)!r}]) == 0\n"
        "print(r.tensors, r.renamed, i.tensor_count, i.dcp['chunks'], i.dcp['ranks'])\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m])"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1].split() == ["2", "2", "2", "8", "3"]
    from safetensors.torch import load_file

    got = load_file(str(out))
    assert set(got) == {"w", "b"} and torch.equal(got["w"], ref["module.w"])


def test_convert_sharded_output_and_optimizer(tmp_path):
    w = _rand((64, 16), torch.float32, 4)
    d = write_dcp(
        tmp_path / "run",
        [
            (("model", "a"), w, grid((64, 16), {1: [5]})),
            (("model", "b"), w + 1, grid((64, 16), {0: [33]})),
            (("optim", "state", "a", "exp_avg"), w * 3, grid((64, 16), {0: [7]})),
        ],
        {("optim", "param_groups", 0, "lr"): 0.1, ("epoch",): 2},
    )
    r = convert(d, tmp_path / "m.safetensors", max_shard_size=5000)
    assert len(r.outputs) == 2 and r.index and os.path.exists(r.index)
    assert r.excluded == ["optim"]
    r2 = convert(d, tmp_path / "o.safetensors", include_optimizer=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "o.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("optimizer.optim.state.a.exp_avg"), w * 3)
        assert '"epoch": 2' in f.metadata()["ckptfix.extra"]
    assert r2.optimizer_tensors == 1


# --------------------------------------------------------------------------- real sharded saves (gloo)


@pytest.fixture
def fsdp_dcp(fsdp2_gloo_dcp):
    """FSDP2 + DTensor sharded DCP saved by 2 gloo ranks (built once per test run: conftest.py)."""
    return fsdp2_gloo_dcp


def test_fsdp_sharded_save_loads_and_converts(fsdp_dcp, tmp_path):
    d, full = fsdp_dcp
    assert sorted(p.name for p in d.iterdir() if p.suffix == ".distcp") == ["__0_0.distcp", "__1_0.distcp"]
    got = load_anywhere(d)
    assert list(got) and set(got) == set(full)
    for k, v in full.items():
        assert torch.equal(got[k], v), k
    ck = load_checkpoint(d).checkpoint
    assert ck["epoch"] == 1 and "state" in ck["optim"]
    out = tmp_path / "fsdp.safetensors"
    convert(d, out, ckptfix_metadata=False)
    assert out.read_bytes() == _save_file_bytes(tmp_path, full)
    from safetensors.torch import load_file

    assert all(torch.equal(load_file(str(out))[k], v) for k, v in full.items())


def test_fsdp_strip_prefix_readable_by_torch(fsdp_dcp, tmp_path):
    d, full = fsdp_dcp
    out = tmp_path / "renamed.dcp"
    rc = main(["add-prefix", str(d), "--prefix", "module.", "-o", str(out)])
    assert rc == 0
    assert (os.stat(out).st_mode & 0o777) == (os.stat(d).st_mode & 0o777)
    for f in d.glob("*.distcp"):  # data files are copies of the source's, never links (issue 21)
        assert os.stat(f).st_ino != os.stat(out / f.name).st_ino
        assert f.read_bytes() == (out / f.name).read_bytes()
    template = {"model": {"module." + k: torch.zeros_like(v) for k, v in full.items()}}
    got = torch_load_dcp(out, template)["model"]
    assert all(torch.equal(got["module." + k], v) for k, v in full.items())
    back = tmp_path / "back.dcp"
    assert main(["strip-prefix", str(out), "-o", str(back)]) == 0
    with open(back / ".metadata", "rb") as f1, open(d / ".metadata", "rb") as f2:
        assert pickle.load(f1).state_dict_metadata == pickle.load(f2).state_dict_metadata


# --------------------------------------------------------------------------- rewrite


def test_rewrite_in_place_and_refusals(tmp_path, capsys):
    d, ref = layout_dir(tmp_path, "columns", prefix="_orig_mod.")
    before = {p.name: p.read_bytes() for p in d.glob("*.distcp")}
    assert main(["strip-prefix", str(d), "--in-place"]) == 0
    assert (d / ".metadata.bak").exists()
    assert {p.name: p.read_bytes() for p in d.glob("*.distcp")} == before
    oracle = torch_load_dcp(d, {"model": {k[len("_orig_mod.") :]: torch.zeros_like(v) for k, v in ref.items()}})
    assert torch.equal(oracle["model"]["w"], ref["_orig_mod.w"])
    assert main(["add-prefix", str(d), "--prefix", "m.", "-o", str(tmp_path / "x")]) == 0
    assert main(["add-prefix", str(d), "--prefix", "m.", "-o", str(tmp_path / "x")]) == 9  # exists, no --force
    assert main(["add-prefix", str(d), "--prefix", "m.", "-o", str(tmp_path / "x"), "--force"]) == 0
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "keep.txt").write_text("mine")
    assert main(["add-prefix", str(d), "--prefix", "m.", "-o", str(tmp_path / "plain"), "--force"]) == 9
    assert (tmp_path / "plain" / "keep.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp directories left


# --------------------------------------------------------------------------- hostile .metadata


HOSTILE_VARIANTS = ["GLOBAL", "STACK_GLOBAL", "dotted_pickle_loads", "torch_save_to_dcp"]


def _hostile_payloads(canary: Path, tmp: Path) -> dict[str, bytes]:
    cmd = f"touch {canary}".encode()
    s = struct.pack("<I", len(cmd))
    inner = b"\x80\x02cos\nsystem\n(X" + s + cmd + b"tR."
    evil_pt = tmp / "evil_payload.pt"
    torch.save(Evil(str(canary)), evil_pt)
    out_dir = str(tmp / "dcp_out")
    return {
        "GLOBAL": b"ctorch.distributed.checkpoint.filesystem\nos.system\n(X" + s + cmd + b"tR0",
        "STACK_GLOBAL": (
            b"X"
            + struct.pack("<I", 39)
            + b"torch.distributed.checkpoint.filesystem"
            + b"X"
            + struct.pack("<I", 9)
            + b"os.system\x93(X"
            + s
            + cmd
            + b"tR0"
        ),
        "dotted_pickle_loads": (
            b"ctorch.distributed.checkpoint.filesystem\npickle.loads\n(B"
            + struct.pack("<I", len(inner))
            + inner
            + b"tR0"
        ),
        "torch_save_to_dcp": (
            b"ctorch.distributed.checkpoint.format_utils\ntorch_save_to_dcp\n(X"
            + struct.pack("<I", len(str(evil_pt)))
            + str(evil_pt).encode()
            + b"X"
            + struct.pack("<I", len(out_dir))
            + out_dir.encode()
            + b"tR0"
        ),
    }


def _poison(d: Path, payload: bytes) -> None:
    data = (d / ".metadata").read_bytes()
    assert data[:2] == b"\x80\x04" and data[2:3] == b"\x95"  # protocol 4 with a frame
    # protocol 4 (no frame): CPython resolves dotted names there, so each payload is live for plain pickle
    (d / ".metadata").write_bytes(b"\x80\x04" + payload + data[11:])


@pytest.mark.parametrize("variant", HOSTILE_VARIANTS)
def test_hostile_metadata_never_runs(tmp_path, capsys, variant):
    canary = tmp_path / "CANARY"
    d = tmp_path / "evil"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(d), no_dist=True)
    _poison(d, _hostile_payloads(canary, tmp_path)[variant])
    for call in (
        lambda: load_anywhere(d),
        lambda: load_checkpoint(d),
        lambda: convert(d, tmp_path / "o.safetensors"),
        lambda: load_anywhere(d, allow_globals=["collections.OrderedDict"]),
    ):
        with pytest.raises(UnsafePickleError):
            call()
    assert main(["convert", str(d), "-o", str(tmp_path / "o.safetensors")]) == 5
    assert main(["strip-prefix", str(d), "--prefix", "x."]) == 5
    main(["inspect", str(d)])
    rc = main(["scan", str(d)])
    out = capsys.readouterr().out
    assert rc != 0 and "safe (" not in out.splitlines()[0]
    assert not canary.exists() and not (tmp_path / "dcp_out").exists()
    assert not (tmp_path / "o.safetensors").exists()
    p = run_cli("convert", d, "-o", tmp_path / "o2.safetensors")
    assert_one_line_error(p, 5)
    assert not canary.exists()


def test_foreign_metadata_object(tmp_path):
    d = tmp_path / "foreign"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CorruptCheckpointError):
        load_anywhere(d)
    (d / ".metadata").write_bytes(b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00true\x85R.")
    with pytest.raises((UnsafePickleError, CorruptCheckpointError)):
        load_anywhere(d)


# --------------------------------------------------------------------------- bad input


def _fresh(tmp_path: Path) -> Path:
    d, _ = layout_dir(tmp_path, "grid")
    return d


def _rewrite_meta(d: Path, fn: Any) -> None:
    with open(d / ".metadata", "rb") as f:
        m = pickle.load(f)
    fn(m)
    with open(d / ".metadata", "wb") as f:
        pickle.dump(m, f)


def _first_info(m: Any) -> Any:
    return next(iter(m.storage_data.values()))


def _bad_missing(d: Path) -> None:
    (d / "__1_0.distcp").unlink()


def _bad_extra(d: Path) -> None:
    (d / "__9_0.distcp").write_bytes(b"stale")


def _bad_truncated(d: Path) -> None:
    p = d / "__2_0.distcp"
    p.write_bytes(p.read_bytes()[:-700])


def _bad_flipped(d: Path) -> None:  # a damaged chunk archive inside its byte range
    p = d / "__0_0.distcp"
    b = bytearray(p.read_bytes())
    b[0:4] = b"XXXX"
    b[-22:-18] = b"XXXX"
    p.write_bytes(bytes(b))


def _bad_overlap(d: Path) -> None:
    def f(m: Any) -> None:
        c = m.state_dict_metadata["model.w"].chunks
        c[1] = type(c[1])(torch.Size([c[1].offsets[0], c[1].offsets[1] - 1]), c[1].sizes)

    _rewrite_meta(d, f)


def _bad_hole(d: Path) -> None:
    def f(m: Any) -> None:
        md = m.state_dict_metadata["model.w"]
        md.size = torch.Size([md.size[0] + 1, md.size[1]])

    _rewrite_meta(d, f)


def _bad_other_run(d: Path) -> None:  # .metadata of a bigger save next to these data files
    other = write_dcp(
        d.parent / "bigger",
        [
            (("model", "w"), torch.zeros(70, 100, dtype=torch.bfloat16), grid((70, 100), {0: [30], 1: [40, 70]})),
            (("model", "b"), torch.zeros(60, 40), grid((60, 40), {0: [10]})),
        ],
        {("epoch",): 3},
    )
    (d / ".metadata").write_bytes((other / ".metadata").read_bytes())


def _bad_escape(rel: str) -> Any:
    def bad(d: Path) -> None:
        def f(m: Any) -> None:
            _first_info(m).relative_path = rel

        _rewrite_meta(d, f)

    return bad


BAD = {
    "missing_distcp": (_bad_missing, 3),
    "extra_distcp": (_bad_extra, 4),
    "truncated": (_bad_truncated, 4),
    "damaged_chunk": (_bad_flipped, 4),
    "overlap": (_bad_overlap, 4),
    "hole": (_bad_hole, 4),
    "other_run": (_bad_other_run, 4),
    "dotdot": (_bad_escape("../../etc/passwd"), 5),
    "absolute": (_bad_escape("/etc/passwd"), 5),
    "nul": (_bad_escape("__0_0.distcp\x00x"), 5),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_error_nothing_written(tmp_path, capsys, case):
    d = _fresh(tmp_path)
    breaker, code = BAD[case]
    breaker(d)
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(d), "-o", str(out)]) == code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("Error: "), err
    assert main(["strip-prefix", str(d), "--prefix", "model.", "-o", str(tmp_path / "s.dcp")]) in (code, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temp files
    with pytest.raises((CorruptCheckpointError, UnsafePickleError, CheckpointNotFoundError)):
        load_anywhere(d)


def test_bad_input_subprocess_has_no_traceback(tmp_path):
    d = _fresh(tmp_path)
    _bad_truncated(d)
    p = run_cli("convert", d, "-o", tmp_path / "o.safetensors")
    assert_one_line_error(p, 4)
    assert not (tmp_path / "o.safetensors").exists()


# one fresh interpreter unpickles every poisoned .metadata in turn (torch is imported once, not per variant)
_PLAIN_PICKLE_EACH = """
import pickle, sys, traceback, warnings
warnings.simplefilter("ignore")
for path in sys.argv[1:]:
    print("loading", path, flush=True)
    try:
        with open(path, "rb") as f:
            pickle.load(f)
    except BaseException:
        traceback.print_exc()
"""


@pytest.fixture(scope="module")
def plain_pickle_ran(tmp_path_factory) -> tuple[dict[str, bool], str]:
    """Each variant's poisoned DCP checkpoint loaded by plain pickle: variant -> whether its payload ran."""
    root = tmp_path_factory.mktemp("live_payloads")
    canaries, metas = {}, []
    for variant in HOSTILE_VARIANTS:
        tmp = root / variant
        tmp.mkdir()
        d = tmp / "evil"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(d), no_dist=True)
        canaries[variant] = tmp / "CANARY"
        _poison(d, _hostile_payloads(canaries[variant], tmp)[variant])
        metas.append(str(d / ".metadata"))
    p = subprocess.run(  # the timeout only catches a hang; the output says which load was running
        [sys.executable, "-c", _PLAIN_PICKLE_EACH, *metas], capture_output=True, text=True, timeout=1800
    )
    return {v: c.exists() for v, c in canaries.items()}, p.stdout + p.stderr


@pytest.mark.parametrize("variant", HOSTILE_VARIANTS)
def test_hostile_payloads_are_live_for_plain_pickle(plain_pickle_ran, variant):
    """The attack corpus is real: CPython's unpickler (what torch's FileSystemReader uses) runs each one."""
    ran, log = plain_pickle_ran
    assert ran[variant], log[-4000:]


def test_inspect_json_describes_sharding(tmp_path, capsys):
    import json

    w = _rand((5, 4), torch.float32, 3)
    d = write_dcp(
        tmp_path / "run",
        [
            (("model", "module.fc.weight"), w, grid((5, 4), {0: [2], 1: [3]})),
            (("optim", "state", 0, "exp_avg"), w, grid((5, 4), {1: [1]})),
        ],
        {("optim", "param_groups", 0, "lr"): 0.5, ("epoch",): 7},
        nranks=2,
    )
    assert main(["inspect", str(d), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "dcp" and doc["state_dict_key"] == ["model"] and doc["tensor_count"] == 1
    assert doc["dcp"]["ranks"] == 2 and doc["dcp"]["chunks"] == 6 and doc["dcp"]["objects"] == 2
    assert doc["dcp"]["tensors_by_top_level_key"] == {"model": 1, "optim": 1}
    assert doc["non_tensor_entries"]["epoch"] == "7" and "module." in doc["prefixes"]
    assert doc["dtypes"] == {"float32": 1} and doc["total_bytes"] == 80


def test_mutation_fuzz_only_typed_errors(tmp_path):
    """Byte flips and truncations of .metadata and the data files: a ckptfix error or a correct result, never
    another exception, never anything run, never a partial output."""
    import random

    from ckptfix.errors import CkptfixError
    from ckptfix.ops.inspect import inspect_checkpoint

    src, _ = layout_dir(tmp_path, "grid")
    files = sorted(p.name for p in src.iterdir())
    rng = random.Random(15)
    outcomes = {"ok": 0, "error": 0}
    for n in range(120):
        d = tmp_path / f"m{n}"
        d.mkdir()
        for name in files:
            (d / name).write_bytes((src / name).read_bytes())
        victim = d / rng.choice(files)
        data = bytearray(victim.read_bytes())
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        victim.write_bytes(bytes(data))
        out = tmp_path / f"o{n}.safetensors"
        for call, args in ((load_anywhere, (d,)), (convert, (d, out)), (inspect_checkpoint, (d,))):
            try:
                call(*args)
                outcomes["ok"] += 1
            except CkptfixError:
                outcomes["error"] += 1
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".o{n}.")]  # no temp file left
    assert outcomes["error"] > 50


def test_align_to_a_target_and_trust_for_objects(tmp_path, capsys):
    import fractions

    from safetensors.torch import save_file

    w, b = _rand((3, 4), torch.float32, 5), _rand((3,), torch.float32, 6)
    d = write_dcp(
        tmp_path / "run",
        [
            (("model", "module.fc.weight"), w, grid((3, 4), {1: [1]})),
            (("model", "module.fc.bias"), b, grid((3,), {0: [2]})),
        ],
        {("meta",): fractions.Fraction(1, 3)},
    )
    target = tmp_path / "target.safetensors"
    save_file({"fc.weight": torch.zeros(3, 4), "fc.bias": torch.zeros(3)}, str(target))
    out = tmp_path / "aligned.dcp"
    assert main(["align", str(d), "--to", str(target), "-o", str(out)]) == 0
    got = torch_load_dcp(out, {"model": {"fc.weight": torch.zeros(3, 4), "fc.bias": torch.zeros(3)}})["model"]
    assert torch.equal(got["fc.weight"], w) and torch.equal(got["fc.bias"], b)
    lc = load_checkpoint(d)
    assert "fractions.Fraction" in lc.stubbed_globals and not isinstance(lc.checkpoint["meta"], fractions.Fraction)
    with pytest.warns(UserWarning):
        trusted = load_checkpoint(d, trust=True).checkpoint["meta"]
    assert trusted == fractions.Fraction(1, 3)


def test_safetensors_serialization_format_is_named(tmp_path, capsys):
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    d = tmp_path / "stf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.randn(3, 4)},
            no_dist=True,
            storage_writer=dcp.FileSystemWriter(str(d), serialization_format=SerializationFormat.SAFETENSORS),
        )
    assert main(["convert", str(d), "-o", str(tmp_path / "o.safetensors")]) == 8
    assert "safetensors serialization format" in capsys.readouterr().err


_METADATA_NEWOBJ = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81"
_DEEP_LIST = b"]" * 50_000 + b"a" * 49_999  # a list 50,000 levels deep (the reader does not walk .metadata)


@pytest.mark.parametrize(
    "state",
    [
        # an entry named by a foreign object whose state nests deeply: the message must not repr it
        b"}X\x13\x00\x00\x00state_dict_metadata}cfractions\nFraction\n)\x81" + _DEEP_LIST + b"bNss",
        # (dict, slots) state whose first half is no dict
        b"(]K\x01a}X\x13\x00\x00\x00state_dict_metadata}st",
        b"(K\x01}X\x13\x00\x00\x00state_dict_metadata}st",
        b"(X\x02\x00\x00\x00ab}X\x13\x00\x00\x00state_dict_metadata}st",
    ],
    ids=["deep_foreign_entry_name", "slots_state_list", "slots_state_int", "slots_state_str"],
)
def test_malformed_metadata_state_is_a_one_line_error(tmp_path, capsys, state):
    d = _fresh(tmp_path)
    (d / ".metadata").write_bytes(_METADATA_NEWOBJ + state + b"b.")
    _assert_metadata_refused(d, tmp_path, capsys, 4)


def test_foreign_layout_argument_is_shown_by_type(tmp_path, capsys):
    """A layout recorded as _get_layout(<a list nested 50,000 deep>): the message must not print it."""
    d = _fresh(tmp_path)
    data = (d / ".metadata").read_bytes()
    strided = b"\x8c\rtorch.strided"  # SHORT_BINUNICODE in torch's protocol-4 .metadata
    assert data[:2] == b"\x80\x04" and data[2:3] == b"\x95" and strided in data
    data = b"\x80\x04" + data[11:]  # drop the frame: its length no longer holds once spliced
    (d / ".metadata").write_bytes(data.replace(strided, _DEEP_LIST))
    _assert_metadata_refused(d, tmp_path, capsys, 8)


def _assert_metadata_refused(d: Path, tmp_path: Path, capsys: Any, code: int) -> None:
    for args in (["inspect", str(d)], ["strip-prefix", str(d), "--prefix", "model.", "-o", str(tmp_path / "s.dcp")]):
        assert main(args) == code
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("Error: ") and "internal error" not in err[0], err
    with pytest.raises((CorruptCheckpointError, UnsupportedError)):
        load_anywhere(d)


def test_tiling_check_sweeps_the_dimension_the_chunks_are_spread_on(monkeypatch):
    """20,000 chunks that all start at row 0 (column sharding): a sweep on dim 0 compared every pair
    (200 million comparisons, minutes); the sweep runs on the dimension where chunks start apart."""
    from ckptfix.formats.dcp import meta

    calls = []
    real = meta._overlap
    monkeypatch.setattr(meta, "_overlap", lambda a, b: calls.append(1) or real(a, b))
    n = 20_000
    meta.check_tiling(meta.TensorEntry("w", "float32", (2, n), [meta.Chunk((0, i), (2, 1)) for i in range(n)]), "x")
    assert len(calls) < n
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        chunks = [meta.Chunk((0, i), (2, 1)) for i in range(n - 2)] + [meta.Chunk((0, n - 3), (1, 2))]
        meta.check_tiling(meta.TensorEntry("w", "float32", (2, n), chunks + [meta.Chunk((1, n - 1), (1, 1))]), "x")


def test_tiling_check_refuses_a_layout_too_costly_to_check(monkeypatch):
    """Chunks crowded on every dimension (a grid, here with a tiny limit) are a resource limit, not hours of work."""
    from ckptfix.errors import ResourceLimitError
    from ckptfix.formats.dcp import meta

    monkeypatch.setattr(meta, "MAX_TILING_PAIRS", 100)
    grid_chunks = [meta.Chunk((r, c), (1, 1)) for r in range(30) for c in range(30)]
    with pytest.raises(ResourceLimitError, match="chunks"):
        meta.check_tiling(meta.TensorEntry("w", "float32", (30, 30), grid_chunks), "x")
