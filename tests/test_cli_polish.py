"""The CLI as users meet it (issue 23, items 11-16): paths shown as typed, one wording per mistake,
Ctrl-C, the directory hint, the command list, torch's numpy warning, the trainer's thread default."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptfix.cli import main
from ckptfix.display import shown_path
from ckptfix.files.atomic import atomic_output, output_error

from helpers import ROOT, run_cli

SHARDED = Path(__file__).parent / "fixtures" / "ckpt" / "sharded"


def _py(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -c CODE`` in ``cwd``, this tree's ckptfix first on the path."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A working directory holding ``m.pt`` (DataParallel keys)."""
    torch.save({"module.a": torch.zeros(3), "module.b": torch.ones(2)}, tmp_path / "m.pt")
    return tmp_path


# ---------------------------------------------------------------- 11: paths as the user gave them


def test_shown_path_is_relative_under_the_current_directory(tmp_path):
    assert shown_path(str(tmp_path / "out" / "x.pt"), cwd=str(tmp_path)) == os.path.join("out", "x.pt")
    assert shown_path(str(tmp_path), cwd=str(tmp_path)) == "."
    assert shown_path("rel/x.pt", cwd=str(tmp_path)) == "rel/x.pt"
    assert shown_path("/elsewhere/x.pt", cwd=str(tmp_path)) == "/elsewhere/x.pt"
    assert shown_path(str(tmp_path) + "-sibling/x.pt", cwd=str(tmp_path)) == str(tmp_path) + "-sibling/x.pt"


def test_convert_prints_the_default_output_relative(work):
    r = run_cli("convert", "m.pt", cwd=work)
    assert r.rc == 0, r.err
    assert r.out == "m.safetensors\n"
    assert str(work) not in r.err and "converted m.pt" in r.err


def test_already_exists_and_missing_directory_name_the_path_as_typed(work):
    (work / "m.safetensors").write_bytes(b"x")
    r = run_cli("convert", "m.pt", cwd=work)
    assert r.rc == 9 and r.err.startswith("Error: m.safetensors already exists;"), r.err
    r = run_cli("strip-prefix", "m.pt", "-o", "out/y.pt", cwd=work)
    assert r.rc == 9 and r.err.startswith("Error: out: the output directory does not exist"), r.err


def test_sharded_rewrite_note_names_the_directory_as_typed(tmp_path):
    shutil.copytree(SHARDED, tmp_path / "sharded")
    r = run_cli("add-prefix", "sharded/pytorch_model.bin.index.json", "--prefix", "module.", "-o", "out", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "note: wrote 2 shard(s) and the index to out" in r.err and str(tmp_path) not in r.err + r.out


def test_trainer_manifest_is_shown_relative(tmp_path):
    r = run_cli(
        "train", "--out", "runs", "--epochs", "1", "--train-samples", "32", "--test-samples", "16", cwd=tmp_path
    )
    assert r.rc == 0, r.err
    assert "manifest: runs/checkpoints.json" in r.out and str(tmp_path) not in r.out
    assert "done: 1 checkpoint(s) in runs" in r.err


# ---------------------------------------------------------------- 13: Ctrl-C


def test_ctrl_c_says_nothing_was_written_and_exits_130(monkeypatch, capsys, work):
    import ckptfix.ops.inspect

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckptfix.ops.inspect, "inspect_checkpoint", interrupted)
    monkeypatch.setattr("ckptfix.files.atomic.FINISHED", [])
    rc = main(["inspect", str(work / "m.pt")])
    err = capsys.readouterr().err
    assert rc == 130
    assert err == "Error: interrupted; nothing was written\n"


def test_ctrl_c_names_what_was_kept(monkeypatch, capsys, work):
    import ckptfix.ops.inspect

    monkeypatch.chdir(work)
    monkeypatch.setattr("ckptfix.files.atomic.FINISHED", [])

    def half_done(*a, **k):
        with atomic_output(str(work / "first.pt")) as f:
            f.write(b"done")
        with atomic_output(str(work / "second.pt")) as f:
            f.write(b"half")
            raise KeyboardInterrupt

    monkeypatch.setattr(ckptfix.ops.inspect, "inspect_checkpoint", half_done)
    rc = main(["inspect", "m.pt"])
    err = capsys.readouterr().err
    assert rc == 130
    assert err.startswith("Error: interrupted; kept 1 output(s) finished before it: first.pt;"), err
    assert not (work / "second.pt").exists()
    assert not [p for p in os.listdir(work) if p.startswith(".second")]  # its temp file is gone


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


