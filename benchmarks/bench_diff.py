#!/usr/bin/env python3
"""``ckptfix diff A B`` on two bit-equal checkpoints vs ``cmp A B``: wall time side by side, and peak RSS.

Usage::

    python benchmarks/bench_diff.py                          # two 1.5 GB files, warm, best/median of 5
    python benchmarks/bench_diff.py --size 512MB --repeat 7
    python benchmarks/bench_diff.py --size 1.5GB --cold      # each file evicted from the page cache first
    python benchmarks/bench_diff.py --jobs 1,2 --json

The fixture is two GPT-2-layout fp32 safetensors files with the same layout and the same bytes (B a copy of A,
written by this script without torch: 12 tensors per block, LayerNorm vectors of a few KB to MLP matrices of tens
of MB, the width and depth growing with ``--size``).  ``cmp`` reads both files in order and compares them; ``ckptfix
diff`` reads both headers, aligns the keys, then compares the tensors piece by piece in the order they lie in the
files (bit equality, no torch).  ckptfix runs as users start it (the ``ckptfix`` console script of ``--python``'s
venv, :func:`_measure.ckptfix`).  Every round runs each command once, the order reversed every other round; the
best and the median wall time of each are reported, with their ratio to ``cmp`` and the peak RSS (``wait4``).
``--cold`` evicts both inputs (``posix_fadvise(DONTNEED)``, never the whole machine's cache) before every run.

Target (issue 35): ``diff`` <= 1.3x ``cmp`` on two 1.5 GB files; memory flat (< 100 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import child_env, ckptfix, measure


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def gpt2_shapes(target: int) -> list[tuple[str, tuple[int, ...]]]:
    """A GPT-2-layout state dict of about ``target`` fp32 bytes: names and shapes."""
    vocab, ctx = 50257, 1024
    d, n = 768, 1
    for d, depth in ((256, 6), (512, 12), (768, 12), (1024, 24), (1280, 36), (1600, 48), (2048, 10**9)):
        per = 12 * d * d + 13 * d
        n = max(1, (target // 4 - vocab * d - ctx * d) // per)
        if n <= depth * 1.4:
            break
    out = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (ctx, d))]
    for i in range(n):
        h = f"transformer.h.{i}."
        out += [
            (h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
            (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
            (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
            (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
            (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
            (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,)),
        ]  # fmt: skip
    return out + [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]


def write_fixture(path: str, target: int) -> int:
    """A safetensors file (F32) of :func:`gpt2_shapes`, written by hand; the bytes are pseudo-random."""
    header: dict[str, object] = {}
    at = 0
    shapes = gpt2_shapes(target)
    for name, shape in shapes:
        n = 4
        for s in shape:
            n *= s
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    block = os.urandom(1 << 20)  # 1 MiB of noise, repeated with a shifting counter: no two pages alike
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        left, i = at, 0
        while left:
            k = min(left, len(block))
            f.write(struct.pack("<Q", i) + block[8:k] if k > 8 else block[:k])
            left, i = left - k, i + 1
    return len(shapes)


def evict(*paths: str) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1.5GB", help="each file's size (default 1.5GB; e.g. 512MB for a quick run)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--jobs", default="1", help="diff --jobs values to measure, comma-separated (default 1)")
    ap.add_argument("--cold", action="store_true", help="evict both inputs from the page cache before every run")
    ap.add_argument("--python", default=None, help="the venv interpreter whose ckptfix console script runs")
    ap.add_argument("--dir", default=None, help="where the fixture goes (default: a temporary folder)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    target = parse_size(args.size)
    tmp = tempfile.mkdtemp(prefix="bench-diff-", dir=args.dir)
    try:
        a, b = os.path.join(tmp, "a.safetensors"), os.path.join(tmp, "b.safetensors")
        ntensors = write_fixture(a, target)
        shutil.copyfile(a, b)
        size = os.path.getsize(a)
        env = child_env()
        cases: dict[str, list[str]] = {"cmp": ["cmp", a, b]}
        for j in (int(x) for x in args.jobs.split(",")):
            cases[f"ckptfix diff -j {j}"] = ckptfix("diff", a, b, "-q", "--jobs", str(j), python=args.python)
        walls: dict[str, list[float]] = {k: [] for k in cases}
        rss: dict[str, float] = dict.fromkeys(cases, 0.0)
        loads: list[float] = []
        if not args.cold:  # warm both files and every command once, untimed
            for argv in cases.values():
                measure(argv, env)
        names = list(cases)
        for r in range(args.repeat):
            for name in names if r % 2 == 0 else names[::-1]:
                if args.cold:
                    os.sync()
                    evict(a, b)
                loads.append(os.getloadavg()[0])
                t, m = measure(cases[name], env)
                walls[name].append(t)
                rss[name] = max(rss[name], m)
        base_best, base_med = min(walls["cmp"]), statistics.median(walls["cmp"])
        rows = []
        for name, w in walls.items():
            best, med = min(w), statistics.median(w)
            rows.append(
                {
                    "command": name,
                    "best_s": round(best, 4),
                    "median_s": round(med, 4),
                    "ratio_best": round(best / base_best, 3),
                    "ratio_median": round(med / base_med, 3),
                    "peak_rss_mib": round(rss[name], 1),
                }
            )
        doc = {
            "size_bytes": size,
            "tensors": ntensors,
            "cache": "cold" if args.cold else "warm",
            "repeat": args.repeat,
            "load_1min": [round(min(loads), 2), round(max(loads), 2)],
            "rows": rows,
        }
        if args.json:
            print(json.dumps(doc, indent=2))
            return
        print(
            f"two bit-equal {size / 1e9:.2f} GB safetensors files ({ntensors} tensors), {doc['cache']}, "
            f"best/median of {args.repeat}, order alternated, load {doc['load_1min'][0]}-{doc['load_1min'][1]}"
        )
        print(f"{'command':<22} {'best s':>8} {'median s':>9} {'x cmp best':>11} {'x cmp median':>13} {'peak RSS':>9}")
        for row in rows:
            print(
                f"{row['command']:<22} {row['best_s']:>8.3f} {row['median_s']:>9.3f} {row['ratio_best']:>10.2f}x "
                f"{row['ratio_median']:>12.2f}x {row['peak_rss_mib']:>6.1f} MiB"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
