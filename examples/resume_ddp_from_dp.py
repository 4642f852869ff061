"""Resume DistributedDataParallel training from a DataParallel checkpoint (keys 'module.*').

    torchrun --standalone --nproc-per-node 2 examples/resume_ddp_from_dp.py DP_CKPT OUT.pt

Each rank loads the checkpoint onto its own device with map_location="auto",
aligns the keys to the unwrapped model, restores the optimizer, trains a few
steps with DDP (gloo on CPU, nccl on GPU) and rank 0 saves a clean checkpoint.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ckptfix import load_checkpoint
from ckptfix.train.data import synthetic_dataset, to_float
from ckptfix.train.models import build_model


def main(src: str, dst: str) -> None:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    model = build_model("lenet", 0).to(device)
    ck = load_checkpoint(src, map_location="auto", model=model)  # strips 'module.' for us
    model.load_state_dict(ck.state_dict)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if isinstance(ck.get("optimizer_state_dict"), dict):
        opt.load_state_dict(ck["optimizer_state_dict"])
    ddp = DDP(model, device_ids=[local] if use_cuda else None)
    ds = synthetic_dataset(seed=0, n_train=256, n_test=64)
    x, y = to_float(ds.train_images).to(device), ds.train_labels.to(device)
    shard = slice(rank, None, dist.get_world_size())
    for step in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x[shard]), y[shard])
        loss.backward()
        opt.step()
    dist.barrier()
    if rank == 0:
        torch.save(
            {
                "epoch": (ck.get("epoch") or 0) + 1,
                "model_state_dict": ddp.module.state_dict(),
                "optimizer_state_dict": opt.state_dict(),
            },
            dst,
        )
        print(
            f"resumed from {ck.format} checkpoint at epoch {ck.get('epoch')}, "
            f"alignment: {ck.alignment.rename}; saved {dst} (loss {loss.item():.3f})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
