"""Tests for the bundled trainer (ckptfix.train) and the ``train`` command.

The checkpoints produced here (DP, DDP through real torchrun with 2 gloo
processes, compile, DCP, legacy, AMP) double as integration fixtures for the
loader: every one must load through ckptfix.ops.load and reproduce its probe
output bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch

from ckptfix.errors import TrainingError
from ckptfix.train import TrainConfig, read_manifest, train, verify_probe
from ckptfix.train.data import load_dataset, probe_batch, save_dataset, synthetic_dataset
from ckptfix.train.manual import naive_all_reduce, ring_all_reduce
from ckptfix.train.models import build_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from train_compare import compare_manual_to_single  # a harness, not in the wheel

from heavy import FSDP_SMALL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(train_samples=512, test_samples=256, quiet=True)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _entry(res, epoch=None):
    return res.checkpoints[-1] if epoch is None else [c for c in res.checkpoints if c["epoch"] == epoch][0]


def _load(path):
    from ckptfix.ops.load import load_checkpoint

    return load_checkpoint(path, map_location="cpu", allow_globals=(argparse.Namespace,))


# --------------------------------------------------------------------------- models and data


@pytest.mark.parametrize("name", ["lenet", "resnet"])
def test_models_output_shape_and_seeded_init(name):
    a, b = build_model(name, 3), build_model(name, 3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=False):
        assert ka == kb and torch.equal(va, vb)
    assert a(torch.zeros(5, 1, 28, 28)).shape == (5, 10)
    if name == "lenet":
        assert list(a.state_dict()) == [
            f"{m}.{p}" for m in ("conv1", "conv2", "fc1", "fc2") for p in ("weight", "bias")
        ]
    else:
        assert any(k.endswith("running_mean") for k in a.state_dict())


def test_synthetic_data_is_deterministic_and_well_formed():
    a, b = synthetic_dataset(7, 64, 32), synthetic_dataset(7, 64, 32)
    assert torch.equal(a.train_images, b.train_images) and torch.equal(a.test_labels, b.test_labels)
    assert a.train_images.dtype == torch.uint8 and a.train_images.shape == (64, 28, 28)
    assert a.train_labels.dtype == torch.int64
    assert not torch.equal(synthetic_dataset(8, 64, 32).train_images, a.train_images)
    x, _ = a.train_tensors()
    assert x.shape == (64, 1, 28, 28) and x.min() >= -1 and x.max() <= 1
    assert torch.equal(probe_batch(), probe_batch())


@pytest.mark.parametrize("ext", [".pt", ".npz"])
def test_data_file_round_trip_and_training(tmp_path, ext):
    ds = synthetic_dataset(1, 300, 100)
    path = str(tmp_path / f"data{ext}")
    save_dataset(ds, path)
    back = load_dataset(path)
    assert torch.equal(back.train_images, ds.train_images) and torch.equal(back.test_labels, ds.test_labels)
    res = train(TrainConfig(out=str(tmp_path / "run"), data=path, epochs=1, quiet=True))
    assert res.train_samples == 300


def test_data_file_without_test_split_and_bad_files(tmp_path):
    p = str(tmp_path / "d.pt")
    torch.save({"images": torch.zeros(10, 28, 28, dtype=torch.uint8), "labels": torch.zeros(10, dtype=torch.int64)}, p)
    ds = load_dataset(p)
    assert len(ds.train_labels) == 8 and len(ds.test_labels) == 2
    bad = str(tmp_path / "bad.pt")
    torch.save({"images": torch.zeros(10, 28, 28), "labels": torch.zeros(10, dtype=torch.int64)}, bad)
    with pytest.raises(TrainingError, match="uint8"):
        load_dataset(bad)
    torch.save({"x": 1}, bad)
    with pytest.raises(TrainingError, match="'images' and 'labels'"):
        load_dataset(bad)


def test_config_validation():
    with pytest.raises(TrainingError, match="--nproc only applies"):
        TrainConfig(mode="single", nproc=2).validate()
    with pytest.raises(TrainingError, match="manual mode"):
        TrainConfig(mode="manual", amp=True).validate()
    with pytest.raises(TrainingError, match="--show-split"):
        TrainConfig(mode="single", show_split=True).validate()
    with pytest.raises(TrainingError):
        TrainConfig(mode="nope").validate()


# --------------------------------------------------------------------------- in-process modes


def test_single_learns_and_writes_manifest_and_probe(tmp_path):
    res = train(TrainConfig(out=str(tmp_path), epochs=2, quiet=True))
    assert res.final_accuracy > 0.5, res.epochs  # chance is 0.1
    assert [c["epoch"] for c in res.checkpoints] == [1, 2]
    ckpt = torch.load(res.final_checkpoint, map_location="cpu", weights_only=True)
    assert set(ckpt) == {"epoch", "model_state_dict", "optimizer_state_dict", "args"}
    assert ckpt["epoch"] == 2 and isinstance(ckpt["args"], dict) and ckpt["args"]["mode"] == "single"
    assert next(iter(ckpt["model_state_dict"])) == "conv1.weight"
    man = read_manifest(str(tmp_path))
    e = man["checkpoints"][-1]
    for k in (
        "path",
        "mode",
        "device",
        "devices",
        "world_size",
        "save_style",
        "save_format",
        "expected_prefix",
        "amp",
        "compile",
        "legacy_format",
        "epoch",
        "probe",
    ):
        assert k in e
    assert e["expected_prefix"] == "" and e["world_size"] == 1 and e["devices"] == ["cpu"]
    side = torch.load(tmp_path / e["probe"]["file"], weights_only=True)
    assert torch.equal(side["output"], torch.tensor(e["probe"]["output"]))
    assert list(side["input"].shape) == e["probe"]["shape"]
    v = verify_probe(e, str(tmp_path), state_dict=ckpt["model_state_dict"])
    assert v == {"exact": True, "max_abs_diff": 0.0, "sha256_ok": True}
    # an earlier epoch's weights do not pass the final probe
    first = torch.load(res.checkpoints[0]["abs_path"], weights_only=True)["model_state_dict"]
    assert not verify_probe(e, str(tmp_path), state_dict=first)["exact"]


def test_manifest_accumulates_runs(tmp_path):
    train(TrainConfig(out=str(tmp_path), epochs=1, **SMALL))
    train(TrainConfig(out=str(tmp_path), mode="dp", epochs=1, **SMALL))
    train(TrainConfig(out=str(tmp_path), epochs=1, **SMALL))  # same run again: replaced, not duplicated
    paths = [c["path"] for c in read_manifest(str(tmp_path))["checkpoints"]]
    assert sorted(paths) == ["dp_epoch1.pt", "single_epoch1.pt"]


def test_dp_has_module_prefix_and_show_split(tmp_path, capsys):
    res = train(TrainConfig(out=str(tmp_path), mode="dp", epochs=1, show_split=True, **{**SMALL, "quiet": False}))
    err = capsys.readouterr().err
    assert "In Model: input size (64, 1, 28, 28)" in err and "Outside: input size (64, 1, 28, 28)" in err
    e = _entry(res)
    assert e["expected_prefix"] == "module." and e["keys"]["first"] == "module.conv1.weight"
    sd = torch.load(res.final_checkpoint, weights_only=True)["model_state_dict"]
    assert all(k.startswith("module.") for k in sd)
    # the clean style saves the unwrapped module
    res = train(TrainConfig(out=str(tmp_path), mode="dp", epochs=1, save_style="clean", **SMALL))
    assert _entry(res)["expected_prefix"] == "" and _entry(res)["path"] == "dp-clean_epoch1.pt"


def test_compile_adds_orig_mod(tmp_path):
    res = train(TrainConfig(out=str(tmp_path), mode="dp", compile=True, epochs=1, **SMALL))
    e = _entry(res)
    assert e["expected_prefix"] == "module._orig_mod." and e["compile_backend"] == "eager"
    sd = torch.load(res.final_checkpoint, weights_only=True)["model_state_dict"]
    assert all(k.startswith("module._orig_mod.") for k in sd)
    assert verify_probe(e, str(tmp_path))["exact"]  # via ckptfix.ops.load with model= alignment


def test_amp_saves_scaler_state(tmp_path):
    res = train(TrainConfig(out=str(tmp_path), amp=True, epochs=1, **SMALL))
    ckpt = torch.load(res.final_checkpoint, weights_only=True)
    assert "scaler_state_dict" in ckpt and ckpt["scaler_state_dict"]["scale"] > 0
    assert _entry(res)["amp_dtype"] == "bfloat16"
    assert ckpt["model_state_dict"]["conv1.weight"].dtype == torch.float32


def test_legacy_format_and_namespace_args(tmp_path):
    res = train(TrainConfig(out=str(tmp_path), legacy_format=True, namespace_args=True, epochs=1, **SMALL))
    path = res.final_checkpoint
    assert not zipfile.is_zipfile(path)
    with pytest.raises(pickle.UnpicklingError, match="Namespace"):
        torch.load(path, weights_only=True)  # argparse.Namespace is not an allowed global
    ckpt = torch.load(path, weights_only=False)
    assert isinstance(ckpt["args"], argparse.Namespace) and ckpt["args"].legacy_format is True
    lc = _load(path)
    assert set(lc.state_dict) == set(build_model("lenet", 0).state_dict())
    assert verify_probe(_entry(res), str(tmp_path))["exact"]


def test_dcp_single_process(tmp_path):
    res = train(TrainConfig(out=str(tmp_path), mode="dp", save_format="dcp", epochs=1, **SMALL))
    d = res.final_checkpoint
    assert os.path.isdir(d) and os.path.exists(os.path.join(d, ".metadata"))
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(d, str(tmp_path / "flat.pt"))
    flat = torch.load(tmp_path / "flat.pt", weights_only=False)
    assert flat["epoch"] == 1 and "module.conv1.weight" in flat["model_state_dict"]
    assert verify_probe(_entry(res), str(tmp_path))["exact"]


def test_resnet_single(tmp_path):
    res = train(TrainConfig(out=str(tmp_path), model="resnet", epochs=1, **SMALL))
    sd = torch.load(res.final_checkpoint, weights_only=True)["model_state_dict"]
    assert "bn1.num_batches_tracked" in sd
    assert verify_probe(_entry(res), str(tmp_path))["exact"]


# --------------------------------------------------------------------------- manual data parallelism


@pytest.mark.parametrize("fn", [ring_all_reduce, naive_all_reduce])
@pytest.mark.parametrize("n,size", [(1, 5), (2, 7), (3, 10), (4, 3)])
def test_all_reduce_sums(fn, n, size):
    g = torch.Generator().manual_seed(n * 100 + size)
    ts = [torch.randn(size, generator=g, dtype=torch.float64) for _ in range(n)]
    want = torch.stack(ts).sum(0)
    fn(ts)
    for t in ts:
        assert torch.allclose(t, want) and torch.equal(t, ts[0])


def test_manual_matches_single(tmp_path):
    r = compare_manual_to_single(replicas=2, out=str(tmp_path), epochs=2, train_samples=1024, test_samples=256)
    print(f"manual(2 replicas) vs single: max |dw| = {r['max_abs_diff']:.3g} at {r['worst_key']}")
    assert r["max_abs_diff"] < 1e-5
    assert abs(r["manual"].final_accuracy - r["single"].final_accuracy) < 0.02
    r3 = compare_manual_to_single(
        replicas=3, epochs=1, allreduce="naive", **{k: v for k, v in SMALL.items() if k != "quiet"}
    )
    assert r3["max_abs_diff"] < 1e-5


def test_manual_checkpoint_resumes_anywhere(tmp_path):
    res = train(TrainConfig(out=str(tmp_path), mode="manual", replicas=2, epochs=1, **SMALL))
    e = _entry(res)
    assert e["replicas"] == 2 and e["devices"] == ["cpu", "cpu"] and e["expected_prefix"] == ""
    res2 = train(TrainConfig(out=str(tmp_path), mode="dp", epochs=2, resume=res.final_checkpoint, **SMALL))
    assert res2.start_epoch == 2 and [c["epoch"] for c in res2.checkpoints] == [2]


# --------------------------------------------------------------------------- resume


def test_resume_continues_exactly(tmp_path):
    """single 2 epochs == single 1 epoch + resume (through the loader) for the 2nd, from a module.-prefixed file."""
    full = train(TrainConfig(out=str(tmp_path / "a"), epochs=2, **SMALL))
    part = train(TrainConfig(out=str(tmp_path / "b"), mode="dp", epochs=1, **SMALL))
    res = train(TrainConfig(out=str(tmp_path / "b"), mode="single", epochs=2, resume=part.final_checkpoint, **SMALL))
    e = _entry(res)
    assert e["resumed_from"] == os.path.abspath(part.final_checkpoint)
    a = torch.load(full.final_checkpoint, weights_only=True)["model_state_dict"]
    b = torch.load(res.final_checkpoint, weights_only=True)["model_state_dict"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_resume_past_last_epoch_is_an_error(tmp_path):
    res = train(TrainConfig(out=str(tmp_path), epochs=1, **SMALL))
    with pytest.raises(TrainingError, match="--epochs 2"):
        train(TrainConfig(out=str(tmp_path), epochs=1, resume=res.final_checkpoint, **SMALL))


def test_resume_amp_restores_scaler(tmp_path):
    res = train(TrainConfig(out=str(tmp_path), amp=True, compile=True, epochs=1, **SMALL))
    res2 = train(TrainConfig(out=str(tmp_path), amp=True, epochs=2, resume=res.final_checkpoint, **SMALL))
    ckpt = torch.load(res2.final_checkpoint, weights_only=True)
    assert ckpt["epoch"] == 2 and "scaler_state_dict" in ckpt


# --------------------------------------------------------------------------- DDP through real torchrun


@pytest.fixture
def ddp_run(ddp_trained_pt):
    """(output directory, result, the epoch-1 checkpoint) of conftest's 2-epoch ddp run (never modify them)."""
    out, res = ddp_trained_pt
    return out, res, os.path.join(out, res.checkpoints[0]["path"])


