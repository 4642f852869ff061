"""Shared helpers: run commands as child processes, side by side, and report wall time and peak RSS.

This machine is shared and noisy, so every comparison is *interleaved*: round after round, each
command runs once, and the best wall time of each is kept.  Background load then hits all of them
alike, and the ratios (not the seconds) are what the benchmarks report.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Mapping, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the measured commands get.

    An installed package has its ``.pyc`` files; a sandbox that sets ``PYTHONDONTWRITEBYTECODE``
    would make every ckptfix run recompile its modules, which no user pays.  So it is dropped
    (the ``.pyc`` files go to ``__pycache__/``, ignored by git), and the checkout is importable.
    """
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def measure(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one run of ``cmd``; exits the benchmark if it fails."""
    t0 = time.perf_counter()
    p = subprocess.Popen(
        list(cmd),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else child_env(),
        cwd=ROOT,
    )
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    err = p.stderr.read().decode() if p.stderr else ""
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        sys.exit(f"benchmark command failed ({rc}): {' '.join(cmd)}\n{err[-2000:]}")
    return dt, ru.ru_maxrss / 1024.0


Case = tuple  # (argv, before-callable or None)


def compare(
    cases: Mapping[str, Case], repeat: int = 3, env: Mapping[str, str] | None = None, sync: bool = True
) -> dict[str, tuple[float, float, float]]:
    """Interleaved runs of every case; ``{name: (best wall s, median wall s, peak RSS MiB)}``.

    ``before`` (e.g. removing the previous output, so every writer creates a new file like ``cp``
    to a fresh name) runs untimed before each run; with ``sync`` the dirty pages of the previous
    run are flushed first, so no command pays for another's writeback.
    """
    env = env if env is not None else child_env()
    walls: dict[str, list[float]] = {k: [] for k in cases}
    rss: dict[str, float] = {k: 0.0 for k in cases}
    for _ in range(repeat):
        for name, (argv, before) in cases.items():
            if before is not None:
                before()
            if sync:
                os.sync()
            t, r = measure(argv, env)
            walls[name].append(t)
            rss[name] = max(rss[name], r)
    return {k: (min(v), statistics.median(v), rss[k]) for k, v in walls.items()}


def run(
    cmd: Sequence[str], repeat: int = 3, env: Mapping[str, str] | None = None, before: Callable[[], None] | None = None
) -> tuple[float, float]:
    """Best wall seconds and peak RSS (MiB) of ``cmd`` alone over ``repeat`` runs."""
    best, _, rss = compare({"cmd": (cmd, before)}, repeat, env)["cmd"]
    return best, rss


def remover(*paths: str) -> Callable[[], None]:
    """A ``before`` hook that deletes ``paths`` if they exist."""

    def rm() -> None:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)

    return rm


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def ckptfix(*args: str, python: str | None = None) -> list[str]:
    """The argv of a ``ckptfix`` command as users start it: pip's ``ckptfix`` console script.

    The script next to the interpreter (its venv's), run by that interpreter; the checkout comes first on
    ``PYTHONPATH`` (:func:`child_env`), so it runs this tree's code.  Where there is no such script (a
    checkout without an install), ``python -m ckptfix``, which also imports ``runpy`` and ``importlib.util``
    (1-3 ms that no user of the console script pays).

    Args:
        args: the command line after ``ckptfix``.
        python: the interpreter (default: this one).  A venv with a plain, non-editable install measures
            what users start: an editable install's finder adds ~10 ms to every start of its interpreter.
    """
    py = python or sys.executable
    script = os.path.join(os.path.dirname(py), "ckptfix")
    if os.path.isfile(script):
        return [py, script, *args]
    return [py, "-m", "ckptfix", *args]
