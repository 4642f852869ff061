"""What the tests share: one way to run the CLI (and Python) in a fresh process, and a fake nvidia-smi on PATH.

``run_cli`` runs ``ckptfix`` like the console script does (``ckptfix.cli.main``) in a new interpreter and also
reports whether torch ended up imported.  ``fake_smi_env`` builds an environment whose ``nvidia-smi`` is
tests/fixtures/nvidia-smi/fake-nvidia-smi.sh, replaying a scenario of tests/fixtures/nvidia-smi/scenarios/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

ROOT = Path(__file__).resolve().parent.parent
FAKE_SMI = Path(__file__).parent / "fixtures" / "nvidia-smi"
SCENARIOS = FAKE_SMI / "scenarios"

# the console script's entry point, then "True"/"False" (torch imported?) into $TORCH_REPORT when set
CLI_PROGRAM = r"""
import os, sys, pathlib
from ckptfix.cli import main
rc = main(sys.argv[1:])
sys.stdout.flush()
if os.environ.get("TORCH_REPORT"):
    pathlib.Path(os.environ["TORCH_REPORT"]).write_text(str("torch" in sys.modules))
sys.exit(rc)
"""

# variables that change what the GPU commands see or report: a test sets them explicitly
_MACHINE_VARS = ("CUDA_", "CKPTFIX_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "NCCL_", "TORCH_NCCL")


@dataclass(frozen=True)
class CliRun:
    """One finished ``ckptfix`` run: exit code, stdout, stderr, and whether torch was imported."""

    rc: int
    out: str
    err: str
    torch_imported: bool | None  # None: the process died before reporting

    @property
    def returncode(self) -> int:
        return self.rc

    @property
    def stdout(self) -> str:
        return self.out

    @property
    def stderr(self) -> str:
        return self.err


def cli_argv(*args: str) -> list[str]:
    """The argv that runs ``ckptfix ARGS`` like the console script (for ``subprocess.Popen`` in a test).

    Args:
        args: the command line after ``ckptfix``.

    Returns:
        ``[python, "-c", CLI_PROGRAM, *args]``.
    """
    return [sys.executable, "-c", CLI_PROGRAM, *map(str, args)]


def run_cli(
    *args: str,
    env: Mapping[str, str] | None = None,
    scenario: str | None = None,
    timeout: float = 60,
    cwd: str | Path | None = None,
    **extra: str,
) -> CliRun:
    """Run ``ckptfix ARGS`` in a fresh interpreter.

    Args:
        args: the command line after ``ckptfix``.
        env: the whole environment (default: this process's); e.g. from :func:`fake_smi_env`.
        scenario: the fake nvidia-smi's scenario (``$FAKE_SMI_SCENARIO``).
        timeout: seconds before the test fails.
        cwd: working directory (default: the repository root).
        extra: more environment variables.

    Returns:
        The :class:`CliRun`.
    """
    e = dict(os.environ if env is None else env)
    e.setdefault("PYTHONPATH", str(ROOT))
    if scenario is not None:
        e["FAKE_SMI_SCENARIO"] = scenario
    e.update(extra)
    fd, report = tempfile.mkstemp(prefix="ckptfix-torch-report-")
    os.close(fd)
    e["TORCH_REPORT"] = report
    try:
        p = subprocess.run(
            cli_argv(*args),
            env=e,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT if cwd is None else cwd,
        )
        said = Path(report).read_text()
    finally:
        os.unlink(report)
    return CliRun(p.returncode, p.stdout, p.stderr, None if not said else said == "True")


def run_python(
    code: str, *, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``python -c CODE`` in a fresh interpreter from the repository root (stdout and stderr captured).

    Args:
        code: the program.
        env: the whole environment (default: this process's).
        timeout: seconds before the test fails.

    Returns:
        The finished process.
    """
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=None if env is None else dict(env),
        timeout=timeout,
    )


def fake_smi_env(tmp_path: Path, scenario: str | None = None) -> dict[str, str]:
    """An environment with the fake nvidia-smi first on PATH, a private lease directory, no CUDA/rank variables.

    Args:
        tmp_path: the test's directory (the fake's ``bin/``, its call log ``smi.log`` and ``leases/`` go there).
        scenario: the scenario to replay (or pass ``scenario=`` to :func:`run_cli`).

    Returns:
        The environment.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shutil.copy(FAKE_SMI / "fake-nvidia-smi.sh", bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_MACHINE_VARS)}
    env.update(
        PATH=f"{bin_dir}:/usr/bin:/bin",
        FAKE_SMI_DIR=str(SCENARIOS),
        FAKE_SMI_LOG=str(tmp_path / "smi.log"),
        CKPTFIX_LEASE_DIR=str(tmp_path / "leases"),
        PYTHONPATH=str(ROOT),
    )
    if scenario is not None:
        env["FAKE_SMI_SCENARIO"] = scenario
    return env


def smi_calls(env: Mapping[str, str]) -> list[str]:
    """The fake nvidia-smi's calls so far, one line each (``query-gpu ...``, ``apps ...``, ``L ...``).

    Args:
        env: the environment from :func:`fake_smi_env`.

    Returns:
        The logged calls, oldest first.
    """
    log = Path(env["FAKE_SMI_LOG"])
    return log.read_text().splitlines() if log.exists() else []
