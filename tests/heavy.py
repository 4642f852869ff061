"""Builders of the expensive read-only fixtures (real multi-process FSDP and DDP saves), run once per test run
by the session fixtures of conftest.py (``fsdp2_gloo_dcp``, ``fsdp_trained_dcp``, ``ddp_trained_pt``).  Tests
must not modify what they return: copy it first."""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path
from typing import Any

import torch

#: the small trainer set-up the FSDP tests share (tests/test_train_fsdp.py)
FSDP_SMALL = dict(train_samples=256, test_samples=64, quiet=True)


def _gloo_worker(rank: int, world: int, out: str, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))  # 7, 5 rows: uneven
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(3, 6)).sum().backward()
        opt.step()
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        col = torch.arange(5 * 9, dtype=torch.float32).reshape(5, 9)
        msd["extra.col"] = distribute_tensor(col, mesh, [Shard(1)])
        dcp.save({"model": msd, "optim": osd, "epoch": 1}, checkpoint_id=out)
        full_now = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in msd.items()}
        if rank == 0:
            torch.save({"model": full_now, "initial": full}, out + ".full.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def build_fsdp2_gloo_dcp(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Two gloo ranks save an FSDP2 model (uneven rows), its Adam state and a column-sharded DTensor as DCP.

    Returns:
        The ``run.dcp`` directory and the full (gathered) model state dict it holds.
    """
    import shutil

    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    out = root / "run.dcp"
    for attempt in range(3):
        # a free port, released before the ranks bind it: another process on a busy machine can take it in
        # between (a rank then dies: "Address already in use", or gloo aborts), so the run is tried again
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mp.spawn(_gloo_worker, args=(2, str(out), port), nprocs=2)
            break
        except (ProcessExitedException, ProcessRaisedException):
            if attempt == 2:
                raise
            shutil.rmtree(out, ignore_errors=True)
    return out, torch.load(str(out) + ".full.pt")["model"]


def build_fsdp_trained_dcp(root: Path) -> tuple[Path, Any]:
    """``train --mode fsdp`` (2 gloo processes through torchrun) for two epochs, each saved as sharded DCP: the
    epoch-1 checkpoint is what the resume tests start from, the epoch-2 probe what a resumed run must reproduce.

    Returns:
        The output directory and the :class:`ckptfix.train.TrainResult`.
    """
    from ckptfix.train import TrainConfig, train

    return root, train(TrainConfig(out=str(root), mode="fsdp", nproc=2, epochs=2, save_format="dcp", **FSDP_SMALL))


def build_ddp_trained_pt(root: Path) -> tuple[Path, Any]:
    """``train --mode ddp`` (2 gloo processes through torchrun) for two epochs, each saved as .pt by rank 0: the
    epoch-1 checkpoint is what the resume tests start from, the epoch-2 probe what a resumed run must reproduce.

    Returns:
        The output directory and the :class:`ckptfix.train.TrainResult`.
    """
    from ckptfix.train import TrainConfig, train

    return root, train(TrainConfig(out=str(root), mode="ddp", nproc=2, epochs=2, **FSDP_SMALL))
