#!/usr/bin/env python3
"""Benchmark ``ckptfix convert`` against ``cp`` and Hugging Face's safetensors ``convert.py`` recipe.

Usage::

    python benchmarks/bench_convert.py                 # quick set: 100 MB, 400 MB
    python benchmarks/bench_convert.py --sizes 100MB,400MB,1.4GB,4GB
    python benchmarks/bench_convert.py --sizes 1.4GB --repeat 3 --json

For each size it writes (in a temp dir, removed afterwards) a zip checkpoint of
a small transformer-like model with tied embedding / lm_head weights, then
measures, in this one run, whole-process wall time and peak RSS of:

* ``cp`` of the checkpoint;
* the reference: what safetensors' ``convert.py`` does (``torch.load(map_location="cpu",
  weights_only=True)``, de-duplicate shared tensors, ``.contiguous()``, ``save_file``,
  reload and compare), as a ``python -c`` subprocess;
* ``python -m ckptfix convert`` (verification on);
* ``ckptfix convert`` of the same weights saved in the legacy (non-zip) format.

Peak RSS is the child's ``ru_maxrss`` (``wait4``), so each process is measured alone.  The runs are
interleaved (see ``_measure.compare``), so background load hits every tool alike.
The page cache is warm for every tool (each file is read once before timing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import child_env, compare, remover

REFERENCE = r"""
import sys, torch
from collections import defaultdict
from safetensors.torch import save_file, load_file, _find_shared_tensors, _is_complete
src, dst = sys.argv[1], sys.argv[2]
loaded = torch.load(src, map_location="cpu", weights_only=True)
if "state_dict" in loaded:
    loaded = loaded["state_dict"]
to_removes = defaultdict(list)
for shared in _find_shared_tensors(loaded):
    complete = sorted(n for n in shared if _is_complete(loaded[n]))
    keep = complete[0]
    for name in sorted(shared):
        if name != keep:
            to_removes[keep].append(name)
metadata = {"format": "pt"}
for kept, names in to_removes.items():
    for name in names:
        if name not in metadata:
            metadata[name] = kept
        del loaded[name]
loaded = {k: v.contiguous() for k, v in loaded.items()}
save_file(loaded, dst, metadata=metadata)
reloaded = load_file(dst)
for k in loaded:
    if not torch.equal(loaded[k], reloaded[k]):
        raise RuntimeError(f"mismatch on {k}")
