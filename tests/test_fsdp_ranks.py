"""FSDP per-rank DTensor files (formats/dtensor_ranks, convert/dtensor_ranks) against torch's own gathering.

The fixtures (tests/fixtures/frameworks/make_fsdp_ranks.py) were written by torch 2.13 FSDP2 on gloo:
``fsdp_ranks/`` by accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer(use_dcp=False)`` on 2 ranks (an
uneven last shard, an empty shard, a weight sharded on dim 1, a plain buffer), ``fsdp_hsdp/`` by
``torch.save(model.state_dict())`` on a 2 x 2 mesh (``Replicate()``, ``Shard(0)``; verl's names, bf16).  The
oracle, ``*.expected.safetensors``, is ``DTensor.full_tensor()`` of every entry, gathered by the writer.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from ckptfix.errors import PartitionedCheckpointError, UnsupportedError, ZeroIncompleteError, ZeroMismatchError
from ckptfix.formats.dtensor_ranks import find_dtensor_ranks, read_dtensor_ranks
from ckptfix.ops.convert import convert

from helpers import run_cli

FIX = Path(__file__).parent / "fixtures" / "frameworks"
RANKS, HSDP = FIX / "fsdp_ranks", FIX / "fsdp_hsdp"


def _tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype code, shape, bytes) of a safetensors file, read by hand (torch-free)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    body = raw[8 + n :]
    return {k: (v["dtype"], v["shape"], body[v["data_offsets"][0] : v["data_offsets"][1]]) for k, v in header.items()}


@pytest.mark.parametrize("folder", [RANKS, HSDP], ids=["accelerate-2-ranks", "hsdp-2x2"])
def test_merged_bit_equal_to_full_tensor(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    r = convert(folder, out)
    assert r.verified and r.source_format == "fsdp-dtensor-ranks"
    got, exp = _tensors(out), _tensors(Path(f"{folder}.expected.safetensors"))
    assert sorted(got) == sorted(exp) and len(got) == 6
    for k in exp:
        assert got[k] == exp[k], k


def test_cli_convert_torch_free_and_the_optimizer_named(tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    r = run_cli("convert", str(RANKS), "-o", str(out), "--json", isolated=True)
    assert r.rc == 0, r.err
    assert r.torch_imported is False
    doc = json.loads(r.out)
    assert doc["source_format"] == "fsdp-dtensor-ranks" and doc["tensors"] == 6
    (left,) = doc["not_converted"]  # the optimizer's rank files: said, not silently left out
    assert left.startswith("optimizer_0_rank0.bin") and "--include-optimizer" in doc["not_converted"][left]


def test_include_optimizer_merges_its_shards(tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    r = convert(RANKS, out, include_optimizer=True)
    assert r.optimizer_tensors == 15 and not r.not_converted
    got, exp = _tensors(out), _tensors(FIX / "fsdp_ranks.optimizer.expected.safetensors")
    for k in exp:
        assert got["optimizer." + k] == exp[k], k


def test_load_anywhere_equals_full_tensor() -> None:
    pytest.importorskip("torch")
    import torch
    from safetensors.torch import load_file

    from ckptfix import load_anywhere

    for folder in (RANKS, HSDP):
        exp = load_file(f"{folder}.expected.safetensors")
        sd = load_anywhere(folder)
        assert sorted(sd) == sorted(exp)
        for k in exp:
            assert sd[k].dtype == exp[k].dtype and torch.equal(sd[k], exp[k]), k


def test_inspect_folder_and_one_rank_file() -> None:
    r = run_cli("inspect", str(RANKS), isolated=False)
    assert r.rc == 0, r.err
    assert "fsdp-dtensor-ranks" in r.out and "6 tensors, 144 values" in r.out
    r = run_cli("inspect", str(HSDP / "model_world_size_4_rank_2.pt"), isolated=False)
    assert r.rc == 0, r.err
    assert "5 DTensor shards of rank 2 of 4" in r.out
    r = run_cli("inspect", str(RANKS / "pytorch_model_fsdp_0_rank0.bin"), "--json", isolated=False)
    assert json.loads(r.out)["dtensor_shards"] == {"shards": 5, "rank": 0, "world": 2}


def test_one_rank_file_alone_is_refused_naming_the_folder(tmp_path: Path) -> None:
    one = RANKS / "pytorch_model_fsdp_0_rank1.bin"
    with pytest.raises(PartitionedCheckpointError, match="of rank 1 of 2") as e:
        convert(one, tmp_path / "o.safetensors")
    assert f"ckptfix convert {RANKS}" in str(e.value) and "dense in torch" not in str(e.value)
    r = run_cli("convert", str(one), "-o", str(tmp_path / "o.safetensors"), isolated=False)
    assert r.rc == PartitionedCheckpointError.exit_code and not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize(
    ("folder", "gone", "named"),
    [
        (RANKS, "pytorch_model_fsdp_0_rank1.bin", "rank(s) 1 of 2"),  # the last rank: known from the mesh
        (HSDP, "model_world_size_4_rank_2.pt", "rank(s) 2 of 4"),
    ],
)
def test_a_missing_rank_is_named(folder: Path, gone: str, named: str, tmp_path: Path) -> None:
    d = tmp_path / folder.name
    shutil.copytree(folder, d)
    (d / gone).unlink()
    with pytest.raises(ZeroIncompleteError, match=re.escape(named)) as e:
        read_dtensor_ranks(find_dtensor_ranks(d))
    assert gone in str(e.value)
    r = run_cli("convert", str(d), "-o", str(tmp_path / "o.safetensors"), isolated=False)
    assert r.rc == ZeroIncompleteError.exit_code and gone in r.err
    assert not (tmp_path / "o.safetensors").exists()


def test_a_rank_file_copied_over_another_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "r"
    shutil.copytree(RANKS, d)
    shutil.copy(d / "pytorch_model_fsdp_0_rank0.bin", d / "pytorch_model_fsdp_0_rank1.bin")
    with pytest.raises(ZeroMismatchError, match="rank 0's shard"):
        convert(d, tmp_path / "o.safetensors")


def _rewrite_pickle(src: Path, dst: Path, old: bytes, new: bytes) -> None:
    """Copy a torch zip archive with its data.pkl's bytes ``old`` replaced by ``new`` (members stored)."""
    zin = zipfile.ZipFile(src)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/data.pkl"):
                assert old in data
                data = data.replace(old, new)
            zout.writestr(zipfile.ZipInfo(info.filename, date_time=info.date_time), data)
    dst.write_bytes(buf.getvalue())


