"""Resume semantics of the trainer (ckptfix.train.run): exact continuation from every format,
state that cannot be restored is reported, explicit hyper-parameters win and are recorded, resumed
runs get their own names, and failed saves leave nothing half-written."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ckptfix.errors import TrainingError
from ckptfix.train import TrainConfig, read_manifest, train
from ckptfix.train.resume import int_optimizer_keys

SMALL = dict(train_samples=256, test_samples=64, quiet=True)


def _sd(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_int_optimizer_keys():
    sd = {"state": {"0": {"momentum_buffer": 1}, "7": {}}, "param_groups": [{"lr": 0.1, "params": ["0", "7"]}]}
    out = int_optimizer_keys(sd)
    assert set(out["state"]) == {0, 7} and out["param_groups"][0]["params"] == [0, 7]
    assert sd["state"].keys() == {"0", "7"}  # input untouched


def test_resume_from_dcp_equals_resume_from_pt(tmp_path):
    out = str(tmp_path)
    a = train(TrainConfig(out=out, epochs=1, save_format="dcp", **SMALL))
    b = train(TrainConfig(out=out, epochs=1, name="same", **SMALL))
    ra = train(TrainConfig(out=out, epochs=2, resume=a.final_checkpoint, **SMALL))
    rb = train(TrainConfig(out=out, epochs=2, resume=b.final_checkpoint, **SMALL))
    full = train(TrainConfig(out=out, epochs=2, name="full", **SMALL))
    x, y, z = _sd(ra.final_checkpoint), _sd(rb.final_checkpoint), _sd(full.final_checkpoint)
    for k in x["model_state_dict"]:
        assert torch.equal(x["model_state_dict"][k], y["model_state_dict"][k]), k
        assert torch.equal(x["model_state_dict"][k], z["model_state_dict"][k]), k
    assert ra.checkpoints[-1]["probe"]["output"] == rb.checkpoints[-1]["probe"]["output"]
    # the optimizer state came back with int ids: 8 entries, not '0'..'7' next to 0..7
    assert sorted(x["optimizer_state_dict"]["state"]) == list(range(8))
    for k in range(8):
        assert torch.equal(
            x["optimizer_state_dict"]["state"][k]["momentum_buffer"],
            y["optimizer_state_dict"]["state"][k]["momentum_buffer"],
        )
    info = ra.checkpoints[-1]["resume"]
    assert info["format"] == "dcp" and info["restored"] == ["model", "optimizer"] and info["not_restored"] == []


def test_resume_without_optimizer_state_says_so(tmp_path, capsys):
    a = train(TrainConfig(out=str(tmp_path), epochs=1, **SMALL))
    ck = _sd(a.final_checkpoint)
    del ck["optimizer_state_dict"]
    bare = str(tmp_path / "bare.pt")
    torch.save(ck, bare)
    r = train(TrainConfig(out=str(tmp_path), epochs=2, resume=bare, **SMALL))
    err = capsys.readouterr().err
    assert "optimizer not restored" in err  # even with quiet=True
    man = read_manifest(str(tmp_path))
    e = [c for c in man["checkpoints"] if c["path"] == os.path.basename(r.final_checkpoint)][0]
    assert e["resume"]["not_restored"][0]["state"] == "optimizer"


def test_explicit_hyperparameters_win_on_resume_and_are_recorded(tmp_path, capsys):
    a = train(TrainConfig(out=str(tmp_path), epochs=1, **SMALL))
    # not explicit: the checkpoint's lr (0.05) is used and recorded, not the config's 0.01
    r1 = train(TrainConfig(out=str(tmp_path), epochs=2, lr=0.01, resume=a.final_checkpoint, name="keep", **SMALL))
    assert _sd(r1.final_checkpoint)["args"]["lr"] == 0.05
    assert _sd(r1.final_checkpoint)["optimizer_state_dict"]["param_groups"][0]["lr"] == 0.05
    # explicit: applied after loading, recorded as used
    r2 = train(
        TrainConfig(
            out=str(tmp_path),
            epochs=2,
            lr=0.01,
            momentum=0.0,
            explicit=("lr", "momentum"),
            resume=a.final_checkpoint,
            name="over",
            **{**SMALL, "quiet": False},
        )
    )
    err = capsys.readouterr().err
    assert "--lr 0.01 given explicitly" in err
    ck = _sd(r2.final_checkpoint)
    assert ck["args"]["lr"] == 0.01 and ck["args"]["momentum"] == 0.0
    assert ck["optimizer_state_dict"]["param_groups"][0]["lr"] == 0.01
    h = r2.checkpoints[-1]["resume"]["hyperparameters"]
    assert h["lr"] == {"checkpoint": 0.05, "used": 0.01, "explicit": True}
    assert r2.checkpoints[-1]["hyperparameters"]["lr"] == 0.01
    # the weights differ from the lr-0.05 continuation: the override really trained
    assert not torch.equal(
        ck["model_state_dict"]["fc2.weight"], _sd(r1.final_checkpoint)["model_state_dict"]["fc2.weight"]
    )


def test_resumed_run_has_its_own_name_and_never_overwrites_another_run(tmp_path):
    out = str(tmp_path)
    first = train(TrainConfig(out=out, epochs=2, **SMALL))
    before = _sd(os.path.join(out, "single_epoch2.pt"))
    r = train(TrainConfig(out=out, epochs=2, resume=first.checkpoints[0]["abs_path"], **SMALL))
    assert os.path.basename(r.final_checkpoint) == "single-resumed-from-single_epoch1_epoch2.pt"
    after = _sd(os.path.join(out, "single_epoch2.pt"))  # the original run's file is untouched
    assert torch.equal(before["model_state_dict"]["fc2.weight"], after["model_state_dict"]["fc2.weight"])
    runs = {c["run"] for c in read_manifest(out)["checkpoints"]}
    assert runs == {"single", "single-resumed-from-single_epoch1"}
    # a --name that collides with another run's files is refused without --force
    with pytest.raises(TrainingError, match="--force"):
        train(TrainConfig(out=out, epochs=2, resume=first.checkpoints[0]["abs_path"], name="single", **SMALL))
    train(TrainConfig(out=out, epochs=2, resume=first.checkpoints[0]["abs_path"], name="single", force=True, **SMALL))
    # re-running the same configuration replaces its own files, as before
    train(TrainConfig(out=out, epochs=1, name="again", **SMALL))
    train(TrainConfig(out=out, epochs=1, name="again", **SMALL))


def test_failed_save_leaves_no_half_written_epoch(tmp_path, monkeypatch):
    from ckptfix.train import run

    real = run.tensor_sha256
    calls = {"n": 0}

    def flaky(t):
        calls["n"] += 1
        if calls["n"] == 2:  # epoch 2's probe hash
            raise RuntimeError("simulated failure while saving")
        return real(t)

    monkeypatch.setattr(run, "tensor_sha256", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        train(TrainConfig(out=str(tmp_path), epochs=3, **SMALL))
    files = sorted(os.listdir(tmp_path))
    assert files == ["checkpoints.json", "single_epoch1.probe.pt", "single_epoch1.pt"], files
    listed = [c["path"] for c in json.load(open(tmp_path / "checkpoints.json"))["checkpoints"]]
    assert listed == ["single_epoch1.pt"]


def test_failed_epoch_removes_dcp_directory_too(tmp_path, monkeypatch):
    from ckptfix.train import run

    def boom(*a, **k):
        raise RuntimeError("simulated probe failure")

    monkeypatch.setattr(run, "probe_output", boom)
    with pytest.raises(RuntimeError):
        train(TrainConfig(out=str(tmp_path), epochs=1, save_format="dcp", **SMALL))
    assert os.listdir(tmp_path) == []


def test_rerun_replaces_its_dcp_directory_whole(tmp_path):
    from ckptfix.train import verify_probe

    for _ in range(2):
        res = train(TrainConfig(out=str(tmp_path), epochs=1, save_format="dcp", name="d", **SMALL))
    # the second run's directory replaced the first's: no temp or old directory is left beside it
    assert sorted(os.listdir(tmp_path)) == ["checkpoints.json", "d_epoch1.dcp", "d_epoch1.probe.pt"]
    assert verify_probe(res.checkpoints[0], str(tmp_path))["exact"]


def test_another_runs_probe_file_is_not_overwritten(tmp_path):
    from ckptfix.train.manifest import check_outputs

    train(TrainConfig(out=str(tmp_path), epochs=1, name="a", **SMALL))
    check_outputs(str(tmp_path), ["a_epoch1.pt", "a_epoch1.probe.pt"], "a", None)  # its own files
    with pytest.raises(TrainingError, match="run 'a'"):
        check_outputs(str(tmp_path), ["a_epoch1.probe.pt"], "b", None)
    (tmp_path / "stray.pt").write_bytes(b"x")
    with pytest.raises(TrainingError, match="not listed in checkpoints.json"):
        check_outputs(str(tmp_path), ["stray.pt"], "a", None)
