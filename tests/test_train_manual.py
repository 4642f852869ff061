"""ckptfix.train.manual and the tutorial network: the hand-written data-parallel tutorial runs exactly
(network, parameter count, init (He-scaled, or the tutorial's with init="tutorial"), plain SGD,
scatter-style split), checked against torch itself."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from ckptfix.train import TrainConfig, train
from ckptfix.train.manual import scatter_sizes
from ckptfix.train.models import TutorialLeNet, build_model, tutorial_forward

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from train_compare import compare_manual_to_single  # a harness, not in the wheel

SMALL = dict(train_samples=512, test_samples=128, quiet=True)


def test_tutorial_network_shape_count_and_init():
    m = build_model("tutorial", 0)
    assert sum(p.numel() for p in m.parameters()) == 129_068
    shapes = [tuple(p.shape) for p in m.params]
    assert shapes == [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]
    weights = [p.detach() for p in m.params[0::2]]
    for w, b, fan_in in zip(weights, [p.detach() for p in m.params[1::2]], (9, 500, 800, 128), strict=True):
        assert torch.count_nonzero(b) == 0  # zero biases
        std = (2 / fan_in) ** 0.5  # He-scaled N(0, sqrt(2 / fan_in)) by default
        assert abs(float(w.std()) - std) < 0.15 * std and abs(float(w.mean())) < 0.1 * std
    tut = build_model("tutorial", 0, init="tutorial")
    for w in [p.detach() for p in tut.params[0::2]]:
        assert abs(float(w.std()) - 0.01) < 0.002 and abs(float(w.mean())) < 0.002  # the tutorial's N(0, 0.01)
    # the layers, spelled out with torch's own modules, give the same logits
    x = torch.randn(4, 1, 28, 28)
    w1, b1, w2, b2, w3, b3, w4, b4 = m.params
    ref = F.avg_pool2d(F.relu(F.conv2d(x, w1, b1)), 2)
    ref = F.avg_pool2d(F.relu(F.conv2d(ref, w2, b2)), 2)
    ref = F.linear(F.relu(F.linear(ref.flatten(1), w3.t(), b3)), w4.t(), b4)
    assert torch.allclose(m(x), ref, atol=1e-6) and torch.equal(m(x), tutorial_forward(x, m.params))
    assert list(TutorialLeNet().state_dict()) == ["w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4"]


@pytest.mark.parametrize("n", [0, 1, 5, 10, 29, 30, 31, 64, 256, 257])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 8])
def test_scatter_sizes_follow_torch_chunk(n, k):
    """nn.parallel.scatter cuts with Tensor.chunk (comm.scatter with chunk_sizes=None)."""
    want = [c.shape[0] for c in torch.arange(n).chunk(k)] if n else []
    want += [0] * (k - len(want))
    assert scatter_sizes(n, k) == want


def test_scatter_sizes_examples():
    assert scatter_sizes(30, 4) == [8, 8, 8, 6]  # not tensor_split's 8, 8, 7, 7
    assert scatter_sizes(30, 3) == [10, 10, 10]
    assert scatter_sizes(10, 3) == [4, 4, 2]


def test_manual_runs_the_tutorial_exactly(tmp_path, capsys):
    """lr 0.2, batch 256, no momentum, 4 replicas, tutorial network; uneven last batch shown."""
    res = train(
        TrainConfig(
            out=str(tmp_path),
            mode="manual",
            model="tutorial",
            lr=0.2,
            momentum=0.0,
            batch_size=256,
            replicas=4,
            epochs=1,
            train_samples=600,
            test_samples=64,
            show_split=True,
        )
    )
    err = capsys.readouterr().err
    assert "batch of 256 -> replicas: 64, 64, 64, 64" in err
    assert "batch of 88 -> replicas: 22, 22, 22, 22" in err  # 600 = 256 + 256 + 88
    ck = torch.load(res.final_checkpoint, weights_only=True)
    g = ck["optimizer_state_dict"]["param_groups"][0]
    assert (g["lr"], g["momentum"], g["weight_decay"]) == (0.2, 0.0, 0.0)
    assert ck["optimizer_state_dict"]["state"] == {} or all(
        v.get("momentum_buffer") is None for v in ck["optimizer_state_dict"]["state"].values()
    )
    assert ck["args"]["model"] == "tutorial" and list(ck["model_state_dict"])[0] == "w1"


def test_manual_tutorial_matches_single(tmp_path):
    r = compare_manual_to_single(
        replicas=4,
        out=str(tmp_path),
        model="tutorial",
        lr=0.2,
        momentum=0.0,
        batch_size=30,
        epochs=1,
        train_samples=300,
        test_samples=64,
    )
    assert r["max_abs_diff"] < 1e-5


def test_uneven_split_last_batch_and_weight_decay(tmp_path, capsys):
    train(
        TrainConfig(
            out=str(tmp_path),
            mode="manual",
            replicas=3,
            batch_size=30,
            epochs=1,
            train_samples=40,
            test_samples=16,
            weight_decay=1e-4,
            show_split=True,
        )
    )
    err = capsys.readouterr().err
    assert "batch of 30 -> replicas: 10, 10, 10" in err and "batch of 10 -> replicas: 4, 4, 2" in err


def test_dp_show_split_on_cpu_says_it_did_not_split(tmp_path, capsys):
    train(
        TrainConfig(
            out=str(tmp_path),
            mode="dp",
            batch_size=30,
            epochs=1,
            train_samples=40,
            test_samples=16,
            show_split=True,
            device="cpu",
        )
    )
    err = capsys.readouterr().err
    assert "DataParallel has one device here (cpu), so it does not split" in err
    assert "In Model: input size (30, 1, 28, 28)" in err and "In Model: input size (10, 1, 28, 28)" in err
    assert "batch 2 (epoch 1):" in err
