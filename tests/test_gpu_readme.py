"""The documented pick-gpu lines (docs/sections/gpus.md, linked from the README), run in order in one shell
against the fake nvidia-smi, behave as shown."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIX = Path(__file__).parent / "fixtures" / "nvidia-smi"
SCENARIO = "h200_busy"  # the 8x H200 box the README's output comes from
TRAIN = """import os, sys
print("train.py sees CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"), sys.argv[1:])
"""


def readme_block() -> tuple[list[str], list[str]]:
    """The ``$ `` commands of the pick-gpu console block, and the output lines shown under the first one."""
    text = (ROOT / "docs" / "sections" / "gpus.md").read_text()
    section = text[text.index("### `ckptfix pick-gpu` in a shell, step by step") :]
    section = section[: section.index("\n### ", 5)]
    block = section[section.index("```console\n") + 11 :]
    block = block[: block.index("```")]
    cmds, shown = [], []
    for line in block.splitlines():
        if line.startswith("$ "):
            cmds.append(line[2:])
        elif len(cmds) == 1:
            shown.append(line)
    return cmds, shown


@pytest.fixture
def shell(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(FIX / "fake-nvidia-smi.sh", bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    (bin_dir / "ckptfix").write_text(f'#!/bin/sh\nexec {sys.executable} -m ckptfix "$@"\n')
    (bin_dir / "ckptfix").chmod(0o755)
    os.symlink(sys.executable, bin_dir / "python")
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "CKPTFIX_"))}
    env.update(
        PATH=f"{bin_dir}:/usr/bin:/bin",
        FAKE_SMI_DIR=str(FIX / "scenarios"),
        FAKE_SMI_SCENARIO=SCENARIO,
        CKPTFIX_LEASE_DIR=str(tmp_path / "leases"),
        PYTHONPATH=str(ROOT),
    )

    def run(lines: list[str]) -> subprocess.CompletedProcess[str]:
        script = ["set -e"]
        for i, line in enumerate(lines):
            script += [
                f"echo '::step {i}' >&2; echo '::step {i}'",
                line,
                f'echo "::cvd {i} ${{CUDA_VISIBLE_DEVICES-<unset>}}"',
            ]
        return subprocess.run(
            ["bash", "-c", "\n".join(script)], env=env, cwd=work, capture_output=True, text=True, timeout=600
        )

    return run


def _steps(out: str) -> dict[int, str]:
    parts = re.split(r"^::step (\d+)\n", out, flags=re.M)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


def test_readme_pick_gpu_sequence_runs_in_order(shell):
    cmds, shown = readme_block()
    assert any("--release" in c for c in cmds) and "--lease 0" in cmds[0]
    r = shell(cmds)
    assert r.returncode == 0, (r.stdout, r.stderr)
    out, err = _steps(r.stdout), _steps(r.stderr)
    # 1: what the README shows (stdout and stderr together; "..." elides the rest of a line)
    both = (out[0] + err[0]).splitlines()
    for want in shown:
        pat = re.compile(re.escape(want).replace(re.escape("..."), ".*") + "$")
        assert any(pat.match(line) for line in both), (want, both)
    assert "leased until" not in err[0]  # --lease 0: nothing reserved
    # 2: eval set exactly one GPU, the best one
    cvd = re.search(r"^::cvd 1 (.*)$", r.stdout, re.M).group(1)
    assert cvd.startswith("GPU-") and "," not in cvd
    # 3: --release gave that lease back
    assert out[2].splitlines()[0] == cvd and "released" in err[2]
    # 4: the command ran on that GPU (it is the only one the shell sees) and got its arguments
    assert f"train.py sees CUDA_VISIBLE_DEVICES={cvd} ['--epochs', '10']" in out[3]


def test_without_release_the_command_takes_over_the_shells_own_lease(shell):
    cmds, _ = readme_block()
    r = shell([c for c in cmds if "--release" not in c])
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "train.py sees CUDA_VISIBLE_DEVICES=GPU-" in r.stdout


def test_another_shell_cannot_take_the_lease(shell):
    cmds, _ = readme_block()
    export = next(c for c in cmds if "--export" in c)
    r = shell([export, "unset CKPTFIX_LEASE_TOKEN", "ckptfix pick-gpu -- python train.py"])
    assert r.returncode == 22 and "leased by another job" in r.stderr, (r.stdout, r.stderr)


def test_eval_fails_loudly_when_nothing_is_picked(shell):
    r = shell(['eval "$(ckptfix pick-gpu --export --min-free 1000GiB)"', "echo reached"])
    assert r.returncode == 22, (r.stdout, r.stderr)
    assert "reached" not in r.stdout and "::cvd 0" not in r.stdout
    assert "nothing picked, CUDA_VISIBLE_DEVICES unchanged" in r.stderr and "Error: " in r.stderr
    # without `set -e` the eval still reports failure through $?
    r = shell(['set +e; eval "$(ckptfix pick-gpu --export --min-free 1000GiB)"; echo "status=$?"'])
    assert "status=22" in r.stdout
