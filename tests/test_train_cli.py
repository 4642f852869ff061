"""``ckptfix train`` usage errors, the ddp/fsdp launcher's pre-flight and error reporting, and --bench options."""

from __future__ import annotations

import json
import os

import pytest

from ckptfix.cli import main
from ckptfix.train import ddp

from helpers import ROOT, run_cli, run_python

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


def test_cli_choices_and_defaults_come_from_the_config():
    from ckptfix.cli.train import train_cmd
    from ckptfix.train import config

    opts = {p.name: p for p in train_cmd.params}
    for name, choices in (
        ("mode", config.MODES),
        ("model", config.MODELS),
        ("device", config.DEVICES),
        ("allreduce", config.ALLREDUCES),
        ("save_style", config.SAVE_STYLES),
        ("save_format", config.SAVE_FORMATS),
    ):
        assert tuple(opts[name].type.choices) == choices, name
    fields = {f.name for f in config.dataclasses.fields(config.TrainConfig)}
    for name, opt in opts.items():
        if name in fields and name != "save_format" and not opt.is_flag:  # save_format: None = the mode's
            assert opt.default == config.default(name), name
    assert config.TrainConfig(mode="fsdp").save_format == "dcp" and config.TrainConfig().save_format == "pt"


def test_bench_options_keep_only_what_was_given(tmp_path):
    from ckptfix.train.bench import bench_options, check_bench_options
    from ckptfix.train.config import TrainConfig

    cfg = TrainConfig(out=str(tmp_path), epochs=1, lr=0.1, save_format="dcp")
    kw = bench_options(cfg, given={"lr"})
    assert kw["out"] is None and kw["modes"] is None and "save_format" not in kw and kw["lr"] == 0.1
    kw = bench_options(cfg, given={"out", "mode", "save_format"})
    assert kw["out"] == str(tmp_path) and kw["modes"] == ("single",) and kw["save_format"] == "dcp"
    from ckptfix.errors import TrainingError

    with pytest.raises(TrainingError, match="--replicas does not apply to --bench"):
        check_bench_options(TrainConfig(mode="manual", replicas=2), given={"replicas"})
    with pytest.raises(TrainingError, match="cannot be combined"):  # a row's own check, before anything runs
        check_bench_options(TrainConfig(save_format="dcp", legacy_format=True), given={"save_format"})


def test_trainer_manifest_is_shown_relative(tmp_path):
    args = ("train", "--out", "runs", "--epochs", "1", "--train-samples", "32", "--test-samples", "16")
    r = run_cli(*args, cwd=tmp_path, isolated=False)  # what it prints: in this process
    assert r.rc == 0, r.err
    assert "manifest: runs/checkpoints.json" in r.out and str(tmp_path) not in r.out
    assert "done: 1 checkpoint(s) in runs" in r.err


def test_ctrl_c_in_training_names_the_epochs_kept(monkeypatch, capsys, tmp_path):
    from ckptfix.train.run import Run

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("ckptfix.files.atomic.FINISHED", [])
    record = Run._record_epoch
    calls = []

    def interrupted_in_epoch_2(self, entry):
        calls.append(entry)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return record(self, entry)

    monkeypatch.setattr(Run, "_record_epoch", interrupted_in_epoch_2)
    args = ["train", "--out", "runs", "--epochs", "3", "--train-samples", "32", "--test-samples", "16", "-q"]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 130
    assert err == (
        "Error: interrupted; kept 3 output(s) finished before it: runs/single_epoch1.pt, "
        "runs/single_epoch1.probe.pt, runs/checkpoints.json; the one in progress was not written\n"
    )
    assert sorted(os.listdir(tmp_path / "runs")) == ["checkpoints.json", "single_epoch1.probe.pt", "single_epoch1.pt"]


def test_trainer_refusal_says_already_exists_with_the_path_as_typed(tmp_path):
    # what it says, not what the process does: in this process (entry.train restores torch's threads)
    args = ("train", "--out", "runs", "--epochs", "1", "--train-samples", "32", "--test-samples", "16", "-q")
    assert run_cli(*args, cwd=tmp_path, isolated=False).rc == 0
    r = run_cli(*args, "--lr", "0.01", "--name", "x", cwd=tmp_path, isolated=False)  # a new run: fine
    assert r.rc == 0, r.err
    (tmp_path / "runs" / "y_epoch1.pt").write_bytes(b"not ours")
    r = run_cli(*args, "--name", "y", cwd=tmp_path, isolated=False)
    assert r.rc == 30, r.err  # TrainingError
    assert "runs/y_epoch1.pt already exists (written by something not listed in checkpoints.json); pass --force" in (
        r.err
    )
    assert str(tmp_path) not in r.err


def test_ctrl_c_during_torchrun_names_what_the_workers_kept(monkeypatch, capsys, tmp_path):
    """ddp/fsdp: the workers write the files, so the launcher names the run's files its manifest lists."""
    import json

    from ckptfix.train import ddp

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("ckptfix.files.atomic.FINISHED", [])
    monkeypatch.setattr(ddp, "preflight", lambda cfg: None)

    def worker_wrote_epoch_1_then_ctrl_c(cmd, env, log_path, *, quiet, timeout):
        out = tmp_path / "runs"
        for name in ("ddp_epoch1.pt", "ddp_epoch1.probe.pt", "other_epoch1.pt"):
            (out / name).write_bytes(b"x")
        entries = [
            {"run": "ddp", "path": "ddp_epoch1.pt", "probe": {"file": "ddp_epoch1.probe.pt"}},
            {"run": "other", "path": "other_epoch1.pt"},
        ]
        (out / "checkpoints.json").write_text(json.dumps({"version": 1, "checkpoints": entries}))
        raise KeyboardInterrupt

    monkeypatch.setattr(ddp, "_run_torchrun", worker_wrote_epoch_1_then_ctrl_c)
    rc = main(["train", "--mode", "ddp", "--nproc", "2", "--device", "cpu", "--out", "runs", "-q"])
    err = capsys.readouterr().err
    assert rc == 130
    assert err == (
        "Error: interrupted; kept 3 output(s) finished before it: runs/ddp_epoch1.pt, runs/ddp_epoch1.probe.pt, "
        "runs/checkpoints.json; the one in progress was not written\n"
    )


def test_no_numpy_warning_when_numpy_is_missing(tmp_path):
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "from ckptfix.cli import main\n"
        "args = ['train', '--out', 'r', '--epochs', '1', '--train-samples', '16', '--test-samples', '8', '-q']\n"
        "sys.exit(main(args))\n"
    )
    p = run_python(code, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "NumPy" not in p.stderr and "numpy" not in p.stderr, p.stderr


def test_the_numpy_filter_is_narrow():
    import warnings

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("default")
        from ckptfix._torch import silence_numpy_warning

        silence_numpy_warning()
        warnings.warn("Failed to initialize NumPy: No module named 'numpy'", UserWarning, stacklevel=1)
        warnings.warn("some other warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in got] == ["some other warning"]
