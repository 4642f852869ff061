"""``--mode fsdp`` (ckptfix.train.fsdp): FSDP2 through real torchrun with 2 gloo processes, a truly
sharded DCP checkpoint, a gathered .pt, and exact resumes from and into the other modes."""

from __future__ import annotations

import os

import pytest
import torch

from ckptfix.train import TrainConfig, train, verify_probe
from ckptfix.train.fsdp import ids_to_names, names_to_ids

from heavy import FSDP_SMALL

SMALL = FSDP_SMALL  # what the session fixture fsdp_trained_dcp was trained with
pytestmark = pytest.mark.slow


def _out(res):
    return torch.tensor(res.checkpoints[-1]["probe"]["output"])


def test_optimizer_key_mapping():
    names = ["a.w", "a.b"]
    sd = {"state": {"a.b": {"m": 1}}, "param_groups": [{"lr": 1, "params": ["a.w", "a.b"]}]}
    ids = names_to_ids(sd, names)
    assert ids["state"] == {1: {"m": 1}} and ids["param_groups"][0]["params"] == [0, 1]
    assert ids_to_names(ids, names) == sd


@pytest.fixture
def fsdp_dcp(fsdp_trained_dcp):
    """``train --mode fsdp`` for two epochs, each saved as DCP (built once per test run: conftest.py)."""
    return fsdp_trained_dcp


def test_fsdp_writes_a_sharded_dcp(fsdp_dcp):
    from torch.distributed.checkpoint import FileSystemReader

    out, res = fsdp_dcp
    e = res.checkpoints[-1]
    assert e["mode"] == "fsdp" and e["world_size"] == 2 and e["sharded"] is True and e["expected_prefix"] == ""
    d = res.final_checkpoint
    assert sorted(f for f in os.listdir(d) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    md = FileSystemReader(d).read_metadata()
    w = md.state_dict_metadata["model_state_dict.fc1.weight"]
    assert list(w.size) == [120, 400]
    assert sorted(tuple(c.offsets) for c in w.chunks) == [(0, 0), (60, 0)]  # each rank wrote half the rows
    mom = md.state_dict_metadata["optimizer_state_dict.state.fc1.weight.momentum_buffer"]
    assert len(mom.chunks) == 2  # optimizer state sharded too
    files = {md.storage_data[k].relative_path for k in md.storage_data if k.fqn == "model_state_dict.fc1.weight"}
    assert files == {"__0_0.distcp", "__1_0.distcp"}
    assert verify_probe(e, str(out))["exact"]  # load_anywhere assembles the shards


def test_fsdp_dcp_resumes_in_single_and_fsdp_exactly(fsdp_dcp, tmp_path):
    out, res = fsdp_dcp
    first = os.path.join(out, res.checkpoints[0]["path"])  # epoch 1 of the fixture's two
    assert res.checkpoints[0]["epoch"] == 1 and first.endswith(".dcp")
    s = train(TrainConfig(out=str(tmp_path), mode="single", epochs=2, resume=first, **SMALL))
    assert s.checkpoints[-1]["resume"]["restored"] == ["model", "optimizer"]
    f2 = train(TrainConfig(out=str(tmp_path), mode="fsdp", nproc=2, epochs=2, resume=first, save_format="pt", **SMALL))
    assert torch.equal(_out(f2), _out(res))  # FSDP -> FSDP continues bit-exactly: the fixture's own epoch 2
    ck = torch.load(f2.final_checkpoint, weights_only=True)
    assert list(ck["model_state_dict"])[0] == "conv1.weight"
    assert sorted(ck["optimizer_state_dict"]["state"]) == list(range(8))  # index keys: resumes anywhere


def test_ddp_pt_resumes_in_fsdp_exactly(ddp_trained_pt, tmp_path):
    out, d = ddp_trained_pt  # 2 epochs of ddp (conftest.py, shared with test_train.py)
    assert [e["epoch"] for e in d.checkpoints] == [1, 2]
    first = os.path.join(out, d.checkpoints[0]["path"])
    f = train(TrainConfig(out=str(tmp_path), mode="fsdp", nproc=2, epochs=2, resume=first, **SMALL))
    assert f.checkpoints[-1]["resume"]["restored"] == ["model", "optimizer"]
    # same global batches, same mean gradient: FSDP's reduce-scatter matches DDP's all-reduce here (the ddp
    # run's own epoch 2 is the reference)
    assert torch.equal(_out(f), _out(d))


def test_fsdp_resume_with_momentum_0_matches_ddp(fsdp_dcp, tmp_path):
    # issue 34 C7: `train --mode fsdp --resume X --momentum 0` died in torch's full-state-dict loader ("Expected
    # device to be set": an SGD without momentum has no state tensors to learn the device from)
    s = train(TrainConfig(out=str(tmp_path), mode="single", epochs=1, **SMALL))
    kw = dict(epochs=2, momentum=0.0, explicit=("momentum",), save_format="pt", **SMALL)
    f = train(TrainConfig(out=str(tmp_path), mode="fsdp", nproc=2, resume=s.final_checkpoint, name="f0", **kw))
    d = train(TrainConfig(out=str(tmp_path), mode="ddp", nproc=2, resume=s.final_checkpoint, name="d0", **kw))
    r = f.checkpoints[-1]["resume"]
    assert r["restored"] == ["model", "optimizer"] and r["hyperparameters"]["momentum"]["used"] == 0.0, r
    assert torch.equal(_out(f), _out(d))  # the oracle: the same resume in DDP, where it always worked
    fo = torch.load(f.final_checkpoint, weights_only=True)["optimizer_state_dict"]
    do = torch.load(d.final_checkpoint, weights_only=True)["optimizer_state_dict"]
    assert [g["momentum"] for g in fo["param_groups"]] == [0.0] == [g["momentum"] for g in do["param_groups"]]
    assert sorted(fo["state"]) == sorted(do["state"]) == list(range(8))  # the buffers are carried, as DDP does
    for i in do["state"]:
        assert torch.equal(fo["state"][i]["momentum_buffer"], do["state"][i]["momentum_buffer"]), i
    # from a sharded FSDP DCP checkpoint too
    out, res = fsdp_dcp  # two epochs (conftest.py): resumed from its first, as the single-mode file above
    first = os.path.join(out, res.checkpoints[0]["path"])
    g = train(TrainConfig(out=str(tmp_path), mode="fsdp", nproc=2, resume=first, name="g0", **kw))
    assert g.checkpoints[-1]["resume"]["restored"] == ["model", "optimizer"]
