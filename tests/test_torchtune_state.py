"""torchtune's ``recipe_state/`` folder (issue 37 §10): the training state of an intermediate checkpoint, read as such.

The fixture (tests/fixtures/frameworks/make_torchtune.py) replays what torchtune 0.6's
``FullModelTorchTuneCheckpointer.save_checkpoint(intermediate_checkpoint=True)`` writes: ``epoch_0/`` (the model)
and ``recipe_state/recipe_state.pt`` (optimizer state, seed, epochs_run ...).  It was exit 3, "no checkpoint in it".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptfix.errors import NoModelWeightsError

from helpers import run_cli

OUT = Path(__file__).parent / "fixtures" / "frameworks" / "torchtune_out"
STATE = OUT / "recipe_state"


def test_inspect_says_what_the_training_state_holds() -> None:
    r = run_cli("inspect", str(STATE), "--json", isolated=False)
    assert r.rc == 0, r.err
    doc = json.loads(r.out)
    fw = doc["framework"]
    assert fw["layout"] == "torchtune-recipe-state" and fw["weights"] is None
    (f,) = fw["files"]
    assert f["file"] == "recipe_state.pt" and f["role"] == "recipe-state"
    assert "epochs_run 1" in f["summary"] and "4 params, 12 state tensors" in f["summary"]
    assert doc["folder_scan"]["verdict"] == "safe"


def test_the_summary_matches_torch_load() -> None:
    torch = pytest.importorskip("torch")
    from ckptfix.formats.layouts import describe_file

    st = torch.load(STATE / "recipe_state.pt", weights_only=True)
    _, d = describe_file(str(STATE / "recipe_state.pt"), "recipe-state")
    assert d["epochs_run"] == st["epochs_run"] and d["seed"] == st["seed"]
    n = sum(len(v) for v in st["optimizer"]["state"].values())
    assert d["optimizer"]["state_tensors"] == n and d["optimizer"]["params"] == 4


def test_convert_names_the_epoch_folder_with_the_model(tmp_path: Path) -> None:
    r = run_cli("convert", str(STATE), "-o", str(tmp_path / "o.safetensors"), isolated=False)
    assert r.rc == NoModelWeightsError.exit_code
    model = OUT / "epoch_0" / "model-00001-of-00001.bin"
    assert "torchtune recipe_state/" in r.err and f"ckptfix convert {model}" in r.err
    r = run_cli("convert", str(model), "-o", str(tmp_path / "m.safetensors"), isolated=False)
    assert r.rc == 0, r.err
