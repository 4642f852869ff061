#!/usr/bin/env python3
"""``convert`` at copy speed: ckptfix vs ``cp`` / ``cp -r`` on GPT-2-layout checkpoints, warm and cold.

Usage::

    python benchmarks/bench_copy.py                                   # 0.5 GB warm, best/median of 5
    python benchmarks/bench_copy.py --sizes 0.5GB,1.5GB,4GB --cold --repeat 5
    python benchmarks/bench_copy.py --sizes 0 --dcp-sizes 0.6GB,2GB --jobs 1,2
    python benchmarks/bench_copy.py --sizes 1.5GB --jobs 1,2 --json
    python benchmarks/bench_copy.py --python ~/venv-plain/bin/python          # a plain (non-editable) install

The fixture (:func:`make_gpt2`) is what users convert: a GPT-2-layout fp32 state dict saved by
``torch.save`` from a DataParallel/DDP model (``module.`` keys), its embedding tied to ``lm_head``
(one storage under two names), 12 tensors of varied sizes per block (LayerNorm vectors of a few KB to
MLP matrices of tens of MB); width and depth grow with the size asked (GPT-2 small, medium, large, XL
widths).  The DCP fixture is ``bench_dcp.py``'s 4-rank gloo run, every weight sharded on dim 0 as
FSDP2 does (``--dcp-shard1`` also shards every 4th on dim 1).

Per size, side by side in one run, ``--repeat`` rounds, the order of the commands reversed every other
round; before every run the previous outputs are deleted and ``sync`` flushes the dirty pages (no command
pays another's writeback); cold runs evict the input's files from the page cache first
(``posix_fadvise(DONTNEED)``; never the whole machine's cache).  ckptfix runs as users start it, through
the ``ckptfix`` console script of ``--python``'s venv (``_measure.ckptfix``).  Whole-process wall time and peak RSS
and CPU time (``wait4``); the 1-minute load average is sampled before every run and its range printed, because the
machine these numbers come from is shared and they swing with its load.

Targets (issue 25): verified convert <= 1.5x ``cp`` best and <= 2x median, warm and cold;
``--no-verify`` <= 1.15x ``cp`` best; DCP -> safetensors <= 1.5x ``cp -r`` best; peak RSS < 64 MiB
(convert), < 100 MiB (DCP), flat over sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import ROOT, child_env, ckptfix

MAKE_GPT2 = r"""
import sys, torch
from collections import OrderedDict
out, target = sys.argv[1], int(sys.argv[2])
vocab, ctx = 50257, 1024
def params(d, n):
    return vocab * d + ctx * d + n * (12 * d * d + 13 * d) + 2 * d
