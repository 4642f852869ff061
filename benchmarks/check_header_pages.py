#!/usr/bin/env python3
"""How many of a cold torch zip's local-header pages stay in the page cache after ckptfix reads its index.

Usage::

    python benchmarks/check_header_pages.py                  # 6 records of 1 MiB in a temp dir, 5 rounds
    python benchmarks/check_header_pages.py --records 149 --dir /data --rounds 9

``zipfmt.members()`` reads every record's local header (spread over the file) before the copy reads the
file in order; ``pagecache.read_scattered`` drops again the pages it brought in, so that cached islands do
not break the kernel's readahead of that copy (issue 25).  What the cache holds after a read depends on the
kernel, its readahead settings, memory pressure and other processes: a figure to look at on a given
machine, not something the test suite can assert (issue 36).  Each round: the file is written, ``fsync``-ed
and evicted (``POSIX_FADV_DONTNEED``, then ``POSIX_FADV_RANDOM`` so that a question about a page reads that
page alone), ``read_checkpoint`` reads its index, and the page before each record's data (its local header)
is asked about once (``preadv2(RWF_NOWAIT)``; on Linux 6.x asking starts reading a page that is not cached,
so only the first answer is its state).  The first two records are left out: ``data.pkl``, at the start, is
read through ``zipfile`` and the kernel reads ahead of it.  Prints, per round, cached / asked; then the best
and the median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def one_round(path: str, records: int) -> tuple[int, int] | None:
    import torch

    from ckptfix.files import pagecache
    from ckptfix.formats import read_checkpoint

    torch.save({f"w{i}": torch.zeros(256 << 10) for i in range(records)}, path)  # 1 MiB records
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if pagecache._cached(fd, 0) is not False:
            return None  # the cache cannot be asked here, or pages stay cached
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        ck = read_checkpoint(path)
        offs = sorted(st.file_offset for st in ck.storages.values())[2:]
        return sum(1 for o in offs if pagecache._cached(fd, o - 100)), len(offs)
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the file is written (default: the temp dir)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        got = []
        for r in range(a.rounds):
            res = one_round(os.path.join(d, "m.pt"), a.records)
            if res is None:
                print("the page cache cannot be asked here (no RWF_NOWAIT, or evicted pages stay cached)")
                return 1
            got.append(res[0])
            print(f"round {r + 1}: {res[0]} / {res[1]} local-header pages still cached")
    print(f"best {min(got)}, median {statistics.median(got)} (of {a.records - 2} asked; 0 = all dropped again)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
