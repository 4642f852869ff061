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
from _measure import ckptfix, py, run  # noqa: E402


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
    run(py(f"""
import torch
from safetensors.torch import save_file
sd = torch.load({src!r}, mmap=True, weights_only=True)["model_state_dict"]
sd.pop("module.head.weight")
save_file(dict(sd), {dst!r})
"""), repeat=1)


def row(name: str, t: float, rss: float, base_t: float | None = None, base_name: str = "") -> None:
    ratio = f"{t / base_t:5.2f}x {base_name}" if base_t else ""
    print(f"  {name:<48} {t:7.3f} s  {rss:8.1f} MiB  {ratio}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=1400)
    ap.add_argument("--sizes", default="", help="comma list of sizes (MB) for the RSS curve")
    ap.add_argument("--repeat", type=int, default=3)
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
        click_t, click_rss = run(py("import click"), r)
        print("\nbaseline")
        row("python -c 'import click'", click_t, click_rss)
        print("\ninspect / scan (target: wall <= 3x import click, RSS < 100 MiB)")
        for label, p in (("zip", zp), ("legacy", lp), ("safetensors", sp)):
            t, rss = run(ckptfix("inspect", p), r)
            row(f"ckptfix inspect ({label})", t, rss, click_t, "import click")
            t, rss = run(ckptfix("scan", p), r) if label != "legacy" else run(ckptfix("scan", p), r)
            row(f"ckptfix scan ({label})", t, rss, click_t, "import click")
        print("\nload (target: load_anywhere within 1.1x of torch.load mmap weights_only, wall and RSS)")
        t_ref, rss_ref = run(py(f"import torch; sd = torch.load({zp!r}, mmap=True, weights_only=True, "
                                f"map_location='cpu')"), r)
        row("torch.load(mmap=True, weights_only=True)", t_ref, rss_ref)
        t, rss = run(py(f"from ckptfix import load_anywhere; sd = load_anywhere({zp!r})"), r)
        row("load_anywhere(path)", t, rss, t_ref, "torch.load")
        print(f"  {'RSS ratio':<48} {rss / rss_ref:7.2f}x")
        print("\nstrip-prefix (target: zip wall <= 1.5x cp, RSS < 100 MiB; legacy RSS <= 1.3x file size)")
        out = os.path.join(work, "out.pt")
        def rm_out() -> None:  # each writer creates a new file, like cp to a fresh name
            if os.path.exists(out):
                os.unlink(out)

        t_cp, rss_cp = run(["cp", zp, out], r, before=rm_out)
        row("cp", t_cp, rss_cp)
        t, rss = run(ckptfix("strip-prefix", zp, "-o", out), r, before=rm_out)
        row("ckptfix strip-prefix (zip)", t, rss, t_cp, "cp")
        t, rss = run(ckptfix("strip-prefix", lp, "-o", out), r, before=rm_out)
        row("ckptfix strip-prefix (legacy)", t, rss, t_cp, "cp")
        print(f"  {'legacy RSS / file size':<48} {rss * 2**20 / os.path.getsize(lp):7.3f}x")
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
