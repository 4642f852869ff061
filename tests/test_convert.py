"""ckptfix.ops.convert: checkpoint -> safetensors and back, on real artefacts made in tmp_path."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckptfix.ops.convert.items as convert_items
import ckptfix.ops.convert.write as convert_write
from ckptfix.errors import KeyConflictError, OutputError, UnsupportedError, VerificationError
from ckptfix.ops.convert import convert, convert_to_safetensors, parse_size, restore_aliases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def meta_of(path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.embed.weight


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def files_in(d) -> list[str]:
    return sorted(os.listdir(d))


@pytest.fixture()
def tied(tmp_path):
    torch.manual_seed(0)
    m = TiedLM()
    p = tmp_path / "model.pth"
    torch.save(m.state_dict(), p)
    return p, m.state_dict()


# --------------------------------------------------------------------------- basics


def test_tied_weights_stored_once_and_restored(tied, tmp_path):
    src, sd = tied
    before = sha(src)
    r = convert_to_safetensors(src)
    out = tmp_path / "model.safetensors"
    assert r.outputs == [str(out)] and r.verified and not r.used_torch
    assert r.aliases == {"lm_head.weight": "embed.weight"}
    raw = load_file(out)
    assert "lm_head.weight" not in raw and "embed.weight" in raw
    meta = meta_of(out)
    assert meta["format"] == "pt"
    assert json.loads(meta["ckptfix.aliases"]) == {"lm_head.weight": "embed.weight"}
    back = restore_aliases(raw, meta)
    assert list(back) == list(sd)
    assert back["lm_head.weight"] is back["embed.weight"]
    for k, v in sd.items():
        assert_same(back[k], v)
    assert sha(src) == before


def test_load_anywhere_restores_shared(tied, tmp_path):
    from ckptfix.ops.load import load_anywhere

    src, sd = tied
    convert_to_safetensors(src)
    back = load_anywhere(tmp_path / "model.safetensors")
    assert back["lm_head.weight"].data_ptr() == back["embed.weight"].data_ptr()
    for k, v in sd.items():
        assert_same(back[k], v)


def test_fast_path_never_imports_torch(tied, tmp_path):
    src, _ = tied
    code = (
        "import sys; from ckptfix.ops.convert import convert_to_safetensors as c; r = c(sys.argv[1]); "
        "assert r.verified; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(src)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_byte_identical_to_save_file(tmp_path):
    torch.manual_seed(1)
    sd = {
        "z.w": torch.randn(3, 5),
        "a.b": torch.randn(7).half(),
        "i": torch.arange(9),
        "m": torch.tensor(True),
        "e": torch.zeros(0, 3),
        "bf": torch.randn(2, 2).bfloat16(),
        "u": torch.arange(4, dtype=torch.uint8),
        "ünï": torch.ones(2),
        "s": torch.tensor(3.5),
    }
    src = tmp_path / "m.pth"
    torch.save(sd, src)
    ours = tmp_path / "ours.safetensors"
    convert_to_safetensors(src, ours, ckptfix_metadata=False)
    ref = tmp_path / "ref.safetensors"
    save_file(sd, ref, metadata={"format": "pt"})
    assert ours.read_bytes() == ref.read_bytes()


def _normalised(path) -> tuple[bytes, str, bytes]:
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    h = json.loads(data[8 : 8 + n])
    h["__metadata__"] = dict(sorted(h["__metadata__"].items()))
    return data[:8], json.dumps(h), data[8 + n :]


def test_identical_to_save_file_with_full_metadata(tied, tmp_path):
    """save_file orders __metadata__ randomly (a Rust HashMap); all else must match byte for byte."""
    src, sd = tied
    ours = tmp_path / "model.safetensors"
    convert_to_safetensors(src, ours)
    meta = meta_of(ours)
    ref = tmp_path / "ref.safetensors"
    save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, ref, metadata=meta)
    assert os.path.getsize(ours) == os.path.getsize(ref)
    a, b = _normalised(ours), _normalised(ref)
    assert a == b
    # tensor order in the header is save_file's too
    ka = list(json.loads(open(ours, "rb").read()[8 : 8 + struct.unpack("<Q", a[0])[0]]))
    kb = list(json.loads(open(ref, "rb").read()[8 : 8 + struct.unpack("<Q", b[0])[0]]))
    assert ka[1:] == kb[1:]


# --------------------------------------------------------------------------- views and dtypes


def test_lstm_and_views(tmp_path):
    torch.manual_seed(2)
    lstm = torch.nn.LSTM(4, 6, num_layers=2)
    sd = dict(lstm.state_dict())
    flat = torch.randn(60)
    sd["packed.a"] = flat[:24].view(4, 6)  # views of one storage, no tensor covers it: copies
    sd["packed.b"] = flat[24:60].view(6, 6)
    base = torch.randn(6, 8)
    sd["base"] = base  # covers its storage: the others are restorable views of it
    sd["base_t"] = base.t()
    sd["base_rows"] = base[1:3]
    sd["base_step"] = base[:, ::2]
    sd["transposed"] = torch.randn(5, 3).t()
    sd["expanded"] = torch.randn(3, 1).expand(3, 4)
    sd["scalar"] = torch.tensor(2.0)
    src = tmp_path / "lstm.pt"
    torch.save(sd, src)
    r = convert_to_safetensors(src)
    assert set(r.copied_views) == {"packed.a", "packed.b"}
    assert set(r.views) == {"base_t", "base_rows", "base_step"}
    out = tmp_path / "lstm.safetensors"
    raw = load_file(out)
    for k, v in sd.items():
        assert_same(raw[k], v)
    back = restore_aliases(raw, meta_of(out))
    for k, v in sd.items():
        assert_same(back[k], v)
        assert back[k].stride() == v.stride() or k not in r.views
    assert back["base_t"].untyped_storage().data_ptr() == back["base"].untyped_storage().data_ptr()


ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
for _name in ("uint16", "uint32", "uint64", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        ALL_DTYPES.append(getattr(torch, _name))


def _sample(dt: torch.dtype) -> torch.Tensor:
    if dt == torch.bool:
        return torch.tensor([[True, False, True], [False, False, True]])
    if dt.is_complex:
        return torch.randn(2, 3, dtype=dt)
    if dt.is_floating_point:
        return torch.randn(2, 3).to(dt)
    return torch.arange(6, dtype=torch.int64).reshape(2, 3).to(dt)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_all_shared_dtypes(tmp_path, legacy):
    torch.manual_seed(3)
    sd = {}
    for dt in ALL_DTYPES:
        name = str(dt).replace("torch.", "")
        sd[name] = _sample(dt)
        sd[name + ".t"] = _sample(dt).t()
    src = tmp_path / "all.pth"
    torch.save(sd, src, _use_new_zipfile_serialization=not legacy)
    r = convert_to_safetensors(src)
    assert r.source_format == ("torch-legacy" if legacy else "torch-zip")
    raw = load_file(tmp_path / "all.safetensors")
    for k, v in sd.items():
        assert_same(raw[k], v)
    save_file(
        {k: v.contiguous() for k, v in sd.items()},
        tmp_path / "ref.safetensors",
        metadata=meta_of(tmp_path / "all.safetensors"),
    )
    assert _normalised(tmp_path / "all.safetensors") == _normalised(tmp_path / "ref.safetensors")


def test_cuda_tagged_checkpoint(tmp_path, monkeypatch):
    import torch.serialization as ser

    torch.manual_seed(4)
    sd = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    monkeypatch.setattr(ser, "location_tag", lambda storage: "cuda:0")
    src = tmp_path / "gpu.pth"
    torch.save(sd, src)
    monkeypatch.undo()
    assert b"cuda:0" in src.read_bytes()
    r = convert_to_safetensors(src)
    assert r.verified
    raw = load_file(tmp_path / "gpu.safetensors")
    for k, v in sd.items():
        assert_same(raw[k], v)


@pytest.mark.parametrize(
    "make,what",
    [
        (lambda: torch.zeros(2, dtype=torch.complex128), "complex128"),
        (lambda: torch.eye(3).to_sparse(), "sparse"),
        (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), "quantized"),
    ],
)
def test_unsupported_names_the_tensor(tmp_path, make, what):
    src = tmp_path / "bad.pth"
    torch.save({"fine": torch.ones(2), "layer.bad": make()}, src)
    with pytest.raises(UnsupportedError) as ei:
        convert_to_safetensors(src)
    assert "layer.bad" in str(ei.value) and what in str(ei.value)
    assert files_in(tmp_path) == ["bad.pth"]


# --------------------------------------------------------------------------- output safety


def test_refuses_to_overwrite_without_force(tied, tmp_path):
    src, _ = tied
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(OutputError, match="--force"):
        convert_to_safetensors(src)
    assert out.read_bytes() == b"keep me"
    convert_to_safetensors(src, force=True)
    assert "embed.weight" in load_file(out)
    with pytest.raises(OutputError, match="input"):
        convert_to_safetensors(src, src, force=True)


def test_verify_detects_corruption_and_removes_output(tied, tmp_path, monkeypatch):
    src, _ = tied
    from ckptfix.files import fileio

    real_write, real_copy = fileio.pwrite_all, fileio.copy_range

    def flip(fd, off, n):  # the disk "loses" a bit of every tensor written
        c = os.pread(fd, 1, off + n - 1)
        os.pwrite(fd, bytes([c[0] ^ 0x40]), off + n - 1)

    def write(fd, data, off):
        n = real_write(fd, data, off)
        if off > 0:
            flip(fd, off, n)
        return n

    def copy(s, so, fd, do, n, *a, **k):
        got = real_copy(s, so, fd, do, n, *a, **k)
        flip(fd, do, n)
        return got

    monkeypatch.setattr(fileio, "pwrite_all", write)
    monkeypatch.setattr(fileio, "copy_range", copy)
    with pytest.raises(VerificationError, match="differs") as e:
        convert_to_safetensors(src)
    assert str(e.value).startswith(str(tmp_path / "model.safetensors") + ":")  # the output asked for, not a temp
    assert files_in(tmp_path) == ["model.pth"]
    # --no-verify would have kept it
    convert_to_safetensors(src, verify=False)
    assert files_in(tmp_path) == ["model.pth", "model.safetensors"]


def test_verify_checks_the_header_read_back(tied, tmp_path, monkeypatch):
    src, _ = tied
    real = convert_write.safetensors_header

    def lying(items, metadata):  # a header whose offsets disagree with where the bytes went
        raw = real(items, metadata)
        return raw.replace(b'"data_offsets":[0,', b'"data_offsets":[1,', 1)

    monkeypatch.setattr(convert_write, "safetensors_header", lying)
    with pytest.raises(VerificationError, match="reads back"):
        convert_to_safetensors(src)
    assert files_in(tmp_path) == ["model.pth"]


@pytest.mark.parametrize("verify", [True, False])
def test_interrupted_conversion_leaves_nothing(tied, tmp_path, monkeypatch, verify):
    src, _ = tied
    calls = []

    def boom(*a, **k):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_write, "copy_range", boom)
    monkeypatch.setattr(convert_write, "copy_checked", boom)
    monkeypatch.setattr(convert_write, "copy_pieces", boom)
    with pytest.raises(KeyboardInterrupt):
        convert_to_safetensors(src, verify=verify)
    assert calls and files_in(tmp_path) == ["model.pth"]


def test_output_file_mode_follows_umask(tied, tmp_path):
    src, _ = tied
    old = os.umask(0o022)
    try:
        convert_to_safetensors(src)
    finally:
        os.umask(old)
    assert (os.stat(tmp_path / "model.safetensors").st_mode & 0o777) == 0o644


# --------------------------------------------------------------------------- sharding


def test_sharding_and_index(tmp_path):
    torch.manual_seed(5)
    sd = {f"layer{i}.weight": torch.randn(64, 64) for i in range(5)}  # 16 KiB each
    sd["head.weight"] = sd["layer0.weight"]
    src = tmp_path / "model.pth"
    torch.save(sd, src)
    r = convert_to_safetensors(src, tmp_path / "model.safetensors", max_shard_size="40KB")
    names = [os.path.basename(p) for p in r.outputs]
    assert names == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["total_size"] == 5 * 64 * 64 * 4
    # stored once under the name that comes first in the state dict (what transformers keeps)
    assert set(idx["weight_map"]) == {f"layer{i}.weight" for i in range(5)}
    assert r.aliases == {"head.weight": "layer0.weight"}
    merged = {}
    for p in r.outputs:
        merged.update(load_file(p))
    for k in idx["weight_map"]:
        assert_same(merged[k], sd[k])
    from ckptfix.ops.load import load_anywhere

    back = load_anywhere(tmp_path / "model.safetensors.index.json")
    assert back["head.weight"].data_ptr() == back["layer0.weight"].data_ptr()
    # existing shard blocks a rerun without --force
    with pytest.raises(OutputError):
        convert_to_safetensors(src, tmp_path / "model.safetensors", max_shard_size="40KB")
    # reverse: index -> one .pth, aliases restored
    rr = convert(tmp_path / "model.safetensors.index.json", tmp_path / "back.pth")
    assert rr.direction == "to-torch" and rr.verified
    pt = torch.load(tmp_path / "back.pth", weights_only=True)
    assert list(pt) == list(sd)
    assert pt["head.weight"].data_ptr() == pt["layer0.weight"].data_ptr()


def test_parse_size():
    assert parse_size("5GB") == 5_000_000_000
    assert parse_size("500MB") == 500_000_000
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5KB") == 1500
    assert parse_size("123") == 123
    with pytest.raises(ValueError):
        parse_size("5 parsecs")


# --------------------------------------------------------------------------- inputs


def test_lightning_ckpt_extras_and_optimizer(tmp_path):
    torch.manual_seed(6)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ckpt = {
        "epoch": 7,
        "global_step": 700,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {"model." + k: v for k, v in model.state_dict().items()},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [],
        "hyper_parameters": {"lr": 0.01, "layers": [3, 2], "name": "net", "nan": float("nan")},
        "callbacks": {"EMA": {"shadow": torch.zeros(2)}},
    }
    src = tmp_path / "last.ckpt"
    torch.save(ckpt, src)
    with pytest.raises(UnsupportedError, match=r"callbacks\.EMA\.shadow"):  # --strict: every tensor or refused
        convert_to_safetensors(src, strip_prefix=True, strict=True)
    assert not (tmp_path / "last.safetensors").exists()
    r = convert_to_safetensors(src, strip_prefix=True)  # issue 34 A: left out, named
    assert r.key_path == ("state_dict",) and r.excluded == ["optimizer_states", "callbacks"]
    assert r.excluded_tensors == {"callbacks": 1} and r.renamed == 2 and r.dropped == []
    out = tmp_path / "last.safetensors"
    assert set(load_file(out)) == {"weight", "bias"}
    meta = meta_of(out)
    extra = json.loads(meta["ckptfix.extra"])
    assert extra["epoch"] == 7 and extra["global_step"] == 700 and extra["hyper_parameters"]["layers"] == [3, 2]
    assert "optimizer_states" not in extra and json.loads(meta["ckptfix.key_path"]) == ["state_dict"]
    r2 = convert_to_safetensors(src, tmp_path / "with_opt.safetensors", include_optimizer=True, drop=["callbacks.*"])
    assert r2.excluded == [] and r2.optimizer_tensors == 6  # step, exp_avg, exp_avg_sq x 2 params
    got = load_file(tmp_path / "with_opt.safetensors")
    assert_same(got["optimizer.optimizer_states.0.state.0.exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    extra2 = json.loads(meta_of(tmp_path / "with_opt.safetensors")["ckptfix.extra"])
    assert extra2["optimizer_states"][0]["param_groups"][0]["lr"] == 0.01
    assert extra2["optimizer_states"][0]["state"]["0"]["exp_avg"] == {
        "__tensor__": "optimizer.optimizer_states.0.state.0.exp_avg"
    }


def test_key_option_and_conflict(tmp_path):
    src = tmp_path / "two.pth"
    torch.save({"model": {"w": torch.ones(2)}, "ema": {"w": torch.zeros(2)}}, src)
    convert_to_safetensors(src, key="ema")
    assert_same(load_file(tmp_path / "two.safetensors")["w"], torch.zeros(2))
    with pytest.raises(KeyConflictError):
        convert_to_safetensors(src, tmp_path / "x.safetensors", key="nope")


def test_torchscript_input(tmp_path):
    torch.manual_seed(7)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    src = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(m), src)
    r = convert_to_safetensors(src)
    assert r.source_format == "torchscript"
    raw = load_file(tmp_path / "scripted.safetensors")
    for k, v in m.state_dict().items():
        assert_same(raw[k], v)


def test_sharded_bin_index_input(tmp_path):
    torch.manual_seed(8)
    a = {"a.weight": torch.randn(3, 3)}
    b = {"b.weight": torch.randn(2), "b.bias": torch.randn(2)}
    torch.save(a, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save(b, tmp_path / "pytorch_model-00002-of-00002.bin")
    wm = {
        "a.weight": "pytorch_model-00001-of-00002.bin",
        "b.weight": "pytorch_model-00002-of-00002.bin",
        "b.bias": "pytorch_model-00002-of-00002.bin",
    }
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    r = convert_to_safetensors(tmp_path / "pytorch_model.bin.index.json")
    assert r.outputs == [str(tmp_path / "model.safetensors")]  # where transformers' from_pretrained looks
    raw = load_file(r.outputs[0])
    for k, v in {**a, **b}.items():
        assert_same(raw[k], v)


def test_dcp_directory_input(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    torch.manual_seed(9)
    sd = {"w": torch.randn(4, 3), "b": torch.arange(3)}
    d = tmp_path / "ckpt_dcp"
    dcp.save(sd, checkpoint_id=str(d), no_dist=True) if "no_dist" in dcp.save.__code__.co_varnames else dcp.save(
        sd, storage_writer=dcp.FileSystemWriter(str(d))
    )
    r = convert_to_safetensors(d, tmp_path / "dcp.safetensors")
    assert not r.used_torch and r.verified  # streamed from the chunks (ckptfix.ops.convert.dcp_in)
    raw = load_file(tmp_path / "dcp.safetensors")
    for k, v in sd.items():
        assert_same(raw[k], v)


def test_reverse_default_and_explicit(tied, tmp_path):
    src, sd = tied
    convert_to_safetensors(src)
    st = tmp_path / "model.safetensors"
    before = sha(st)
    with pytest.raises(OutputError):
        convert(st)  # model.pth is the original: never overwritten without --force
    r = convert(st, tmp_path / "again.pth")
    assert r.verified and r.aliases == {"lm_head.weight": "embed.weight"}
    pt = torch.load(tmp_path / "again.pth", weights_only=True)
    assert list(pt) == list(sd)
    assert pt["lm_head.weight"].data_ptr() == pt["embed.weight"].data_ptr()
    for k, v in sd.items():
        assert_same(pt[k], v)
    assert sha(st) == before
    # and the round trip converts back to the same safetensors bytes
    convert_to_safetensors(tmp_path / "again.pth", tmp_path / "again.safetensors")
    assert _normalised(tmp_path / "again.safetensors")[2] == _normalised(st)[2]


def _training_checkpoint(path):
    torch.manual_seed(0)
    m = TiedLM()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m.lm_head(m.body(m.embed(torch.arange(4)))).sum().backward()
    opt.step()
    obj = {
        "epoch": 3,
        "step": 17,
        "model_state_dict": m.state_dict(),
        "optimizer_state_dict": opt.state_dict(),
        "hparams": {"lr": 1e-3, "warmup": float("inf"), "sizes": [16, 8]},
    }
    torch.save(obj, path)
    return obj


@pytest.mark.parametrize("with_optimizer", [False, True], ids=["model-only", "with-optimizer"])
def test_reverse_restore_wrapper_rebuilds_the_training_checkpoint(tmp_path, with_optimizer):
    obj = _training_checkpoint(tmp_path / "ck.pth")
    convert_to_safetensors(tmp_path / "ck.pth", include_optimizer=with_optimizer)
    r = convert(tmp_path / "ck.safetensors", tmp_path / "back.pth", restore_wrapper=True)
    assert r.verified and r.key_path == ("model_state_dict",)
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    assert back["epoch"] == 3 and back["step"] == 17
    assert back["hparams"] == {"lr": 1e-3, "warmup": float("inf"), "sizes": [16, 8]}
    sd = back["model_state_dict"]
    assert list(sd) == list(obj["model_state_dict"])
    assert sd["lm_head.weight"].data_ptr() == sd["embed.weight"].data_ptr()
    for k, v in obj["model_state_dict"].items():
        assert_same(sd[k], v)
    if not with_optimizer:
        assert "optimizer_state_dict" not in back
        return
    # the optimizer state is usable again: integer parameter ids, every moment tensor bit-identical
    m = TiedLM()
    m.load_state_dict(sd)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    opt.load_state_dict(back["optimizer_state_dict"])
    want = obj["optimizer_state_dict"]
    got = back["optimizer_state_dict"]
    # JSON has no tuples: betas=(0.9, 0.999) comes back as a list, which Adam takes alike
    assert got["param_groups"] == [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in want["param_groups"]
    ]
    assert set(got["state"]) == set(want["state"])
    for pid, st in want["state"].items():
        for name, t in st.items():
            assert_same(got["state"][pid][name], t)
    assert not any(k.startswith("optimizer.") for k in sd)


def test_restore_wrapper_needs_ckptfix_metadata_and_the_reverse_direction(tmp_path, tied):
    save_file({"w": torch.ones(2)}, tmp_path / "plain.safetensors")
    with pytest.raises(UnsupportedError, match="key_path"):
        convert(tmp_path / "plain.safetensors", tmp_path / "p.pth", restore_wrapper=True)
    src, _ = tied
    with pytest.raises(UnsupportedError, match="back to torch"):
        convert(src, restore_wrapper=True)
    assert not (tmp_path / "p.pth").exists()


@pytest.mark.parametrize("verify", [True, False])
def test_progress_moves_within_a_big_tensor(tmp_path, verify):
    torch.save({"big": torch.zeros(5 * (convert_items.CHUNK // 4) // 2), "t": torch.ones(3, 4).t()}, tmp_path / "m.pth")
    seen = []
    convert_to_safetensors(tmp_path / "m.pth", verify=verify, progress=lambda done, total: seen.append((done, total)))
    total = seen[-1][1]
    assert seen[-1][0] == total == 2.5 * convert_items.CHUNK + 48
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    if verify:  # chunk by chunk, not one jump per tensor
        assert len(seen) >= 4


def test_hf_style_alias_metadata_is_understood():
    w = torch.ones(2)
    out = restore_aliases({"a": w}, {"format": "pt", "b": "a"})
    assert out["b"] is out["a"]


# --------------------------------------------------------------------------- real-world shapes (issue 11)


def _np():
    return pytest.importorskip("numpy")


@pytest.mark.parametrize("case", ["numpy_array", "class_ref", "namespace", "big_array", "omegaconf_like"])
@pytest.mark.parametrize("opts", [[], ["--key", "state_dict"], ["--trust"], ["--allow-global", "numpy.dtype"]])
def test_placeholder_classes_beside_the_state_dict(tmp_path, case, opts):
    """A placeholder *class* (numpy.ndarray via _reconstruct, {"dtype": int}) next to the weights never crashes."""
    import argparse

    from helpers import run_cli

    np = _np()
    extra = {
        "numpy_array": np.arange(3.0),
        "class_ref": {"dtype": int, "kind": str},
        "namespace": argparse.Namespace(lr=0.1, arr=np.ones(2, dtype=np.float32), dt=np.dtype("int8")),
        "big_array": np.zeros(10_000),
        "omegaconf_like": {"types": [int, float], "n": np.int64(4)},
    }[case]
    w = torch.randn(3, 2)
    src = tmp_path / "a.pt"
    torch.save({"state_dict": {"w": w}, "cfg": extra, "epoch": 2}, src)
    p = run_cli("convert", src, "--json", *opts)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["tensors"] == 1 and doc["verified"]
    assert_same(load_file(tmp_path / "a.safetensors")["w"], w)
    extra_json = json.loads(meta_of(tmp_path / "a.safetensors")["ckptfix.extra"])
    assert extra_json["epoch"] == 2
    if case == "numpy_array":
        assert extra_json["cfg"] == [0.0, 1.0, 2.0] and doc["converted"]["cfg"] == "numpy.ndarray float64 [3] -> list"
    elif case == "class_ref":
        assert extra_json["cfg"] == {"dtype": "builtins.int", "kind": "builtins.str"}
        assert doc["placeholders"]["cfg.dtype"] == "class builtins.int"
    elif case == "namespace":
        assert extra_json["cfg"] == {"lr": 0.1, "arr": [1.0, 1.0], "dt": "int8"}
    elif case == "big_array":  # too large for JSON metadata: listed, not written
        assert "cfg" not in extra_json and "10000 values" in doc["skipped"]["cfg"]
    elif case == "omegaconf_like":
        assert extra_json["cfg"] == {"types": ["builtins.int", "builtins.float"], "n": 4}


def test_placeholder_class_as_the_whole_object(tmp_path):
    from helpers import assert_one_line_error, run_cli

    src = tmp_path / "a.pt"
    torch.save(int, src)
    for cmd in (["convert"], ["strip-prefix"], ["inspect"]):
        p = run_cli(*cmd, src)
        assert "internal error" not in p.stderr, p.stderr
        if cmd != ["inspect"]:
            assert_one_line_error(p, 13)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 3, 3)
        self.rnn = torch.nn.LSTM(3, 4)
        self.bn = torch.nn.BatchNorm1d(3)
        self.register_buffer("scratch", torch.ones(2), persistent=False)


@pytest.mark.parametrize("layout", ["module", "nested_module", "tuple_of_lists"])
def test_whole_module_and_tensor_lists(tmp_path, layout):
    """torch.save(model) and tuples of tensors: named as state_dict() / by position, equal to torch's."""
    from ckptfix.ops.inspect import inspect_checkpoint
    from ckptfix.ops.load import load_anywhere

    torch.manual_seed(0)
    net = _Net()
    src = tmp_path / "m.pt"
    if layout == "module":
        torch.save(net, src)
        want = net.state_dict()
    elif layout == "nested_module":
        torch.save({"model": net, "epoch": 4}, src)
        want = net.state_dict()
    else:
        a, b = [torch.randn(2), torch.randn(3)], [torch.arange(4)]
        torch.save((a, b), src)
        want = {"0.0": a[0], "0.1": a[1], "1.0": b[0]}
    assert inspect_checkpoint(src).tensor_count == len(want)
    got = load_anywhere(src)
    assert list(got) == list(want)
    for k, v in want.items():
        assert_same(got[k], v)
    r = convert_to_safetensors(src, tmp_path / "m.safetensors")
    assert r.verified and r.tensors == len(want)
    raw = load_file(tmp_path / "m.safetensors")
    for k, v in want.items():
        assert_same(raw[k], v)
    from helpers import assert_one_line_error, run_cli

    # no keys to rename in the file: said clearly (a module: unsupported; unnamed tensors: none to rename)
    assert_one_line_error(run_cli("strip-prefix", src), 8 if "module" in layout else 13)


