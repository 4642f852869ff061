"""Prefix detection, stripping, adding and alignment, on real wrapped torch models."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckptfix.ops.prefixes as prefixes
from ckptfix.errors import KeyConflictError
from ckptfix.ops.prefixes import (
    INNER_WRAPPER_SEGMENTS,
    KNOWN_PREFIXES,
    add_prefix,
    align_state_dict,
    detect_prefixes,
    rename_keys,
    strip_prefix,
    strip_prefix_report,
)

# --------------------------------------------------------------------------- fixtures


class Net(nn.Module):
    """Small model with parameters, buffers (BatchNorm) and nested submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.block = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.bn(self.conv1(x)).mean((2, 3)))


class LightningLike(nn.Module):
    """What a LightningModule with ``self.model = net`` saves."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.model = net


class FabricLike(nn.Module):
    """What Lightning Fabric's wrapper saves (``_forward_module.``)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self._forward_module = net


def trained_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():  # non-default buffers so they matter in the comparison
        net.bn.running_mean.uniform_(-1, 1)
        net.bn.running_var.uniform_(0.5, 2)
        net.bn.num_batches_tracked.fill_(7)
    return net.eval()


def assert_loads_bit_identical(source: Net, state_dict: dict) -> None:
    """Load ``state_dict`` strictly into a fresh Net and compare outputs bit for bit."""
    fresh = Net()
    fresh.load_state_dict(state_dict, strict=True)
    fresh.eval()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(source(x), fresh(x))
    for key, value in source.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[key]), key


def metadata(sd) -> dict:
    return dict(sd._metadata)


