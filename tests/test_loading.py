"""load_anywhere / load_checkpoint on every container, device remapping, alignment and safety."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from ckptfix.errors import CkptfixError, KeyConflictError, UnsupportedError
from ckptfix.ops import load as loading
from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint
from ckptfix.ops.load import is_stub, load_anywhere, load_checkpoint

from helpers import HAS_CUDA, TinyNet, assert_same_tensors, gpu, sample_input, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore")


def _sd_only(sd):
    return {k: v for k, v in sd.items()}


# --------------------------------------------------------------------------- every container


@pytest.mark.parametrize(
    "builder,fmt",
    [
        ("plain", "torch-zip"),
        ("legacy", "torch-legacy"),
        ("dataparallel", "torch-zip"),
        ("compiled", "torch-zip"),
        ("safetensors", "safetensors"),
        ("sharded_bin", "sharded"),
        ("sharded_safetensors", "sharded"),
        ("dcp", "dcp"),
        ("torchscript", "torchscript"),
        ("weird_root", "torch-zip"),
    ],
)
def test_every_container_loads_exactly(ckpt, builder, fmt):
    b = getattr(ckpt, builder)()
    lc = load_checkpoint(b.path)
    assert lc.format == fmt
    assert_same_tensors(lc.state_dict, b.expected)
    sd = load_anywhere(b.path)
    assert_same_tensors(sd, b.expected)
    assert all(v.device.type == "cpu" for v in sd.values())


def test_sharded_dir_path_also_works(ckpt):
    b = ckpt.sharded_safetensors()
    sd = load_anywhere(b.extra["dir"])
    assert_same_tensors(sd, b.expected)


def test_model_loads_strict_from_each_container_and_outputs_match(ckpt):
    ref = tiny_model()
    x = sample_input()
    want = ref(x)
    for b in (ckpt.plain(), ckpt.legacy(), ckpt.safetensors(), ckpt.dcp(), ckpt.torchscript(), ckpt.sharded_bin()):
        m = TinyNet().eval()
        m.load_state_dict(load_anywhere(b.path), strict=True)
        assert torch.equal(m(x), want), b.path


def test_metadata_is_kept(ckpt):
    b = ckpt.plain()
    sd = load_anywhere(b.path)
    assert hasattr(sd, "_metadata")
    assert sd._metadata == b.model.state_dict()._metadata


def test_metadata_kept_in_legacy_and_wrapped(ckpt):
    for b in (ckpt.legacy(), ckpt.wrapped()):
        sd = load_anywhere(b.path)
        assert hasattr(sd, "_metadata"), b.path
        assert "bn" in sd._metadata or "module.bn" in sd._metadata or "" in sd._metadata


def test_tied_weights_stay_shared(ckpt):
    for legacy in (False, True):
        b = ckpt.tied(f"tied_{legacy}.pt", legacy=legacy)
        sd = load_anywhere(b.path)
        assert_same_tensors(sd, b.expected)
        assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()


# --------------------------------------------------------------------------- devices


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("device", ["cuda:0", "cuda:7"])
@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU fallback")
def test_cuda_tagged_loads_on_cpu(ckpt, legacy, device):
    b = ckpt.cuda_tagged(device=device, legacy=legacy)
    # plain torch.load cannot (no CUDA here)
    with pytest.raises(RuntimeError):
        torch.load(b.path, weights_only=True)
    lc = load_checkpoint(b.path)
    assert_same_tensors(lc.state_dict, b.expected)
    assert all(v.device.type == "cpu" for v in lc.state_dict.values())
    assert lc.locations == {device: len(b.expected)}
    assert lc.remapped == {device: "cpu"}


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU fallback")
def test_mixed_cpu_cuda1_loads_on_cpu(ckpt, legacy):
    b = ckpt.mixed_tagged(legacy=legacy)
    lc = load_checkpoint(b.path, map_location=None)
    assert_same_tensors(lc.state_dict, b.expected)
    assert lc.locations == {"cpu": 1, "cuda:1": len(b.expected) - 1}
    assert lc.remapped == {"cuda:1": "cpu"}


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU fallback")
@pytest.mark.parametrize(
    "ml",
    [
        "cpu",
        torch.device("cpu"),
        {"cuda:7": "cpu"},
        {"cuda:7": torch.device("cpu")},
        "auto",
        None,
        lambda storage, loc: storage,
        lambda storage, loc: None,
    ],
    ids=["str", "device", "dict", "dict-device", "auto", "none", "callable", "callable-none"],
)
def test_map_location_forms(ckpt, ml):
    b = ckpt.cuda_tagged("c7.pt", device="cuda:7")
    lc = load_checkpoint(b.path, map_location=ml)
    assert_same_tensors(lc.state_dict, b.expected)
    assert all(v.device.type == "cpu" for v in lc.state_dict.values())
    assert lc.locations == {"cuda:7": len(b.expected)}


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU error")
def test_explicit_cuda_map_location_without_cuda_is_a_clear_error(ckpt):
    b = ckpt.plain()
    with pytest.raises(UnsupportedError, match="CUDA is not available"):
        load_anywhere(b.path, map_location="cuda:0")
    with pytest.raises(UnsupportedError):
        load_anywhere(b.path, map_location=torch.device("cuda", 0))


def test_callable_map_location_sees_every_tag(ckpt):
    b = ckpt.mixed_tagged()
    seen = []

    def ml(storage, loc):
        seen.append(loc)
        return storage

    load_anywhere(b.path, map_location=ml)
    assert sorted(set(seen)) == ["cpu", "cuda:1"]


@gpu
@pytest.mark.parametrize("ml", ["cuda:0", "auto", torch.device("cuda:0")])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_gpu_cuda7_file_to_cuda0(ckpt, ml, legacy):
    b = ckpt.cuda_tagged(device="cuda:7", legacy=legacy)
    lc = load_checkpoint(b.path, map_location=ml)
    for k, v in lc.state_dict.items():
        assert v.device == torch.device("cuda:0"), k
    assert_same_tensors(lc.state_dict, b.expected)


@gpu
def test_gpu_safetensors_and_dcp_to_cuda(ckpt):
    for b in (ckpt.safetensors(), ckpt.dcp()):
        sd = load_anywhere(b.path, map_location="cuda:0")
        assert all(v.device == torch.device("cuda:0") for v in sd.values())
        assert_same_tensors(sd, b.expected)


# --------------------------------------------------------------------------- key= / model=


def test_key_finds_nested_state_dict(ckpt):
    b = ckpt.wrapped()
    lc = load_checkpoint(b.path)
    assert lc.key_path == ("model",)
    assert_same_tensors(lc.state_dict, b.expected)
    assert lc["epoch"] == 5
    assert lc.get("missing", 42) == 42
    lc2 = load_checkpoint(b.path, key="model")
    assert_same_tensors(lc2.state_dict, b.expected)
    # optimizer state survives (torch-allowed globals rebuilt)
    opt = lc.checkpoint["optimizer"]
    assert opt["param_groups"][0]["lr"] == 0.1
    for sid, st in b.extra["optimizer"]["state"].items():
        assert torch.equal(opt["state"][sid]["momentum_buffer"], st["momentum_buffer"])


def test_key_that_does_not_exist(ckpt):
    b = ckpt.wrapped()
    with pytest.raises(KeyConflictError):
        load_anywhere(b.path, key="nope")


def test_key_with_slash_path(ckpt, tmp_path):
    m = tiny_model()
    p = tmp_path / "nested.pt"
    torch.save({"ema": {"inner": m.state_dict()}, "model": {"w": torch.ones(1)}}, p)
    sd = load_anywhere(p, key="ema/inner")
    assert_same_tensors(sd, m.state_dict())


def test_model_alignment_dp_into_plain(ckpt):
    b = ckpt.dataparallel()
    m = TinyNet().eval()
    lc = load_checkpoint(b.path, model=m)
    assert lc.alignment is not None and lc.alignment.exact
    m.load_state_dict(lc.state_dict, strict=True)
    x = sample_input()
    assert torch.equal(m(x), b.model(x))


def test_model_alignment_compiled_and_lightning_into_plain(ckpt):
    x = sample_input()
    for b in (ckpt.compiled(), ckpt.lightning()):
        m = TinyNet().eval()
        sd = load_anywhere(b.path, model=m)
        m.load_state_dict(sd, strict=True)
        assert torch.equal(m(x), b.model(x)), b.path


def test_model_alignment_plain_into_dp(ckpt):
    b = ckpt.plain()
    dp = nn.DataParallel(TinyNet().eval())
    sd = load_anywhere(b.path, model=dp)
    dp.load_state_dict(sd, strict=True)
    x = sample_input()
    assert torch.equal(dp.module(x), b.model(x))


# --------------------------------------------------------------------------- globals


def test_lightning_namespace_stubbed_then_allowed(ckpt):
    b = ckpt.lightning()
    lc = load_checkpoint(b.path)
    assert lc.stubbed_globals == ["argparse.Namespace"]
    assert lc.key_path == ("state_dict",)
    assert lc["epoch"] == 3
    hp = lc["hyper_parameters"]
    assert is_stub(hp)
    assert not isinstance(hp, argparse.Namespace)
    assert_same_tensors(lc.state_dict, b.expected)

    lc2 = load_checkpoint(b.path, allow_globals=["argparse.Namespace"])
    assert lc2.stubbed_globals == []
    hp2 = lc2["hyper_parameters"]
    assert isinstance(hp2, argparse.Namespace)
    assert hp2 == argparse.Namespace(lr=0.01, hidden=3, name="tiny")

    lc3 = load_checkpoint(b.path, allow_globals=[argparse.Namespace])
    assert isinstance(lc3["hyper_parameters"], argparse.Namespace)


def test_trust_true_rebuilds_everything(ckpt):
    b = ckpt.lightning()
    with pytest.warns(UserWarning, match="trust=True"):
        lc = load_checkpoint(b.path, trust=True)
    assert isinstance(lc["hyper_parameters"], argparse.Namespace)
    assert lc.stubbed_globals == []
    assert_same_tensors(lc.state_dict, b.expected)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_unimportable_class_becomes_placeholder(ckpt, legacy):
    b = ckpt.unimportable_args(legacy=legacy)
    # the classic failure
    with pytest.raises(ModuleNotFoundError, match="models"):
        torch.load(b.path, weights_only=False)
    lc = load_checkpoint(b.path)
    assert lc.stubbed_globals == ["models.TrainArgs"]
    assert_same_tensors(lc.state_dict, b.expected)
    args = lc["args"]
    assert is_stub(args)
    assert args._state == {"lr": 0.1, "depth": 4}


def test_allow_global_that_cannot_be_imported_is_an_error(ckpt):
    b = ckpt.unimportable_args()
    with pytest.raises(CkptfixError, match="models.TrainArgs"):
        load_anywhere(b.path, allow_globals=["models.TrainArgs"])


# --------------------------------------------------------------------------- safety


@pytest.mark.parametrize("mode", ["zip", "legacy", "pickle"])
def test_os_system_payload_never_runs(ckpt, mode):
    b = ckpt.evil(f"evil_{mode}.pt", mode=mode)
    marker = b.extra["marker"]
    if mode != "pickle":
        lc = load_checkpoint(b.path)
        assert not marker.exists()
        assert any(g.endswith(".system") for g in lc.stubbed_globals), lc.stubbed_globals
        assert_same_tensors(lc.state_dict, b.expected)
        assert is_stub(lc["payload"])
        sd = load_anywhere(b.path)
        assert not marker.exists()
        assert_same_tensors(sd, b.expected)
    else:
        with pytest.raises(CkptfixError):
            load_anywhere(b.path)  # no tensors in it, but it must not run the payload either
        assert not marker.exists()
        lc_obj = loading.restricted_pickle_module().load(open(b.path, "rb"))
        assert is_stub(lc_obj["payload"])
    if mode == "pickle":  # no tensors in it: summarised, the payload a placeholder
        assert inspect_checkpoint(b.path).tensor_count == 0
    else:
        inspect_checkpoint(b.path)
    assert not marker.exists()
    rep = scan_checkpoint(b.path)
    assert rep.verdict == "dangerous"
    assert not marker.exists()
    # with key= and model= too
    if mode != "pickle":
        load_anywhere(b.path, key="state_dict", model=TinyNet())
        assert not marker.exists()


def test_os_system_payload_in_sharded_shard_never_runs(ckpt, tmp_path):
    import json

    b = ckpt.evil("evil_shard.bin", mode="zip")
    sd = load_anywhere(b.path)
    assert not b.extra["marker"].exists()
    # re-save as a shard whose state dict carries the payload next to it
    idx = tmp_path / "pytorch_model.bin.index.json"
    idx.write_text(json.dumps({"weight_map": {k: "evil_shard.bin" for k in sd}}))
    got = load_anywhere(idx)
    assert_same_tensors(got, b.expected)
    assert not b.extra["marker"].exists()


def test_restricted_pickle_module_rebuilds_torch_safe_globals():
    import io
    import pickle
    from collections import OrderedDict

    data = pickle.dumps(OrderedDict(a=1))
    out = loading.restricted_pickle_module().load(io.BytesIO(data))
    assert type(out) is OrderedDict and out == OrderedDict(a=1)


def test_file_without_tensors(tmp_path):
    """load_checkpoint returns the object with an empty state dict; load_anywhere says there is nothing to load."""
    import argparse

    from ckptfix.errors import CorruptCheckpointError, NoTensorsError
    from ckptfix.ops.load import load_anywhere, load_checkpoint

    torch.save(argparse.Namespace(lr=0.1), tmp_path / "training_args.bin")
    lc = load_checkpoint(tmp_path / "training_args.bin")
    assert lc.state_dict == {} and lc.checkpoint._state == {"lr": 0.1}
    lc = load_checkpoint(tmp_path / "training_args.bin", allow_globals=["argparse.Namespace"])
    assert lc.checkpoint == argparse.Namespace(lr=0.1)
    with pytest.raises(NoTensorsError) as ei:
        load_anywhere(tmp_path / "training_args.bin")
    assert not isinstance(ei.value, CorruptCheckpointError) and ei.value.exit_code == 13


# --------------------------------------------------------------------------- one fit rule with align (issue #38)


def _lenet_and_other(tmp_path):
    """A LeNet (conv1, conv2, fc1, fc2) and a file of another net: ``module.fc.*`` and ``module.conv.*``."""
    from ckptfix.train.models import LeNet

    ref = LeNet().state_dict()
    other = {
        "module.fc.weight": ref["fc2.weight"].clone(),
        "module.fc.bias": ref["fc2.bias"].clone(),
        "module.conv.weight": ref["conv1.weight"].clone(),
    }
    path = tmp_path / "other.pt"
    torch.save(other, path)
    return LeNet, path


def test_load_anywhere_refuses_the_partial_rename_align_refuses(tmp_path):
    from ckptfix.errors import AlignmentError
    from ckptfix.ops.rewrite.keys import align_checkpoint

    LeNet, path = _lenet_and_other(tmp_path)
    with pytest.raises(AlignmentError) as by_align:
        align_checkpoint(str(path), LeNet(), output=str(tmp_path / "aligned.pt"))
    assert not (tmp_path / "aligned.pt").exists()
    with pytest.raises(AlignmentError) as by_load:
        load_anywhere(path, model=LeNet())
    assert str(by_load.value) == str(by_align.value)
    assert "module.fc." in str(by_load.value) and "1 unexpected" in str(by_load.value)
    with pytest.raises(AlignmentError):
        load_checkpoint(path, model=LeNet())
    assert list(load_anywhere(path)) == ["module.fc.weight", "module.fc.bias", "module.conv.weight"]


def test_a_whole_wrapper_strip_still_loads_into_a_bigger_model(tmp_path):
    """DP backbone into a model with a new head, and an AveragedModel (``n_averaged`` beside ``module.*``):
    the rename is a wrapper fix; an entry the model has no place for is left out, and said (issue 37 §6: a
    torchvision EMA loaded strict)."""
    from torch.optim.swa_utils import AveragedModel

    backbone = TinyNet()
    torch.save(nn.DataParallel(backbone).state_dict(), tmp_path / "dp.pt")
    bigger = nn.ModuleDict({"head": nn.Linear(2, 2)})
    for name, mod in backbone.named_children():
        bigger[name] = mod
    sd = load_anywhere(tmp_path / "dp.pt", model=bigger)
    assert set(sd) == set(backbone.state_dict())
    torch.save(AveragedModel(TinyNet()).state_dict(), tmp_path / "swa.pt")
    with pytest.warns(UserWarning, match="left out 1 entry the model has no place for: n_averaged"):
        sd = load_anywhere(tmp_path / "swa.pt", model=TinyNet())
    assert set(sd) == set(TinyNet().state_dict())
    TinyNet().load_state_dict(sd)


# --------------------------------------------------------------------------- one global, one name (issue #38)


def test_a_protocol_2_global_has_its_python_3_name_everywhere(tmp_path):
    """torch.save(pickle_protocol=2) writes subprocess.call as ``GLOBAL commands call`` (pickle's reverse
    _compat_pickle mapping): the loader's placeholders say subprocess.call, as scan and inspect do."""
    import subprocess
    import zipfile

    from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint

    class Calls:
        def __reduce__(self):
            return (subprocess.call, (["true"],))

    path = tmp_path / "p2.pt"
    torch.save({"w": torch.zeros(2), "x": Calls()}, path, pickle_protocol=2)
    with zipfile.ZipFile(path) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert b"ccommands\ncall\n" in pkl  # what the file really says
    ck = load_checkpoint(path)
    assert ck.stubbed_globals == ["subprocess.call"]
    assert inspect_checkpoint(path).stubbed_globals == ["subprocess.call"]
    assert scan_checkpoint(path).dangerous == ["subprocess.call"]
    from ckptfix.pickles import global_name

    assert global_name(type(ck.checkpoint["x"])) == "subprocess.call"  # the placeholder's own record
    # a protocol-2 safe global (``__builtin__ set``, ``copy_reg _reconstructor``) still rebuilds for real
    torch.save({"w": torch.zeros(1), "s": {1, 2}}, tmp_path / "set.pt", pickle_protocol=2)
    ck = load_checkpoint(tmp_path / "set.pt")
    assert ck.checkpoint["s"] == {1, 2} and ck.stubbed_globals == []
