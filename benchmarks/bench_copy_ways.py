#!/usr/bin/env python3
"""The ways of copying a checkpoint's tensors into safetensors' packed offsets, timed in one process.

Usage::

    python benchmarks/bench_copy_ways.py                      # 0.5 GB GPT-2-layout fixture in /tmp, warm
    python benchmarks/bench_copy_ways.py --size 1.5GB --cold --dir /dev/shm

What ``ckptfix.files.fileio`` chooses between, on the file system of ``--dir``: the fixture of
``bench_copy.py`` (a ``torch.save`` zip: 64-byte aligned records) is copied record by record to the
offsets a safetensors file gives them (packed after a 14 KB header, so the offsets do not line up),
each way in turn, order reversed every other round, the output deleted and ``sync`` before every run
(cold: the input's pages evicted with ``posix_fadvise(DONTNEED)``).  Wall and CPU time (this process's
user + system), best and median.  Ways: ``cp`` (one ``copy_file_range`` of the whole file, offsets
equal: the floor), ``cfr`` (``copy_file_range`` per record at the packed offsets), ``cfr-64k`` /
``cfr-4k`` (the whole file at offset 65536 / 4096: what header padding would give), ``buf`` (``pread``
+ ``pwrite`` through a 1 MiB buffer), ``buf+cmp`` (that plus the read-back ``memcmp``: the verified
copy), ``falloc+...`` (the output's blocks reserved first with ``fallocate``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import struct
import sys
import tempfile
import time
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HEADER = 14_000
BUF = 1 << 20
STEP = 64 << 20
WAYS = ("cp", "cfr", "cfr-64k", "cfr-4k", "buf", "buf+cmp", "falloc+buf", "falloc+buf+cmp", "falloc+cfr")


def records(path: str) -> list[tuple[int, int]]:
    """``(data offset, size)`` of every tensor record of a torch zip, in file order."""
    out = []
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for zi in z.infolist():
            if "/data/" in zi.filename:
                f.seek(zi.header_offset + 26)
                n, m = struct.unpack("<HH", f.read(4))
                out.append((zi.header_offset + 30 + n + m, zi.file_size))
    return sorted(out)


def _cfr(s: int, d: int, so: int, do: int, n: int) -> None:
    done = 0
    while done < n:
        k = os.copy_file_range(s, d, min(STEP, n - done), so + done, do + done)
        if k <= 0:
            raise OSError("copy_file_range copied nothing")
        done += k


def _buf(s: int, d: int, so: int, do: int, n: int, a: bytearray, b: bytearray, cmp: bool) -> None:
    mv, bv = memoryview(a), memoryview(b)
    done = 0
    while done < n:
        k = os.preadv(s, [mv[: min(n - done, BUF)]], so + done)
        os.pwrite(d, mv[:k], do + done)
        if cmp:
            os.preadv(d, [bv[:k]], do + done)
            if not a.startswith(bv[:k]):
                raise SystemExit("read back differs")
        done += k


def run(way: str, src: int, out: str, recs: list[tuple[int, int]], bufs: tuple[bytearray, bytearray]) -> None:
    d = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        size = os.fstat(src).st_size
        if way in ("cp", "cfr-64k", "cfr-4k"):
            _cfr(src, d, 0, {"cp": 0, "cfr-64k": 65536, "cfr-4k": 4096}[way], size)
            return
        total = 8 + HEADER + sum(n for _, n in recs)
        if way.startswith("falloc+"):
            os.posix_fallocate(d, 0, total)
            way = way[len("falloc+") :]
        os.pwrite(d, b" " * (8 + HEADER), 0)
        pos = 8 + HEADER
        for so, n in recs:
            if way == "cfr":
                _cfr(src, d, so, pos, n)
            else:
                _buf(src, d, so, pos, n, *bufs, cmp=way == "buf+cmp")
            pos += n
    finally:
        os.close(d)


def main() -> None:
    from bench_copy import make_gpt2

    from ckptfix.text import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="0.5GB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--dir", default=None, help="where the fixture and the output go (default: a temp dir in /tmp)")
    ap.add_argument("--ways", default=",".join(WAYS))
    a = ap.parse_args()
    ways = a.ways.split(",")
    work = tempfile.mkdtemp(prefix="bench_copy_ways.", dir=a.dir)
    path, out = os.path.join(work, "gpt2.pt"), os.path.join(work, "out.bin")
    try:
        layout = make_gpt2(path, parse_size(a.size))
        recs = records(path)
        src = os.open(path, os.O_RDONLY)
        bufs = (bytearray(BUF), bytearray(BUF))
        times: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
        loads = []
        for r in range(a.repeat):
            for way in ways if r % 2 == 0 else ways[::-1]:
                if os.path.exists(out):
                    os.unlink(out)
                os.sync()
                if a.cold:
                    os.posix_fadvise(src, 0, 0, os.POSIX_FADV_DONTNEED)
                loads.append(os.getloadavg()[0])
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                run(way, src, out, recs, bufs)
                t, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
                times[way].append((t, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime))
        os.close(src)
        print(
            f"{os.path.getsize(path) / 1e9:.2f} GB ({layout}), {len(recs)} records, {'cold' if a.cold else 'warm'}, "
            f"load {min(loads):.1f}-{max(loads):.1f}, best / median of {a.repeat}"
        )
        for w, v in times.items():
            wall, cpu = [x for x, _ in v], [c for _, c in v]
            print(
                f"  {w:15} wall {min(wall):.3f} / {statistics.median(wall):.3f} s   "
                f"cpu {min(cpu):.3f} / {statistics.median(cpu):.3f} s"
            )
    finally:
        for p in (path, out):
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(work)


if __name__ == "__main__":
    main()