def test_a_real_sigint_gives_the_error_line(work):
    code = (
        "import os, signal, sys\n"
        "import ckptfix.ops.inspect\n"
        "def hang(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "ckptfix.ops.inspect.inspect_checkpoint = hang\n"
        "from ckptfix.cli import main\n"
        "sys.exit(main(['inspect', 'm.pt']))\n"
    )
    p = _py(code, work)
    assert p.returncode == 130, p.stderr
    assert p.stderr == "Error: interrupted; nothing was written\n"


def test_exit_code_130_is_an_error_class():
    from ckptfix.errors import InterruptedByUserError, all_error_classes

    assert InterruptedByUserError in all_error_classes() and InterruptedByUserError.exit_code == 130
    assert issubclass(InterruptedByUserError, KeyboardInterrupt)


# ---------------------------------------------------------------- 14: one wording for one mistake


def test_already_exists_is_worded_alike_by_every_command(work):
    (work / "m.stripped.pt").write_bytes(b"x")
    (work / "m.safetensors").write_bytes(b"x")
    strip = run_cli("strip-prefix", "m.pt", cwd=work).err
    conv = run_cli("convert", "m.pt", cwd=work).err
    tail = " already exists; pass --force to overwrite it, or -o to choose another path\n"
    assert strip == "Error: m.stripped.pt" + tail
    assert conv == "Error: m.safetensors" + tail


def test_output_is_input_is_worded_alike(work):
    strip = run_cli("strip-prefix", "m.pt", "-o", "m.pt", cwd=work).err
    conv = run_cli("convert", "m.safetensors", "-o", "m.safetensors", cwd=work)
    assert strip.startswith("Error: m.pt: the output is the input; -o to choose another path")
    assert "--in-place" in strip
    torch.save({"a": torch.zeros(2)}, work / "n.pt")
    conv = run_cli("convert", "n.pt", "-o", "n.pt", cwd=work).err
    assert conv == "Error: n.pt: the output is the input; -o to choose another path\n"


def test_permission_denied_is_said_once():
    e = output_error(OSError(errno.EACCES, os.strerror(errno.EACCES)), "/nowhere/x.pt")
    assert str(e).lower().count("permission denied") == 1, str(e)


def test_read_only_file_system_is_worded_alike_by_every_command(work, monkeypatch):
    """convert checks the directory first (os.access fails EROFS on a read-only mount), strip-prefix fails
    creating its temp file (EROFS): one wording, not 'rofs: permission denied' for one of them (issue #38 item 7).
    A read-only mount needs root to make, so the file system's answers are simulated for that one directory."""
    import tempfile

    rofs = work / "rofs"
    rofs.mkdir()
    real_access, real_statvfs, real_mkstemp = os.access, os.statvfs, tempfile.mkstemp

    class RoStat:
        def __init__(self, st):
            self.f_flag = st.f_flag | os.ST_RDONLY

    def on_rofs(p) -> bool:
        return os.path.abspath(os.fspath(p)) == str(rofs)

    def mkstemp(suffix=None, prefix=None, dir=None, text=False):
        if dir is not None and on_rofs(dir):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_mkstemp(suffix, prefix, dir, text)

    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if on_rofs(p) else real_access(p, mode, **k))
    monkeypatch.setattr(os, "statvfs", lambda p: RoStat(real_statvfs(p)) if on_rofs(p) else real_statvfs(p))
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    tail = ": read-only file system; -o to choose a writable location\n"
    conv = run_cli("convert", "m.pt", "-o", "rofs/m.safetensors", cwd=work, isolated=False)
    assert (conv.rc, conv.err) == (9, "Error: rofs" + tail)
    strip = run_cli("strip-prefix", "m.pt", "-o", "rofs/m.pt", cwd=work, isolated=False)
    assert (strip.rc, strip.err) == (9, "Error: " + os.path.join("rofs", "m.pt") + tail)


def test_a_directory_that_refuses_files_is_not_called_missing(tmp_path):
    e = output_error(OSError(errno.ENOENT, os.strerror(errno.ENOENT)), str(tmp_path / "x.pt"))
    assert "does not exist" not in str(e) and "cannot create a file there" in str(e)
    e = output_error(OSError(errno.ENOENT, os.strerror(errno.ENOENT)), str(tmp_path / "no" / "x.pt"))
    assert "the output directory does not exist" in str(e)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_output_in_proc(work):
    r = run_cli("strip-prefix", "m.pt", "-o", "/proc/x.pt", cwd=work)
    assert r.rc == 9 and "does not exist" not in r.err, r.err


def test_a_directory_lists_real_checkpoints_before_probe_sidecars(tmp_path):
    d = tmp_path / "runs"
    d.mkdir()
    for n in ("a_epoch1.probe.pt", "a_epoch2.probe.pt", "b_epoch1.probe.pt", "z_epoch1.pt", "z_epoch2.pt"):
        torch.save({"x": torch.zeros(1)}, d / n)
    r = run_cli("inspect", "runs", cwd=tmp_path)
    assert r.rc == 3
    assert "it holds z_epoch1.pt, z_epoch2.pt, a_epoch1.probe.pt and 2 more: pass one of them" in r.err, r.err