@pytest.fixture
def process_group(tmp_path: Path):
    """A single-process gloo group (DDP and FSDP need one), destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def compiled(module: nn.Module) -> nn.Module:
    return torch.compile(module, backend="eager")  # keys only; never run


# --------------------------------------------------------------------------- module hygiene


def test_module_does_not_import_torch():
    code = "import sys, ckptfix.ops.prefixes; assert 'torch' not in sys.modules, 'torch imported'"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={"PYTHONPATH": str(root)})


def test_doctests():
    r = doctest.testmod(prefixes, optionflags=doctest.ELLIPSIS)
    assert r.attempted > 5 and r.failed == 0


def test_constants():
    assert KNOWN_PREFIXES == ("module.", "_orig_mod.", "_forward_module.", "model.")
    assert "_fsdp_wrapped_module." in INNER_WRAPPER_SEGMENTS
    assert "_checkpoint_wrapped_module." in INNER_WRAPPER_SEGMENTS
    assert "module." not in INNER_WRAPPER_SEGMENTS  # mid-key 'module.' may be a real submodule


# --------------------------------------------------------------------------- wrapper styles


def test_dataparallel_strip_loads_bit_identical():
    net = trained_net()
    sd = nn.DataParallel(net).state_dict()
    assert all(k.startswith("module.") for k in sd)
    stripped = strip_prefix(sd)
    assert type(stripped) is OrderedDict
    assert list(stripped) == list(net.state_dict())
    assert metadata(stripped) == metadata(net.state_dict())
    assert_loads_bit_identical(net, stripped)


def test_ddp_strip_loads_bit_identical(process_group):
    net = trained_net()
    sd = nn.parallel.DistributedDataParallel(net).state_dict()
    assert all(k.startswith("module.") for k in sd)
    stripped = strip_prefix(sd)
    assert metadata(stripped) == metadata(net.state_dict())
    assert_loads_bit_identical(net, stripped)


def test_compile_strip_loads_bit_identical():
    net = trained_net()
    sd = compiled(net).state_dict()
    assert all(k.startswith("_orig_mod.") for k in sd)
    stripped = strip_prefix(sd)
    assert metadata(stripped) == metadata(net.state_dict())
    assert_loads_bit_identical(net, stripped)


@pytest.mark.parametrize(
    ("wrap", "stack"),
    [
        (lambda m: nn.DataParallel(compiled(m)), "module._orig_mod."),
        (lambda m: compiled(nn.DataParallel(m)), "_orig_mod.module."),
        (lambda m: nn.DataParallel(nn.DataParallel(m)), "module.module."),
        (lambda m: LightningLike(compiled(m)), "model._orig_mod."),
        (lambda m: FabricLike(nn.DataParallel(m)), "_forward_module.module."),
        (LightningLike, "model."),
        (FabricLike, "_forward_module."),
    ],
    ids=["dp-compile", "compile-dp", "dp-dp", "lightning-compile", "fabric-dp", "lightning", "fabric"],
)
def test_stacked_wrappers_strip_loads_bit_identical(wrap, stack):
    net = trained_net()
    sd = wrap(net).state_dict()
    report = detect_prefixes(sd)
    assert report.stacks == {stack: len(sd)}
    assert "".join(report.default_strip) == stack
    stripped, strip_report = strip_prefix_report(sd)
    assert "".join(p for p, _ in strip_report.stripped) == stack
    assert strip_report.renamed_keys == len(sd) and strip_report.changed
    assert metadata(stripped) == metadata(net.state_dict())
    assert_loads_bit_identical(net, stripped)


def test_activation_checkpoint_inner_segments_removed():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = trained_net()
    wrapped = trained_net()
    wrapped.block[0] = checkpoint_wrapper(wrapped.block[0])
    # checkpoint_wrapper hides itself in state_dict(), not in named_parameters(): what people save
    sd = OrderedDict((n, t.detach().clone()) for n, t in wrapped.named_parameters())
    sd.update((n, t.clone()) for n, t in wrapped.named_buffers())
    assert "block.0._checkpoint_wrapped_module.weight" in sd
    report = detect_prefixes(sd)
    assert report.inner == {"_checkpoint_wrapped_module.": 2}
    assert report.leading == {}
    stripped, strip_report = strip_prefix_report(sd)
    assert strip_report.inner_removed == {"_checkpoint_wrapped_module.": 2}
    assert strip_report.renamed_keys == 2
    assert set(stripped) == set(net.state_dict())
    assert_loads_bit_identical(wrapped, stripped)


def test_fsdp_inner_segments_removed(process_group):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))
    torch.manual_seed(0)
    wrapped = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))
    with pytest.warns(UserWarning):  # world size 1: FSDP says it switches to NO_SHARD
        wrapped[1] = FSDP(wrapped[1], device_id=torch.device("cpu"), use_orig_params=True)
    sd = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    assert "1._fsdp_wrapped_module.0.weight" in sd
    assert detect_prefixes(sd).inner == {"_fsdp_wrapped_module.": 2}
    stripped = strip_prefix(sd)
    assert type(stripped) is dict
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))
    fresh.load_state_dict(stripped, strict=True)
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(plain(x), fresh(x))


def test_compiled_submodule_orig_mod_mid_key():
    net = trained_net()
    inner = trained_net()
    inner.block = compiled(inner.block)
    sd = inner.state_dict()
    assert "block._orig_mod.0.weight" in sd
    report = detect_prefixes(sd)
    assert report.inner == {"_orig_mod.": 4} and report.leading == {}
    stripped = strip_prefix(sd)
    assert list(stripped) == list(net.state_dict())
    assert metadata(stripped) == metadata(net.state_dict())
    assert_loads_bit_identical(net, stripped)  # same weights; running `inner` would compile


def test_mid_key_module_is_kept():
    sd = {"encoder.module.weight": 1, "encoder.module.bias": 2}
    assert strip_prefix(sd) == sd
    assert detect_prefixes(sd).has_wrappers is False


def test_add_prefix_loads_into_dataparallel():
    net = trained_net()
    target = nn.DataParallel(Net())
    sd = add_prefix(net.state_dict(), "module.")
    assert metadata(sd) == metadata(nn.DataParallel(net).state_dict())
    target.load_state_dict(sd, strict=True)
    x = torch.randn(2, 3, 8, 8)
    target.eval()
    with torch.no_grad():
        assert torch.equal(net(x), target(x))


def test_add_prefix_without_dot_and_metadata_root_kept():
    sd = OrderedDict([("fc.w", 1)])
    sd._metadata = OrderedDict([("", {"version": 1}), ("fc", {"version": 2})])
    out = add_prefix(sd, "wrap")
    assert list(out) == ["wrap.fc.w"]
    assert metadata(out) == {"": {"version": 1}, "wrap": {"version": 1}, "wrap.fc": {"version": 2}}
    assert list(out._metadata)[0] == ""
    assert out._metadata["wrap"] is not sd._metadata[""]  # copied, not shared


# --------------------------------------------------------------------------- conventions


def test_input_not_mutated_and_values_are_the_same_objects():
    net = trained_net()
    sd = nn.DataParallel(net).state_dict()
    keys, meta, values = list(sd), {k: dict(v) for k, v in sd._metadata.items()}, list(sd.values())
    out = strip_prefix(sd)
    assert list(sd) == keys and metadata(sd) == meta
    assert [id(v) for v in out.values()] == [id(v) for v in values]
    assert out is not sd and out._metadata is not sd._metadata


def test_values_never_inspected():
    class Opaque:
        def __getattr__(self, name):
            raise AssertionError(f"value inspected: {name}")

        def __eq__(self, other):
            raise AssertionError("value compared")

        __hash__ = object.__hash__

    sd = {"module.a": Opaque(), "module.b": Opaque()}
    out = strip_prefix(sd)
    assert list(out) == ["a", "b"]
    out = add_prefix(out, "x")
    assert list(out) == ["x.a", "x.b"]


def test_dict_subclass_type_kept():
    class MyDict(dict):
        pass

    out = strip_prefix(MyDict({"module.a": 1}))
    assert type(out) is MyDict and out == {"a": 1}


def test_rename_keys_with_mapping():
    assert rename_keys({"a": 1, "b": 2}, {"a": "c"}) == {"c": 1, "b": 2}


def test_rename_keys_rejects_non_str():
    with pytest.raises(TypeError, match="must return str"):
        rename_keys({"a": 1}, lambda k: 3)


# --------------------------------------------------------------------------- bad input


def test_mixed_checkpoint_default_strips_nothing_and_says_so():
    sd = {"module.a.w": 1, "module.b.w": 2, "c.w": 3}
    out, report = strip_prefix_report(sd)
    assert out == sd
    assert not report.changed
    assert report.skipped == {"module.": 2}
    assert "left 'module.' in place: it is on 2 of 3 keys only (strip it with partial=True" in report.summary()
    assert detect_prefixes(sd).partial == {"module.": 2}
    json.dumps(report.to_dict())


def test_mixed_checkpoint_partial_strips_carriers():
    sd = {"module._orig_mod.a.w": 1, "module.b.w": 2, "c.w": 3}
    out, report = strip_prefix_report(sd, partial=True)
    assert out == {"a.w": 1, "b.w": 2, "c.w": 3}
    assert report.stripped == (("module.", 2), ("_orig_mod.", 1))
    assert report.renamed_keys == 2


def test_partial_never_strips_model_from_some_keys():
    # Lightning around a Hugging Face model: 'model.model.*' next to 'model.lm_head'
    sd = {"model.model.layers.0.w": 1, "model.lm_head.weight": 2}
    for partial in (False, True):
        out, report = strip_prefix_report(sd, partial=partial)
        assert out == {"model.layers.0.w": 1, "lm_head.weight": 2}
        assert report.skipped == {"model.": 1}
        assert "(strip it with an explicit prefix)" in report.summary()


def test_explicit_prefix_strips_only_that_from_carriers():
    sd = {"model.fc.w": 1, "criterion.pos_weight": 2}
    assert strip_prefix(sd) == sd  # not all keys carry 'model.'
    out, report = strip_prefix_report(sd, "model")
    assert out == {"fc.w": 1, "criterion.pos_weight": 2}
    assert report.stripped == (("model.", 1),)
    # explicit never touches inner segments or other layers
    assert strip_prefix({"module.module.a._orig_mod.w": 1}, "module.") == {"module.a._orig_mod.w": 1}


def test_prefix_no_key_has():
    sd = {"module.a.w": 1, "module.b.w": 2}
    with pytest.raises(KeyConflictError, match=r"no key starts with 'encoder\.'") as info:
        strip_prefix(sd, "encoder.")
    assert "'module.'" in str(info.value)
    assert isinstance(info.value, KeyError) and info.value.exit_code == 6
    with pytest.raises(KeyConflictError, match=r"keys start with 'enc\.' \(1\)"):
        strip_prefix({"enc.w": 1}, "module")


def test_collision_raises_naming_both_keys():
    sd = OrderedDict([("module.fc.w", 1), ("fc.w", 2)])
    sd._metadata = OrderedDict([("", {}), ("module.fc", {})])
    before = (list(sd.items()), metadata(sd))
    with pytest.raises(KeyConflictError) as info:
        strip_prefix(sd, "module.")
    message = str(info.value)
    assert "'module.fc.w'" in message and "'fc.w'" in message and "nothing was changed" in message
    with pytest.raises(KeyConflictError):
        strip_prefix(sd, partial=True)
    assert (list(sd.items()), metadata(sd)) == before


def test_inner_segment_collision_raises():
    sd = {"a._fsdp_wrapped_module.w": 1, "a.w": 2}
    with pytest.raises(KeyConflictError, match="'a.w'"):
        strip_prefix(sd)


@pytest.mark.parametrize("kind", [dict, OrderedDict])
def test_empty_state_dict(kind):
    empty = kind()
    out, report = strip_prefix_report(empty)
    assert out == {} and type(out) is kind and not report.changed
    assert strip_prefix(empty, "module.") == {}
    assert add_prefix(empty, "module.") == {}
    assert detect_prefixes(empty).to_dict()["total_keys"] == 0
    new, align = align_state_dict(empty, ["a.w"])
    assert new == {} and align.missing == ("a.w",) and not align.exact


def test_single_segment_keys_are_never_emptied():
    assert strip_prefix({"module.": 1, "module.a": 2}) == {"module.": 1, "module.a": 2}


def test_detect_report_json():
    sd = {"module._orig_mod.a.w": 1, "module._orig_mod.b._fsdp_wrapped_module.w": 2}
    report = detect_prefixes(sd)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["leading"] == {"module.": 2, "_orig_mod.": 2}
    assert data["inner"] == {"_fsdp_wrapped_module.": 1}
    assert data["default_strip"] == ["module.", "_orig_mod."]
    assert "on 2 of 2 keys" in report.summary()
    assert strip_prefix(sd) == {"a.w": 1, "b.w": 2}


def test_detect_rejects_single_string():
    with pytest.raises(TypeError):
        detect_prefixes("module.a")


# --------------------------------------------------------------------------- align


class Shaped:
    """A value that only has a shape (like ckptfix's lazy tensor records)."""

    def __init__(self, *shape: int) -> None:
        self.shape = shape


def test_align_dataparallel_checkpoint_into_lightning_module():
    net = trained_net()
    sd = nn.DataParallel(net).state_dict()
    target = LightningLike(Net())
    new, report = align_state_dict(sd, target)
    assert report.rename == "replace 'module.' with 'model.'"
    assert report.exact and report.applied and not report.ambiguous
    assert report.shapes_compared
    target.load_state_dict(new, strict=True)
    assert metadata(new) == metadata(LightningLike(net).state_dict())
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(net(x), target.eval().model(x))


@pytest.mark.parametrize(
    ("wrap", "rename"),
    [
        (lambda m: nn.DataParallel(compiled(m)), "strip 'module._orig_mod.'"),
        (lambda m: compiled(m), "strip '_orig_mod.'"),
        (lambda m: m, "no change"),
    ],
)
def test_align_into_plain_module(wrap, rename):
    net = trained_net()
    new, report = align_state_dict(wrap(net).state_dict(), Net())
    assert report.rename == rename and report.exact
    assert_loads_bit_identical(net, new)


def test_align_plain_into_dataparallel_adds_prefix():
    net = trained_net()
    new, report = align_state_dict(net.state_dict(), nn.DataParallel(Net()))
    assert report.rename == "add 'module.'" and report.exact
    nn.DataParallel(Net()).load_state_dict(new, strict=True)


def test_align_removes_inner_segments():
    sd = {"enc._fsdp_wrapped_module.w": Shaped(2), "head.w": Shaped(3)}
    new, report = align_state_dict(sd, {"enc.w": Shaped(2), "head.w": Shaped(3)})
    assert list(new) == ["enc.w", "head.w"]
    assert report.rename == "remove inner wrapper segments" and report.exact


def test_align_against_key_list_reports_missing_and_unexpected():
    sd = {"module.fc.weight": 1, "module.fc.bias": 2, "module.extra.w": 3}
    new, report = align_state_dict(sd, ["fc.weight", "fc.bias", "head.weight"])
    assert list(new) == ["fc.weight", "fc.bias", "extra.w"]
    assert report.rename == "strip 'module.'"
    assert report.matched == ("fc.weight", "fc.bias")
    assert report.missing == ("head.weight",)
    assert report.unexpected == ("extra.w",)
    assert not report.shapes_compared and report.shape_mismatches == ()
    assert not report.exact
    data = json.loads(json.dumps(report.to_dict()))
    assert data["matched_count"] == 2 and data["exact"] is False


def test_align_shape_mismatch_reported():
    sd = {"module.fc.weight": Shaped(3, 4), "module.fc.bias": Shaped(3)}
    target = {"fc.weight": Shaped(5, 4), "fc.bias": Shaped(3)}
    new, report = align_state_dict(sd, target)
    assert list(new) == ["fc.weight", "fc.bias"]
    assert report.shape_mismatches == (("fc.weight", (3, 4), (5, 4)),)
    mismatch = report.shape_mismatches[0]
    assert mismatch.key == "fc.weight" and mismatch.checkpoint_shape == (3, 4) and mismatch.target_shape == (5, 4)
    assert not report.exact
    assert report.to_dict()["shape_mismatches"] == [
        {"key": "fc.weight", "checkpoint_shape": [3, 4], "target_shape": [5, 4]}
    ]


def test_align_real_shape_mismatch_from_torch():
    sd = nn.DataParallel(nn.Linear(4, 3)).state_dict()
    _, report = align_state_dict(sd, nn.Linear(4, 5))
    assert [m.key for m in report.shape_mismatches] == ["weight", "bias"]
    assert report.shape_mismatches[0].target_shape == (5, 4)


def test_align_shapes_break_name_ties():
    # 'a.' and 'b.' both match the target names; only 'b.' matches the shapes
    sd = {"a.w": Shaped(2), "b.w": Shaped(3)}
    new, report = align_state_dict(sd, {"w": Shaped(3)})
    assert list(new) == ["a.w", "w"] and report.rename.startswith("strip 'b.'")
    assert not report.ambiguous


def test_align_ambiguous_returns_unchanged():
    sd = {"a.w": 1, "b.w": 2}
    new, report = align_state_dict(sd, ["w"])
    assert report.ambiguous and not report.applied
    assert new == sd and new is not sd
    assert {c.rename for c in report.candidates} >= {
        "strip 'a.' (on the 1 of 2 keys that carry it)",
        "strip 'b.' (on the 1 of 2 keys that carry it)",
    }
    assert "ambiguous" in report.summary()
    assert json.loads(json.dumps(report.to_dict()))["ambiguous"] is True


def test_align_same_pairing_is_not_ambiguous():
    # stripping 'module.' or 'module.enc.'->'enc.' pair the same keys: one answer
    sd = {"module.enc.w": 1, "module.dec.w": 2}
    new, report = align_state_dict(sd, ["enc.w"])
    assert not report.ambiguous
    assert report.rename == "strip 'module.'"
    assert list(new) == ["enc.w", "dec.w"] and report.unexpected == ("dec.w",)


def test_align_nothing_matches():
    new, report = align_state_dict({"x.a": 1}, ["y.b"])
    assert new == {"x.a": 1} and report.rename == "no change" and not report.ambiguous
    assert report.candidates == ()


def test_align_custom_prefixes_and_replace():
    sd = {"backbone.layer1.w": 1, "backbone.layer2.w": 2, "head.w": 3}
    new, report = align_state_dict(sd, ["encoder.layer1.w", "encoder.layer2.w", "head.w"])
    assert report.rename == "replace 'backbone.' with 'encoder.' (on the 2 of 3 keys that carry it)"
    assert report.exact and list(new) == ["encoder.layer1.w", "encoder.layer2.w", "head.w"]


def test_align_skips_colliding_candidates():
    sd = {"module.w": 1, "w": 2}
    new, report = align_state_dict(sd, ["w", "v"])
    assert new == sd and report.matched == ("w",)


def test_align_rejects_bad_target():
    with pytest.raises(TypeError):
        align_state_dict({"a": 1}, "a")
    with pytest.raises(TypeError):
        align_state_dict({"a": 1}, [1, 2])


def test_align_does_not_mutate():
    net = trained_net()
    sd = nn.DataParallel(net).state_dict()
    keys, meta = list(sd), metadata(sd)
    align_state_dict(sd, Net())
    assert list(sd) == keys and metadata(sd) == meta