@pytest.mark.slow
def test_ddp_checkpoint(ddp_run):
    out, res, _ = ddp_run
    e = _entry(res)
    assert e["world_size"] == 2 and e["devices"] == ["cpu", "cpu"] and e["expected_prefix"] == "module."
    ckpt = torch.load(res.final_checkpoint, weights_only=True)
    assert all(k.startswith("module.") for k in ckpt["model_state_dict"])
    assert ckpt["args"]["mode"] == "ddp" and ckpt["args"]["world_size"] == 2
    assert not any(n.endswith(".tmp") or ".tmp." in n for n in os.listdir(out))
    assert verify_probe(e, str(out))["exact"]
    assert res.final_accuracy > 0.1 and res.samples_per_sec > 0


@pytest.mark.slow
def test_ddp_checkpoint_resumes_in_single(ddp_run, tmp_path):
    _, _, first = ddp_run
    r = train(TrainConfig(out=str(tmp_path), mode="single", epochs=2, resume=first, **FSDP_SMALL))
    assert r.start_epoch == 2 and verify_probe(_entry(r), str(tmp_path))["exact"]


@pytest.mark.slow
def test_dp_checkpoint_resumes_in_ddp_with_dcp_shards(tmp_path):
    dp = train(TrainConfig(out=str(tmp_path), mode="dp", epochs=1, **SMALL))
    r = train(
        TrainConfig(
            out=str(tmp_path),
            mode="ddp",
            nproc=2,
            epochs=2,
            resume=dp.final_checkpoint,
            save_format="dcp",
            compile=True,
            **SMALL,
        )
    )
    e = _entry(r)
    assert r.start_epoch == 2 and e["epoch"] == 2 and e["expected_prefix"] == "module._orig_mod."
    files = sorted(os.listdir(r.final_checkpoint))
    assert ".metadata" in files and sum(f.endswith(".distcp") for f in files) == 2  # one shard per rank
    lc = _load(r.final_checkpoint)
    assert lc.checkpoint["epoch"] == 2
    assert verify_probe(e, str(tmp_path))["exact"]
    # and the DDP/DCP result resumes in single mode
    r2 = train(TrainConfig(out=str(tmp_path), mode="single", epochs=3, resume=r.final_checkpoint, **SMALL))
    assert r2.start_epoch == 3


