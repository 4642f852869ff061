"""Running nvidia-smi: where it is, one call (:func:`subprocess_runner`) or several at once, with timeouts.

The only module in :mod:`ckptfix.gpu` that starts processes.  A *runner* (``argv, timeout -> RunResult``)
is what :func:`ckptfix.gpu.smi.query` calls, so tests can replace the subprocess.
"""

from __future__ import annotations

import _signal  # the signal numbers, without the signal module's enums (start-up)
import io
import os
import select
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ckptfix.errors import GpuQueryError, GpuToolingError

_SIGKILL = getattr(_signal, "SIGKILL", 9)
#: reset to their defaults in nvidia-smi (Python ignores SIGPIPE; Popen's restore_signals did the same)
_DEFAULT_SIGNALS = tuple(getattr(_signal, n) for n in ("SIGPIPE", "SIGXFSZ") if hasattr(_signal, n))

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

    Returns:
        The path (``$CKPTFIX_NVIDIA_SMI`` as given).

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

    Args:
        argv: the command.
        timeout: seconds to wait for it.

    Returns:
        Its exit code and output.

    Raises:
        GpuToolingError: the program is missing or cannot be executed (exit code 20).
        GpuQueryError: it did not answer within ``timeout`` (exit code 25).
    """
    p = _start_or_raise(argv)
    try:
        if not _communicate([p], time.monotonic() + timeout):
            raise GpuQueryError(
                f"nvidia-smi did not answer within {timeout:g}s (a hung GPU or driver?): check `dmesg`, or retry"
            )
    finally:
        if p.returncode is None:
            _kill_group(p)
        p.close()
    return p.result()


def nvidia_smi_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment nvidia-smi runs in: ``LC_ALL=C``, so that no locale prints a decimal comma
    (``47,5`` in a comma-separated table shifts every later column).

    Args:
        base: the environment to start from (default ``os.environ``).

    Returns:
        A copy of it with ``LC_ALL=C`` and ``LANG=C``.
    """
    env = dict(os.environ if base is None else base)
    env["LC_ALL"] = "C"
    env["LANG"] = "C"
    env.pop("LANGUAGE", None)
    return env


class _Proc:
    """A started command: its pid, the read ends of its stdout and stderr pipes, what they gave, its exit code.

    What :class:`subprocess.Popen` with ``communicate`` did for :func:`subprocess_runner` and
    :func:`run_parallel`, without importing :mod:`subprocess` (about 1.5 ms of the GPU commands'
    start-up: ``subprocess``, ``selectors``, ``signal``'s enums).
    """

    def __init__(self, pid: int, out: int, err: int) -> None:
        self.pid = pid
        self.fds = {out: bytearray(), err: bytearray()}
        self.out, self.err = out, err
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs; reaps it once done."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def close(self) -> None:
        """Close the read ends of its pipes (what was read stays)."""
        for fd in (self.out, self.err):
            if fd >= 0:
                os.close(fd)
        self.out = self.err = -1

    def result(self) -> RunResult:
        """Its exit code and output, decoded as ``Popen(text=True, errors="replace")`` did (the locale's
        encoding, universal newlines)."""
        assert self.returncode is not None
        out, err = self.fds.values()
        return RunResult(self.returncode, _text(bytes(out)), _text(bytes(err)))


def _text(data: bytes) -> str:
    return io.TextIOWrapper(io.BytesIO(data), errors="replace").read() if data else ""


def _start(argv: Sequence[str]) -> _Proc:
    """nvidia-smi in its own process group (session), so that a hung one is killed with every child it started.

    As ``subprocess.Popen(argv, stdin=DEVNULL, stdout=PIPE, stderr=PIPE, start_new_session=True)``: found on
    ``PATH`` when ``argv[0]`` has no ``/``, SIGPIPE and SIGXFSZ back to their defaults in the child.  One
    difference: a descriptor this process was started with and that is marked inheritable reaches the child
    (``close_fds`` closed it); the ones Python opens are non-inheritable (PEP 446), the pipes here included.
    And glibc's posix_spawn leaves its two internal signals (32, 33: no program but glibc handles them) ignored.
    """
    if not hasattr(os, "posix_spawn"):  # (Windows) pragma: no cover
        raise GpuToolingError("running nvidia-smi needs os.posix_spawn (Linux, macOS); not available here")
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        spawn = os.posix_spawn if "/" in argv[0] else os.posix_spawnp
        pid = spawn(
            argv[0],
            list(argv),
            nvidia_smi_env(),
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ],
            setsid=True,
            setsigdef=_DEFAULT_SIGNALS,
        )
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    return _Proc(pid, out_r, err_r)