def test_command_list_does_not_cut_demo_to_nothing():
    r = run_cli("--help", COLUMNS="80")
    line = next(x for x in r.out.splitlines() if x.strip().startswith("demo "))
    assert "End-to-end: train..." not in line and not line.endswith("...")


# ---------------------------------------------------------------- 15: torch's numpy warning


def test_no_numpy_warning_when_numpy_is_missing(tmp_path):
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "from ckptfix.cli import main\n"
        "args = ['train', '--out', 'r', '--epochs', '1', '--train-samples', '16', '--test-samples', '8', '-q']\n"
        "sys.exit(main(args))\n"
    )
    p = _py(code, tmp_path)
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


# ---------------------------------------------------------------- 16: one thread per process on CPU


def test_in_process_training_uses_one_thread_on_cpu_unless_told(monkeypatch, tmp_path):
    from ckptfix.train import TrainConfig, entry
    from ckptfix.train.run import Run

    seen: list[int] = []

    def fake_run(self):
        seen.append(torch.get_num_threads())
        raise SystemExit(0)

    monkeypatch.setattr(Run, "run", fake_run)
    before = torch.get_num_threads()
    for threads, want in ((None, 1), (2, 2)):
        with pytest.raises(SystemExit):
            entry.train(TrainConfig(out=str(tmp_path), device="cpu", threads=threads, quiet=True))
        assert seen[-1] == want
        assert torch.get_num_threads() == before
    assert entry.in_process_threads(TrainConfig(device="cpu")) == 1
    assert entry.in_process_threads(TrainConfig(device="cpu", threads=3)) == 3


def test_trainer_refusal_says_already_exists_with_the_path_as_typed(tmp_path):
    args = ("train", "--out", "runs", "--epochs", "1", "--train-samples", "32", "--test-samples", "16", "-q")
    assert run_cli(*args, cwd=tmp_path).rc == 0
    r = run_cli(*args, "--lr", "0.01", "--name", "x", cwd=tmp_path)  # a new run: fine
    assert r.rc == 0, r.err
    (tmp_path / "runs" / "y_epoch1.pt").write_bytes(b"not ours")
    r = run_cli(*args, "--name", "y", cwd=tmp_path)
    assert r.rc == 30, r.err  # TrainingError
    assert "runs/y_epoch1.pt already exists (written by something not listed in checkpoints.json); pass --force" in (
        r.err
    )
    assert str(tmp_path) not in r.err


def test_directory_outputs_say_permission_denied_once(tmp_path, monkeypatch):
    """DCP and sharded outputs go through the same wording (no 'cannot write X: X: permission denied')."""
    import tempfile

    from ckptfix.errors import OutputError
    from ckptfix.ops.rewrite.keys import add_prefix_checkpoint

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    shutil.copytree(SHARDED, tmp_path / "sharded")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "makedirs", refuse)
    with pytest.raises(OutputError) as ei:
        add_prefix_checkpoint("sharded/pytorch_model.bin.index.json", "module.", output="out")
    assert str(ei.value) == "out: permission denied; -o to choose a writable location"
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    from ckptfix.ops.convert.dcp_out import convert_to_dcp

    torch.save({"a": torch.zeros(2)}, tmp_path / "n.pt")
    from ckptfix.ops.convert import convert

    convert("n.pt", "n.safetensors")
    with pytest.raises(OutputError) as ei:
        convert_to_dcp("n.safetensors", "n.dcp")
    assert str(ei.value) == "n.dcp: permission denied; -o to choose a writable location"


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


def test_a_git_lfs_pointer_is_named_with_git_lfs_pull(work):
    """A clone without git-lfs leaves pointer files where the checkpoints were (issue #38 item 7). The pointer
    is written as git-lfs writes it (docs/spec.md of git-lfs: version, oid sha256, size; sorted keys)."""
    import hashlib

    real = (work / "m.pt").read_bytes()
    pointer = (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(real).hexdigest()}\nsize {len(real)}\n"
    )
    (work / "model.safetensors").write_text(pointer)
    (work / "m.pt").write_text(pointer)
    want = (
        f"a Git LFS pointer of a {len(real):,}-byte file, not the checkpoint (the clone did not download it); "
        "run `git lfs pull --include=NAME` (or `git lfs pull`) in the repository\n"
    )
    for args in (("inspect", "m.pt"), ("scan", "m.pt"), ("convert", "m.pt"), ("inspect", "model.safetensors")):
        r = run_cli(*args, cwd=work, isolated=False)
        name = args[1]
        assert (r.rc, r.err) == (4, f"Error: {name}: " + want.replace("NAME", name)), r.err
