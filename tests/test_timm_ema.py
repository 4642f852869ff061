"""``align --to`` on a timm training checkpoint with EMA weights (issue 34 B9), written by timm's CheckpointSaver.

tests/fixtures/frameworks/timm/ (``make_timm.py``): ``last.pth.tar`` holds ``state_dict`` and ``state_dict_ema``
(they differ: two steps, EMA decay 0.5); ``ref_dp.safetensors`` is the model under ``nn.DataParallel``
(``module.`` names); ``expected_ema`` / ``expected_model`` are what timm's ``load_checkpoint`` gives with
``use_ema=True`` / ``False``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import run_cli

torch = pytest.importorskip("torch")

TM = Path(__file__).resolve().parent / "fixtures" / "frameworks" / "timm"


def _prefixed(sd: dict) -> dict:
    return {f"module.{k}": v for k, v in sd.items()}


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _align(tmp_path: Path, *extra: str) -> tuple[dict, str, dict]:
    out = tmp_path / "a.pth.tar"
    p = run_cli("align", str(TM / "last.pth.tar"), "--to", str(TM / "ref_dp.safetensors"), "-o", str(out), *extra)
    assert p.returncode == 0, p.stderr
    return torch.load(out, weights_only=False), p.stderr, {}


def test_align_says_which_state_dict_and_which_it_left(tmp_path: Path) -> None:
    # was: "add 'module.'; ... exact", no word that state_dict_ema (timm's default) was left unaligned
    ck, err, _ = _align(tmp_path)
    assert "renamed the state dict at 'state_dict' (20 tensors); left as they were: state_dict_ema (20 tensors)" in err
    assert "timm's load_checkpoint, use_ema=True" in err and "--key state_dict_ema renames that one" in err
    _same(ck["state_dict"], _prefixed(load_file(str(TM / "expected_model.safetensors"))))
    _same(ck["state_dict_ema"], load_file(str(TM / "expected_ema.safetensors")))


def test_align_takes_the_named_state_dict(tmp_path: Path) -> None:
    ck, err, _ = _align(tmp_path, "--key", "state_dict_ema")
    assert "renamed the state dict at 'state_dict_ema'" in err
    _same(ck["state_dict_ema"], _prefixed(load_file(str(TM / "expected_ema.safetensors"))))
    _same(ck["state_dict"], load_file(str(TM / "expected_model.safetensors")))  # untouched
    out = tmp_path / "j.pth.tar"
    p = run_cli(
        "align", str(TM / "last.pth.tar"), "--to", str(TM / "ref_dp.safetensors"), "-o", str(out),
        "--key", "state_dict_ema", "--json",
    )  # fmt: skip
    doc = json.loads(p.stdout)
    assert doc["key_path"] == ["state_dict_ema"] and any("state_dict_ema" in n for n in doc["notes"])


def test_aligned_ema_against_timm(tmp_path: Path) -> None:
    timm = pytest.importorskip("timm")
    from timm.models import load_checkpoint

    kw = dict(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=3)
    ref = timm.create_model("vit_tiny_patch16_224", **kw).eval()
    load_checkpoint(ref, str(TM / "last.pth.tar"))  # timm's default: the EMA weights
    _align(tmp_path, "--key", "state_dict_ema")
    got = timm.create_model("vit_tiny_patch16_224", **kw).eval()
    load_checkpoint(got, str(tmp_path / "a.pth.tar"))  # timm strips the module. it was aligned to
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(got(x), ref(x))
