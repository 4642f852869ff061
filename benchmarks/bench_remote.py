#!/usr/bin/env python3
"""Benchmark remote checkpoints (issue #26) against a local S3 server (moto) with a simulated latency.

Usage::

    python benchmarks/bench_remote.py                          # 100 MB, every container, 20 ms per request
    python benchmarks/bench_remote.py --sizes 100MB,400MB,4GB --latency 0.02 --repeat 3 --jobs 8
    python benchmarks/bench_remote.py --containers zip,safetensors --json

Needs torch (to write the checkpoints), s3fs and ``moto[server]`` (``pip install "ckptfix[remote]" "moto[server]"``).
For each size and container (torch zip, legacy torch, safetensors, a sharded safetensors index folder, a DCP
folder) it writes a transformer-like checkpoint in a temp folder, uploads it to moto's S3 server (started in
this process on a free port: ``tests/s3server.py``; the server sleeps ``--latency`` seconds before answering
each request, the round trip of a real store) and deletes everything afterwards.  Then it reports:

* ``inspect URL --stats`` and ``scan URL --stats``: bytes transferred and requests, as the server counted
  them (the client's own ``--stats`` line too), and wall time;
* ``convert URL -o out.safetensors --jobs N`` (range requests, streamed into the output, verified) vs the
  ``aws s3 cp`` way: ``s3fs get`` of the whole checkpoint to local disk, then ``ckptfix convert`` of the local
  copy; both timed side by side, order alternated round after round (``_measure.compare``), best and median
  of ``--repeat`` runs, and the ratio (remote / download + convert); bytes and requests of each.

The server and the benchmarked commands share this machine's CPUs, so the absolute throughput is the local
server's; the ratio and the request counts are what carry over to a real store.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from _measure import child_env, compare  # noqa: E402

from s3server import S3Server  # noqa: E402

CONTAINERS = ("zip", "legacy", "safetensors", "sharded", "dcp")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def state_dict(nbytes: int) -> dict:
    """A GPT-like fp32 state dict of about ``nbytes``: per block 4 d x d and 2 d x 4d weights, biases, norms."""
    import torch

    d = 1024 if nbytes >= 300 * 10**6 else 512
    per_block = (4 * d * d + 2 * 4 * d * d + 10 * d) * 4
    blocks = max(1, nbytes // per_block)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for b in range(blocks):
        p = f"h.{b}."
        for n in ("q", "k", "v", "o"):
            sd[p + f"attn.{n}.weight"] = torch.randn(d, d, generator=g)
            sd[p + f"attn.{n}.bias"] = torch.zeros(d)
        sd[p + "mlp.fc.weight"] = torch.randn(4 * d, d, generator=g)
        sd[p + "mlp.proj.weight"] = torch.randn(d, 4 * d, generator=g)
        sd[p + "ln1.weight"] = torch.ones(d)
        sd[p + "ln2.weight"] = torch.ones(d)
    return sd


def write(container: str, sd: dict, root: str) -> str:
    """The checkpoint as ``container`` under ``root``; the path to give ckptfix (file, index or folder)."""
    import torch

    if container == "zip":
        p = os.path.join(root, "model.pt")
        torch.save(sd, p)
        return p
    if container == "legacy":
        p = os.path.join(root, "model_legacy.pt")
        torch.save(sd, p, _use_new_zipfile_serialization=False)
        return p
    if container == "safetensors":
        from safetensors.torch import save_file

        p = os.path.join(root, "model.safetensors")
        save_file(sd, p, metadata={"format": "pt"})
        return p
    if container == "sharded":
        from safetensors.torch import save_file

        d = os.path.join(root, "sharded")
        os.makedirs(d)
        keys = list(sd)
        n = 4
        per = -(-len(keys) // n)
        wm = {}
        for i in range(n):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            part = {k: sd[k] for k in keys[i * per : (i + 1) * per]}
            save_file(part, os.path.join(d, name), metadata={"format": "pt"})
            wm.update(dict.fromkeys(part, name))
        total = sum(t.numel() * t.element_size() for t in sd.values())
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f)
        return d
    if container == "dcp":
        import warnings

        import torch.distributed.checkpoint as dcp

        d = os.path.join(root, "run.dcp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=d)
        return d
    raise ValueError(container)


def du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)


def ckptfix(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptfix", *args]


def counted(srv: S3Server, argv: list[str], env: dict) -> dict:
    """Run ``argv`` once; the server's request and byte counts, the wall time and the client's stats line."""
    srv.reset_counts()
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode == 2 and "--stats" in argv and "--stats" in p.stderr:  # a build whose command lacks --stats
        return counted(srv, [a for a in argv if a != "--stats"], env)
    if p.returncode not in (0, 11):  # scan exits 11 on findings: still a measurement
        sys.exit(f"failed ({p.returncode}): {' '.join(argv)}\n{p.stderr[-2000:]}")
    line = next((ln for ln in p.stderr.splitlines() if ln.startswith("read ")), "")
    return {
        "requests": srv.requests,
        "bytes": srv.bytes_sent,
        "by_method": dict(srv.by_method),
        "seconds": round(dt, 3),
        "client": line,
    }


DOWNLOAD = r"""
import os, sys, s3fs
url, dst = sys.argv[1], sys.argv[2]
fs = s3fs.S3FileSystem(skip_instance_cache=True)
if fs.isdir(url):
    fs.get(url.rstrip("/") + "/", dst.rstrip("/") + "/", recursive=True)