def test_nested_state_dict_with_non_tensor_values(tmp_path):
    """{"state_dict": {"w": tensor, "kind": int}}: found, converted, the non-tensor value listed as skipped."""
    from ckptfix.ops.inspect import inspect_checkpoint
    from ckptfix.ops.load import load_anywhere

    w = torch.randn(2, 2)
    src = tmp_path / "m.pt"
    torch.save({"state_dict": {"w": w, "kind": int, "_extra_state": b"x"}, "epoch": 1}, src)
    assert inspect_checkpoint(src).state_dict_key == ["state_dict"]
    sd = load_anywhere(src)
    assert_same(sd["w"], w)
    r = convert_to_safetensors(src, tmp_path / "m.safetensors")
    assert r.tensors == 1 and r.skipped["state_dict.kind"] == (
        "a non-tensor value inside the state dict (class builtins.int)"
    )
    assert_same(load_file(tmp_path / "m.safetensors")["w"], w)


def test_keep_two_names_of_one_tied_tensor_is_refused(tmp_path):
    """``--keep a --keep b`` where a and b are the same tensor cannot both be stored: refused, nothing written."""
    from ckptfix.errors import KeyConflictError

    t = torch.ones(4)
    src = tmp_path / "t.pt"
    torch.save({"a": t, "b": t}, src)
    out = tmp_path / "t.safetensors"
    with pytest.raises(KeyConflictError, match="one tensor"):
        convert_to_safetensors(src, out, keep=["a", "b"])
    assert not out.exists()


def test_a_name_with_a_lone_surrogate_is_refused_before_anything_is_written(tmp_path):
    """torch pickles any str key (BINUNICODE passes surrogates); a safetensors header is UTF-8 JSON."""
    from helpers import assert_one_line_error, run_cli

    src = tmp_path / "sur.pt"
    torch.save({"a\ud800b": torch.ones(2), "ok": torch.zeros(1)}, src)
    out = tmp_path / "out.safetensors"
    with pytest.raises(UnsupportedError, match="lone surrogate"):
        convert(str(src), str(out))
    assert sorted(os.listdir(tmp_path)) == ["sur.pt"]
    assert_one_line_error(run_cli("convert", str(src), "-o", str(out)), 8)