@pytest.mark.slow
def test_ddp_error_is_reported(ddp_run, tmp_path):
    _, _, first = ddp_run
    with pytest.raises(TrainingError, match="already has 1 epoch"):
        train(TrainConfig(out=str(tmp_path), mode="ddp", nproc=2, epochs=1, resume=first, **FSDP_SMALL))


# --------------------------------------------------------------------------- CLI


def test_cli_train_module_does_not_import_torch():
    code = "import sys\nimport ckptfix.cli.train\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_train_json_and_errors(tmp_path, capsys):
    from ckptfix.cli import main

    rc = main(
        [
            "train",
            "--mode",
            "dp",
            "--out",
            str(tmp_path),
            "--epochs",
            "1",
            "--train-samples",
            "256",
            "--test-samples",
            "64",
            "--json",
            "-q",
        ]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mode"] == "dp" and doc["checkpoints"][0]["expected_prefix"] == "module."
    ck = doc["checkpoints"][0]["abs_path"]
    rc = main(["train", "--out", str(tmp_path), "--epochs", "1", "--resume", ck, "-q"])
    assert rc == TrainingError.exit_code
    assert "Error: " in capsys.readouterr().err
    rc = main(
        [
            "train",
            "--out",
            str(tmp_path),
            "--epochs",
            "2",
            "--resume",
            ck,
            "--train-samples",
            "256",
            "--test-samples",
            "64",
        ]
    )
    cap = capsys.readouterr()
    assert rc == 0 and "single-resumed-from-dp_epoch1_epoch2.pt" in cap.out and "resumed" in cap.err


@pytest.mark.slow
def test_cli_bench_json(capsys):
    from ckptfix.cli import main

    rc = main(["train", "--bench", "--epochs", "1", "--train-samples", "256", "--test-samples", "64", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["bench"]
    assert [r["mode"] for r in rows][:5] == ["single", "dp", "manual", "ddp", "fsdp"]
    assert rows[3]["world_size"] == 2 and rows[4]["world_size"] == 2 and all(r["samples_per_sec"] > 0 for r in rows)
    assert all("checkpoint" not in r for r in rows)  # the files were in a removed temp dir: not named


# --------------------------------------------------------------------------- GPU paths


@pytest.mark.gpu
@cuda
def test_cuda_single_amp_fp16_scaler(tmp_path):
    res = train(TrainConfig(out=str(tmp_path), device="cuda", amp=True, epochs=1, **SMALL))
    e = _entry(res)
    assert e["amp_dtype"] == "float16" and e["devices"] == ["cuda:0"]
    ckpt = torch.load(res.final_checkpoint, map_location="cpu", weights_only=True)
    assert "scaler_state_dict" in ckpt
    assert verify_probe(e, str(tmp_path))["max_abs_diff"] == 0.0  # saved from CUDA, restored on CPU


@pytest.mark.gpu
@pytest.mark.slow
@cuda
def test_cuda_ddp_nccl(tmp_path):
    res = train(
        TrainConfig(out=str(tmp_path), device="cuda", mode="ddp", nproc=1, model="resnet", amp=True, epochs=1, **SMALL)
    )
    e = _entry(res)
    assert e["sync_batchnorm"] is True and e["devices"] == ["cuda:0"]
    assert verify_probe(e, str(tmp_path))["exact"]


def test_in_process_training_uses_one_thread_on_cpu_unless_told(monkeypatch, tmp_path):
    from ckptfix.train import TrainConfig, entry
    from ckptfix.train.run import Run

    seen: list[int] = []

    def fake_run(self):
        seen.append(torch.get_num_threads())
        raise SystemExit(0)

    monkeypatch.setattr(Run, "run", fake_run)
    before = torch.get_num_threads()
    for threads, want in ((None, 1), (2, 2)):
        with pytest.raises(SystemExit):
            entry.train(TrainConfig(out=str(tmp_path), device="cpu", threads=threads, quiet=True))
        assert seen[-1] == want
        assert torch.get_num_threads() == before
    assert entry.in_process_threads(TrainConfig(device="cpu")) == 1
    assert entry.in_process_threads(TrainConfig(device="cpu", threads=3)) == 3
