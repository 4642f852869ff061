"""The nvidia-smi runner: exit codes, decoded output, PATH look-up, a missing program, no descriptor left open."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ckptfix.errors import GpuToolingError
from ckptfix.gpu.runner import RunResult, run_parallel, subprocess_runner

#: (script, exit code, stdout, stderr): what nvidia-smi's callers get, as Popen(text=True, errors="replace") gives it
SCRIPTS = {
    "crlf and bad utf-8": (
        "printf 'a\\r\\nb\\rc\\n\\377\\376 end'; printf 'warn\\r\\n' >&2",
        0,
        "a\nb\nc\n\ufffd\ufffd end",
        "warn\n",
    ),
    "exit code": ("echo out; echo err >&2; exit 3", 3, "out\n", "err\n"),
    "killed": ("echo before; kill -9 $$", -9, "before\n", ""),
    "silent": ("true", 0, "", ""),
    "stdin is empty": ("cat; echo done", 0, "done\n", ""),
    "big output": ("seq 1 200000", 0, "".join(f"{i}\n" for i in range(1, 200001)), ""),
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_runner_returns_the_exit_code_and_decoded_output(name, tmp_path):
    script, code, out, err = SCRIPTS[name]
    prog = tmp_path / "prog"
    prog.write_text(f"#!/bin/sh\n{script}\n")
    prog.chmod(0o755)
    want = RunResult(code, out, err)
    assert subprocess_runner([str(prog), "x"], 60) == want
    assert run_parallel([[str(prog), "x"], [str(prog), "x"]], 60) == [want, want]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_nvidia_smi_gets_sigpipe_back(tmp_path):
    """Python ignores SIGPIPE; nvidia-smi (and what it starts) runs with the default back."""
    prog = tmp_path / "prog"
    prog.write_text("#!/bin/sh\ngrep SigIgn /proc/self/status\n")
    prog.chmod(0o755)
    mask = int(subprocess_runner([str(prog)], 60).stdout.split()[1], 16)
    assert not mask & (1 << (signal.SIGPIPE - 1)) and not mask & (1 << (signal.SIGXFSZ - 1))


def test_runner_finds_a_bare_name_on_path_and_maps_a_missing_one(tmp_path, monkeypatch):
    prog = tmp_path / "fake-smi-for-ckptfix"
    prog.write_text('#!/bin/sh\necho "$0 $1 $LC_ALL"\n')
    prog.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert subprocess_runner(["fake-smi-for-ckptfix", "q"], 60) == RunResult(0, f"{prog} q C\n", "")
    with pytest.raises(GpuToolingError, match="not found"):
        subprocess_runner(["no-such-smi-for-ckptfix"], 60)
    with pytest.raises(GpuToolingError, match="permission denied"):
        run_parallel([[str(tmp_path)]], 60)  # a folder


def test_runner_leaves_no_descriptor_open(tmp_path):
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc")
    prog = tmp_path / "prog"
    prog.write_text("#!/bin/sh\necho hi\n")
    prog.chmod(0o755)
    before = set(os.listdir("/proc/self/fd"))
    for _ in range(3):
        subprocess_runner([str(prog)], 60)
        run_parallel([[str(prog)], [str(prog)]], 60)
        with pytest.raises(GpuToolingError):
            run_parallel([[str(prog)], [str(tmp_path / "nope")]], 60)
    assert set(os.listdir("/proc/self/fd")) <= before | {str(n) for n in range(3)}
