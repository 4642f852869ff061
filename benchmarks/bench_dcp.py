#!/usr/bin/env python3
"""Benchmark DCP consolidation, renaming and loading against ``cp -r`` and torch's own recipe.

Usage::

    python benchmarks/bench_dcp.py                         # 0.2 GB and 1 GB, 4 ranks
    python benchmarks/bench_dcp.py --sizes 0.2GB,1GB,2GB,4GB --repeat 2 --json
    python benchmarks/bench_dcp.py --sizes 4GB --no-reference   # memory curve point without the torch recipe
    python benchmarks/bench_dcp.py --sizes 2GB --jobs 1,2,4     # convert with --jobs N side by side
    python benchmarks/bench_dcp.py --sizes 6.5MB --layer 67x16 --no-reference   # 3,000 tiny tensors: the rename

For each size a 4-rank sharded DCP checkpoint is written by a gloo process group (each rank
builds only its own shards with ``DTensor.from_local``: FSDP-style ``Shard(0)`` with uneven rows
for most weights, ``Shard(1)`` for a quarter of them, a replicated bias and an optimizer-like
``exp_avg`` for every weight), then, side by side in one run (interleaved, best of ``--repeat``),
whole-process wall time and peak RSS (``wait4``) of:

* ``cp -r`` of the directory;
* ``python -m ckptfix convert DIR -o model.safetensors`` (streaming, verification on), once per ``--jobs``
  value (``--jobs N``: N tensors assembled, written and verified at a time);
* the reference: ``dcp_to_torch_save`` then ``safetensors.torch.save_file`` of the model part;
* ``python -m ckptfix add-prefix DIR --prefix m. -o NEW`` (``.metadata`` rewritten, data hard-linked);
* ``load_checkpoint(DIR)`` (the whole checkpoint: peak RSS above an ``import torch, ckptfix`` baseline, over
  the bytes of the tensors it returns).

Targets from issue 15: convert <= 1.5x ``cp -r``, <= 0.25x the reference, peak RSS <= 100 MiB
flat over sizes; add-prefix <= 0.1 s plus linking; load_anywhere <= 1.1x the state dict.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import child_env, ckptfix, compare, py

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckptfix.ops.convert import parse_size

MAKE = r"""
import os, sys, warnings, torch, torch.distributed as dist, torch.multiprocessing as mp
warnings.simplefilter("ignore")

