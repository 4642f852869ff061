#!/usr/bin/env python3
"""Wall time of `ckptfix gpus` / `ckptfix pick-gpu` against `python -c "import click"`.

A fake nvidia-smi (tests/fixtures/nvidia-smi/fake-nvidia-smi.sh, shell builtins
only) answers instantly, so what is measured is ckptfix's own start-up and work:
interpreter, click, ckptfix.cli (which must not import torch) and one or two
nvidia-smi calls run concurrently.  Each figure is the best of N whole-process runs.

    .venv/bin/python benchmarks/bench_gpu.py [-n 15] [--scenario h200_busy]

Target (from the issue): both commands within 2x of `python -c "import click"`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import child_env, compare

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "nvidia-smi"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=15, help="runs per command (best is reported)")
    ap.add_argument("--scenario", default="h200_busy")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        shutil.copy(FIX / "fake-nvidia-smi.sh", bin_dir / "nvidia-smi")
        (bin_dir / "nvidia-smi").chmod(0o755)
        env = child_env(
            {
                "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                "FAKE_SMI_DIR": str(FIX / "scenarios"),
                "FAKE_SMI_SCENARIO": args.scenario,
                "CKPTFIX_LEASE_DIR": str(Path(tmp) / "leases"),
            }
        )
        for k in list(env):
            if k.startswith("CUDA_"):
                del env[k]
        py = sys.executable
        entry = [py, "-m", "ckptfix"]
        cases = {
            'python -c "import click"': [py, "-c", "import click"],
            "ckptfix gpus": entry + ["gpus"],
            "ckptfix gpus --json": entry + ["gpus", "--json"],
            "ckptfix pick-gpu --lease 0": entry + ["pick-gpu", "--lease", "0"],
            "ckptfix pick-gpu -- true (exec)": entry + ["pick-gpu", "--", "true"],
            "fake nvidia-smi --query-gpu (alone)": [str(bin_dir / "nvidia-smi"), "--query-gpu=index"],
        }
        for argv in cases.values():  # warm the page cache and .pyc files
            subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        results = {
            k: v[:2] for k, v in compare({k: (v, None) for k, v in cases.items()}, args.n, env, sync=False).items()
        }

    base = results['python -c "import click"'][0]
    print(
        f"best of {args.n} whole-process runs (interleaved), scenario {args.scenario}, python {sys.version.split()[0]}"
    )
    print(f"{'command':40} {'best ms':>8} {'median ms':>10} {'ratio':>6}")
    for name, (best, med) in results.items():
        print(f"{name:40} {best * 1000:8.1f} {med * 1000:10.1f} {best / base:6.2f}x")
    worst = max(results[k][0] for k in ("ckptfix gpus", "ckptfix pick-gpu --lease 0")) / base
    print(
        f"target: gpus and pick-gpu within 2.00x of import click -> worst {worst:.2f}x "
        f"({'OK' if worst <= 2 else 'OVER'})"
    )


if __name__ == "__main__":
    main()
