#!/usr/bin/env python3
"""Peak memory of ``ckptfix convert CKPT -o s3://...`` by checkpoint size (issue #33 §5b): flat, not 2x the file.

Usage::

    python benchmarks/bench_upload_rss.py                      # 64 MB and 480 MB
    python benchmarks/bench_upload_rss.py --sizes 64,480,1000  # MB
    python benchmarks/bench_upload_rss.py --root /path/to/other/checkout   # the same runs of another branch

For each size it writes a torch checkpoint (one float32 tensor per 16 MB, in a temp folder), starts moto's S3
server in this process (``tests/s3server.py``), and reports the peak RSS (``/usr/bin/time``) of child
processes: ``ckptfix convert big.pt -o s3://.../big.safetensors`` beside the same convert to a local file (both
map the input: its pages count in RSS), and the upload alone (``ckptfix.files.remote.upload.commit_file`` of the
file of random bytes of that size, as convert calls it on its verified output), beside a child that only imports
the driver and makes its client (the baseline).  Everything is deleted afterwards.  Needs torch, s3fs and
``moto[server]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


_UPLOAD = """
import sys
from ckptfix.files.remote.upload import commit_file
from ckptfix.files.remote.url import filesystem
filesystem(sys.argv[2])
if sys.argv[3:] != ["baseline"]:
    commit_file(sys.argv[1], sys.argv[2])
"""


def _peak_rss(cmd: list[str], env: dict[str, str]) -> tuple[int, int]:
    """The command's exit status and peak RSS in MiB (``/usr/bin/time -f %M``: a child forked from this process,
    which holds moto's objects, would count the fork's pages in its own ``ru_maxrss``)."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as out:
        # run in the temp folder: ``python -c`` puts the working directory before PYTHONPATH (--root)
        cwd = os.path.dirname(out.name)
        p = subprocess.run(["/usr/bin/time", "-o", out.name, "-f", "%M", *cmd], env=env, capture_output=True, cwd=cwd)
        if p.returncode:
            sys.stderr.write(p.stderr.decode())
        return p.returncode, int(out.read().split()[-1]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,480", help="checkpoint sizes in MB, comma separated")
    ap.add_argument("--root", default=str(ROOT), help="the ckptfix checkout the children run (another branch's)")
    args = ap.parse_args()

    import torch

    from s3server import S3Server

    env = {**os.environ, "PYTHONPATH": args.root}
    with tempfile.TemporaryDirectory(prefix="ckptfix-bench-upload-") as tmp, S3Server() as s3:
        env.update(s3.env())
        print(f"{'size':>8}  {'convert, local':>14}  {'convert, s3://':>14}  {'upload alone':>12}  {'baseline':>8}")
        for mb in (int(x) for x in args.sizes.split(",")):
            src = Path(tmp) / f"big{mb}.pt"
            n = mb * 1_000_000 // 4
            per = 4_000_000  # 16 MB tensors
            g = torch.Generator().manual_seed(0)
            torch.save({f"w{i}": torch.randn(min(per, n - i * per), generator=g) for i in range(-(-n // per))}, src)
            cli = [sys.executable, "-m", "ckptfix"]
            rc1, local = _peak_rss([*cli, "convert", str(src), "-o", str(Path(tmp) / "out.safetensors")], env)
            rc2, remote = _peak_rss([*cli, "convert", str(src), "-o", s3.url(f"bench/big{mb}.safetensors")], env)
            blob = Path(tmp) / "blob.bin"  # the upload alone: a file of random bytes of the size asked
            with open(blob, "wb") as f:
                for _ in range(mb):
                    f.write(os.urandom(1_000_000))
            up = [sys.executable, "-c", _UPLOAD, str(blob), s3.url(f"bench/up{mb}.st")]
            rc3, alone = _peak_rss(up, env)
            rc4, base = _peak_rss([*up, "baseline"], env)
            if rc1 or rc2 or rc3 or rc4:
                raise SystemExit(f"a run failed ({rc1}, {rc2}, {rc3}, {rc4})")
            print(f"{mb:>6}MB  {local:>10} MiB  {remote:>10} MiB  {alone:>8} MiB  {base:>4} MiB")
            src.unlink()
            (Path(tmp) / "out.safetensors").unlink()
            blob.unlink()
            for key in (f"big{mb}.safetensors", f"up{mb}.st"):
                s3.fs().rm_file(f"{s3.bucket}/bench/{key}")


if __name__ == "__main__":
    main()
