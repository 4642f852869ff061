"""torchao tensor subclasses in a plain ``torch.save(model.state_dict())``: read, converted and loaded.

The fixtures in tests/fixtures/frameworks/torchao/ were written by torchao itself (``make_torchao.py``;
versions in ``VERSIONS``): ``NAME.pt`` a quantized model's state dict, ``NAME.flat.safetensors`` what torchao's
own ``flatten_tensor_state_dict`` gives for it (saved with ``save_file``), ``NAME.dequant.safetensors`` each
weight's ``dequantize()``.  The tests before the oracle section run without torchao; the oracle tests
(torchao's own loaders on ckptfix's outputs) need it installed and are skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfix.errors import UnsupportedError
from ckptfix.ops.convert import convert
from ckptfix.ops.inspect import inspect_checkpoint

from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
AO = REPO / "tests" / "fixtures" / "frameworks" / "torchao"

#: fixture -> (class, the dtype inspect shows for its weights)
FIXTURES = {
    "int8wo": ("Int8Tensor", "int8"),
    "int8dq": ("Int8Tensor", "int8"),
    "float8wo": ("Float8Tensor", "float8_e4m3fn"),
    "float8dq": ("Float8Tensor", "float8_e4m3fn"),
    "intx4wo": ("IntxUnpackedToInt8Tensor", "int4"),
    "intx4dq": ("IntxUnpackedToInt8Tensor", "int4"),
    "int4": ("Int4Tensor", "int4"),  # packed two per byte
}
HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None


def _safetensors(path: Path | str) -> tuple[dict[str, tuple[str, list[int], bytes]], dict[str, str]]:
    """A safetensors file read by hand: name -> (dtype, shape, bytes), and the metadata."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {
        k: (v["dtype"], v["shape"], data[base + v["data_offsets"][0] : base + v["data_offsets"][1]])
        for k, v in header.items()
    }
    return out, meta


# --------------------------------------------------------------------------- read torch-free


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_inspect_shows_the_stored_dtype_and_the_dense_size(name):
    cls, dtype = FIXTURES[name]
    r = inspect_checkpoint(AO / f"{name}.pt")
    assert r.dtypes == {"bfloat16": 2, dtype: 2}  # was {"bfloat16": 2, "unknown": 2}
    assert r.tensor_count == 4
    assert r.parameter_count == 32 * 64 + 32 + 16 * 32 + 16  # the dense weights' values (was 50)
    assert r.stubbed_globals == []
    assert r.weights_only_ok and "import torchao" in r.weights_only_reason
    (note,) = [n for n in r.notes if "torchao tensor subclasses" in n]
    assert f"{cls} x2" in note and "qdata" in note and "dense bfloat16 [32, 64]" in note
    rows = {t["name"]: t for t in r.tensors}
    assert rows["0.weight"]["shape"] == [32, 64] and rows["0.weight"]["dtype"] == dtype
    assert rows["0.bias"]["dtype"] == "bfloat16"


def test_the_policy_names_exactly_the_torchao_classes_it_reads():
    from ckptfix.pickles.policy import TORCHAO_GLOBALS, classify_global, needs_package
    from ckptfix.pickles.subclass import HELPERS, SUBCLASSES

    assert set(TORCHAO_GLOBALS) == set(SUBCLASSES) | set(HELPERS)
    for g in TORCHAO_GLOBALS:
        assert classify_global(g) == "safe" and needs_package(g) == "torchao"
    for other in (
        "torchao.quantization.quant_api.quantize_",
        "torchao.quantization.Int8TensorX",
        "torchao.utils.TorchAOBaseTensor",
        "torchao.dtypes.AffineQuantizedTensor",
        "torchao.os.system",
    ):
        assert classify_global(other) != "safe", other
    assert needs_package("torch.Size") is None


