"""Framework folders from someone else: hostile sidecars, symlinks, lying or broken config files.

Each test builds its hostile folder at test time from the framework-written fixtures in
tests/fixtures/frameworks/ (nothing hostile is committed).  Promises checked: no code from the folder
runs, ``scan`` never says "safe" for a pickle torch.load or a tokenizer would unpickle, a bad folder
gets one ``Error:`` line with a distinct exit code (no internal error), and nothing hangs.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from helpers import run_cli

FW = Path(__file__).resolve().parent / "fixtures" / "frameworks"


class _Payload:
    """Pickles to ``os.system("touch MARKER")``: never unpickled by the tests or by ckptfix."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _plant(path: Path, marker: Path, protocol: int = 2) -> None:
    path.write_bytes(pickle.dumps(_Payload(marker), protocol=protocol))


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / "folder"
    shutil.copytree(FW / name, dst)
    return dst


def _scan_flags(folder: Path, marker: Path) -> None:
    p = run_cli("scan", str(folder), "--json")
    assert p.returncode == 11, (p.stdout, p.stderr)
    assert "system" in p.stdout  # the payload's global is named
    assert "Traceback" not in p.stderr
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, 1])
def test_scan_flags_old_protocol_pickle_sidecar(tmp_path: Path, protocol: int) -> None:
    """A protocol-0 pickle looks like text: it must be scanned, not skipped as a text file."""
    d = _copy("trainer/checkpoint-2", tmp_path)
    marker = tmp_path / "MARK"
    for n in ("training_args.bin", "rng_state.pth", "optimizer.pt", "scheduler.pt"):
        (d / n).unlink()
    _plant(d / "rng_state.pth", marker, protocol)
    _scan_flags(d, marker)


def test_scan_flags_pickled_vocab(tmp_path: Path) -> None:
    """``vocab.pkl`` (TransfoXL-style tokenizers unpickle it) is a pickle, whatever its role."""
    d = _copy("hf_llama_bin", tmp_path)
    marker = tmp_path / "MARK"
    _plant(d / "vocab.pkl", marker)
    _scan_flags(d, marker)


def test_scan_flags_bin_weights_beside_safetensors(tmp_path: Path) -> None:
    """A ``pytorch_model.bin`` beside ``model.safetensors`` is loaded with ``use_safetensors=False``: scan it."""
    d = _copy("trainer/checkpoint-2", tmp_path)
    marker = tmp_path / "MARK"
    for n in ("training_args.bin", "rng_state.pth", "optimizer.pt", "scheduler.pt"):
        (d / n).unlink()
    _plant(d / "pytorch_model.bin", marker)
    _scan_flags(d, marker)


def test_scan_flags_shard_not_in_index(tmp_path: Path) -> None:
    """A shard-named file the index does not name is still a pickle in the folder."""
    d = _copy("hf_gpt2_sharded", tmp_path)
    marker = tmp_path / "MARK"
    _plant(d / "pytorch_model-00001-of-00009.bin", marker)
    _scan_flags(d, marker)


def test_scan_does_not_follow_symlinked_dir_outside(tmp_path: Path) -> None:
    """A sub-folder symlink to ``/usr`` is not walked (unbounded, and not the folder's own files)."""
    d = _copy("accelerate", tmp_path)
    os.symlink("/usr", d / "sub")
    p = run_cli("scan", str(d), "--json", timeout=120)
    assert "internal error" not in p.stderr and "Traceback" not in p.stderr
    assert p.returncode in (0, 11), p.stderr
    notes = json.loads(p.stdout)["notes"]
    assert any("/usr" in n and "not followed" in n for n in notes)  # it says what it did not follow


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
@pytest.mark.parametrize("name", ["config.json", "trainer_state.json", "optimizer.pt"])
def test_fifo_in_folder_does_not_hang(tmp_path: Path, name: str) -> None:
    d = _copy("trainer/checkpoint-2", tmp_path)
    (d / name).unlink()
    os.mkfifo(d / name)
    for cmd in ("inspect", "scan"):
        p = run_cli(cmd, str(d), timeout=60)
        assert "internal error" not in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("name", ["config.json", "trainer_state.json"])
