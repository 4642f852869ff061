"""``ckptfix train --bench``: the "1 GPU vs DataParallel vs DDP vs DDP+AMP" table.

Each row is a real training run (:func:`ckptfix.train.train`) of the same
model, data and seed.  ``s/epoch`` is the training-loop time per epoch (no
evaluation or saving; the first epoch is left out as warm-up when there are
two or more), ``samples/s`` the training samples per second over all
devices/ranks, ``wall s`` the whole run including torchrun start-up.

On a CPU-only machine: single, dp (one CPU "device"), manual (2 replicas on
the CPU) and ddp (2 gloo processes).  Every CPU process uses one intra-op
thread, so "one device" is one core and DDP with 2 ranks uses 2 cores -- the
CPU analogue of 1 GPU vs 2 GPUs (and no OpenMP oversubscription).  With CUDA: single GPU,
DataParallel over every GPU, manual over every GPU, DDP with one process per
GPU, and DDP+AMP (fp16 autocast + GradScaler).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any

from ckptfix.train.config import TrainConfig


@dataclasses.dataclass
class BenchRow:
    mode: str
    devices: str
    world_size: int
    sec_per_epoch: float
    samples_per_sec: float
    final_accuracy: float
    wall_seconds: float
    checkpoint: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def bench_configs(device_type: str, nproc: int | None = None, base: dict[str, Any] | None = None) -> list[tuple[str, dict]]:
    """The (label, TrainConfig overrides) rows the benchmark runs on ``device_type``."""
    import torch

    base = dict(base or {})
    if device_type == "cuda":
        n = nproc or max(1, torch.cuda.device_count())
        rows = [
            ("single", dict(mode="single")),
            ("dp", dict(mode="dp")),
            ("manual", dict(mode="manual", replicas=n)),
            ("ddp", dict(mode="ddp", nproc=n)),
            ("ddp+amp", dict(mode="ddp", nproc=n, amp=True)),
        ]
    else:
        n = nproc or 2
        rows = [
            ("single", dict(mode="single")),
            ("dp", dict(mode="dp")),
            ("manual", dict(mode="manual", replicas=n)),
            ("ddp", dict(mode="ddp", nproc=n)),
        ]
    return [(label, {**base, **kw}) for label, kw in rows]


def bench(
    *,
    out: str | None = None,
    device: str = "auto",
    epochs: int = 2,
    nproc: int | None = None,
    quiet: bool = True,
    **config: Any,
) -> list[BenchRow]:
    """Run every benchmark row and return the table.  Extra keywords go to :class:`TrainConfig`."""
    from ckptfix.train.trainer import resolve_device, train

    device_type = resolve_device(device)
    if device_type == "cpu":
        # one intra-op thread per process: "1 device" = 1 core, DDP with 2 ranks = 2 cores (like 1 vs 2 GPUs),
        # and no OpenMP spin-wait oversubscription when the machine is busy
        config.setdefault("threads", 1)
    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="ckptfix-bench-")
        out = tmp.name
    rows: list[BenchRow] = []
    try:
        for label, kw in bench_configs(device_type, nproc, config):
            cfg = TrainConfig(out=out, device=device_type, epochs=epochs, quiet=quiet,
                              name=f"bench-{label.replace('+', '-')}", **kw)
            t0 = time.perf_counter()
            res = train(cfg)
            wall = time.perf_counter() - t0
            if res.mode == "ddp":
                devs = f"{res.world_size} x {res.devices[0]}" if len(set(res.devices)) == 1 else ", ".join(res.devices)
            elif res.mode == "manual":
                devs = f"{len(res.devices)} x {res.devices[0]}" if len(set(res.devices)) == 1 else ", ".join(res.devices)
            else:
                devs = ", ".join(res.devices)
            rows.append(
                BenchRow(
                    mode=label,
                    devices=devs,
                    world_size=res.world_size,
                    sec_per_epoch=res.sec_per_epoch,
                    samples_per_sec=res.samples_per_sec,
                    final_accuracy=res.final_accuracy,
                    wall_seconds=wall,
                    checkpoint=res.final_checkpoint if tmp is None else os.path.basename(res.final_checkpoint),
                )
            )
    finally:
        if tmp is not None:
            tmp.cleanup()
    return rows


def format_table(rows: list[BenchRow]) -> str:
    from ckptfix.cli._common import table

    body = [
        [
            r.mode,
            r.devices,
            str(r.world_size),
            f"{r.sec_per_epoch:.3f}",
            f"{r.samples_per_sec:,.0f}",
            f"{r.final_accuracy:.1%}",
            f"{r.wall_seconds:.1f}",
        ]
        for r in rows
    ]
    return table(body, ["mode", "devices", "world size", "s/epoch", "samples/s", "final acc", "wall s"])
