"""An in-process stand-in for nvidia-smi that replays tests/fixtures/nvidia-smi/scenarios/<name>/ (pure runner)."""

from __future__ import annotations

from pathlib import Path

from ckptfix.errors import GpuQueryError
from ckptfix.gpu.runner import RunResult

SCENARIOS = Path(__file__).parent / "fixtures" / "nvidia-smi" / "scenarios"


def scenario_runner(name: str, calls: list[list[str]] | None = None):
    """A runner for ``ckptfix.gpu`` that answers like the fake nvidia-smi script, recording argv in ``calls``."""
    d = SCENARIOS / name

    def run(argv, timeout):
        if calls is not None:
            calls.append(list(argv))
        kind = "default"
        for a in argv:
            if a.startswith("--query-gpu="):
                kind = "query-gpu"
            elif a.startswith("--query-compute-apps="):
                kind = "apps"
            elif a == "-L":
                kind = "L"
        if (d / f"{kind}.hang").exists():  # what subprocess_runner raises when the call times out
            raise GpuQueryError(f"nvidia-smi did not answer within {timeout:g}s (a hung GPU or driver?)")
        f = d / f"{kind}.txt"
        if not f.exists():
            f = d / "default.txt"
        out = f.read_text().split("\n", 1)[1] if f.exists() else ""
        rc_file = d / f"{kind}.rc" if (d / f"{kind}.rc").exists() else d / "rc"
        rc = int(rc_file.read_text()) if rc_file.exists() else 0
        return RunResult(rc, out, "")

    return run
