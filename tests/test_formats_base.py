"""ckptfix.formats.base: one Format vocabulary, typed per-format details, the TorchScript state dict.

torch is the oracle for what each file holds (``torch.jit.load(...).state_dict()`` for TorchScript).
"""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest
import torch

import ckptfix.formats
from ckptfix import load_checkpoint
from ckptfix.formats import (
    DcpDetails,
    Format,
    LegacyDetails,
    PickleDetails,
    SafetensorsDetails,
    ShardedDetails,
    TorchScriptDetails,
    ZipDetails,
    read_checkpoint,
    sniff,
)
from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint


def test_format_is_a_str_that_json_writes_as_its_value() -> None:
    assert Format.DCP == "dcp" and "torch-zip" == Format.TORCH_ZIP
    assert f"{Format.TORCH_LEGACY}" == str(Format.TORCH_LEGACY) == "torch-legacy"
    assert json.dumps({"format": Format.SAFETENSORS}) == '{"format": "safetensors"}'
    assert {"torchscript": 1}.get(Format.TORCHSCRIPT) == 1  # hashes as its value
    assert Format("sharded") is Format.SHARDED


def test_sniff_and_reader_use_one_vocabulary(ckpt) -> None:
    """What sniff says is what the reader records, for every format."""
    built = [
        ckpt.plain(),
        ckpt.legacy(),
        ckpt.safetensors(),
        ckpt.sharded_bin(),
        ckpt.sharded_safetensors(),
        ckpt.dcp(),
        ckpt.torchscript(),
        ckpt.weird_root(),
    ]
    for b in built:
        kind = sniff(str(b.path))
        assert isinstance(kind, Format)
        cf = read_checkpoint(b.path)
        assert cf.format is kind, b.path
        assert inspect_checkpoint(b.path).format is kind
        assert scan_checkpoint(b.path).format is kind


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_sniff_tells_legacy_torch_save_from_a_bare_pickle(tmp_path: Path, protocol: int) -> None:
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    bare = tmp_path / "bare.pkl"
    bare.write_bytes(pickle.dumps({"epoch": 3, "lr": 0.1}, protocol=protocol))
    assert sniff(str(legacy)) is Format.TORCH_LEGACY
    assert sniff(str(bare)) is Format.PICKLE
    assert read_checkpoint(legacy).format is Format.TORCH_LEGACY
    assert read_checkpoint(bare).format is Format.PICKLE
    # a bare pickle of the magic number's type but another value, and of torch's magic itself
    from ckptfix.formats.legacy import MAGIC_NUMBER

    other = tmp_path / "int.pkl"
    other.write_bytes(pickle.dumps(MAGIC_NUMBER + 1, protocol=protocol))
    assert sniff(str(other)) is Format.PICKLE


def test_sniff_says_sharded_for_an_index_and_its_directory(ckpt) -> None:
    b = ckpt.sharded_safetensors()
    assert sniff(str(b.path)) is Format.SHARDED
    assert sniff(str(b.path.parent)) is Format.SHARDED


def test_details_are_typed_per_format(ckpt) -> None:
    z = read_checkpoint(ckpt.plain().path)
    assert type(z.details) is ZipDetails and z.details.root and z.details.byteorder == "little"
    assert z.details.root + "data.pkl" in z.details.members
    leg = read_checkpoint(ckpt.legacy().path)
    assert isinstance(leg.details, LegacyDetails)
    assert leg.details.pickle_start < leg.details.pickle_end and leg.details.storage_keys
    st = read_checkpoint(ckpt.safetensors(metadata={"format": "pt"}).path)
    assert isinstance(st.details, SafetensorsDetails) and st.details.metadata == {"format": "pt"}
    sh = read_checkpoint(ckpt.sharded_bin().path)
    assert isinstance(sh.details, ShardedDetails)
    assert sh.details.shard_format is Format.TORCH_ZIP
    assert set(sh.details.shards) == set(sh.details.index.shards) == set(sh.details.index.weight_map.values())
    d = read_checkpoint(ckpt.dcp().path)
    assert isinstance(d.details, DcpDetails) and d.details.summary["tensors"] > 0
    assert inspect_checkpoint(ckpt.dcp("d2").path).dcp == d.details.summary
    ts = read_checkpoint(ckpt.torchscript().path)
    assert isinstance(ts.details, TorchScriptDetails) and ts.details.state_dict


def test_details_as_checks_the_kind(ckpt) -> None:
    cf = read_checkpoint(ckpt.safetensors().path)
    assert cf.details_as(SafetensorsDetails) is cf.details
    with pytest.raises(TypeError, match="safetensors checkpoint has no ZipDetails"):
        cf.details_as(ZipDetails)


def test_bare_pickle_details(tmp_path: Path) -> None:
    p = tmp_path / "args.bin"
    p.write_bytes(pickle.dumps({"lr": 0.1}, protocol=2))
    cf = read_checkpoint(p)
    assert isinstance(cf.details, PickleDetails) and cf.details.pickle_end == p.stat().st_size


def test_every_format_has_its_typed_details_and_no_untyped_extra(ckpt) -> None:
    """Each reader records its own details class; there is no ``extra`` dict to read by key."""
    z = read_checkpoint(ckpt.plain().path)
    assert z.details_as(ZipDetails).root.endswith("/") and not hasattr(z, "extra")
    assert isinstance(read_checkpoint(ckpt.legacy().path).details, LegacyDetails)
    assert isinstance(read_checkpoint(ckpt.safetensors().path).details, SafetensorsDetails)
    assert isinstance(read_checkpoint(ckpt.sharded_bin().path).details, ShardedDetails)
    assert isinstance(read_checkpoint(ckpt.dcp().path).details, DcpDetails)
    ts = read_checkpoint(ckpt.torchscript().path)
    assert ts.details_as(TorchScriptDetails).state_dict is not None and ts.state_root is ts.details.state_dict


def test_state_dict_covers_torchscript(ckpt) -> None:
    b = ckpt.torchscript()
    cf = read_checkpoint(b.path)
    key_path, sd = cf.state_dict()
    want = torch.jit.load(str(b.path), map_location="cpu").state_dict()
    assert key_path == () and list(sd) == list(want)
    for name, rec in sd.items():
        assert rec.dtype == str(want[name].dtype).removeprefix("torch.")
        assert tuple(rec.shape) == tuple(want[name].shape)
    lc = load_checkpoint(b.path)
    assert lc.format is Format.TORCHSCRIPT
    for name, t in want.items():
        assert torch.equal(lc.state_dict[name], t)


def test_format_modules_import_base_not_the_package() -> None:
    """No format reader imports ``ckptfix.formats`` (whose ``__init__`` imports them): no cycle.  ``layouts.py``
    (framework folders, above the readers: no reader and not ``__init__`` imports it) and ``dtensor_ranks.py``
    (a layout's reader of whole rank files, which reads each with ``read_checkpoint``, inside a function) may."""
    root = Path(ckptfix.formats.__file__).parent
    bad = []
    for f in sorted(root.glob("*.py")):
        if f.name in ("__init__.py", "layouts.py", "dtensor_ranks.py"):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "ckptfix.formats":
                bad.append(f.name)
            if isinstance(node, ast.Import) and any(a.name == "ckptfix.formats" for a in node.names):
                bad.append(f.name)
    assert bad == []
