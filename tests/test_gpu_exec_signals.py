"""``pick-gpu -- CMD`` hands COMMAND the signal dispositions a shell would (issue 23, item 1)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import fake_smi_env, run_cli

# read by the exec'd process itself (grep, through `exec`): a shell that forks would show its own mask while it
# waits (dash blocks every signal around fork and wait), which says nothing about what pick-gpu handed over
SHOW = "exec grep -E '^Sig(Ign|Blk):' /proc/self/status"


@pytest.fixture
def fake_env(tmp_path: Path) -> dict[str, str]:
    return fake_smi_env(tmp_path)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_command_gets_the_shells_signal_dispositions(fake_env):
    # what a shell started from here gives its commands (subprocess restores Python's ignored signals)
    plain = subprocess.run(["sh", "-c", SHOW], capture_output=True, text=True, env=fake_env, check=True).stdout
    r = run_cli("pick-gpu", "--", "sh", "-c", SHOW, scenario="two_free", env=fake_env)
    assert r.rc == 0, r
    assert r.out == plain, r


def test_broken_pipe_kills_the_writer_quietly(fake_env):
    # SIGPIPE ignored: `yes` would print "yes: standard output: Broken pipe" and exit 1
    r = run_cli("pick-gpu", "--", "sh", "-c", "yes | head -1; echo done", scenario="two_free", env=fake_env)
    assert r.rc == 0, r
    assert r.out == "y\ndone\n", r
    assert "Broken pipe" not in r.err and "broken pipe" not in r.err.lower(), r