for d, depth in ((768, 12), (1024, 24), (1280, 36), (1600, 48), (2048, 64), (2560, 10**9)):   # GPT-2 S/M/L/XL
    n = max(1, (target // 4 - vocab * d - ctx * d) // (12 * d * d + 13 * d))
    if n <= depth * 1.4:
        break
def t(*shape, i=[0]):
    x = torch.empty(*shape)   # untouched pages: no RSS to speak of; a marker per tensor
    i[0] += 1
    x.view(-1)[: min(x.numel(), 16)] = i[0]
    return x
sd = OrderedDict()
wte = t(vocab, d)
sd["module.transformer.wte.weight"] = wte
sd["module.transformer.wpe.weight"] = t(ctx, d)
for b in range(n):
    p = f"module.transformer.h.{b}."
    sd[p + "ln_1.weight"] = t(d); sd[p + "ln_1.bias"] = t(d)
    sd[p + "attn.c_attn.weight"] = t(d, 3 * d); sd[p + "attn.c_attn.bias"] = t(3 * d)
    sd[p + "attn.c_proj.weight"] = t(d, d); sd[p + "attn.c_proj.bias"] = t(d)
    sd[p + "ln_2.weight"] = t(d); sd[p + "ln_2.bias"] = t(d)
    sd[p + "mlp.c_fc.weight"] = t(d, 4 * d); sd[p + "mlp.c_fc.bias"] = t(4 * d)
    sd[p + "mlp.c_proj.weight"] = t(4 * d, d); sd[p + "mlp.c_proj.bias"] = t(d)
sd["module.transformer.ln_f.weight"] = t(d); sd["module.transformer.ln_f.bias"] = t(d)
sd["module.lm_head.weight"] = wte   # tied
torch.save(sd, out)
print(d, n, len(sd))
"""


#: the interpreter whose venv's ``ckptfix`` console script runs the conversions (``--python``)
PYTHON = sys.executable


def _ck(*args: str) -> list[str]:
    return ckptfix(*args, python=PYTHON)


def make_gpt2(path: str, size: int) -> str:
    """Write a GPT-2-layout ``torch.save`` checkpoint of about ``size`` bytes at ``path``.

    Args:
        path: the output file.
        size: bytes wanted (the depth is rounded; at least one block).

    Returns:
        ``"d=WIDTH layers=N tensors=K"``.
    """
    out = subprocess.run(
        [sys.executable, "-c", MAKE_GPT2, path, str(size)], check=True, capture_output=True, text=True, env=child_env()
    ).stdout.split()
    return f"d={out[0]} layers={out[1]} tensors={out[2]}"


def make_dcp(path: str, size: int, shard1: bool) -> None:
    """A 4-rank DCP directory by ``bench_dcp.py``'s gloo run (all weights ``Shard(0)`` unless ``shard1``)."""
    import bench_dcp

    make = path + ".make.py"
    code = bench_dcp.MAKE
    if not shard1:
        code = code.replace("pl = Shard(1) if i % 4 == 3 else Shard(0)", "pl = Shard(0)")
    with open(make, "w") as f:
        f.write(code)
    try:
        subprocess.run(
            [sys.executable, make, path, str(size), "4", "4099x1024"],
            check=True,
            env=child_env(),
            stderr=subprocess.DEVNULL,
        )
    finally:
        os.unlink(make)


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        return [os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns]
    return [path]


def _size(path: str) -> int:
    return sum(os.path.getsize(p) for p in _files(path))


def _rm(*paths: str) -> Callable[[], None]:
    def go() -> None:
        for p in paths:
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.unlink(p)

    return go


def drop_cache(paths: list[str]) -> str:
    """Evict the inputs from the page cache (``posix_fadvise(DONTNEED)`` on each of their files); returns how.

    Only the inputs' pages go: the machine is shared, and ``/proc/sys/vm/drop_caches`` would evict
    everyone's (and needs root).  ``sync`` first, so that no page of theirs is dirty and kept.
    """
    os.sync()
    for p in paths:
        for f in _files(p):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "cold"


def warm(paths: list[str]) -> None:
    """Read the inputs once through a small buffer (this process stays small: children's RSS includes it)."""
    buf = bytearray(1 << 20)
    for p in paths:
        for f in _files(p):
            with open(f, "rb") as fh:
                while fh.readinto(buf):
                    pass


def measure(argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall s, peak RSS MiB, CPU s: user + system) of one run; CPU time swings less than wall time on a loaded
    machine."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode() if p.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"benchmark command failed: {' '.join(argv)}\n{err[-2000:]}")
    return wall, ru.ru_maxrss / 1024.0, ru.ru_utime + ru.ru_stime


def side_by_side(cases: dict[str, tuple[list[str], Callable[[], None]]], repeat: int, cold_inputs: list[str] | None):
    """``{name: (best s, median s, peak RSS MiB)}``, the loadavg range, and how the cache was dropped."""
    env = child_env()
    walls: dict[str, list[float]] = {k: [] for k in cases}
    cpus: dict[str, list[float]] = {k: [] for k in cases}
    rss = dict.fromkeys(cases, 0.0)
    loads: list[float] = []
    how = "warm"
    names = list(cases)
    for r in range(repeat):
        for name in names if r % 2 == 0 else names[::-1]:
            argv, before = cases[name]
            before()
            if cold_inputs is not None:
                how = drop_cache(cold_inputs)
            else:
                os.sync()
            loads.append(os.getloadavg()[0])
            t, m, c = measure(argv, env)
            walls[name].append(t)
            cpus[name].append(c)
            rss[name] = max(rss[name], m)
    for _, before in cases.values():
        before()
    res = {k: (min(v), statistics.median(v), rss[k], min(cpus[k])) for k, v in walls.items()}
    return res, (min(loads), max(loads)), how


def _row(res, base: str, loads, how: str, **extra) -> dict:
    b_best, b_med, _, b_cpu = res[base]
    row = {
        **extra,
        "cache": how,
        "loadavg": [round(loads[0], 1), round(loads[1], 1)],
        base: {"best_s": round(b_best, 3), "median_s": round(b_med, 3), "cpu_s": round(b_cpu, 3)},
    }
    for k, (best, med, rss, cpu) in res.items():
        if k == base:
            continue
        row[k] = {
            "best_s": round(best, 3),
            "median_s": round(med, 3),
            "best_x": round(best / b_best, 2),
            "median_x": round(med / b_med, 2),
            "rss_mib": round(rss, 1),
            "cpu_s": round(cpu, 3),
        }
    return row


def bench_convert(size: int, repeat: int, cold: bool, jobs: list[int], work: str, kernel_any: bool = False) -> dict:
    src = os.path.join(work, "gpt2.pt")
    shape = make_gpt2(src, size)
    out, cp_out = os.path.join(work, "model.safetensors"), os.path.join(work, "copy.pt")
    cases = {"cp": (["cp", src, cp_out], _rm(cp_out))}
    cases["convert"] = (_ck("convert", src, "-o", out, "--quiet"), _rm(out))  # -j chosen per input
    for j in jobs:
        cases[f"convert -j {j}"] = (_ck("convert", src, "-o", out, "--quiet", "-j", str(j)), _rm(out))
    cases["convert --no-verify"] = (_ck("convert", src, "-o", out, "--quiet", "--no-verify"), _rm(out))
    one = ["env", "CKPTFIX_COPY_STREAMS=1"]  # the copy in one stream (the default runs two from 64 MiB)
    cases["convert 1 stream"] = (one + _ck("convert", src, "-o", out, "--quiet"), _rm(out))
    cases["--no-verify 1 stream"] = (one + _ck("convert", src, "-o", out, "--quiet", "--no-verify"), _rm(out))
    if kernel_any:  # copy_file_range for every offset (ckptfix.files.fileio.KERNEL_ANY) instead of the 1 MiB buffer
        any_env = ["env", "CKPTFIX_COPY_KERNEL=any"]
        cases["convert cfr-any"] = (any_env + _ck("convert", src, "-o", out, "--quiet"), _rm(out))
        nov = _ck("convert", src, "-o", out, "--quiet", "--no-verify")
        cases["--no-verify cfr-any"] = (any_env + nov, _rm(out))
    if not cold:
        warm([src])
    res, loads, how = side_by_side(cases, repeat, [src] if cold else None)
    row = _row(res, "cp", loads, how, what="convert", size_bytes=_size(src), layout=shape)
    os.unlink(src)
    return row


def bench_dcp(size: int, repeat: int, cold: bool, jobs: list[int], shard1: bool, work: str) -> dict:
    src = os.path.join(work, "run.dcp")
    make_dcp(src, size, shard1)
    out, cp_out = os.path.join(work, "model.safetensors"), os.path.join(work, "copy.dcp")
    cases = {"cp -r": (["cp", "-r", src, cp_out], _rm(cp_out))}
    cases["convert"] = (_ck("convert", src, "-o", out, "--quiet"), _rm(out))  # -j chosen per input
    for j in jobs:
        cases[f"convert -j {j}"] = (_ck("convert", src, "-o", out, "--quiet", "-j", str(j)), _rm(out))
    cases["convert --no-verify"] = (_ck("convert", src, "-o", out, "--quiet", "--no-verify"), _rm(out))
    if not cold:
        warm([src])
    res, loads, how = side_by_side(cases, repeat, [src] if cold else None)
    row = _row(res, "cp -r", loads, how, what="dcp", size_bytes=_size(src))
    shutil.rmtree(src)
    return row


def _print(row: dict) -> None:
    base = "cp" if row["what"] == "convert" else "cp -r"
    b = row[base]
    lo, hi = row["loadavg"]
    head = f"{row['what']:7} {row['size_bytes'] / 1e9:5.2f} GB {row['cache']:11} load {lo}-{hi}"
    parts = [f"{base} {b['best_s']:.2f}/{b['median_s']:.2f}s cpu {b['cpu_s']:.2f}s"]
    for k, v in row.items():
        if isinstance(v, dict) and k != base:
            parts.append(f"{k} {v['best_x']:.2f}x/{v['median_x']:.2f}x {v['rss_mib']:.0f}MiB cpu {v['cpu_s']:.2f}s")
    print(head + " | " + " | ".join(parts) + (f" | {row['layout']}" if "layout" in row else ""), flush=True)


def main() -> None:
    from ckptfix.text import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.5GB", help="GPT-2-layout checkpoint sizes (0: none)")
    ap.add_argument("--dcp-sizes", default="", help="DCP directory sizes (model + optimizer), e.g. 0.6GB,2GB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="also time with the inputs evicted from the page cache")
    ap.add_argument("--no-warm", action="store_true", help="cold runs only")
    ap.add_argument("--jobs", default="", help="--jobs values timed besides the default (e.g. 2,4)")
    ap.add_argument("--kernel-any", action="store_true", help="also time copy_file_range for every offset")
    ap.add_argument("--dcp-shard1", action="store_true", help="shard every 4th DCP weight on dim 1 too")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed afterwards)")
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter whose venv's ckptfix console script is timed (default: this one); a plain, "
        "non-editable install is what users start (an editable install's finder costs ~10 ms per start)",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    global PYTHON
    PYTHON = a.python
    jobs = [int(j) for j in a.jobs.split(",") if j]
    modes = ([] if a.no_warm else [False]) + ([True] if a.cold or a.no_warm else [])
    rows = []
    t0 = time.time()
    for kind, sizes in (("convert", a.sizes), ("dcp", a.dcp_sizes)):
        for s in filter(None, sizes.split(",")):
            if s.strip() in ("0", "0GB", "0B"):
                continue
            for cold in modes:
                work = tempfile.mkdtemp(prefix="bench_copy.", dir=a.dir)
                try:
                    if kind == "convert":
                        row = bench_convert(parse_size(s), a.repeat, cold, jobs, work, a.kernel_any)
                    else:
                        row = bench_dcp(parse_size(s), a.repeat, cold, jobs, a.dcp_shard1, work)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                rows.append(row)
                if not a.json:
                    _print(row)
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"({time.time() - t0:.0f} s; ratios best/median of {a.repeat}, order alternated)", file=sys.stderr)


if __name__ == "__main__":
    main()
