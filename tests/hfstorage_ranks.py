"""Write a HuggingFaceStorageWriter folder with torch's own writer, at test time: N gloo ranks on CPU.

    python tests/hfstorage_ranks.py OUT_DIR NRANKS

Each rank holds rows of a (6, 4) float32 tensor ``w`` (``Shard(0)``) and the whole of ``b`` (replicated);
``dcp.save(..., storage_writer=HuggingFaceStorageWriter(OUT_DIR, save_distributed=True))`` writes one
``shard-<rank+1>-model-00001-of-00001.safetensors`` per rank.  :func:`expected` is the state dict.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def expected():
    import torch

    return {
        "w": torch.arange(24, dtype=torch.float32).reshape(6, 4) + 1,
        "b": torch.arange(4, dtype=torch.float32) + 100,
    }


def _worker(out_dir: str, n: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (n,))
    sd = expected()
    sd = {"w": distribute_tensor(sd["w"], mesh, [Shard(0)]), "b": distribute_tensor(sd["b"], mesh, [Replicate()])}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out_dir, save_distributed=True))
    dist.barrier()
    dist.destroy_process_group()


def write(out_dir: str, n: int = 3) -> None:
    """Run ``n`` ranks writing ``out_dir`` (raises RuntimeError when a rank fails)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(n):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="lo",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", out_dir, str(n)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    errs = [p.communicate(timeout=300)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(b"\n".join(errs).decode(errors="replace")[-4000:])


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]))
    else:
        write(sys.argv[1], int(sys.argv[2]))