"""

MAKE = r"""
import sys, torch
target, path, legacy = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
d, vocab, ff = 1024, 32000, 4096
per_layer = (4 * d * d + 2 * d * ff + 4 * d) * 4
layers = max(1, (target - vocab * d * 4) // per_layer)
g = torch.Generator().manual_seed(0)
sd = {}
emb = torch.randn(vocab, d, generator=g) * 0.02
sd["model.embed_tokens.weight"] = emb
for i in range(layers):
    p = f"model.layers.{i}."
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        sd[p + "self_attn." + n + ".weight"] = torch.randn(d, d, generator=g)
    sd[p + "mlp.up_proj.weight"] = torch.randn(ff, d, generator=g)
    sd[p + "mlp.down_proj.weight"] = torch.randn(d, ff, generator=g)
    for n in ("input_layernorm", "post_attention_layernorm", "b1", "b2"):
        sd[p + n + ".weight"] = torch.ones(d)
sd["model.norm.weight"] = torch.ones(d)
sd["lm_head.weight"] = emb  # tied
torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
"""

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse(s: str) -> int:
    s = s.strip().upper()
    for u, m in _UNITS.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def warm(path: str) -> None:
    buf = bytearray(1 << 20)  # small: a forked child's peak RSS starts from the parent's
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def run_size(size: int, tmp: str, repeat: int, reference: bool) -> dict:
    py = sys.executable
    src = os.path.join(tmp, "model.pth")
    legacy = os.path.join(tmp, "legacy.pth")
    subprocess.run([py, "-c", MAKE, str(size), src, "0"], check=True)
    subprocess.run([py, "-c", MAKE, str(size), legacy, "1"], check=True)
    fsize = os.path.getsize(src)
    out = os.path.join(tmp, "out.safetensors")
    ref_out = os.path.join(tmp, "ref.safetensors")
    cp_out = os.path.join(tmp, "copy.pth")
    for p in (src, legacy):
        warm(p)
    ck = [py, "-m", "ckptfix", "convert"]
    clean = remover(cp_out, out, ref_out)  # every tool writes a new file, like cp to a fresh name
    cases = {
        "cp": (["cp", src, cp_out], clean),
        "ckptfix": (ck + [src, "-o", out, "--quiet"], clean),
        "ckptfix_no_verify": (ck + [src, "-o", out, "--quiet", "--no-verify"], clean),
        "ckptfix_legacy": (ck + [legacy, "-o", out, "--quiet"], clean),
    }
    if reference:
        cases["reference"] = ([py, "-c", REFERENCE, src, ref_out], clean)
    res: dict = {"size_bytes": fsize}
    for name, (best, median, rss) in compare(cases, repeat).items():
        res[name] = (best, rss)
        res[name + "_median"] = median
    if reference:
        # same tensors, same metadata?  (save_file orders metadata randomly, so compare data and tensor entries)
        subprocess.run(ck + [src, "-o", out, "--quiet", "--force"], check=True, env=child_env())
        res["same_data_as_reference"] = _data_equal(out, ref_out)
    for p in (out, ref_out, cp_out, src, legacy):
        if os.path.exists(p):
            os.unlink(p)
    return res


def _data_equal(a: str, b: str) -> bool:
    import struct

    def parts(p):
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h = json.loads(f.read(n))
            h.pop("__metadata__", None)
            return h, os.path.getsize(p) - 8 - n, p, 8 + n

    ha, na, _, sa = parts(a)
    hb, nb, _, sb = parts(b)
    if ha != hb or na != nb:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        fa.seek(sa)
        fb.seek(sb)
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)  # small: children inherit our peak RSS
            if x != y:
                return False
            if not x:
                return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100MB,400MB", help="comma-separated checkpoint sizes (decimal units)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs per tool; best wall, worst RSS reported")
    ap.add_argument("--no-reference", action="store_true", help="skip the (slow, memory-hungry) HF recipe")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args()
    sizes = [parse(s) for s in a.sizes.split(",") if s.strip()]
    results = []
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="bench_convert_") as tmp:
        for size in sizes:
            print(f"== {size / 1e9:.2f} GB target", file=sys.stderr)
            r = run_size(size, tmp, a.repeat, not a.no_reference)
            results.append(r)
            _print_one(r)
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        print(
            "\nRSS curve (ckptfix convert, zip, verify on): "
            + ", ".join(f"{r['size_bytes'] / 1e9:.2f} GB -> {r['ckptfix'][1]:.0f} MiB" for r in results)
        )


def _print_one(r: dict) -> None:
    gb = r["size_bytes"] / 1e9
    print(f"\ncheckpoint {gb:.3f} GB (zip, tied embedding/lm_head)")
    print(f"  {'tool':<28}{'best s':>9}{'median s':>10}{'peak RSS MiB':>14}")
    for k in ("cp", "reference", "ckptfix", "ckptfix_no_verify", "ckptfix_legacy"):
        if k in r:
            w, m = r[k]
            print(f"  {k:<28}{w:>9.3f}{r[k + '_median']:>10.3f}{m:>14.1f}")
    ck = r["ckptfix"][0]
    print(
        f"  ckptfix / cp        = {ck / r['cp'][0]:.2f}x   (target <= 2.5x; medians "
        f"{r['ckptfix_median'] / r['cp_median']:.2f}x)"
    )
    if "reference" in r:
        print(f"  ckptfix / reference = {ck / r['reference'][0]:.2f}x   (target <= 0.4x)")
        print(f"  same tensor data and header entries as the reference: {r['same_data_as_reference']}")
    print(
        f"  legacy peak RSS / checkpoint size = {r['ckptfix_legacy'][1] * 2**20 / r['size_bytes']:.3f} (target <= 1.3)"
    )


if __name__ == "__main__":
    main()
