"""Data parallelism written by hand, for teaching.

What ``DataParallel``/``DistributedDataParallel`` do, in plain code:

1. every replica starts as an exact copy of the model (``copy.deepcopy``);
2. each batch is split along dim 0 the way ``nn.parallel.scatter`` (DataParallel)
   splits it: ``torch.chunk`` semantics, chunk size ``ceil(n / k)`` -- 30 samples
   on 4 replicas are 8, 8, 8, 6 (see :func:`scatter_sizes`);
3. each replica computes the loss on its slice, scaled by the slice's share of
   the batch (``n_i / n``), and back-propagates -- so the *sum* of the replica
   gradients is exactly the full-batch mean-loss gradient;
4. the gradients are all-reduced (summed) and the sum is written back into
   every replica -- :func:`ring_all_reduce` does it the way NCCL/gloo do
   (reduce-scatter then all-gather around a ring), :func:`naive_all_reduce`
   sums on the first replica and copies the result out;
5. every replica's optimizer steps with the same gradient, so the replicas
   stay bit-identical (checked at every epoch end);
6. BatchNorm running statistics are computed per replica from its own slice;
   like DDP's ``broadcast_buffers`` the buffers of replica 0 are copied to the
   others after each step.  Because batch statistics come from slices, a
   BatchNorm model does *not* match ``single`` exactly -- compare with LeNet.

On a CPU-only machine the replicas are N copies on the CPU, so the algorithm
still runs for real; with CUDA replica ``i`` lives on ``cuda:i``.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ckptfix.errors import TrainingError


def naive_all_reduce(tensors: Sequence[torch.Tensor]) -> None:
    """Sum ``tensors`` (one per replica, any devices) in replica order; write the sum into each.

    Args:
        tensors: One tensor per replica, all of one shape; overwritten with the sum.
    """
    total = tensors[0].detach().clone()
    for t in tensors[1:]:
        total.add_(t.detach().to(total.device))
    for t in tensors:
        t.copy_(total.to(t.device))


def ring_all_reduce(tensors: Sequence[torch.Tensor]) -> None:
    """In-place sum all-reduce over a logical ring of ``len(tensors)`` replicas.

    The flat tensor is cut into N chunks.  Reduce-scatter: in N-1 steps, replica
    ``r`` sends chunk ``(r - step) % N`` to replica ``r + 1``, which adds it to its
    own copy; afterwards replica ``r`` owns the full sum of chunk ``(r + 1) % N``.
    All-gather: in N-1 more steps the finished chunks travel round the ring and
    overwrite the partial ones.  Each chunk's sum is computed once, so every
    replica ends with bit-identical values.

    Args:
        tensors: One contiguous tensor per replica, all of one shape; overwritten with the sum.
    """
    n = len(tensors)
    if n == 1:
        return
    flats = [t.detach().view(-1) for t in tensors]
    bounds = torch.tensor_split(torch.arange(flats[0].numel()), n)
    spans = [(int(b[0]), int(b[-1]) + 1) if b.numel() else (0, 0) for b in bounds]
    for step in range(n - 1):  # reduce-scatter
        sends = []
        for r in range(n):
            lo, hi = spans[(r - step) % n]
            sends.append(flats[r][lo:hi].clone())  # "send buffer": snapshot before anyone adds
        for r in range(n):
            dst = (r + 1) % n
            lo, hi = spans[(r - step) % n]
            flats[dst][lo:hi].add_(sends[r].to(flats[dst].device))
    for step in range(n - 1):  # all-gather
        sends = []
        for r in range(n):
            lo, hi = spans[(r + 1 - step) % n]
            sends.append(flats[r][lo:hi].clone())
        for r in range(n):
            dst = (r + 1) % n
            lo, hi = spans[(r + 1 - step) % n]
            flats[dst][lo:hi].copy_(sends[r].to(flats[dst].device))


ALL_REDUCE = {"ring": ring_all_reduce, "naive": naive_all_reduce}


def scatter_sizes(n: int, k: int) -> list[int]:
    """Per-replica slice sizes of an ``n``-sample batch on ``k`` replicas, as ``nn.parallel.scatter`` cuts it.

    DataParallel's scatter calls ``tensor.chunk(k)``: chunks of ``ceil(n / k)`` samples, the last one
    smaller (30 on 4 -> 8, 8, 8, 6; 10 on 3 -> 4, 4, 2).  ``chunk`` can return fewer than ``k`` chunks
    (5 on 4 -> 2, 2, 1); the replicas left over get 0 samples and sit the step out, as DataParallel
    then uses fewer replicas.

    Raises:
        TrainingError: ``k`` is less than 1.
    """
    if k < 1:
        raise TrainingError("at least one replica is needed")
    if n <= 0:
        return [0] * k
    size = -(-n // k)
    out = []
    left = n
    for _ in range(k):
        take = min(size, left)
        out.append(take)
        left -= take
    return out


class ManualDataParallel:
    """N replicas of ``module`` on ``devices`` trained in lock-step by hand-written data parallelism."""

    def __init__(
        self,
        module: nn.Module,
        devices: Sequence[torch.device],
        *,
        lr: float,
        momentum: float,
        weight_decay: float = 0.0,
        all_reduce: str = "ring",
    ) -> None:
        if not devices:
            raise TrainingError("manual mode needs at least one replica")
        if all_reduce not in ALL_REDUCE:
            raise TrainingError(f"unknown all-reduce {all_reduce!r}; choose ring or naive")
        self.devices = list(devices)
        self.replicas = [copy.deepcopy(module).to(d) for d in self.devices]
        self.optimizers = [
            torch.optim.SGD(r.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay) for r in self.replicas
        ]
        self.all_reduce = ALL_REDUCE[all_reduce]
        self.last_split: list[int] = []

    def train(self) -> None:
        """Put every replica in training mode."""
        for r in self.replicas:
            r.train()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimisation step on the batch ``(x, y)``.

        Args:
            x: The input batch (any device; each slice goes to its replica's device).
            y: The labels.
        """
        n = x.shape[0]
        sizes = scatter_sizes(n, len(self.replicas))
        xs, ys = torch.split(x, sizes), torch.split(y, sizes)
        self.last_split = sizes
        total = 0.0
        for rep, opt, dev, xi, yi in zip(self.replicas, self.optimizers, self.devices, xs, ys, strict=False):
            opt.zero_grad(set_to_none=False)
            if xi.shape[0] == 0:
                continue
            out = rep(xi.to(dev, non_blocking=True))
            # mean over the slice times the slice's share = this slice's part of the full-batch mean
            loss = F.cross_entropy(out, yi.to(dev, non_blocking=True)) * (xi.shape[0] / n)
            loss.backward()
            total += float(loss.detach())
        for params in zip(*(list(r.parameters()) for r in self.replicas), strict=False):
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            self.all_reduce(grads)
        for opt in self.optimizers:
            opt.step()
        with torch.no_grad():  # DDP's broadcast_buffers: replica 0's BatchNorm statistics win
            for bufs in zip(*(list(r.buffers()) for r in self.replicas), strict=False):
                for b in bufs[1:]:
                    b.copy_(bufs[0].to(b.device))
        return total

    def check_in_sync(self) -> None:
        """Check that every replica holds exactly replica 0's weights and buffers.

        Raises:
            TrainingError: a replica drifted (names the first key that differs).
        """
        ref = self.replicas[0].state_dict()
        for i, rep in enumerate(self.replicas[1:], 1):
            for k, v in rep.state_dict().items():
                if not torch.equal(v.cpu(), ref[k].cpu()):
                    diff = (v.cpu().double() - ref[k].cpu().double()).abs().max().item()
                    raise TrainingError(
                        f"manual data parallel: replica {i} drifted from replica 0 at {k} (max diff {diff:g})"
                    )
