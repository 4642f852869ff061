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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "nvidia-smi"


def time_once(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{argv} failed ({p.returncode}): {p.stderr.decode()[-500:]}")
    return dt


def interleaved(cases: dict[str, list[str]], env: dict[str, str], n: int) -> dict[str, tuple[float, float]]:
    """Round-robin over the commands so that background load hits them all alike; (best, median)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(n):
        for name, argv in cases.items():
            times[name].append(time_once(argv, env))
    return {name: (min(ts), statistics.median(ts)) for name, ts in times.items()}


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
        env = dict(os.environ)
        for k in list(env):
            if k.startswith("CUDA_"):
                del env[k]
        # An installed package has .pyc files, and click's are there already: let ckptfix's be
        # written too (they go to __pycache__/, ignored by git), or every run recompiles it.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.update(
            PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}",
            FAKE_SMI_DIR=str(FIX / "scenarios"),
            FAKE_SMI_SCENARIO=args.scenario,
            CKPTFIX_LEASE_DIR=str(Path(tmp) / "leases"),
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        py = sys.executable
        if (ROOT / "ckptfix" / "cli" / "ckpt.py").exists():
            entry = [py, "-m", "ckptfix"]
        else:  # the checkpoint commands are not written yet: stand in an empty module
            entry = [py, "-c", "import sys, types; sys.modules['ckptfix.cli.ckpt'] = types.ModuleType('x'); "
                     "from ckptfix.cli import main; sys.exit(main(sys.argv[1:]))"]
        cases = {
            'python -c "import click"': [py, "-c", "import click"],
            "ckptfix gpus": entry + ["gpus"],
            "ckptfix gpus --json": entry + ["gpus", "--json"],
            "ckptfix pick-gpu --lease 0": entry + ["pick-gpu", "--lease", "0"],
            "fake nvidia-smi --query-gpu (alone)": [str(bin_dir / "nvidia-smi"), "--query-gpu=index"],
        }
        for argv in cases.values():  # warm the page cache and .pyc files
            subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        results = interleaved(cases, env, args.n)

    base = results['python -c "import click"'][0]
    print(f"best of {args.n} whole-process runs (interleaved), scenario {args.scenario}, python {sys.version.split()[0]}")
    print(f"{'command':40} {'best ms':>8} {'median ms':>10} {'ratio':>6}")
    for name, (best, med) in results.items():
        print(f"{name:40} {best * 1000:8.1f} {med * 1000:10.1f} {best / base:6.2f}x")
    worst = max(results[k][0] for k in ("ckptfix gpus", "ckptfix pick-gpu --lease 0")) / base
    print(f"target: gpus and pick-gpu within 2.00x of import click -> worst {worst:.2f}x "
          f"({'OK' if worst <= 2 else 'OVER'})")


if __name__ == "__main__":
    main()
