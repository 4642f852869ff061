"""torchvision's EMA checkpoints (``AveragedModel``: ``module.`` on every weight, plus ``n_averaged``): convert's
``--prefix`` and ``load_anywhere(model=...)`` leaving out what the model has no place for (issue 37 §6).

The writer is torch's own ``torch.optim.swa_utils.AveragedModel``, the base class of torchvision's
``ExponentialMovingAverage`` (its reference scripts save ``{"model": ..., "model_ema": ema.state_dict()}``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from helpers import run_cli

torch = pytest.importorskip("torch")


def _net():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten())


@pytest.fixture
def ema_ckpt(tmp_path: Path) -> tuple[Path, dict]:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    m = _net()
    ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    ema.update_parameters(m)
    p = tmp_path / "checkpoint.pth"
    torch.save({"model": m.state_dict(), "model_ema": ema.state_dict(), "epoch": 3}, p)
    return p, ema.state_dict()


def test_convert_prefix_strips_module_from_an_ema(ema_ckpt: tuple[Path, dict], tmp_path: Path) -> None:
    p, ema_sd = ema_ckpt
    out = tmp_path / "ema.safetensors"
    r = run_cli("convert", str(p), "--key", "model_ema", "--prefix", "module.", "-o", str(out), "--json")
    assert r.rc == 0, r.err
    assert json.loads(r.out)["renamed"] == len(ema_sd) - 1  # every key but n_averaged
    from safetensors.torch import load_file

    got = load_file(str(out))
    assert set(got) == {k.removeprefix("module.") for k in ema_sd}
    for k, v in ema_sd.items():
        assert torch.equal(got[k.removeprefix("module.")], v), k
    m = _net()
    m.load_state_dict({k: v for k, v in got.items() if k != "n_averaged"})


def test_load_anywhere_with_model_leaves_n_averaged_out_and_says_so(ema_ckpt: tuple[Path, dict]) -> None:
    from ckptfix import load_anywhere

    p, ema_sd = ema_ckpt
    m = _net()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        sd = load_anywhere(p, model=m, key="model_ema")
    assert "n_averaged" not in sd
    assert any("left out 1 entry the model has no place for: n_averaged" in str(x.message) for x in w)
    m.load_state_dict(sd)  # strict
    for k, v in m.state_dict().items():
        assert torch.equal(v, ema_sd["module." + k]), k
    assert "n_averaged" in load_anywhere(p, key="model_ema")  # without model=: every entry
