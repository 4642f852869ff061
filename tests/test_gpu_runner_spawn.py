"""The nvidia-smi runner without :mod:`subprocess` (issue 25, start-up): it returns what ``Popen(text=True,
errors="replace").communicate()`` returned, for the same programs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ckptfix.errors import GpuToolingError
from ckptfix.gpu.runner import RunResult, nvidia_smi_env, run_parallel, subprocess_runner

SCRIPTS = {
    "crlf and bad utf-8": "printf 'a\\r\\nb\\rc\\n\\377\\376 end'; printf 'warn\\r\\n' >&2",
    "exit code": "echo out; echo err >&2; exit 3",
    "killed": "echo before; kill -9 $$",
    "silent": "true",
    # Python ignores SIGPIPE; the child gets the default back (a hex mask of the ignored signals)
    "signals ignored": "grep SigIgn /proc/self/status || echo no-proc",
    "stdin is empty": "cat; echo done",
    "big output": "seq 1 200000",
}


def _popen(argv: list[str]) -> RunResult:
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=nvidia_smi_env(),
        start_new_session=True,
    )
    so, se = p.communicate(timeout=60)
    return RunResult(p.returncode, so or "", se or "")


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_runner_returns_what_popen_returned(name, tmp_path):
    prog = tmp_path / "prog"
    prog.write_text(f"#!/bin/sh\n{SCRIPTS[name]}\n")
    prog.chmod(0o755)
    want = _standard(_popen([str(prog), "x"]))
    assert _standard(subprocess_runner([str(prog), "x"], 60)) == want
    assert [_standard(r) for r in run_parallel([[str(prog), "x"], [str(prog), "x"]], 60)] == [want, want]


def _standard(r: RunResult) -> RunResult:
    """``r`` with the ignored signals 32 and up left out: glibc's posix_spawn ignores its two internal ones
    (SIGCANCEL, SIGSETXID) in the child, which no program can handle but glibc itself."""
    if r.stdout.startswith("SigIgn:"):
        mask = int(r.stdout.split()[1], 16) & 0x7FFFFFFF
        return RunResult(r.returncode, f"SigIgn: {mask:x}\n", r.stderr, r.timed_out)
    return r


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