else:
    fs.get_file(url, dst)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100MB")
    ap.add_argument("--containers", default=",".join(CONTAINERS))
    ap.add_argument("--latency", type=float, default=0.02, help="seconds the server waits per request")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--no-convert", action="store_true", help="inspect/scan counts only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    with S3Server() as srv:
        env = child_env(srv.env())
        for size_s in args.sizes.split(","):
            size = parse_size(size_s)
            sd = state_dict(size)
            for container in args.containers.split(","):
                work = tempfile.mkdtemp(prefix="bench-remote-")
                try:
                    local = write(container, sd, work)
                    nbytes = du(local)
                    rel = os.path.relpath(local, work)
                    key = f"{srv.prefix(container)}/{rel}"
                    target = local
                    if container == "sharded":
                        target = os.path.join(local, "model.safetensors.index.json")
                    url = srv.upload(local, key)
                    url_arg = srv.url(f"{key}/model.safetensors.index.json") if container == "sharded" else url
                    srv.latency = args.latency
                    row: dict = {"size": size_s, "container": container, "bytes": nbytes, "latency": args.latency}
                    row["inspect"] = counted(srv, ckptfix("inspect", url_arg, "--stats"), env)
                    row["scan"] = counted(srv, ckptfix("scan", url_arg, "--stats"), env)
                    if not args.no_convert:
                        out_r = os.path.join(work, "out_remote.safetensors")
                        out_l = os.path.join(work, "out_local.safetensors")
                        dl = os.path.join(work, "download")
                        dl_target = os.path.join(dl, os.path.basename(target)) if container == "sharded" else dl

                        def clean(out_r: str = out_r, out_l: str = out_l, dl: str = dl) -> None:
                            for p in (out_r, out_l):
                                if os.path.exists(p):
                                    os.unlink(p)
                            shutil.rmtree(dl, ignore_errors=True)
                            if os.path.exists(dl):
                                os.unlink(dl)

                        remote = ckptfix("convert", url_arg, "-o", out_r, "--jobs", str(args.jobs), "-q")
                        both = [
                            "sh",
                            "-c",
                            f'"{sys.executable}" -c \'{DOWNLOAD}\' "{url}" "{dl}" && '
                            f'"{sys.executable}" -m ckptfix convert "{dl_target}" -o "{out_l}" -q',
                        ]
                        row["convert_remote_once"] = counted(srv, remote, env)
                        clean()
                        row["download_convert_once"] = counted(srv, both, env)
                        clean()
                        timed = compare(
                            {"remote": (remote, clean), "download+convert": (both, clean)},
                            repeat=args.repeat,
                            env=env,
                        )
                        row["convert"] = {k: {"best": v[0], "median": v[1], "rss_mib": v[2]} for k, v in timed.items()}
                        row["ratio_best"] = timed["remote"][0] / timed["download+convert"][0]
                        row["ratio_median"] = timed["remote"][1] / timed["download+convert"][1]
                    srv.latency = 0.0
                    results.append(row)
                    if not args.json:
                        show(row)
                finally:
                    srv.latency = 0.0
                    shutil.rmtree(work, ignore_errors=True)
                    for k in srv.keys():
                        srv.fs().rm_file(f"{srv.bucket}/{k}")
    if args.json:
        print(json.dumps(results, indent=2))


def show(r: dict) -> None:
    mb = r["bytes"] / 1e6
    print(f"{r['container']:12s} {r['size']:>6s} ({mb:,.0f} MB), {r['latency'] * 1000:.0f} ms/request")
    for what in ("inspect", "scan"):
        x = r[what]
        print(f"  {what:8s} {x['bytes']:>12,d} bytes in {x['requests']:>3d} requests, {x['seconds']:.2f} s")
    if "convert" in r:
        c = r["convert"]
        o, d = r["convert_remote_once"], r["download_convert_once"]
        print(
            f"  convert  remote: best {c['remote']['best']:.2f} s (median {c['remote']['median']:.2f}), "
            f"{o['bytes']:,d} bytes in {o['requests']} requests, {c['remote']['rss_mib']:.0f} MiB RSS"
        )
        print(
            f"           download+convert: best {c['download+convert']['best']:.2f} s "
            f"(median {c['download+convert']['median']:.2f}), {d['bytes']:,d} bytes in {d['requests']} requests"
        )
        best, med = r["ratio_best"], r["ratio_median"]
        print(f"           ratio remote / download+convert: {best:.2f}x best, {med:.2f}x median")


if __name__ == "__main__":
    main()