def test_a_torchao_class_outside_its_rebuild_call_stays_an_inert_placeholder():
    """The class named as a plain call (not torch's wrapper rebuild) runs nothing and is no tensor."""
    from ckptfix.pickles import Stub, loads_records

    # protocol 2: {"w": torchao.quantization.Int8Tensor("x")}
    data = b"\x80\x02}X\x01\x00\x00\x00wctorchao.quantization\nInt8Tensor\nX\x01\x00\x00\x00x\x85Rs."
    obj, _ = loads_records(data)
    assert isinstance(obj["w"], Stub) and obj["w"].args == ("x",)
    assert inspect_checkpoint  # (the reader, not torch, built it)


# --------------------------------------------------------------------------- convert, torch-free


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_convert_writes_torchaos_own_flattened_layout(name, tmp_path):
    """The output's tensors are bit-equal to torchao's flatten_tensor_state_dict's, its metadata entries equal."""
    out = tmp_path / f"{name}.safetensors"
    rep = convert(AO / f"{name}.pt", out)  # was UnsupportedError: "... is a subclass tensor"
    mine, mine_meta = _safetensors(out)
    theirs, theirs_meta = _safetensors(AO / f"{name}.flat.safetensors")
    assert mine == theirs
    for k, v in theirs_meta.items():
        assert json.loads(mine_meta[k]) == json.loads(v), k
    assert set(rep.subclasses) == {"0.weight", "2.weight"}
    assert rep.subclasses["0.weight"].startswith(FIXTURES[name][0] + " -> 0._weight_qdata")
    assert rep.verified


def test_convert_of_torchao_tensors_imports_no_torch(tmp_path):
    out = tmp_path / "o.safetensors"
    r = run_cli("convert", str(AO / "int8dq.pt"), "-o", str(out), "--json", isolated=True)
    assert r.rc == 0, r.err
    assert not r.torch_imported
    doc = json.loads(r.out)
    assert doc["subclasses"]["2.weight"].startswith("Int8Tensor -> 2._weight_qdata")


def test_a_top_level_torchao_tensor_is_refused_in_user_terms():
    """torchao's layout splits the module at the last dot: a dotless name has none (torchao's flatten fails too)."""
    from ckptfix.formats import read_checkpoint
    from ckptfix.pickles.subclass import flatten_named

    cf = read_checkpoint(AO / "int8wo.pt")
    with pytest.raises(UnsupportedError, match="dotted name"):
        flatten_named([("weight", cf.obj["0.weight"])])


@pytest.mark.skipif(HAVE_TORCHAO, reason="the messages for a machine without torchao")
def test_without_torchao_load_and_reverse_say_what_to_install(tmp_path):
    from ckptfix import load_anywhere
    from ckptfix.ops.convert.reverse import convert_from_safetensors

    for trust in (False, True):  # was CorruptCheckpointError "torch could not load it (ModuleNotFoundError ...)"
        with pytest.raises(UnsupportedError, match="pip install torchao"):
            load_anywhere(AO / "int8wo.pt", trust=trust)
    with pytest.raises(UnsupportedError, match="pip install torchao"):
        convert_from_safetensors(AO / "int8wo.flat.safetensors", tmp_path / "x.pth")
    assert not (tmp_path / "x.pth").exists()


# --------------------------------------------------------------------------- wrapper subclasses in load_anywhere


_DTENSOR = r"""
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
w = torch.randn(4, 6)
torch.save({"w": distribute_tensor(w, mesh, [Replicate()])}, sys.argv[1] + "/dt.pt")
from ckptfix import load_anywhere
for kw in ({"trust": True}, {"trust": True, "map_location": "cpu"}):
    sd = load_anywhere(sys.argv[1] + "/dt.pt", **kw)
    assert isinstance(sd["w"], DTensor), type(sd["w"])
    assert torch.equal(sd["w"].to_local(), w)
try:
    load_anywhere(sys.argv[1] + "/dt.pt", trust=True, map_location=lambda s, loc: s)
except Exception as e:
    assert type(e).__name__ == "UnsupportedError" and "callable map_location" in str(e), e
else:
    raise AssertionError("a callable map_location loaded wrapper subclasses")
dist.destroy_process_group()
print("ok")
"""


