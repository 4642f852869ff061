"""Checkpoints written on a real CUDA GPU (an H200, torch 2.11.0+cu130, by ``benchmarks/gpu_check.sh``), read here on a
machine without one.

tests/fixtures/cuda/ holds what the bundled trainer wrote there: a DDP (nccl) ResNet whose BatchNorm layers were
converted to SyncBatchNorm (``module.`` keys), an AMP run (GradScaler state), a ``torch.compile``/inductor run
(``_orig_mod.`` keys) and an FSDP2 DCP directory, all with ``cuda:0`` storages, and ``checkpoints.json`` with the
probe outputs recorded on that machine.  Plain ``torch.load`` fails on them without a GPU; ckptfix must inspect them
torch-free, load them onto the CPU, fix their prefixes and give back the very model that was trained there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import fake_smi_env, run_cli

CUDA = Path(__file__).parent / "fixtures" / "cuda"
MANIFEST = json.loads((CUDA / "checkpoints.json").read_text())
ENTRIES = {c["path"]: c for c in MANIFEST["checkpoints"]}
FILES = sorted(p for p in ENTRIES if p.endswith(".pt"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure")
@pytest.mark.parametrize("name", FILES)
def test_plain_torch_fails_without_a_gpu(name):
    with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device"):
        torch.load(CUDA / name, weights_only=True)


@pytest.mark.parametrize("name", FILES)
def test_inspect_sees_cuda_storages_torch_free(name):
    p = run_cli("inspect", "--json", str(CUDA / name))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert "cuda:0" in json.dumps(doc.get("storage_tags", doc))


def _model_for(entry: dict) -> torch.nn.Module:
    from ckptfix.train.models import build_model

    return build_model(entry["model"], 0)


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_load_anywhere_gives_back_the_trained_model(name):
    """load_anywhere on CPU -> strict load_state_dict -> the probe output recorded on the GPU machine."""
    from ckptfix import load_anywhere
    from ckptfix.train.data import probe_batch
    from ckptfix.train.probe import probe_output

    entry = ENTRIES[name]
    sd = load_anywhere(CUDA / name, model=_model_for(entry))
    assert all(t.device.type == "cpu" for t in sd.values() if isinstance(t, torch.Tensor))
    model = _model_for(entry)
    model.load_state_dict(sd, strict=True)
    probe = entry["probe"]
    out = probe_output(model, probe_batch(seed=probe["seed"], n=probe["shape"][0]))
    assert list(out.shape) == probe["output_shape"]
    want = torch.tensor(probe["output"], dtype=torch.float32)
    # another CPU (AVX-512 there) may sum in another order: equal to float32 rounding, not bit for bit
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_strip_prefix_of_the_syncbatchnorm_ddp_checkpoint_loads_with_plain_torch(tmp_path):
    src = tmp_path / "ddp.pt"
    shutil.copy(CUDA / "ddp-resnet_epoch1.pt", src)
    out = tmp_path / "clean.pt"
    p = run_cli("strip-prefix", str(src), "-o", str(out), "--map-location", "cpu")
    assert p.returncode == 0, p.stderr
    sd = torch.load(out, weights_only=True)
    sd = sd.get("model_state_dict", sd)
    assert not any(k.startswith("module.") for k in sd)
    assert any(k.endswith("num_batches_tracked") for k in sd)  # SyncBatchNorm keeps BatchNorm's buffers
    _model_for(ENTRIES["ddp-resnet_epoch1.pt"]).load_state_dict(sd, strict=True)


def test_gpus_replays_the_real_h200_byte_for_byte(tmp_path):
    """The recorded H200 nvidia-smi answers give exactly the table ``ckptfix gpus`` printed on that machine."""
    p = run_cli("gpus", env=fake_smi_env(tmp_path, "h200_real_idle"))
    assert p.returncode == 0, p.stderr
    assert p.stdout == (CUDA / "real_gpus_h200.txt").read_text()


def test_gpus_json_replays_the_real_h200(tmp_path):
    p = run_cli("gpus", "--json", env=fake_smi_env(tmp_path, "h200_real_idle"))
    assert p.returncode == 0, p.stderr
    got, real = json.loads(p.stdout), json.loads((CUDA / "real_gpus_h200.json").read_text())
    for doc in (got, real):  # sampled a second apart on the real machine
        for d in doc["devices"] + doc["physical"]:
            d.pop("power_w"), d.pop("temperature_c")
    assert got == real
