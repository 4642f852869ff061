"""``ckptfix demo`` (ckptfix.train.demo): every row's problem is plain torch's own error and every fix is
proven with plain torch / safetensors loads and bit-identical probe outputs."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ckptfix.train.demo import plain_problem, run_demo
from ckptfix.train.models import build_model

HAVE_SANITIZE = importlib.util.find_spec("ckptfix.ops.sanitize") is not None


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_demo(str(tmp_path_factory.mktemp("demo")), quick=True)


def test_problems_are_plain_torch_errors(quick):
    rows = {r.checkpoint: r for r in quick.rows}
    assert rows["single_epoch1.pt"].problem == "none (plain torch loads it)"
    assert rows["dp_epoch1.pt"].problem.startswith("load_state_dict: RuntimeError: Missing key(s) in state_dict")
    assert rows["single-dcp_epoch1.dcp"].problem.startswith("torch.load: IsADirectoryError")
    assert "Unsupported global: GLOBAL argparse.Namespace" in rows["dp-legacy-nsargs_epoch1.pt"].problem
    assert "Attempting to deserialize object on a CUDA device" in rows["single-saved-on-cuda1.pt"].problem


def test_plain_problem_on_an_unstripped_file_is_not_hidden(quick, tmp_path):
    sd = {"module." + k: v for k, v in build_model("lenet", 0).state_dict().items()}
    p = str(tmp_path / "x.pt")
    torch.save(sd, p)
    assert "Missing key(s)" in plain_problem(p, build_model("lenet", 0))


def test_every_fix_is_proven_by_plain_tools(quick):
    for r in quick.rows:
        if r.checkpoint.startswith("dp-legacy-nsargs"):
            continue  # see the sanitize tests below
        assert r.verified, (r.checkpoint, r.detail)
        for fix in ("load_anywhere", "convert"):
            assert r.steps[fix]["exact"] is True and r.steps[fix]["max_abs_diff"] == 0.0
        if "strip-prefix" in r.fix:
            out = r.steps["strip-prefix"]["output"]
            sd = torch.load(out, weights_only=True)["model_state_dict"]
            build_model("lenet", 0).load_state_dict(sd, strict=True)
        assert os.path.exists(r.steps["convert"]["output"])


@pytest.mark.skipif(HAVE_SANITIZE, reason="ckptfix.ops.sanitize is present: see the next test")
def test_namespace_row_is_honest_without_sanitize(quick):
    r = [r for r in quick.rows if r.checkpoint.startswith("dp-legacy-nsargs")][0]
    assert not r.verified and "sanitize (not verified)" in r.fix and not quick.ok


@pytest.mark.skipif(not HAVE_SANITIZE, reason="needs ckptfix.sanitize (branch `real`)")
def test_namespace_row_is_fixed_by_sanitize(quick):
    """After merging `real`: the sanitized file loads with plain torch.load(weights_only=True)."""
    r = [r for r in quick.rows if r.checkpoint.startswith("dp-legacy-nsargs")][0]
    assert r.verified, r.detail
    assert r.steps["sanitize"]["exact"] is True
    safe = r.steps["sanitize"]["output"]
    torch.load(safe, weights_only=True)
    sd = torch.load(r.steps["strip-prefix"]["output"], weights_only=True)["model_state_dict"]
    build_model("lenet", 0).load_state_dict(sd, strict=True)
    assert quick.ok
