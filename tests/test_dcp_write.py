"""ckptfix.ops.convert.dcp_out: safetensors -> a DCP directory that torch's dcp.load and ckptfix's reader both read."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from ckptfix import load_anywhere
from ckptfix.errors import OutputError, UnsupportedError
from ckptfix.ops.convert import convert
from ckptfix.ops.convert.dcp_out import default_dcp_output

from helpers import assert_one_line_error, run_cli


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(11, 6, generator=g),
        "layers.0.attn.w": torch.randn(6, 6, generator=g).to(torch.bfloat16),
        "layers.0.norm.b": torch.randn(6, generator=g).to(torch.float16),
        "steps": torch.tensor(7, dtype=torch.int64),
        "mask": torch.randint(0, 2, (3, 5), generator=g).bool(),
        "ids": torch.arange(9, dtype=torch.int32),
        "empty": torch.empty(0, 4),
    }


def _torch_load(d: Path, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tmpl = {k: torch.zeros_like(v) for k, v in ref.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(tmpl, checkpoint_id=str(d), no_dist=True)
    return tmpl


def test_round_trip_byte_identical_and_torch_loads_it(tmp_path):
    ref = _sd()
    src = tmp_path / "model.safetensors"
    save_file(ref, src, metadata={"format": "pt"})
    out = tmp_path / "model.dcp"
    r = convert(src, out)
    assert r.verified and r.direction == "to-dcp" and r.tensors == len(ref) and r.used_torch
    got = _torch_load(out, ref)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in ref.items())
    back = tmp_path / "back.safetensors"
    convert(out, back, ckptfix_metadata=False)
    assert back.read_bytes() == src.read_bytes()
    la = load_anywhere(out)  # ckptfix's own reader
    assert set(la) == set(ref) and all(torch.equal(la[k], v) for k, v in ref.items())
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_loads_into_a_model_and_tied_weights_come_back(tmp_path):
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    m = M()
    st = tmp_path / "m.safetensors"
    convert_src = tmp_path / "m.pth"
    torch.save({"module." + k: v for k, v in m.state_dict().items()}, convert_src)
    convert(convert_src, st, strip_prefix=True)  # stores the tied weight once, records the alias
    assert len(load_file(st)) == 1
    out = tmp_path / "m.dcp"
    r = convert(st, out)
    assert r.aliases
    fresh = M()
    sd = fresh.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.emb.weight, m.emb.weight) and torch.equal(fresh.head.weight, m.head.weight)


def test_to_dcp_option_strip_prefix_and_sharded_index(tmp_path):
    ref = {f"module.l{i}.w": torch.full((3, 2), float(i)) for i in range(4)}
    d = tmp_path / "hf"
    d.mkdir()
    wm = {}
    for s in range(2):
        part = {k: v for j, (k, v) in enumerate(ref.items()) if j % 2 == s}
        save_file(part, d / f"model-{s + 1:05d}-of-00002.safetensors", metadata={"format": "pt"})
        wm.update(dict.fromkeys(part, f"model-{s + 1:05d}-of-00002.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    out = tmp_path / "weights"  # no .dcp suffix: --to says it
    r = convert(d / "model.safetensors.index.json", out, to="dcp", strip_prefix=True)
    assert r.renamed == 4
    got = _torch_load(out, {k[len("module.") :]: v for k, v in ref.items()})
    assert all(torch.equal(got[k[len("module.") :]], v) for k, v in ref.items())


def test_default_output_name():
    assert default_dcp_output("a/model.safetensors") == os.path.join("a", "model.dcp")
    assert default_dcp_output("a/model.safetensors.index.json") == os.path.join("a", "model.dcp")
    assert default_dcp_output("hf/") == "hf.dcp"


def test_bad_inputs(tmp_path):
    src = tmp_path / "m.safetensors"
    save_file(_sd(), src)
    out = tmp_path / "o.dcp"
    convert(src, out)
    with pytest.raises(OutputError, match="already exists"):
        convert(src, out)
    convert(src, out, force=True)  # a DCP directory may be replaced
    (tmp_path / "notdcp.dcp").mkdir()
    (tmp_path / "notdcp.dcp" / "keep.txt").write_text("x")
    with pytest.raises(OutputError, match="not a DCP checkpoint"):
        convert(src, tmp_path / "notdcp.dcp", force=True)
    assert (tmp_path / "notdcp.dcp" / "keep.txt").exists()
    pth = tmp_path / "m.pth"
    torch.save({"w": torch.ones(2)}, pth)
    with pytest.raises(UnsupportedError, match="not a safetensors file"):
        convert(pth, tmp_path / "x.dcp")
    with pytest.raises(UnsupportedError, match="max_shard_size"):
        convert(src, tmp_path / "y.dcp", max_shard_size="1MB")
    assert not (tmp_path / "x.dcp").exists() and not (tmp_path / "y.dcp").exists()


def test_cli(tmp_path):
    src = tmp_path / "m.safetensors"
    save_file(_sd(), src)
    p = run_cli("convert", src, "-o", tmp_path / "c.dcp", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["direction"] == "to-dcp"
    p = run_cli("convert", src, "-o", tmp_path / "c.dcp")
    assert_one_line_error(p, p.returncode)
    assert "already exists" in p.stderr and p.returncode != 0
    pth = tmp_path / "m.pth"
    torch.save({"w": torch.ones(2)}, pth)
    p = run_cli("convert", pth, "--to", "dcp")
    assert_one_line_error(p, p.returncode)
    assert "not a safetensors file" in p.stderr


def test_a_bad_read_back_leaves_nothing(tmp_path, monkeypatch):
    from ckptfix.errors import VerificationError
    from ckptfix.ops.convert import dcp_in as consolidate

    src = tmp_path / "m.safetensors"
    save_file(_sd(), src)
    real = consolidate.TensorStream.__iter__

    def flipped(self):
        for block in real(self):
            b = bytearray(block)
            b[0] ^= 1
            yield b

    monkeypatch.setattr(consolidate.TensorStream, "__iter__", flipped)
    with pytest.raises(VerificationError, match="differs from the source"):
        convert(src, tmp_path / "o.dcp")
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


def test_shards_split_rows_like_ranks(tmp_path):
    from ckptfix.formats.dcp.meta import read_metadata

    ref = _sd()
    ref["big"] = torch.randn(10, 3, 2)
    src = tmp_path / "m.safetensors"
    save_file(ref, src, metadata={"format": "pt"})
    out = tmp_path / "m.dcp"
    assert convert(src, out, shards=4).verified
    assert sorted(p for p in os.listdir(out) if p.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    meta = read_metadata(out)
    big = meta.entries["big"]
    assert sorted((c.offsets[0], c.sizes[0]) for c in big.chunks) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert (
        len(meta.entries["steps"].chunks) == 1 and len(meta.entries["layers.0.norm.b"].chunks) == 3
    )  # 6 rows: 2, 2, 2, none
    got = _torch_load(out, ref)
    assert all(torch.equal(got[k], v) for k, v in ref.items())
    back = tmp_path / "back.safetensors"
    convert(out, back, ckptfix_metadata=False)
    assert back.read_bytes() == src.read_bytes()
    p = run_cli("convert", src, "-o", tmp_path / "x.safetensors", "--shards", "2")
    assert_one_line_error(p, p.returncode)
    assert "--shards applies to DCP output" in p.stderr


# a conversion interrupted while it reads the output back (here: its progress callback raises, as a Ctrl-C in a
# progress bar does), then the traceback's frames are looked at, as pytest, pdb post-mortem or a logger with
# locals do: every tensor they still hold must read, never view an input mapping that was already closed
_INTERRUPTED = """
import sys, torch
from safetensors.torch import save_file
from ckptfix.ops.convert import convert