@pytest.mark.parametrize(("placement", "why"), [(b"_StridedShard", "_StridedShard"), (b"Partial", "Partial")])
def test_strided_and_partial_placements_are_refused(placement: bytes, why: str, tmp_path: Path) -> None:
    d = tmp_path / "r"
    shutil.copytree(RANKS, d)
    for rk in (0, 1):
        f = d / f"pytorch_model_fsdp_0_rank{rk}.bin"
        _rewrite_pickle(f, f, b"placement_types\nShard\n", b"placement_types\n" + placement + b"\n")
    with pytest.raises(UnsupportedError, match=why) as e:
        convert(d, tmp_path / "o.safetensors")
    assert "full_tensor()" in str(e.value)


def test_gloo_fsdp2_written_now_merges_bit_equal(fsdp2_run: Path, tmp_path: Path) -> None:
    """Files the installed torch writes (2 gloo ranks, FSDP2), merged torch-free == full_tensor() in the writer."""
    out = tmp_path / "m.safetensors"
    convert(fsdp2_run, out)
    assert _tensors(out) == _tensors(Path(f"{fsdp2_run}.expected.safetensors"))


@pytest.fixture(scope="session")
def fsdp2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank FSDP2 save with the installed torch (and accelerate's helpers when accelerate is installed)."""
    pytest.importorskip("torch.distributed.fsdp")
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("make_fsdp_ranks", FIX / "make_fsdp_ranks.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_fsdp_ranks", mod)
    spec.loader.exec_module(mod)
    kind = "accelerate" if importlib.util.find_spec("accelerate") else "plain"
    out = tmp_path_factory.mktemp("fsdp2") / "run"
    mod.run(kind, str(out), 2)
    return out


FULL, DCP = FIX / "accelerate_fsdp_full", FIX / "accelerate_fsdp_dcp"


def test_accelerate_fsdp_full_state_dict_folder_is_its_weights(tmp_path: Path) -> None:
    """FULL_STATE_DICT: pytorch_model_fsdp.bin is the folder's model (it was exit 15 'no model weights in it')."""
    out = tmp_path / "m.safetensors"
    r = run_cli("convert", str(FULL), "-o", str(out), "--include-optimizer", "--json", isolated=False)
    assert r.rc == 0, r.err
    doc = json.loads(r.out)
    got, exp = _tensors(out), _tensors(Path(f"{FULL}.expected.safetensors"))
    assert {k: v for k, v in got.items() if not k.startswith("optimizer.")} == exp
    assert doc["optimizer_tensors"] == 15  # optimizer.bin (rank 0's full optimizer state)
    assert "pytorch_model_fsdp_1.bin" in doc["not_converted"]  # the second model: named, with its command
    r = run_cli("inspect", str(FULL), "--json", isolated=False)
    assert json.loads(r.out)["framework"]["weights"] == "pytorch_model_fsdp.bin"


def test_accelerate_fsdp_sharded_dcp_folder_names_its_optimizer_folder(tmp_path: Path) -> None:
    """SHARDED_STATE_DICT with DCP: the model is pytorch_model_fsdp_0/; optimizer_0/ (a DCP folder) is said to be
    left out, in the report and its JSON, with --include-optimizer too (it was left out silently)."""
    out = tmp_path / "m.safetensors"
    r = run_cli("convert", str(DCP), "-o", str(out), "--include-optimizer", "--json", isolated=False)
    assert r.rc == 0, r.err
    assert _tensors(out) == _tensors(Path(f"{DCP}.expected.safetensors"))
    why = json.loads(r.out)["not_converted"]["optimizer_0/"]
    assert "DCP folder" in why and "--include-optimizer" in why
    r = run_cli("convert", str(DCP), "-o", str(tmp_path / "n.safetensors"), isolated=False)
    assert r.rc == 0 and "optimizer_0/" in r.err


UNFLAT = FIX / "dcp_unflattened"


@pytest.mark.parametrize("command", [("inspect",), ("convert", "-o", "OUT")])
def test_dcp_unflattened_dtensor_entry_is_partial(command: tuple[str, ...], tmp_path: Path) -> None:
    """dcp.save(planner=DefaultSavePlanner(flatten_state_dict=False)) of an FSDP2 model: 'model' is one pickled
    object of one rank's DTensor shards (inspect/convert said 'no state dict')."""
    args = [str(tmp_path / "o.safetensors") if a == "OUT" else a for a in command]
    r = run_cli(args[0], str(UNFLAT), *args[1:], isolated=False)
    assert r.rc == PartitionedCheckpointError.exit_code, r.err
    assert "entry 'model' holds DTensor shards of one rank: partial" in r.err
    assert not (tmp_path / "o.safetensors").exists()


def test_dcp_unflattened_load_anywhere_says_partial_not_corrupt() -> None:
    pytest.importorskip("torch")
    from ckptfix import load_anywhere

    with pytest.raises(PartitionedCheckpointError, match="DTensor shards of one rank: partial"):
        load_anywhere(UNFLAT)
