"""Running nvidia-smi: where it is, one call (:func:`subprocess_runner`) or several at once, with timeouts.

The only module in :mod:`ckptfix.gpu` that starts processes.  A *runner* (``argv, timeout -> RunResult``)
is what :func:`ckptfix.gpu.smi.query` calls, so tests can replace the subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ckptfix.errors import GpuQueryError, GpuToolingError

__all__ = ["RunResult", "Runner", "find_nvidia_smi", "nvidia_smi_env", "subprocess_runner", "run_parallel"]


@dataclass(frozen=True)
class RunResult:
    """What one nvidia-smi call returned."""

    returncode: int
    stdout: str
    stderr: str = ""
    timed_out: bool = False  # only for an optional call (see :func:`run_parallel`): it did not answer in time


Runner = Callable[[Sequence[str], float], RunResult]


# ----------------------------------------------------------------------------- running


#: where WSL2 keeps nvidia-smi (the Windows driver's Linux side): off PATH for root, SSH sessions and services
WSL_LIB_DIR = "/usr/lib/wsl/lib"
#: the GPU paravirtualisation device that exists only under WSL2
WSL_GPU_DEVICE = "/dev/dxg"


def find_nvidia_smi(
    env: Mapping[str, str] | None = None, *, wsl_dir: str = WSL_LIB_DIR, wsl_device: str = WSL_GPU_DEVICE
) -> str:
    """The nvidia-smi to run: ``$CKPTFIX_NVIDIA_SMI``, the one on ``PATH``, else (WSL2: ``wsl_device`` exists)
    the one in ``wsl_dir``.

    Args:
        env: the environment to read (default ``os.environ``).
        wsl_dir: where WSL2 keeps nvidia-smi (tests).
        wsl_device: the device whose presence means WSL2 (tests).

    Raises:
        GpuToolingError: none found (exit code 20); the message names ``CKPTFIX_NVIDIA_SMI``.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    explicit = environ.get("CKPTFIX_NVIDIA_SMI")
    if explicit:
        return explicit
    found = _which("nvidia-smi", environ.get("PATH", os.defpath))
    wsl = os.path.exists(wsl_device)
    if not found and wsl:
        found = _which("nvidia-smi", wsl_dir)
    if not found:
        if wsl:
            raise GpuToolingError(
                f"nvidia-smi not found on PATH nor in {wsl_dir} (this is WSL2: {wsl_device} exists): install the "
                "NVIDIA driver on the Windows side, or set CKPTFIX_NVIDIA_SMI to where nvidia-smi is; or run on CPU"
            )
        raise GpuToolingError(
            "nvidia-smi not found on PATH: no NVIDIA driver is installed here; run on CPU or install the driver "
            "(if nvidia-smi is elsewhere, set CKPTFIX_NVIDIA_SMI to its path)"
        )
    return found


def _which(name: str, path: str) -> str | None:
    """``shutil.which`` without importing shutil (and its compression modules) on the fast path."""
    for d in path.split(os.pathsep):
        cand = os.path.join(d or ".", name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def subprocess_runner(argv: Sequence[str], timeout: float) -> RunResult:
    """Run one command; map a missing/unrunnable binary and a timeout to ckptfix errors.

    Raises:
        GpuToolingError: the program is missing or cannot be executed (exit code 20).
        GpuQueryError: it did not answer within ``timeout`` (exit code 25).
    """
    return run_parallel([list(argv)], timeout)[0]


def nvidia_smi_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment nvidia-smi runs in: ``LC_ALL=C``, so that no locale prints a decimal comma
    (``47,5`` in a comma-separated table shifts every later column).

    Args:
        base: the environment to start from (default ``os.environ``).
    """
    env = dict(os.environ if base is None else base)
    env["LC_ALL"] = "C"
    env["LANG"] = "C"
    env.pop("LANGUAGE", None)
    return env


def _start(argv: Sequence[str]) -> subprocess.Popen[str]:
    """nvidia-smi in its own session (process group), so that a hung one is killed with every child it started;
    a missing or unrunnable program as :class:`GpuToolingError`."""
    try:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=nvidia_smi_env(),
            start_new_session=True,
        )
    except FileNotFoundError:
        raise GpuToolingError(
            f"{argv[0]} not found: no NVIDIA driver is installed here; run on CPU or install the driver"
        ) from None
    except PermissionError:
        raise GpuToolingError(f"{argv[0]} cannot be executed (permission denied)") from None


def _kill_group(p: subprocess.Popen[str]) -> None:
    """Kill ``p`` and its whole process group (it leads one: :func:`_start`), then reap it."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.kill()
    p.wait()


def run_parallel(cmds: list[list[str]], timeout: float, optional: frozenset[int] = frozenset()) -> list[RunResult]:
    """Start several commands at once and wait for all (saves a whole nvidia-smi start-up).

    A command whose position is in ``optional`` that does not answer in time is killed and
    reported as ``RunResult(-1, "", "", timed_out=True)``; any other timeout raises.

    Raises:
        GpuToolingError: a program is missing or cannot be executed (exit code 20).
        GpuQueryError: a command not in ``optional`` did not answer in time (exit code 25).
    """
    deadline = time.monotonic() + timeout
    procs: list[subprocess.Popen[str]] = []
    try:
        for argv in cmds:
            procs.append(_start(argv))
        out: list[RunResult] = []
        for i, p in enumerate(procs):
            # all run at once and share the deadline; one that ended before it is read even when the deadline
            # has passed while an earlier one was waited for
            left = max(deadline - time.monotonic(), 0.0 if p.poll() is None else 1.0)
            try:
                stdout, stderr = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                if i not in optional:
                    raise GpuQueryError(
                        f"nvidia-smi did not answer within {timeout:g}s (a hung GPU or driver?): check `dmesg`, "
                        "or retry"
                    ) from None
                _kill_group(p)
                out.append(RunResult(-1, "", "", timed_out=True))
            else:
                out.append(RunResult(p.returncode, stdout or "", stderr or ""))
        return out
    finally:
        for p in procs:
            if p.returncode is None:
                _kill_group(p)
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()
