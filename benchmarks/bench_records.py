#!/usr/bin/env python3
"""Cost per record (issue #33 §5): peak RSS and CPU seconds of every command on files of many tiny records.

Usage::

    python benchmarks/bench_records.py                       # this checkout
    python benchmarks/bench_records.py --root /other/checkout   # the same runs of another branch (before/after)
    python benchmarks/bench_records.py --only memo1m --commands inspect,convert

The inputs (written with torch in a temp folder, deleted afterwards):

* ``memo1m``: ``torch.save([t] * 10**6)``: one tensor pickled once and referenced a million times (8 KB);
* ``dict200k``: ``torch.save({f"k{i}": t for i in range(200_000)})``: 200,000 keys naming one tensor;
* ``str1000``: a million-character string memoized and referenced 1,000 times (``[s] * 1000``) beside a tensor;
* ``views1m``: a million distinct views of one storage (refused by the object budget: the control case).

Each command runs in a child under ``/usr/bin/time`` (``%M``: peak RSS, ``%U`` + ``%S``: CPU seconds); the
table gives its exit status, so a typed refusal (exit 12, ``ResourceLimitError``) reads beside a success.
Each run is capped (``--cap-mib`` of address space, ``--cap-cpu`` seconds): a run killed there shows a
MemoryError (exit 1) or a negative status (SIGXCPU).
The target of #33 §5 is < 150 MiB and < 15 s CPU per command, or a typed error before the work.  Each
command runs ``--repeat`` times and the best and median CPU seconds are shown (RSS: the highest).
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

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "inspect": lambda f, o: ["inspect", f],
    "scan": lambda f, o: ["scan", f],
    "convert": lambda f, o: ["convert", f, "-o", o + ".safetensors"],
    "add-prefix": lambda f, o: ["add-prefix", f, "--prefix", "m.", "-o", o + ".pt"],
    "sanitize": lambda f, o: ["sanitize", f, "-o", o + ".pt"],
    "diff": lambda f, o: ["diff", f, f],
}


def _make(kind: str, path: str) -> None:
    import torch

    t = torch.zeros(2)
    if kind == "memo1m":
        obj: object = [t] * 10**6
    elif kind == "dict200k":
        obj = {f"k{i}": t for i in range(200_000)}
    elif kind == "str1000":
        obj = {"w": t, "meta": ["x" * 10**6] * 1000}
    elif kind == "views1m":
        base = torch.zeros(10**6)
        obj = [base[i : i + 1] for i in range(10**6)]
    else:
        raise SystemExit(f"unknown input {kind}")
    torch.save(obj, path)


INPUTS = ("memo1m", "dict200k", "str1000", "views1m")


def _run(root: str, argv: list[str], cwd: str, cap_mib: int, cap_cpu: int) -> tuple[int, float, float, str]:
    """(exit status, peak RSS MiB, CPU seconds, last stderr line) of ``python -m ckptfix ARGV`` from ``root``,
    under an address-space and a CPU limit (a run past them is killed, and shows as such)."""
    import resource

    def caps() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap_mib << 20, cap_mib << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cap_cpu, cap_cpu))

    env = dict(os.environ, PYTHONPATH=root)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.NamedTemporaryFile("r", suffix=".time", dir=cwd) as tf:
        p = subprocess.run(
            ["/usr/bin/time", "-o", tf.name, "-f", "%M %U %S", sys.executable, "-m", "ckptfix", *argv],
            env=env,
            cwd=cwd,
            capture_output=True,
            preexec_fn=caps,
        )
        rss_kb, user, system = tf.read().split()[-3:]
    last = (p.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
    return p.returncode, int(rss_kb) / 1024, float(user) + float(system), last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT), help="the ckptfix checkout the children run")
    ap.add_argument("--only", default=",".join(INPUTS), help="inputs, comma separated")
    ap.add_argument("--commands", default=",".join(COMMANDS), help="commands, comma separated")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--cap-mib", type=int, default=3072, help="address-space limit of each run (MiB)")
    ap.add_argument("--cap-cpu", type=int, default=120, help="CPU-time limit of each run (s)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_records.")
    try:
        print(f"root {args.root}")
        head = f"{'input':10} {'size':>9} {'command':11} {'rc':>3} {'peak MiB':>9} {'CPU best':>9} {'median':>7}"
        print(head + "  last line")
        for kind in args.only.split(","):
            src = os.path.join(tmp, f"{kind}.pt")
            _make(kind, src)
            size = os.path.getsize(src)
            for name in args.commands.split(","):
                cpus, peak, rc, last = [], 0.0, 0, ""
                for i in range(args.repeat):
                    out = os.path.join(tmp, f"out_{name}_{i}")
                    rc, rss, cpu, last = _run(args.root, COMMANDS[name](src, out), tmp, args.cap_mib, args.cap_cpu)
                    cpus.append(cpu)
                    peak = max(peak, rss)
                    for ext in (".pt", ".safetensors"):
                        if os.path.exists(out + ext):
                            os.unlink(out + ext)
                print(
                    f"{kind:10} {size:>9,} {name:11} {rc:>3} {peak:>9.0f} {min(cpus):>9.2f} "
                    f"{statistics.median(cpus):>7.2f}  {last[:110]}",
                    flush=True,
                )
            os.unlink(src)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