def work(rank, world, out, total, port):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, Replicate
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rows, hidden = map(int, sys.argv[4].split("x"))   # 4099 rows: not divisible by the world size
    per = rows * hidden * 4 * 2          # weight + its exp_avg, float32
    n = max(1, total // per)
    g = torch.Generator().manual_seed(rank)
    def local(shape, placement):
        d = placement.dim
        size = shape[d]
        step = -(-size // world)
        lo, hi = min(size, rank * step), min(size, (rank + 1) * step)
        ls = list(shape); ls[d] = hi - lo
        t = torch.randn(ls, generator=g)
        return DTensor.from_local(t, mesh, [placement], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())
    model, optim = {}, {}
    for i in range(n):
        pl = Shard(1) if i % 4 == 3 else Shard(0)
        model[f"layers.{i}.weight"] = local((rows, hidden), pl)
        model[f"layers.{i}.bias"] = torch.full((rows,), float(i))
        optim[f"layers.{i}.weight"] = {"exp_avg": local((rows, hidden), pl), "step": torch.tensor(1.0)}
    dcp.save({"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-3}]}, "epoch": 1},
             checkpoint_id=out)
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(work, args=(int(sys.argv[3]), sys.argv[1], int(sys.argv[2]), port), nprocs=int(sys.argv[3]))
"""

REFERENCE = r"""
import sys, warnings, torch
warnings.simplefilter("ignore")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
src, tmp, dst = sys.argv[1], sys.argv[2], sys.argv[3]
dcp_to_torch_save(src, tmp)
sd = torch.load(tmp, weights_only=True)["model"]
save_file({k: v.contiguous() for k, v in sd.items()}, dst, metadata={"format": "pt"})
"""

LOAD = r"""
import sys, resource, torch, ckptfix
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ck = ckptfix.load_checkpoint(sys.argv[1]).checkpoint
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
def nbytes(o):
    if isinstance(o, torch.Tensor):
        return o.numel() * o.element_size()
    if isinstance(o, dict):
        return sum(nbytes(v) for v in o.values())
    if isinstance(o, list):
        return sum(nbytes(v) for v in o)
    return 0
print(base, peak, nbytes(ck))
"""


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def _rm(*paths: str):
    def go() -> None:
        for p in paths:
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.unlink(p)

    return go


def bench(
    size: int,
    repeat: int,
    ranks: int,
    reference: bool,
    workdir: str,
    jobs: tuple[int, ...] = (1,),
    layer: str = "4099x1024",
) -> dict:
    import subprocess

    src = os.path.join(workdir, "run.dcp")
    make = os.path.join(workdir, "make.py")
    with open(make, "w") as f:
        f.write(MAKE)
    subprocess.run(
        [sys.executable, make, src, str(size), str(ranks), layer],
        check=True,
        env=child_env(),
        stderr=subprocess.DEVNULL,
    )
    total = _du(src)
    # what the rename's cost follows: .metadata entries (tensors, optimizer states, objects), not bytes
    entries = int(
        subprocess.run(
            py(
                "import sys; from ckptfix.formats.dcp.meta import read_metadata; "
                "print(len(read_metadata(sys.argv[1]).entries))"
            )
            + [src],
            capture_output=True,
            text=True,
            env=child_env(),
            check=True,
        ).stdout
    )
    # warm the page cache for every tool alike, through a small buffer: a child's ru_maxrss includes this
    # process's peak RSS (the memory it was forked from), so the benchmark itself must stay small
    buf = bytearray(1 << 20)
    for n in os.listdir(src):
        with open(os.path.join(src, n), "rb") as f:
            while f.readinto(buf):
                pass
    cp_dst = os.path.join(workdir, "copy.dcp")
    out = os.path.join(workdir, "model.safetensors")
    ref_tmp, ref_out = os.path.join(workdir, "ref.pt"), os.path.join(workdir, "ref.safetensors")
    renamed = os.path.join(workdir, "renamed.dcp")
    cases = {
        "cp -r": (["cp", "-r", src, cp_dst], _rm(cp_dst)),
        "ckptfix convert": (ckptfix("convert", src, "-o", out, "--quiet"), _rm(out)),
        **{
            f"ckptfix convert -j {n}": (ckptfix("convert", src, "-o", out, "--quiet", "--jobs", str(n)), _rm(out))
            for n in jobs
            if n != 1
        },
        "ckptfix add-prefix": (ckptfix("add-prefix", src, "--prefix", "m.", "-o", renamed), _rm(renamed)),
        "ckptfix noop": (ckptfix("--version"), None),
    }
    if reference:
        cases["dcp_to_torch_save + save_file"] = (py(REFERENCE) + [src, ref_tmp, ref_out], _rm(ref_tmp, ref_out))
    res = compare(cases, repeat)
    if reference:
        import hashlib

        def h(p: str) -> str:
            d = hashlib.sha256()
            with open(p, "rb") as f:
                while k := f.readinto(buf):
                    d.update(memoryview(buf)[:k])
            return d.hexdigest()

        # the reference writes no ckptfix metadata: compare against ckptfix's plain header instead
        plain = os.path.join(workdir, "plain.safetensors")
        subprocess.run(
            py(
                "import sys; from ckptfix.ops.convert import convert; "
                "convert(sys.argv[1], sys.argv[2], ckptfix_metadata=False)"
            )
            + [src, plain],
            env=child_env(),
            check=True,
            capture_output=True,
        )
        same = os.path.exists(plain) and h(plain) == h(ref_out)
        _rm(plain)()
    else:
        same = None
    p = subprocess.run(py(LOAD) + [src], capture_output=True, text=True, env=child_env(), check=True)
    base_kib, load_peak, sd_bytes = map(int, p.stdout.split())  # KiB, KiB, bytes (whole checkpoint)
    rename_s = res["ckptfix add-prefix"][0] - res["ckptfix noop"][0]
    row = {
        "size_bytes": total,
        "ranks": ranks,
        "cp_s": round(res["cp -r"][0], 3),
        "convert_s": round(res["ckptfix convert"][0], 3),
        "convert_rss_mib": round(res["ckptfix convert"][2], 1),
        "convert_vs_cp": round(res["ckptfix convert"][0] / res["cp -r"][0], 2),
        "convert_jobs": {
            str(n): {
                "s": round(res[k][0], 3),
                "vs_cp": round(res[k][0] / res["cp -r"][0], 2),
                "rss_mib": round(res[k][2], 1),
            }
            for n in jobs
            for k in ["ckptfix convert" if n == 1 else f"ckptfix convert -j {n}"]
        },
        "add_prefix_s": round(res["ckptfix add-prefix"][0], 3),
        "add_prefix_minus_startup_s": round(rename_s, 3),
        "entries": entries,
        "add_prefix_ms_per_entry": round(rename_s * 1000 / max(1, entries), 3),
        "startup_s": round(res["ckptfix noop"][0], 3),
        "load_peak_over_state_dict": round((load_peak - base_kib) * 1024 / max(1, sd_bytes), 3),
        "state_dict_bytes": sd_bytes,
    }
    if reference:
        row.update(
            {
                "reference_s": round(res["dcp_to_torch_save + save_file"][0], 3),
                "reference_rss_mib": round(res["dcp_to_torch_save + save_file"][2], 1),
                "convert_vs_reference": round(res["ckptfix convert"][0] / res["dcp_to_torch_save + save_file"][0], 3),
                "byte_identical_to_reference": same,
            }
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.2GB,1GB", help="comma-separated checkpoint sizes (model + optimizer)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--no-reference", action="store_true", help="skip dcp_to_torch_save + save_file")
    ap.add_argument("--jobs", default="1,2", help="comma-separated --jobs values to time convert with")
    ap.add_argument(
        "--layer",
        default="4099x1024",
        help="ROWSxCOLS of each weight; small layers give many tensors per byte (the rename's cost follows them)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed afterwards)")
    a = ap.parse_args()
    rows = []
    for s in a.sizes.split(","):
        work = tempfile.mkdtemp(prefix="bench_dcp.", dir=a.dir)
        try:
            jobs = tuple(int(j) for j in a.jobs.split(","))
            rows.append(bench(parse_size(s), a.repeat, a.ranks, not a.no_reference, work, jobs, a.layer))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if not a.json:
            r = rows[-1]
            print(
                f"{r['size_bytes'] / 1e9:5.2f} GB {r['ranks']} ranks | cp -r {r['cp_s']:.2f}s | convert "
                f"{r['convert_s']:.2f}s ({r['convert_vs_cp']:.2f}x cp"
                + (
                    f", {r['convert_vs_reference']:.3f}x reference {r['reference_s']:.2f}s"
                    if "reference_s" in r
                    else ""
                )
                + f") RSS {r['convert_rss_mib']:.0f} MiB"
                + (f" vs {r['reference_rss_mib']:.0f} MiB" if "reference_rss_mib" in r else "")
                + "".join(
                    f" | -j {n} {v['s']:.2f}s ({v['vs_cp']:.2f}x cp, {v['rss_mib']:.0f} MiB)"
                    for n, v in r["convert_jobs"].items()
                    if n != "1"
                )
                + f" | identical {r.get('byte_identical_to_reference')} | add-prefix {r['add_prefix_s']:.2f}s "
                f"({r['add_prefix_minus_startup_s']:+.3f}s over startup, {r['entries']} entries) | "
                f"load_checkpoint peak {r['load_peak_over_state_dict']:.2f}x checkpoint",
                flush=True,
            )
    if a.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
