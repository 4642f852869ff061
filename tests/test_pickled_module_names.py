"""A whole pickled module (``torch.save(model)``, as ultralytics ships ``.pt`` files): its ``state_dict()`` names
are its own, so ``convert --strip-prefix`` keeps them; only a pickled wrapper (DataParallel, DDP, compile) strips."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

from helpers import run_cli  # noqa: E402

MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    class DetectionModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1))
    """
)


@pytest.fixture
def saved(tmp_path):
    (tmp_path / "det.py").write_text(MODEL)
    code = (
        "import torch, det\n"
        "torch.manual_seed(0)\n"
        "torch.save(det.DetectionModel(), 'yolo.pt')\n"
        "torch.save(torch.nn.DataParallel(det.DetectionModel()), 'dp.pt')\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, check=True)
    return tmp_path


def _model(tmp_path):
    sys.path.insert(0, str(tmp_path))
    try:
        import det

        return det.DetectionModel()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("det", None)


def test_a_pickled_models_own_names_are_kept_and_load_strict(saved):
    r = run_cli("convert", "yolo.pt", "--strip-prefix", "-o", "yolo.safetensors", cwd=saved)
    assert r.rc == 0, r.err
    assert "pickled DetectionModel's own state_dict() names" in r.err and "stripped prefixes" not in r.err
    sd = load_file(str(saved / "yolo.safetensors"))
    assert all(k.startswith("model.") for k in sd)
    m = _model(saved)
    m.load_state_dict(sd, strict=True)  # the class's own loader is the oracle


def test_a_pickled_wrapper_is_stripped(saved):
    r = run_cli("convert", "dp.pt", "--strip-prefix", "-o", "dp.safetensors", "--json", cwd=saved)
    assert r.rc == 0, r.err
    sd = load_file(str(saved / "dp.safetensors"))
    assert all(k.startswith("model.") for k in sd), list(sd)
    assert "kept_names" not in __import__("json").loads(r.out)
    _model(saved).load_state_dict(sd, strict=True)
