"""torch's HuggingFaceStorageWriter output (formats/hfstorage, convert/hfstorage) against torch's consolidation.

The fixture (tests/fixtures/frameworks/hfstorage/, tests/fixtures/frameworks/make_hfstorage.py) was written by
torch 2.13 with 2 gloo ranks: row- and column-sharded, replicated (written by rank 1 only), 3-d and bf16 DTensors.
``expected/model-00001-of-00001.safetensors`` is what ``consolidate_safetensors_files`` wrote for it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckptfix.errors import CorruptCheckpointError
from ckptfix.formats.hfstorage import _merged_order, find_hf_storage, read_hf_storage
from ckptfix.ops.convert.hfstorage import convert_hf_storage

from helpers import run_cli

FIX = Path(__file__).parent / "fixtures" / "frameworks" / "hfstorage"
EXPECTED = FIX / "expected" / "model-00001-of-00001.safetensors"


def test_byte_identical_to_consolidate_safetensors_files(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    r = convert_hf_storage(find_hf_storage(FIX / "run"), out)
    assert r.verified and r.tensors == 7
    assert out.read_bytes() == EXPECTED.read_bytes()


def test_cli_convert_folder_torch_free(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    r = run_cli("convert", str(FIX / "run"), "-o", str(out), isolated=True)
    assert r.rc == 0, r.err
    assert r.torch_imported is False and "hf-storage-dcp" in r.err
    assert out.read_bytes() == EXPECTED.read_bytes()


def test_load_anywhere_gives_every_tensor() -> None:
    pytest.importorskip("torch")
    import torch
    from safetensors.torch import load_file

    from ckptfix import load_anywhere

    exp = load_file(str(EXPECTED))
    sd = load_anywhere(FIX / "run")
    assert list(sd) == list(exp) and len(sd) == 7  # not 4 of them
    for k in exp:
        assert sd[k].dtype == exp[k].dtype and torch.equal(sd[k], exp[k]), k


def test_missing_shard_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "run"
    shutil.copytree(FIX / "run", d)
    (d / "shard-00001-model-00001-of-00001.safetensors").unlink()  # rank 0's rows and columns
    with pytest.raises(CorruptCheckpointError, match="missing"):
        read_hf_storage(find_hf_storage(d))
    out = tmp_path / "o.safetensors"
    r = run_cli("convert", str(d), "-o", str(out))
    assert r.rc == CorruptCheckpointError.exit_code and r.err.startswith("Error: ") and len(r.err.splitlines()) == 1
    assert not out.exists()


def test_uncovered_rows_are_refused(tmp_path: Path) -> None:
    """Shards 1 and 3 of 3 (rank 1's renamed): the middle rows of a row-sharded tensor are nobody's."""
    d = tmp_path / "run"
    shutil.copytree(FIX / "run", d)
    (d / "shard-00002-model-00001-of-00001.safetensors").rename(d / "shard-00003-model-00001-of-00001.safetensors")
    with pytest.raises(CorruptCheckpointError, match="00002"):
        find_hf_storage(d)


def test_describe() -> None:
    from ckptfix.formats.hfstorage import describe

    lines = dict(describe(find_hf_storage(FIX / "run")))
    assert lines["shards"].startswith("2 file(s)") and lines["weights"].startswith("7 tensors")


def test_one_shard_alone_is_refused(tmp_path: Path) -> None:
    """Before: convert/load_anywhere of one shard gave a silently partial model (this rank's chunks only)."""
    shard = FIX / "run" / "shard-00001-model-00001-of-00001.safetensors"
    out = tmp_path / "o.safetensors"
    r = run_cli("convert", str(shard), "-o", str(out))
    assert r.rc == 8 and "pass the folder" in r.err and not out.exists()
    pytest.importorskip("torch")
    from ckptfix import load_anywhere
    from ckptfix.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="pass the folder"):
        load_anywhere(shard)


def test_not_hf_storage() -> None:
    assert find_hf_storage(FIX / "expected") is None
    assert find_hf_storage(EXPECTED) is None


def test_merged_order_keeps_every_shards_order() -> None:
    got = _merged_order([["a", "b", "d"], ["a", "c", "d"]])
    assert sorted(got) == ["a", "b", "c", "d"] and got[0] == "a" and got[-1] == "d"
    assert _merged_order([["b", "c"], ["a", "b"]]) == ["a", "b", "c"]
    assert _merged_order([["a"], ["z"]]) == ["a", "z"]


def test_a_rank_file_copied_over_another_is_refused(tmp_path: Path) -> None:
    """Issue 39 §2: three ranks split a (6, 4) tensor by rows (torch's own writer); rank 3's file is replaced
    by a copy of rank 1's.  The chunk sizes still add up to 24, but rows 0-1 are covered twice and rows 4-5 not
    at all: refused (exit 4), never an output with zeros or repeated rows."""
    pytest.importorskip("torch")
    from hfstorage_ranks import expected, write
    from safetensors.torch import load_file

    d = tmp_path / "run"
    write(str(d), 3)
    out = tmp_path / "ok.safetensors"
    r = run_cli("convert", str(d), "-o", str(out))  # the untampered folder converts right
    assert r.rc == 0, r.err
    import torch

    got, exp = load_file(str(out)), expected()
    assert all(torch.equal(got[k], exp[k]) for k in exp)
    shutil.copyfile(
        d / "shard-00001-model-00001-of-00001.safetensors", d / "shard-00003-model-00001-of-00001.safetensors"
    )
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        read_hf_storage(find_hf_storage(d))
    bad = tmp_path / "bad.safetensors"
    r = run_cli("convert", str(d), "-o", str(bad))
    assert r.rc == CorruptCheckpointError.exit_code and r.err.startswith("Error: ") and len(r.err.splitlines()) == 1
    assert "overlap" in r.err and not bad.exists()
