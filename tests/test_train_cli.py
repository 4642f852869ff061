"""``ckptfix train`` usage errors, the ddp/fsdp launcher's pre-flight and error reporting, and --bench options."""

from __future__ import annotations

import json
import os

import pytest

from ckptfix.cli import main
from ckptfix.train import ddp

TINY = ["--train-samples", "128", "--test-samples", "32", "--epochs", "1"]


@pytest.mark.parametrize(
    "args",
    [
        ["--show-split"],
        ["--mode", "manual", "--amp"],
        ["--save-format", "dcp", "--legacy-format"],
        ["--nproc", "2"],
        ["--mode", "fsdp", "--amp"],
        ["--bench", "--resume", __file__],
        ["--bench", "--name", "x"],
    ],
)
def test_usage_errors_exit_2(tmp_path, capsys, args):
    rc = main(["train", "--out", str(tmp_path), *TINY, *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and "Error" in err
    assert not os.listdir(tmp_path)


def test_in_process_mode_under_torchrun_is_refused(tmp_path, capsys, monkeypatch):
    for k, v in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(k, v)
    rc = main(["train", "--mode", "single", "--out", str(tmp_path), *TINY])
    assert rc == 2 and "every worker would train the same run" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_ddp_config_errors_are_found_before_torchrun(tmp_path, capsys, monkeypatch):
    import subprocess

    def no_launch(*a, **k):
        raise AssertionError("torchrun must not start")

    monkeypatch.setattr(subprocess, "Popen", no_launch)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    rc = main(["train", "--mode", "ddp", "--out", str(tmp_path / "o"), *TINY, "--resume", str(bad)])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and err.startswith("Error: "), err


def test_failure_cause_picks_the_real_line():
    log = [
        "W1123 warning: something",
        "Traceback (most recent call last):",
        '  File "x.py", line 3, in <module>',
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local address "
        "(Address already in use)",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
    ]
    assert ddp.failure_cause(log).startswith("torch.distributed.DistNetworkError: The server socket")
    assert ddp.failure_cause(["[rank 1] Error: boom"] + log) == "[rank 1] Error: boom"
    assert ddp.failure_cause([]) == "no output"


def test_bench_honours_mode_amp_out_and_names_existing_checkpoints(tmp_path, capsys):
    rc = main(
        [
            "train",
            "--bench",
            "--mode",
            "single",
            "--amp",
            "--out",
            str(tmp_path),
            "--save-style",
            "clean",
            *TINY,
            "--json",
        ]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    doc = json.loads(cap.out)
    rows = doc["bench"]
    assert [r["mode"] for r in rows] == ["single", "single+amp"]
    assert rows[0]["amp_dtype"] is None and rows[1]["amp_dtype"] == "bfloat16"
    assert "bfloat16 autocast" in cap.err
    for r in rows:
        assert os.path.exists(r["checkpoint"]) and r["checkpoint"].startswith(str(tmp_path))
    man = json.load(open(tmp_path / "checkpoints.json"))
    assert {c["save_style"] for c in man["checkpoints"]} == {"clean"}
    assert {c["amp"] for c in man["checkpoints"]} == {False, True}


def test_bench_compile_leaves_out_rows_that_cannot_compile(tmp_path, capsys):
    from ckptfix.train.bench import bench_configs

    rows, skipped = bench_configs("cpu", None, {"compile": True})
    assert [label for label, _ in rows] == ["single", "dp", "ddp"]
    assert all(kw["compile"] for _, kw in rows)
    assert skipped == ["manual (no --compile in manual mode)", "fsdp (no --compile in fsdp mode)"]
    rows, skipped = bench_configs("cpu", None, {}, amp=True)
    assert [label for label, _ in rows] == ["single", "single+amp", "dp", "dp+amp", "manual", "ddp", "ddp+amp", "fsdp"]
    # an explicit mode that cannot compile is a usage error
    assert main(["train", "--bench", "--mode", "manual", "--compile", *TINY]) == 2