def test_deeply_nested_json_is_no_internal_error(tmp_path: Path, name: str) -> None:
    d = _copy("trainer/checkpoint-2", tmp_path)
    (d / name).write_text("[" * 200_000, encoding="utf-8")
    for args in (("inspect", str(d)), ("convert", str(d), "-o", str(tmp_path / "o.safetensors"))):
        p = run_cli(*args)
        assert p.returncode == 0, p.stderr  # the weights are fine; the JSON is described as unreadable
        assert "internal error" not in p.stderr and "Traceback" not in p.stderr


def test_marker_never_written(tmp_path: Path) -> None:
    """Every command on a folder full of payloads: nothing runs."""
    d = _copy("accelerate", tmp_path)
    marker = tmp_path / "MARK"
    for n in os.listdir(d):
        if n.endswith((".pkl", ".bin")) and n != "model.safetensors":
            _plant(d / n, marker)
    for args in (
        ("inspect", str(d)),
        ("scan", str(d)),
        ("convert", str(d), "-o", str(tmp_path / "o.safetensors"), "--include-optimizer"),
    ):
        p = run_cli(*args)
        assert "Traceback" not in p.stderr, p.stderr
    code = f"import ckptfix; ckptfix.load_anywhere({str(d)!r})"
    import subprocess

    subprocess.run(
        [sys.executable, "-c", code], capture_output=True, env={**os.environ, "PYTHONPATH": str(FW.parents[2])}
    )
    assert not marker.exists()


