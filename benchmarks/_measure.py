"""Shared helpers: run a command as a child process and report its wall time and peak RSS."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def run(cmd: list[str], repeat: int = 3, env: dict | None = None, before=None) -> tuple[float, float]:
    """Best wall seconds and peak RSS (MiB) of ``cmd`` over ``repeat`` runs (each a fresh process)."""
    best_t, best_rss = float("inf"), 0.0
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        _, status, ru = os.wait4(p.pid, 0)
        dt = time.perf_counter() - t0
        err = p.stderr.read().decode() if p.stderr else ""
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode not in (0,):
            sys.exit(f"benchmark command failed ({p.returncode}): {' '.join(cmd)}\n{err}")
        best_t = min(best_t, dt)
        best_rss = max(best_rss, ru.ru_maxrss / 1024.0)
    return best_t, best_rss


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def ckptfix(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptfix", *args]
