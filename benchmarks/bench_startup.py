#!/usr/bin/env python3
"""Start-up of ``inspect`` / ``scan`` / ``gpus`` / ``pick-gpu`` against ``python -c "import click"``.

Usage::

    python benchmarks/bench_startup.py [-n 21]

Whole-process wall time, interleaved round after round (order reversed every other round), best and
median of ``-n``; the 1-minute load average is recorded.  ``inspect`` and ``scan`` read a small
``torch.save`` checkpoint (made once, torch-free afterwards); ``gpus`` and ``pick-gpu`` ask the
instant fake ``nvidia-smi`` of the tests (as ``bench_gpu.py``), so what is measured is the
interpreter, the imports and ckptfix's own work.  Target (issue 25): each at or under 1.4x
``import click``, best of n.  ``python -X importtime -m ckptfix inspect FILE`` shows where the rest goes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import child_env, measure

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "nvidia-smi"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=21)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        shutil.copy(FIX / "fake-nvidia-smi.sh", bin_dir / "nvidia-smi")
        (bin_dir / "nvidia-smi").chmod(0o755)
        env = child_env(
            {
                "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                "FAKE_SMI_DIR": str(FIX / "scenarios"),
                "FAKE_SMI_SCENARIO": "h200_busy",
                "CKPTFIX_LEASE_DIR": str(Path(tmp) / "leases"),
            }
        )
        for k in list(env):
            if k.startswith("CUDA_"):
                del env[k]
        ck = os.path.join(tmp, "m.pt")
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys, torch; torch.save({'w': torch.ones(4, 4), 'b': torch.ones(4)}, sys.argv[1])",
                ck,
            ],
            check=True,
            env=env,
        )
        py = sys.executable
        cases = {
            "import click": [py, "-c", "import click"],
            "inspect": [py, "-m", "ckptfix", "inspect", ck],
            "scan": [py, "-m", "ckptfix", "scan", ck],
            "gpus": [py, "-m", "ckptfix", "gpus"],
            "pick-gpu": [py, "-m", "ckptfix", "pick-gpu", "--lease", "0"],
        }
        for argv in cases.values():  # .pyc files and page cache
            subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        walls: dict[str, list[float]] = {k: [] for k in cases}
        loads = []
        names = list(cases)
        for r in range(a.n):
            for name in names if r % 2 == 0 else names[::-1]:
                loads.append(os.getloadavg()[0])
                walls[name].append(measure(cases[name], env)[0])
    base_best, base_med = min(walls["import click"]), statistics.median(walls["import click"])
    print(f"best / median of {a.n}, order alternated, loadavg {min(loads):.1f}-{max(loads):.1f}")
    for name, v in walls.items():
        best, med = min(v), statistics.median(v)
        print(
            f"{name:14} {best * 1000:7.1f} / {med * 1000:7.1f} ms   {best / base_best:5.2f}x / {med / base_med:5.2f}x"
        )


if __name__ == "__main__":
    main()
