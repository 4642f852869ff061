"""inspect_checkpoint: counting (tied tensors), files without tensors, placeholder classes (issue 11)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from ckptfix.ops.inspect import inspect_checkpoint

from helpers import assert_one_line_error, run_cli

pytestmark = pytest.mark.filterwarnings("ignore")


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_counts_tied_and_unique(tmp_path):
    m = Tied()
    sd = m.state_dict()
    sd["body_view"] = sd["body.weight"][1]  # a view of another tensor's storage
    torch.save(sd, tmp_path / "m.pt")
    r = inspect_checkpoint(tmp_path / "m.pt")
    assert r.parameter_count == sum(t.numel() for t in sd.values())
    distinct = {
        (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride())) for t in sd.values()
    }
    assert r.unique_parameter_count == sum(t.numel() for t in sd.values()) - 40 == 40 + 16 + 4 + 4
    assert len(distinct) == 4  # embed (= head), body.weight, body.bias, body_view
    assert r.unique_parameter_count == sum(p.numel() for p in m.parameters()) + 4
    assert r.total_bytes == sum(t.numel() * t.element_size() for t in sd.values())
    assert r.unique_bytes == (40 + 16 + 4) * 4  # storages: embed (=head), body.weight (with its view), body.bias
    assert r.storage_bytes == r.unique_bytes


def test_cli_shows_both_counts(tmp_path):
    torch.save(Tied().state_dict(), tmp_path / "m.pt")
    p = run_cli("inspect", tmp_path / "m.pt")
    assert p.returncode == 0
    assert "100 values" in p.stdout and "(60 values, 240 B counting tied/shared tensors once)" in p.stdout
    doc = json.loads(run_cli("inspect", tmp_path / "m.pt", "--json").stdout)
    assert (doc["parameter_count"], doc["unique_parameter_count"], doc["total_bytes"], doc["unique_bytes"]) == (
        100,
        60,
        400,
        240,
    )


@pytest.mark.parametrize("kind", ["namespace", "scheduler", "training_args"])
def test_files_without_tensors(tmp_path, kind):
    path = tmp_path / "f.bin"
    if kind == "namespace":
        torch.save(argparse.Namespace(lr=0.1, seed=3), path)
    elif kind == "scheduler":
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 3)
        torch.save(sched.state_dict(), path)
    else:
        transformers = pytest.importorskip("transformers")
        try:
            args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), learning_rate=3e-5)
        except ImportError as e:  # transformers' Trainer needs accelerate
            pytest.skip(str(e))
        torch.save(args, path)
    p = run_cli("inspect", path, "--json", timeout=600)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["tensor_count"] == 0 and doc["state_dict_key"] is None and doc["format"] == "torch-zip"
    assert doc["non_tensor_entries"]
    assert doc["weights_only_ok"] is (kind == "scheduler")
    if kind == "namespace":
        assert doc["non_tensor_entries"]["lr"] == "0.1" and "argparse.Namespace" in doc["globals"]
    if kind == "training_args":
        assert "transformers.training_args.TrainingArguments" in doc["globals"]
    for cmd in (["convert"], ["strip-prefix"], ["add-prefix", "--prefix", "m."]):
        assert_one_line_error(run_cli(*cmd, path), 13)


def test_placeholder_class_values_are_described(tmp_path):
    torch.save({"state_dict": {"w": torch.ones(1)}, "cfg": {"dtype": int}, "cls": float}, tmp_path / "m.pt")
    r = inspect_checkpoint(tmp_path / "m.pt")
    assert r.non_tensor_entries["cls"] == "class builtins.float (a reference, not an instance)"
    assert r.non_tensor_entries["cfg"] == "dict (1 keys)"
    r = inspect_checkpoint(tmp_path / "m.pt")
    torch.save(int, tmp_path / "c.pt")
    assert inspect_checkpoint(tmp_path / "c.pt").non_tensor_entries == {
        "(top level)": "class builtins.int (a reference, not an instance)"
    }


def test_numpy_values_are_described(tmp_path):
    np = pytest.importorskip("numpy")
    torch.save(
        {"state_dict": {"w": torch.ones(1)}, "shift": np.arange(6.0).reshape(2, 3), "n": np.float32(1.0)},
        tmp_path / "m.pt",
    )
    r = inspect_checkpoint(tmp_path / "m.pt")
    assert r.non_tensor_entries["shift"] == "numpy.ndarray float64 [2, 3] (placeholder)"
    assert r.non_tensor_entries["n"] == "numpy scalar float32 (placeholder)"


@pytest.mark.parametrize("proto", [2, 4])
def test_weights_only_verdict_agrees_with_torch_for_the_pickle_protocol(tmp_path, proto):
    """torch's weights-only unpickler cannot read protocol-4 opcodes (FRAME ...): the verdict must say so."""
    p = tmp_path / "p.pt"
    torch.save({"w": torch.ones(2), "name": "x"}, p, pickle_protocol=proto)
    try:
        torch.load(p, weights_only=True)
        torch_ok = True
    except Exception:  # noqa: BLE001 - torch's UnpicklingError
        torch_ok = False
    assert inspect_checkpoint(p).weights_only_ok is torch_ok
