#!/usr/bin/env python3
"""Benchmark remote checkpoints (issue #26) against a local S3 server (moto) with a simulated latency.

Usage::

    python benchmarks/bench_remote.py                          # 100 MB, every container, 20 ms per request
    python benchmarks/bench_remote.py --sizes 100MB,400MB,4GB --latency 0.02 --repeat 3 --jobs 8
    python benchmarks/bench_remote.py --containers zip,safetensors --json

Needs torch (to write the checkpoints), s3fs and ``moto[server]`` (``pip install ".[remote]" "moto[server]"``).
For each size and container (torch zip, legacy torch, safetensors, a sharded safetensors index folder, a DCP
folder) it writes a transformer-like checkpoint in a temp folder, uploads it to moto's S3 server (started in
this process on a free port: ``tests/s3server.py``; the server sleeps ``--latency`` seconds before answering
each request, the round trip of a real store) and deletes everything afterwards.  Then it reports:

* ``inspect URL --stats`` and ``scan URL --stats``: bytes transferred and requests, as the server counted
  them (the client's own ``--stats`` line too), and wall time;
* ``convert URL -o out.safetensors --jobs N`` (range requests, streamed into the output, verified) vs the
  ``aws s3 cp`` way: the driver's ``get_file`` of every file of the checkpoint (one GET each) to local disk,
  then ``ckptfix convert`` of the local copy; both timed side by side, the order alternated round after round,
  best and median of ``--repeat`` runs, peak RSS (``/usr/bin/time``), and the ratio (remote / download +
  convert); bytes and requests of each.

``--servers s3,http``: the same runs against moto's S3 server and against the Range-serving ``http.server`` of
the tests (``tests/rangeserver.py``, same latency).  moto answers a range request by reading the whole object
(a 90 MB object: ~90 ms per ranged GET on this machine, a 1 MB one ~7 ms), which a real store does not: its
convert times penalise range requests in proportion to the object's size, so the HTTP server's ratio is the
one closer to S3.  The servers and the benchmarked commands share this machine's CPUs: the absolute
throughput is the local server's; the ratios and the request counts are what carry over to a real store.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from _measure import child_env  # noqa: E402

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
    # random weights up to 0.5 GB; zeros above (the bytes moved are the same, and writing them is quicker)
    randn = (lambda *shape: torch.randn(*shape, generator=g)) if nbytes <= 5 * 10**8 else torch.zeros
    sd = {}
    for b in range(blocks):
        p = f"h.{b}."
        for n in ("q", "k", "v", "o"):
            sd[p + f"attn.{n}.weight"] = randn(d, d)
            sd[p + f"attn.{n}.bias"] = torch.zeros(d)
        sd[p + "mlp.fc.weight"] = randn(4 * d, d)
        sd[p + "mlp.proj.weight"] = randn(d, 4 * d)
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


class Backend:
    """A local store serving the benchmark's files: moto's S3 (``s3``) or the Range-serving HTTP server (``http``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.latency = 0.0
        self.s3: S3Server | None = None
        self.http: Any = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Backend:
        if self.kind == "s3":
            self.s3 = self._stack.enter_context(S3Server())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def env(self) -> dict[str, str]:
        return child_env(self.s3.env() if self.s3 is not None else {})

    def publish(self, work: str, rel: str) -> str:
        """Make ``work/rel`` (a file or folder) available; its URL."""
        if self.s3 is not None:
            return self.s3.upload(os.path.join(work, rel), f"{self.s3.prefix('b')}/{rel}")
        from rangeserver import Handler, RangeServer

        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        backend = self

        class Slow(Handler):
            def do_GET(self) -> None:
                time.sleep(backend.latency)
                super().do_GET()

            def do_HEAD(self) -> None:
                time.sleep(backend.latency)
                super().do_HEAD()

        srv = RangeServer(work)
        srv.RequestHandlerClass = lambda *a, **k: Slow(*a, directory=work, **k)  # type: ignore[assignment]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        self.http = srv
        return f"{srv.url}/{rel}"

    def set_latency(self, seconds: float) -> None:
        self.latency = seconds
        if self.s3 is not None:
            self.s3.latency = seconds

    def reset(self) -> None:
        if self.s3 is not None:
            self.s3.reset_counts()
        elif self.http is not None:
            self.http.reset()

    def counts(self) -> tuple[int, int]:
        """(requests, body bytes sent) since :meth:`reset`."""
        if self.s3 is not None:
            return self.s3.requests, self.s3.bytes_sent
        return len(self.http.requests()), self.http.sent()

    def cleanup(self) -> None:
        if self.s3 is not None:
            for k in self.s3.keys():
                self.s3.fs().rm_file(f"{self.s3.bucket}/{k}")
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            self.http = None


def counted(be: Backend, argv: list[str], env: dict) -> dict:
    """Run ``argv`` once; the server's request and byte counts, the wall time and the client's stats line."""
    be.reset()
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode == 2 and "--stats" in argv and "--stats" in p.stderr:  # a build whose command lacks --stats
        return counted(be, [a for a in argv if a != "--stats"], env)
    if p.returncode not in (0, 11):  # scan exits 11 on findings: still a measurement
        sys.exit(f"failed ({p.returncode}): {' '.join(argv)}\n{p.stderr[-2000:]}")
    line = next((ln for ln in p.stderr.splitlines() if ln.startswith("read ")), "")
    requests, sent = be.counts()
    return {"requests": requests, "bytes": sent, "seconds": round(dt, 3), "client": line}


#: the ``aws s3 cp`` way: every file of the checkpoint downloaded whole (one GET each), by the store's driver
DOWNLOAD = r"""
import os, sys, fsspec
url, dst, names = sys.argv[1], sys.argv[2], sys.argv[3:]
fs, _ = fsspec.core.url_to_fs(url)
strip = (lambda u: u) if url.startswith("http") else (lambda u: u.split("://", 1)[1])
if names:
    os.makedirs(dst)
    for n in names:
        fs.get_file(strip(url.rstrip("/") + "/" + n), os.path.join(dst, n))
else:
    fs.get_file(strip(url), dst)
"""


def timed_run(argv: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one run, RSS from ``/usr/bin/time`` (this process is big: moto holds the
    objects, and Linux carries a forking parent's peak RSS into its exec'd child's ``ru_maxrss``)."""
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-f", "maxrss %M", *argv], env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(argv)}\n{p.stderr[-2000:]}")
    kib = next((int(ln.split()[1]) for ln in reversed(p.stderr.splitlines()) if ln.startswith("maxrss ")), 0)
    return dt, kib / 1024


def interleaved(cases: dict[str, list[str]], before: Any, repeat: int, env: dict) -> dict[str, tuple]:
    """Round after round each case once, the order alternated; ``{name: (best s, median s, peak RSS MiB)}``."""
    walls: dict[str, list[float]] = {k: [] for k in cases}
    rss = dict.fromkeys(cases, 0.0)
    names = list(cases)
    for i in range(repeat):
        for name in names if i % 2 == 0 else names[::-1]:
            before()
            os.sync()
            t, r = timed_run(cases[name], env)
            walls[name].append(t)
            rss[name] = max(rss[name], r)
    return {k: (min(v), statistics.median(v), rss[k]) for k, v in walls.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100MB")
    ap.add_argument("--containers", default=",".join(CONTAINERS))
    ap.add_argument("--servers", default="s3,http", help="s3 (moto), http (Range-serving http.server), or both")
    ap.add_argument("--latency", type=float, default=0.02, help="seconds the server waits per request")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--no-convert", action="store_true", help="inspect/scan counts only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    for server in args.servers.split(","):
        with Backend(server) as be:
            env = be.env()
            for size_s in args.sizes.split(","):
                sd = state_dict(parse_size(size_s))
                for container in args.containers.split(","):
                    work = tempfile.mkdtemp(prefix="bench-remote-")
                    try:
                        row = one(be, env, args, work, size_s, container, sd)
                    finally:
                        be.set_latency(0.0)
                        be.cleanup()
                        shutil.rmtree(work, ignore_errors=True)
                    results.append(row)
                    if not args.json:
                        show(row)
                del sd
    if args.json:
        print(json.dumps(results, indent=2))


def one(be: Backend, env: dict, args: Any, work: str, size_s: str, container: str, sd: dict) -> dict:
    local = write(container, sd, work)
    rel = os.path.relpath(local, work)
    url = be.publish(work, rel)
    index = "model.safetensors.index.json"
    url_arg = url + "/" + index if container == "sharded" else url
    names = sorted(os.listdir(local)) if os.path.isdir(local) else []
    row: dict = {"server": be.kind, "size": size_s, "container": container, "bytes": du(local)}
    row["latency"] = args.latency
    be.set_latency(args.latency)
    row["inspect"] = counted(be, ckptfix("inspect", url_arg, "--stats"), env)
    row["scan"] = counted(be, ckptfix("scan", url_arg, "--stats"), env)
    if args.no_convert:
        return row
    out_r = os.path.join(work, "out_remote.safetensors")
    out_l = os.path.join(work, "out_local.safetensors")
    dl = os.path.join(work, "download")
    dl_target = os.path.join(dl, index) if container == "sharded" else dl

    def clean() -> None:
        for p in (out_r, out_l):
            if os.path.exists(p):
                os.unlink(p)
        shutil.rmtree(dl, ignore_errors=True)
        if os.path.exists(dl):
            os.unlink(dl)

    remote = ckptfix("convert", url_arg, "-o", out_r, "--jobs", str(args.jobs), "-q")
    quoted = " ".join(f'"{n}"' for n in names)
    both = [
        "sh",
        "-c",
        f'"{sys.executable}" -c \'{DOWNLOAD}\' "{url}" "{dl}" {quoted} && '
        f'"{sys.executable}" -m ckptfix convert "{dl_target}" -o "{out_l}" -q',
    ]
    row["convert_remote_once"] = counted(be, remote, env)
    clean()
    row["download_convert_once"] = counted(be, both, env)
    clean()
    timed = interleaved({"remote": remote, "download+convert": both}, clean, args.repeat, env)
    row["convert"] = {k: {"best": v[0], "median": v[1], "rss_mib": v[2]} for k, v in timed.items()}
    row["ratio_best"] = timed["remote"][0] / timed["download+convert"][0]
    row["ratio_median"] = timed["remote"][1] / timed["download+convert"][1]
    clean()
    return row


def show(r: dict) -> None:
    mb = r["bytes"] / 1e6
    print(f"{r['server']:4s} {r['container']:12s} {r['size']:>6s} ({mb:,.0f} MB), {r['latency'] * 1000:.0f} ms/request")
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