def test_convert_names_second_model_it_leaves_out(tmp_path: Path) -> None:
    """accelerate with two models (``model_1.safetensors``): convert writes the first and says the second is left."""
    import torch
    from safetensors.torch import load_file, save_file

    d = _copy("accelerate", tmp_path)
    save_file({"w": torch.ones(2, 2)}, str(d / "model_1.safetensors"))
    out = tmp_path / "o.safetensors"
    p = run_cli("convert", str(d), "-o", str(out), "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert "model_1.safetensors" in rep["not_converted"]
    p = run_cli("convert", str(d), "-o", str(tmp_path / "o2.safetensors"))
    assert p.returncode == 0 and "model_1.safetensors" in p.stderr, p.stderr  # the text report warns too
    assert "w" not in load_file(str(out))


def _break_index(d: Path, how: str) -> None:
    idx = d / "model.safetensors.index.json"
    if how == "missing":
        (d / "model-00002-of-00002.safetensors").unlink()
    elif how == "outside":
        doc = json.loads(idx.read_text(encoding="utf-8"))
        doc["weight_map"][next(iter(doc["weight_map"]))] = "../../etc/passwd"
        idx.write_text(json.dumps(doc), encoding="utf-8")
    elif how == "link":
        (d / "model-00002-of-00002.safetensors").unlink()
        os.symlink("/etc/passwd", d / "model-00002-of-00002.safetensors")
    elif how == "text":
        idx.write_text("nope\n", encoding="utf-8")
    elif how == "deep":
        idx.write_text('{"weight_map":' + "[" * 100_000, encoding="utf-8")


@pytest.mark.parametrize("how", ["missing", "outside", "link", "text", "deep"])
def test_scan_folder_with_broken_index_is_never_safe(tmp_path: Path, how: str) -> None:
    """The folder's own weights failing to scan is an error (as for the index alone), not a skipped text file."""
    d = _copy("hf_gpt2_sharded", tmp_path)
    _break_index(d, how)
    alone = run_cli("scan", str(d / "model.safetensors.index.json"))
    p = run_cli("scan", str(d))
    assert p.returncode != 0 and p.returncode == alone.returncode, (p.stdout, p.stderr, alone.stderr)
    assert p.stderr.startswith("Error:") and "Traceback" not in p.stderr and "internal error" not in p.stderr


def test_scan_sharded_bin_folder_scans_its_shards(tmp_path: Path) -> None:
    """A ``save_pretrained`` folder of ``.bin`` shards + ``pytorch_model.bin.index.json``: the index is the
    weights, so its shards are scanned (the index is JSON, but not a file to skip)."""
    d = tmp_path / "folder"
    d.mkdir()
    marker = tmp_path / "MARK"
    shutil.copy(FW / "hf_llama_bin" / "config.json", d / "config.json")
    _plant(d / "pytorch_model-00001-of-00001.bin", marker)
    idx = {"metadata": {}, "weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(idx), encoding="utf-8")
    _scan_flags(d, marker)


def _odd_optimizer(tmp_path: Path, state: dict) -> Path:
    import torch

    d = _copy("accelerate", tmp_path)
    torch.save({"state": state, "param_groups": [{"params": list(state)}]}, str(d / "optimizer.bin"))
    return d


def test_include_optimizer_name_collision_is_a_key_conflict(tmp_path: Path) -> None:
    """State keys ``1`` and ``"1"`` (or ``"a.b"`` + ``exp_avg`` and ``"a"`` + ``"b.exp_avg"``) flatten to one name."""
    import torch

    for i, state in enumerate(
        (
            {1: {"m": torch.ones(2)}, "1": {"m": torch.ones(3)}},
            {"a.b": {"exp_avg": torch.ones(2)}, "a": {"b.exp_avg": torch.zeros(2)}},
        )
    ):
        d = _odd_optimizer(tmp_path / str(i), state)
        out = tmp_path / f"o{i}.safetensors"
        p = run_cli("convert", str(d), "-o", str(out), "--include-optimizer")
        assert p.returncode == 6, p.stderr  # KeyConflictError, before anything is written
        assert p.stderr.startswith("Error:") and "collide" in p.stderr
        assert not out.exists()


def test_include_optimizer_tensors_under_tuple_keys_are_not_dropped_silently(tmp_path: Path) -> None:
    import torch

    d = _odd_optimizer(tmp_path, {(0, 1): {"exp_avg": torch.ones(2)}})
    out = tmp_path / "o.safetensors"
    p = run_cli("convert", str(d), "-o", str(out), "--include-optimizer")
    assert p.returncode == 8, p.stderr  # UnsupportedError: tensors ckptfix cannot name
    assert "tuple" in p.stderr and not out.exists()


def test_load_optimizer_with_odd_keys_keeps_every_tensor(tmp_path: Path) -> None:
    """load_anywhere / inspect of an optimizer file: float and None state keys are named, colliding keys refused."""
    import torch

    from ckptfix import load_anywhere
    from ckptfix.errors import KeyConflictError

    p = tmp_path / "f.bin"
    torch.save({"state": {0.5: {"m": torch.ones(2)}, None: {"m": torch.zeros(1)}}, "param_groups": []}, str(p))
    assert sorted(load_anywhere(str(p))) == ["state.0.5.m", "state.None.m"]
    q = tmp_path / "c.bin"
    torch.save({"state": {1: {"m": torch.ones(2)}, "1": {"m": torch.ones(3)}}, "param_groups": []}, str(q))
    with pytest.raises(KeyConflictError):
        load_anywhere(str(q))
    r = run_cli("inspect", str(q))
    assert r.returncode == 6 and r.stderr.startswith("Error:"), r.stderr


@pytest.mark.parametrize("name", ["config.json", "trainer_state.json", "optimizer.pt", "rng_state.pth"])
def test_convert_never_overwrites_a_file_of_the_input_folder(tmp_path: Path, name: str) -> None:
    """``-o FOLDER/config.json --force``: the folder is the input (its config.json decides ties), so refused."""
    d = _copy("trainer/checkpoint-2", tmp_path)
    before = (d / name).read_bytes()
    p = run_cli("convert", str(d), "-o", str(d / name), "--force")
    assert p.returncode == 9, p.stderr  # OutputError
    assert p.stderr.startswith("Error:") and "input" in p.stderr
    assert (d / name).read_bytes() == before


def test_stray_metadata_folder_does_not_hide_a_trainer_folder(tmp_path: Path) -> None:
    """A ``.metadata`` *folder* (IDEs, dvc) is no DCP metadata file: the Trainer layout still wins."""
    d = _copy("trainer/checkpoint-2", tmp_path)
    (d / ".metadata").mkdir()
    p = run_cli("inspect", str(d), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["framework"]["layout"] == "hf-trainer"


def test_output_dir_of_checkpoints_names_them(tmp_path: Path) -> None:
    """Trainer's ``output_dir`` (``checkpoint-500/``, ``checkpoint-1000/``): the message names the sub-folders."""
    out = tmp_path / "out"
    for n in (500, 1000):
        shutil.copytree(FW / "trainer" / "checkpoint-2", out / f"checkpoint-{n}")
    for cmd in ("inspect", "scan", "convert"):
        p = run_cli(cmd, str(out))
        assert p.returncode == 3, p.stderr
        assert "checkpoint-1000" in p.stderr and "checkpoint-500" in p.stderr, p.stderr
        assert p.stderr.index("checkpoint-1000") < p.stderr.index("checkpoint-500")  # the newest first


def test_unused_weight_files_are_listed_and_named_by_convert(tmp_path: Path) -> None:
    """A ``pytorch_model.bin`` beside ``model.safetensors`` (which wins, as in from_pretrained): inspect lists it,
    convert says it was not converted, scan scans it once."""
    d = _copy("trainer/checkpoint-2", tmp_path)
    shutil.copy(FW / "hf_llama_bin" / "pytorch_model.bin", d / "pytorch_model.bin")
    p = run_cli("inspect", str(d), "--json")
    files = {f["file"]: f["role"] for f in json.loads(p.stdout)["framework"]["files"]}
    assert files.get("pytorch_model.bin") == "weights-unused", files
    p = run_cli("convert", str(d), "-o", str(tmp_path / "o.safetensors"), "--json")
    assert "pytorch_model.bin" in json.loads(p.stdout)["not_converted"]
    p = run_cli("scan", str(d), "--json")
    pickles = json.loads(p.stdout)["pickles"]
    assert sum(q.startswith("pytorch_model.bin") for q in pickles) == 1, pickles


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
def test_links_out_of_the_folder_are_not_converted(tmp_path: Path, name: str) -> None:
    """A folder from someone else whose ``model.safetensors`` / ``optimizer.pt`` links to a file of yours:
    convert must not copy that file's tensors into an output (as for a sharded index's shards)."""
    d = _copy("trainer/checkpoint-2", tmp_path)
    private = tmp_path / "private"
    private.mkdir()
    shutil.move(str(d / name), private / name)
    os.symlink(private / name, d / name)
    out = tmp_path / "o.safetensors"
    p = run_cli("convert", str(d), "-o", str(out), "--include-optimizer")
    assert p.returncode == 8, p.stderr  # UnsupportedError, as for a shard linking outside its index's folder
    assert p.stderr.startswith("Error:") and "outside" in p.stderr and not out.exists()
    if name == "model.safetensors":
        from ckptfix import load_anywhere
        from ckptfix.errors import UnsupportedError

        with pytest.raises(UnsupportedError):
            load_anywhere(str(d))


def test_hub_cache_snapshot_links_are_followed(tmp_path: Path) -> None:
    """The Hugging Face hub cache links every file of ``snapshots/<rev>/`` to ``../../blobs/<hash>``: allowed."""
    src = FW / "hf_llama_bin"
    snap = tmp_path / "models--x" / "snapshots" / "abc"
    blobs = tmp_path / "models--x" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, n in enumerate(sorted(os.listdir(src))):
        shutil.copy(src / n, blobs / f"h{i}")
        os.symlink(Path("..") / ".." / "blobs" / f"h{i}", snap / n)
    p = run_cli("convert", str(snap), "-o", str(tmp_path / "o.safetensors"))
    assert p.returncode == 0, p.stderr


def test_scan_flags_old_protocol_pickle_as_the_weights(tmp_path: Path) -> None:
    d = _copy("hf_llama_bin", tmp_path)
    marker = tmp_path / "MARK"
    (d / "model.safetensors").unlink(missing_ok=True)
    _plant(d / "pytorch_model.bin", marker, protocol=0)
    _scan_flags(d, marker)
