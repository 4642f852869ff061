"""File-level key renaming: strip_prefix_checkpoint, add_prefix_checkpoint, align_checkpoint (the library
calls behind strip-prefix, add-prefix and align)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from ckptfix.errors import AlignmentError, CheckpointNotFoundError, KeyConflictError
from ckptfix.ops.rewrite.keys import (
    MIN_FIT,
    add_prefix_checkpoint,
    align_checkpoint,
    load_align_target,
    strip_prefix_checkpoint,
)


def _save(path, sd):
    torch.save(sd, path)
    return str(path)


def test_strip_then_add_round_trips_the_keys(tmp_path):
    src = _save(tmp_path / "m.pt", {"module.fc.weight": torch.ones(2), "module.fc.bias": torch.zeros(2)})
    rep = strip_prefix_checkpoint(src)
    assert rep.output == str(tmp_path / "m.stripped.pt")
    assert list(torch.load(rep.output, weights_only=True)) == ["fc.weight", "fc.bias"]
    back = add_prefix_checkpoint(rep.output, "module")
    assert back.output == str(tmp_path / "m.stripped.prefixed.pt")
    assert back.detail == {"summary": "added 'module' to 2 keys", "prefix": "module", "keys": 2}
    assert list(torch.load(back.output, weights_only=True)) == ["module.fc.weight", "module.fc.bias"]


def test_align_to_a_module_is_exact_and_writes_the_renamed_file(tmp_path):
    net = nn.Linear(3, 2)
    src = _save(tmp_path / "ddp.pt", nn.DataParallel(net).state_dict())
    res = align_checkpoint(src, net)
    assert res.exact and res.mismatch_error() is None
    assert res.alignment.rename == "strip 'module.'"
    assert res.rewrite.output == str(tmp_path / "ddp.aligned.pt")
    assert res.to_dict()["detail"]["exact"] is True
    nn.Linear(3, 2).load_state_dict(torch.load(res.rewrite.output, weights_only=True))


def test_align_that_leaves_keys_unmatched_writes_and_says_what_remains(tmp_path):
    src = _save(tmp_path / "m.pt", {"module.a": torch.ones(1), "module.b": torch.ones(1), "module.c": torch.ones(1)})
    res = align_checkpoint(src, ["a", "b", "d"])
    assert not res.exact and os.path.exists(res.rewrite.output)
    err = res.mismatch_error()
    assert isinstance(err, AlignmentError) and err.exit_code == 10
    assert str(err).startswith("1 missing, 1 unexpected, 0 shape mismatches remain after 'strip 'module.''")


def test_align_below_the_fit_threshold_writes_nothing(tmp_path):
    src = _save(tmp_path / "m.pt", {f"k{i}": torch.ones(1) for i in range(4)})
    assert MIN_FIT == 0.5
    with pytest.raises(AlignmentError, match="matches only 1 of 4 keys"):
        align_checkpoint(src, ["k0", "x", "y", "z"])
    assert os.listdir(tmp_path) == ["m.pt"]
    align_checkpoint(src, ["k0", "k1", "y", "z"], output=str(tmp_path / "half.pt"))  # half is enough


def test_align_with_two_equally_good_renamings_writes_nothing(tmp_path):
    src = _save(tmp_path / "m.pt", {"a.w": torch.ones(1), "b.w": torch.ones(1)})
    with pytest.raises(KeyConflictError, match="ambiguous.*rename explicitly with strip-prefix --prefix"):
        align_checkpoint(src, ["w"])
    assert os.listdir(tmp_path) == ["m.pt"]


def test_align_target_from_a_checkpoint_file_and_from_a_factory(tmp_path, monkeypatch):
    tgt = _save(tmp_path / "t.pt", {"state_dict": {"fc.w": torch.ones(1)}, "epoch": 1})
    assert list(load_align_target(tgt)) == ["fc.w"]
    (tmp_path / "mynets.py").write_text("import torch\ndef build():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert sorted(load_align_target("mynets:build").state_dict()) == ["bias", "weight"]
    with pytest.raises(CheckpointNotFoundError, match="cannot import it"):
        load_align_target("mynets:nothing")
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        load_align_target(str(tmp_path / "absent.pt"))