src, out, shards = sys.argv[1], sys.argv[2], int(sys.argv[3])
g = torch.Generator().manual_seed(3)
save_file({"embed.weight": torch.randn(64, 32, generator=g), "head.weight": torch.randn(8, 32, generator=g)}, src)
calls = []

def progress(done, total):
    calls.append(done)
    if done < total and len(calls) > 1:  # inside the read-back, after the save
        raise KeyboardInterrupt

try:
    convert(src, out, progress=progress, shards=shards)
except KeyboardInterrupt as e:
    tb, seen = e.__traceback__, 0
    while tb is not None:
        for v in list(tb.tb_frame.f_locals.values()):
            for t in (v.values() if isinstance(v, dict) else [v]):
                if isinstance(t, torch.Tensor):
                    repr(t)
                    float(t.float().sum())
                    seen += 1
        tb = tb.tb_next
    print("tensors read after the interruption:", seen)
else:
    raise SystemExit("the conversion was not interrupted")
"""


@pytest.mark.parametrize("shards", [1, 2])
def test_tensors_left_in_an_interrupted_conversions_traceback_still_read(tmp_path, shards):
    import subprocess
    import sys

    argv = [str(tmp_path / "m.safetensors"), str(tmp_path / "m.dcp"), str(shards)]
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED, *argv], capture_output=True, text=True, cwd=root, timeout=180
    )
    assert p.returncode == 0, f"exit {p.returncode} (-11: a tensor viewed a closed mapping)\n{p.stderr[-3000:]}"
    assert int(p.stdout.split(":")[-1]) > 0, p.stdout  # the frames did hold tensors over the input
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("shards", [1, 2])
def test_a_finished_conversion_leaves_no_mapping_of_its_input(tmp_path, shards):
    import gc

    src = tmp_path / "m.safetensors"
    save_file(_sd(), src)
    r = convert(src, tmp_path / "m.dcp", shards=shards)
    gc.collect()
    assert r.verified and str(src) not in Path("/proc/self/maps").read_text()