def test_load_anywhere_loads_dtensors_with_trust(tmp_path):
    """torch refuses a callable map_location for _rebuild_wrapper_subclass: ckptfix passes the device instead."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    r = subprocess.run(
        [sys.executable, "-c", _DTENSOR, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


# --------------------------------------------------------------------------- oracle: torchao's own loaders


def _torchao():
    pytest.importorskip("torchao")
    import torchao.quantization  # noqa: F401 - registers its classes with torch's weights-only loader

    from ckptfix.ops.convert.torchao import same_tensor

    return same_tensor


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_oracle_torchao_unflattens_the_output_into_the_saved_tensors(name, tmp_path):
    same_tensor = _torchao()
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict
    from torchao.prototype.safetensors.safetensors_utils import is_metadata_torchao

    out = tmp_path / f"{name}.safetensors"
    convert(AO / f"{name}.pt", out)
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert is_metadata_torchao(meta)
    got, left = unflatten_tensor_state_dict(load_file(str(out)), meta)
    want = torch.load(AO / f"{name}.pt", weights_only=True)
    assert not left and list(got) == list(want)
    assert all(same_tensor(got[k], want[k]) for k in want)
    if name != "int4":  # (Int4Tensor.dequantize needs CUDA kernels)
        deq = load_file(str(AO / f"{name}.dequant.safetensors"))
        assert torch.equal(got["0.weight"].dequantize(), deq["0.weight"])


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_oracle_convert_to_pt_gives_back_the_torchao_tensors(name, tmp_path):
    same_tensor = _torchao()
    import torch

    st, pth = tmp_path / "a.safetensors", tmp_path / "b.pth"
    convert(AO / f"{name}.pt", st)
    rep = convert(st, pth, to="pt")
    assert rep.verified and set(rep.subclasses) == {"0.weight", "2.weight"}
    assert "__metadata__" not in rep.excluded  # torchao's entries are consumed, not left out
    back = torch.load(pth, weights_only=True)
    want = torch.load(AO / f"{name}.pt", weights_only=True)
    assert list(back) == list(want) and all(same_tensor(back[k], want[k]) for k in want)


@pytest.mark.parametrize("name", ["int8dq", "float8dq", "intx4wo"])
def test_oracle_load_anywhere_loads_torchao_tensors(name):
    same_tensor = _torchao()
    import torch

    from ckptfix import load_anywhere

    want = torch.load(AO / f"{name}.pt", weights_only=True)
    for kw in ({}, {"trust": True}, {"map_location": "cpu"}, {"trust": True, "map_location": "auto"}):
        got = load_anywhere(AO / f"{name}.pt", **kw)  # was CorruptCheckpointError: "Callable map_location ..."
        assert all(same_tensor(got[k], want[k]) for k in want), kw
    with pytest.raises(UnsupportedError, match="callable map_location"):
        load_anywhere(AO / f"{name}.pt", map_location=lambda s, loc: s)


# --------------------------------------------------------------------------- transformers' TorchAoConfig layout


def test_convert_of_a_quantized_transformers_state_dict_equals_transformers_own_save_pretrained(tmp_path):
    """torch.save(model.state_dict()) of a TorchAoConfig model, converted: what transformers' save_pretrained
    writes (bit-equal tensors, every metadata entry), and no JSON list under a dotted key (transformers'
    torchao loader parses each one as a dict)."""
    out = tmp_path / "model.safetensors"
    convert(AO / "hf_llama_int8.pt", out)
    mine, mine_meta = _safetensors(out)
    theirs, theirs_meta = _safetensors(AO / "hf_llama_int8" / "model.safetensors")
    assert mine == theirs
    for k, v in theirs_meta.items():
        assert (json.loads(mine_meta[k]) if k != "format" else mine_meta[k]) == (json.loads(v) if k != "format" else v)
    for k, v in mine_meta.items():
        if "." in k and v[:1] in "[{":
            assert isinstance(json.loads(v), dict), k


def test_inspect_names_torchaos_layout_in_a_safetensors_file():
    r = inspect_checkpoint(AO / "hf_llama_int8" / "model.safetensors")
    (note,) = [n for n in r.notes if "torchao's safetensors layout" in n]
    assert "Int8Tensor x7" in note


def test_oracle_transformers_loads_the_converted_folder_with_equal_logits(tmp_path):
    _torchao()
    pytest.importorskip("transformers")
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    dst = tmp_path / "m"
    dst.mkdir()
    for f in ("config.json", "generation_config.json"):
        shutil.copy(AO / "hf_llama_int8" / f, dst / f)
    convert(AO / "hf_llama_int8.pt", dst / "model.safetensors")
    x = torch.tensor([[1, 5, 7, 9, 11]])
    with torch.no_grad():
        want = LlamaForCausalLM.from_pretrained(AO / "hf_llama_int8")(x).logits
        got = LlamaForCausalLM.from_pretrained(dst)(x).logits
    assert torch.equal(got, want)


def test_oracle_convert_to_pt_of_transformers_torchao_file(tmp_path):
    same_tensor = _torchao()
    import torch

    pth = tmp_path / "m.pth"
    rep = convert(AO / "hf_llama_int8" / "model.safetensors", pth, to="pt")
    assert rep.verified and len(rep.subclasses) == 7
    back = torch.load(pth, weights_only=True)
    want = torch.load(AO / "hf_llama_int8.pt", weights_only=True)
    assert sorted(back) == sorted(want) and all(same_tensor(back[k], want[k]) for k in want)


def test_scan_calls_torchaos_classes_safe_and_says_they_need_torchao_imported():
    r = run_cli("scan", str(AO / "float8dq.pt"), isolated=False)
    assert r.rc == 0, r.err
    assert "safe      torchao.quantization.Float8Tensor" in r.out
    assert "safe      torchao.float8.inference.Float8MMConfig" in r.out
    assert "once `import torchao` has registered them" in r.out


def test_a_torchao_safetensors_folder_converted_keeps_a_metadata_transformers_reads(tmp_path):
    """convert of transformers' own TorchAoConfig folder (safetensors in torchao's layout) to safetensors: the
    tensors and torchao's entries as they were, and no JSON list under a dotted key, which transformers'
    torchao loader parses as a dict (``'list' object has no attribute 'get'`` in from_pretrained)."""
    out = tmp_path / "model.safetensors"
    convert(AO / "hf_llama_int8", out)
    mine, mine_meta = _safetensors(out)
    theirs, theirs_meta = _safetensors(AO / "hf_llama_int8" / "model.safetensors")
    assert mine == theirs
    for k, v in theirs_meta.items():
        assert mine_meta[k] == v
    for k, v in mine_meta.items():
        if "." in k and v[:1] in "[{":
            assert isinstance(json.loads(v), dict), k


def test_load_anywhere_of_torchaos_safetensors_layout_rebuilds_or_says_why(tmp_path):
    """transformers' TorchAoConfig file: with torchao, load_anywhere gives the Int8Tensors from_pretrained's
    state_dict() holds (rebuilt by torchao's unflatten); without it, the inner tensors and a warning naming
    torchao, never a silent flat state dict."""
    from ckptfix import load_anywhere

    f = AO / "hf_llama_int8" / "model.safetensors"
    if importlib.util.find_spec("torchao") is None:
        with pytest.warns(UserWarning, match="torchao"):
            sd = load_anywhere(f)
        assert any(k.endswith("._weight_qdata") for k in sd)
        return
    import torchao  # noqa: F401

    sd = load_anywhere(f)
    kinds = {type(v).__name__ for v in sd.values()}
    assert "Int8Tensor" in kinds and not any(k.endswith("._weight_qdata") for k in sd)
