#!/usr/bin/env python3
"""Checkpoint benchmarks: load_anywhere, inspect, scan, strip-prefix -- ratios from one run.

    python benchmarks/bench_ckpt.py                 # ~1.4 GB checkpoint, ~300 tensors
    python benchmarks/bench_ckpt.py --size-mb 200   # quicker
    python benchmarks/bench_ckpt.py --sizes 100,400,1400  # the RSS curve for strip-prefix / inspect

Everything is measured as whole processes side by side in this one run (best of --repeat), so the
ratios are what matters on a shared, noisy machine.  Files are generated in a temp dir, never in git.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from _measure import ckptfix, compare, py, remover, run


def make_checkpoint(path: str, size_mb: int, n_tensors: int = 300, legacy: bool = False) -> None:
    code = f"""
import torch, collections
n = {n_tensors}; per = max(1, ({size_mb} * 2**20) // 4 // n)
torch.manual_seed(0)
sd = collections.OrderedDict()
for i in range(n):
    sd[f"module.layer{{i}}.weight"] = torch.empty(per).uniform_()
sd["module.head.weight"] = sd["module.layer0.weight"]  # tied
torch.save({{"epoch": 3, "model_state_dict": sd}}, {path!r}, _use_new_zipfile_serialization={not legacy})
"""
    run(py(code), repeat=1)


def make_safetensors(src: str, dst: str) -> None:
    run(
        py(f"""
import torch
from safetensors.torch import save_file
sd = torch.load({src!r}, mmap=True, weights_only=True)["model_state_dict"]
sd.pop("module.head.weight")
save_file(dict(sd), {dst!r})
"""),
        repeat=1,
    )


def row(name: str, t: float, rss: float, base_t: float | None = None, base_name: str = "") -> None:
    ratio = f"{t / base_t:5.2f}x {base_name}" if base_t else ""
    print(f"  {name:<48} {t:7.3f} s  {rss:8.1f} MiB  {ratio}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=1400)
    ap.add_argument("--sizes", default="", help="comma list of sizes (MB) for the RSS curve")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to generate files (default: a temp dir)")
    a = ap.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="ckptfix-bench-")
    try:
        zp = os.path.join(work, "model.pt")
        lp = os.path.join(work, "model_legacy.pt")
        sp = os.path.join(work, "model.safetensors")
        print(f"generating {a.size_mb} MB checkpoints in {work} ...", file=sys.stderr)
        make_checkpoint(zp, a.size_mb)
        make_checkpoint(lp, a.size_mb, legacy=True)
        make_safetensors(zp, sp)
        size = os.path.getsize(zp)
        print(f"checkpoint: {size / 1e9:.2f} GB, 301 entries (300 tensors + 1 tied)")
        r = a.repeat
        print(f"(best of {r} interleaved runs each; ratios are what matter on a noisy machine)")
        cases = {"click": (py("import click"), None)}
        for label, p in (("zip", zp), ("legacy", lp), ("safetensors", sp)):
            cases[f"inspect {label}"] = (ckptfix("inspect", p), None)
            cases[f"scan {label}"] = (ckptfix("scan", p), None)
        res = compare(cases, r)
        click_t = res["click"][0]
        print("\nbaseline")
        row("python -c 'import click'", click_t, res["click"][2])
        print("\ninspect / scan (target: wall <= 3x import click, RSS < 100 MiB)")
        for name, (t, _, rss) in res.items():
            if name != "click":
                row(f"ckptfix {name}", t, rss, click_t, "import click")
        print("\nload (target: load_anywhere within 1.1x of torch.load mmap weights_only, wall and RSS)")
        res = compare(
            {
                "ref": (
                    py(f"import torch; sd = torch.load({zp!r}, mmap=True, weights_only=True, map_location='cpu')"),
                    None,
                ),
                "ours": (py(f"from ckptfix import load_anywhere; sd = load_anywhere({zp!r})"), None),
            },
            r,
        )
        (t_ref, _, rss_ref), (t, _, rss) = res["ref"], res["ours"]
        row("torch.load(mmap=True, weights_only=True)", t_ref, rss_ref)
        row("load_anywhere(path)", t, rss, t_ref, "torch.load")
        print(f"  {'RSS ratio':<48} {rss / rss_ref:7.2f}x")
        print("\nstrip-prefix (target: zip wall <= 1.5x cp, RSS < 100 MiB; legacy RSS <= 1.3x file size)")
        out = os.path.join(work, "out.pt")
        rm_out = remover(out)  # each writer creates a new file, like cp to a fresh name
        res = compare(
            {
                "cp": (["cp", zp, out], rm_out),
                "zip": (ckptfix("strip-prefix", zp, "-o", out), rm_out),
                "legacy": (ckptfix("strip-prefix", lp, "-o", out), rm_out),
            },
            r,
        )
        t_cp = res["cp"][0]
        row("cp", t_cp, res["cp"][2])
        row("ckptfix strip-prefix (zip)", res["zip"][0], res["zip"][2], t_cp, "cp")
        row("ckptfix strip-prefix (legacy)", res["legacy"][0], res["legacy"][2], t_cp, "cp")
        print(f"  {'legacy RSS / file size':<48} {res['legacy'][2] * 2**20 / os.path.getsize(lp):7.3f}x")
        if a.sizes:
            print("\nRSS curve (strip-prefix and inspect, zip)")
            for mb in [int(x) for x in a.sizes.split(",")]:
                p = os.path.join(work, f"curve_{mb}.pt")
                make_checkpoint(p, mb)
                t1, rss1 = run(ckptfix("strip-prefix", p, "-o", out), 1, before=rm_out)
                t2, rss2 = run(ckptfix("inspect", p), 1)
                print(f"  {mb:6d} MB   strip-prefix {t1:6.2f} s {rss1:7.1f} MiB   inspect {t2:5.2f} s {rss2:6.1f} MiB")
                os.unlink(p)
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