def _start_or_raise(argv: Sequence[str]) -> _Proc:
    try:
        return _start(argv)
    except FileNotFoundError:
        raise GpuToolingError(
            f"{argv[0]} not found: no NVIDIA driver is installed here; run on CPU or install the driver"
        ) from None
    except PermissionError:
        raise GpuToolingError(f"{argv[0]} cannot be executed (permission denied)") from None


def _communicate(procs: list[_Proc], deadline: float) -> bool:
    """Read every process's stdout and stderr to their ends and reap it, until ``deadline`` (monotonic).

    Returns:
        Whether all of them finished (closed both pipes and exited) in time; the unfinished ones have
        ``returncode`` None.
    """
    poller = select.poll()
    owner: dict[int, _Proc] = {}
    for p in procs:
        for fd in p.fds:
            poller.register(fd, select.POLLIN | select.POLLPRI)
            owner[fd] = p
    while owner:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poller.poll(max(int(left * 1000), 1)):
            chunk = os.read(fd, 1 << 16)
            if chunk:
                owner[fd].fds[fd] += chunk
            else:  # the end of that pipe
                poller.unregister(fd)
                del owner[fd]
    if owner:  # a pipe still open at the deadline: that command has not finished
        for p in procs:
            if not any(fd in owner for fd in p.fds):
                p.poll()
        return False
    delay = 0.0005
    while True:  # both pipes closed: each exits now (waited for on a pidfd, else polled as Popen.wait does)
        running = [p for p in procs if p.poll() is None]
        if not running:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if not _wait_exit(running[0], left):
            time.sleep(min(delay, left, 0.05))
            delay *= 2


def _wait_exit(p: _Proc, timeout: float) -> bool:
    """Sleep until ``p`` exits or ``timeout`` seconds pass, on a pidfd (Linux 5.3+): no polling interval
    (the first ``Popen.wait``-style sleep, 0.5 ms, was most of the wait).  ``False`` where there is no pidfd."""
    try:
        fd = os.pidfd_open(p.pid)
    except (AttributeError, OSError):  # not Linux, an old kernel, or a seccomp filter without pidfd_open
        return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll(max(int(timeout * 1000), 1))
    finally:
        os.close(fd)
    return True


def _kill_group(p: _Proc) -> None:
    """Kill ``p`` and its whole process group (it leads one: :func:`_start`), then reap it."""
    try:
        os.killpg(p.pid, _SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if p.returncode is None:
        try:
            os.kill(p.pid, _SIGKILL)
        except ProcessLookupError:  # pragma: no cover
            pass
        _, status = os.waitpid(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)


def run_parallel(cmds: list[list[str]], timeout: float, optional: frozenset[int] = frozenset()) -> list[RunResult]:
    """Start several commands at once and wait for all (saves a whole nvidia-smi start-up).

    A command whose position is in ``optional`` that does not answer in time is killed and
    reported as ``RunResult(-1, "", "", timed_out=True)``; any other timeout raises.

    Args:
        cmds: the commands.
        timeout: seconds for all of them together.
        optional: positions of the commands whose timeout is not an error.

    Returns:
        One result per command, in order.

    Raises:
        GpuToolingError: a program is missing or cannot be executed (exit code 20).
        GpuQueryError: a command not in ``optional`` did not answer in time (exit code 25).
    """
    procs: list[_Proc] = []
    try:
        for argv in cmds:
            procs.append(_start_or_raise(argv))
        if _communicate(procs, time.monotonic() + timeout):
            return [p.result() for p in procs]
        late = [i for i, p in enumerate(procs) if p.returncode is None]
        if any(i not in optional for i in late):
            raise GpuQueryError(
                f"nvidia-smi did not answer within {timeout:g}s (a hung GPU or driver?): check `dmesg`, or retry"
            )
        out: list[RunResult] = []
        for i, p in enumerate(procs):
            if i in late:
                _kill_group(p)
                out.append(RunResult(-1, "", "", timed_out=True))
            else:
                out.append(p.result())
        return out
    finally:
        for p in procs:
            if p.returncode is None:
                _kill_group(p)
            p.close()
