"""Running nvidia-smi: a hung one is killed with its whole process group, and it runs with LC_ALL=C
(issue 23, items 3 and 7)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckptfix.errors import GpuQueryError
from ckptfix.gpu.runner import run_parallel, subprocess_runner

HUNG = """#!/bin/sh
# a hung nvidia-smi that started helpers of its own
sleep 300 & echo $! >> "{pids}"
sh -c 'sleep 300 & echo $! >> "{pids}"; wait' &
wait
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _hung_smi(tmp_path: Path) -> tuple[Path, Path]:
    pids = tmp_path / "pids"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(HUNG.format(pids=pids))
    smi.chmod(0o755)
    return smi, pids


def _wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + 10  # only to catch a hang
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_timed_out_call_kills_its_children(tmp_path):
    smi, pids = _hung_smi(tmp_path)
    with pytest.raises(GpuQueryError, match="did not answer"):
        subprocess_runner([str(smi), "--query-gpu=index"], 1.0)
    started = [int(x) for x in pids.read_text().split()]
    assert len(started) == 2
    left = _wait_gone(started)
    for p in left:  # clean up before failing
        os.kill(p, 9)
    assert left == [], "children of the timed-out nvidia-smi are still running"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_timed_out_parallel_calls_kill_their_children(tmp_path):
    smi, pids = _hung_smi(tmp_path)
    out = run_parallel([[str(smi), "a"], [str(smi), "b"]], 1.0, optional=frozenset({0, 1}))
    assert [r.timed_out for r in out] == [True, True]
    started = [int(x) for x in pids.read_text().split()]
    assert len(started) == 4
    left = _wait_gone(started)
    for p in left:
        os.kill(p, 9)
    assert left == []


def test_nvidia_smi_runs_in_the_c_locale(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "$LC_ALL|$LANG|${LC_NUMERIC-unset}"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")
    monkeypatch.setenv("LANG", "de_DE.UTF-8")
    r = subprocess_runner([str(smi)], 10)
    assert r.stdout.split("|")[:2] == ["C", "C"]
    (r,) = run_parallel([[str(smi)]], 10)
    assert r.stdout.split("|")[:2] == ["C", "C"]
