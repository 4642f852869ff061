"""``ckptfix train --bench``: the "1 GPU vs DataParallel vs DDP vs FSDP (+AMP)" table.

Each row is a real training run (:func:`ckptfix.train.train`) of the same
model, data and seed.  ``s/epoch`` is the training-loop time per epoch (no
evaluation or saving; the first epoch is left out as warm-up when there are
two or more), ``samples/s`` the training samples per second over all
devices/ranks, ``wall s`` the whole run including torchrun start-up.  Before
the first row an untimed one-epoch warm-up run pays this process's one-off
costs (first kernels, allocator, imports), so they do not land on the first row.

On a CPU-only machine: single, dp (one CPU "device"), manual (2 replicas on
the CPU), ddp and fsdp (2 gloo processes).  Every CPU process uses one
intra-op thread, so "one device" is one core and DDP with 2 ranks uses 2 cores
-- the CPU analogue of 1 GPU vs 2 GPUs.  With CUDA: single GPU, DataParallel
over every GPU, manual over every GPU, DDP and FSDP with one process per GPU,
and DDP+AMP (fp16 autocast + GradScaler).

The options of a training run apply to every row that supports them: ``amp``
adds ``+amp`` rows for single, dp and ddp (bf16 autocast on CPU, fp16 on
CUDA); ``compile``, ``save_style``, ``save_format`` go to every row (rows of
modes that do not support an option are left out and listed in
:attr:`BenchResult.skipped`); ``modes`` limits the table to those modes.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any

from ckptfix.train.config import TrainConfig

BENCH_MODES = ("single", "dp", "manual", "ddp", "fsdp")


@dataclasses.dataclass
class BenchRow:
    mode: str
    devices: str
    world_size: int
    sec_per_epoch: float
    samples_per_sec: float
    final_accuracy: float
    wall_seconds: float
    checkpoint: str | None  # absolute path when the bench kept its files (``out``), else None
    amp_dtype: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["checkpoint"] is None:
            del d["checkpoint"]
        return d


def bench_configs(
    device_type: str,
    nproc: int | None = None,
    base: dict[str, Any] | None = None,
    *,
    modes: tuple[str, ...] | None = None,
    amp: bool = False,
) -> tuple[list[tuple[str, dict]], list[str]]:
    """The (label, TrainConfig overrides) rows the benchmark runs on ``device_type``, and the rows left out (why)."""
    import torch

    base = dict(base or {})
    n = (nproc or max(1, torch.cuda.device_count())) if device_type == "cuda" else (nproc or 2)
    plain: list[tuple[str, dict]] = [
        ("single", dict(mode="single")),
        ("dp", dict(mode="dp")),
        ("manual", dict(mode="manual", replicas=n)),
        ("ddp", dict(mode="ddp", nproc=n)),
        ("fsdp", dict(mode="fsdp", nproc=n)),
    ]
    rows: list[tuple[str, dict]] = []
    skipped: list[str] = []
    for label, kw in plain:
        if modes and kw["mode"] not in modes:
            continue
        cfg = {**base, **kw}
        if base.get("compile") and kw["mode"] in ("manual", "fsdp"):
            skipped.append(f"{label} (no --compile in {kw['mode']} mode)")
            continue
        rows.append((label, cfg))
        want_amp = amp or (device_type == "cuda" and kw["mode"] == "ddp" and not modes)
        if want_amp and kw["mode"] in ("single", "dp", "ddp"):
            rows.append((f"{label}+amp", {**cfg, "amp": True}))
        elif amp:
            skipped.append(f"{label}+amp (no --amp in {kw['mode']} mode)")
    return rows, skipped


@dataclasses.dataclass
class BenchResult:
    rows: list[BenchRow]
    skipped: list[str]
    out_dir: str | None  # where the checkpoints are (None: a removed temp dir)
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "bench": [r.to_dict() for r in self.rows],
            "skipped": self.skipped,
            "out_dir": self.out_dir,
            "notes": self.notes,
        }


def run_bench(
    *,
    out: str | None = None,
    device: str = "auto",
    epochs: int = 2,
    nproc: int | None = None,
    quiet: bool = True,
    modes: tuple[str, ...] | None = None,
    amp: bool = False,
    **config: Any,
) -> BenchResult:
    """Run every benchmark row (see the module docstring); extra keywords go to :class:`TrainConfig`.

    Raises :class:`ckptfix.errors.TrainingError` when a row's configuration is invalid or a run fails.
    """
    from ckptfix.train.trainer import amp_dtype, resolve_device, train

    device_type = resolve_device(device)
    if device_type == "cpu":
        # one intra-op thread per process: "1 device" = 1 core, DDP with 2 ranks = 2 cores (like 1 vs 2 GPUs),
        # and no OpenMP spin-wait oversubscription when the machine is busy
        config.setdefault("threads", 1)
    rows_cfg, skipped = bench_configs(device_type, nproc, config, modes=modes, amp=amp)
    for _label, kw in rows_cfg:  # every row's options are checked before anything runs
        TrainConfig(out=out or ".", device=device_type, epochs=epochs, **kw).validate()
    notes = []
    if amp and device_type == "cpu":
        notes.append("+amp rows on CPU: bfloat16 autocast (with a GradScaler, as on CUDA fp16)")
    tmp = tempfile.TemporaryDirectory(prefix="ckptfix-bench-")
    rows: list[BenchRow] = []
    try:
        # untimed warm-up: this process's one-off costs must not land on the first row
        train(
            TrainConfig(
                out=tmp.name,
                device=device_type,
                epochs=1,
                quiet=True,
                name="warmup",
                train_samples=128,
                test_samples=32,
                threads=config.get("threads"),
            )
        )
        where = out or tmp.name
        for label, kw in rows_cfg:
            cfg = TrainConfig(
                out=where, device=device_type, epochs=epochs, quiet=quiet, name=f"bench-{label.replace('+', '-')}", **kw
            )
            t0 = time.perf_counter()
            res = train(cfg)
            wall = time.perf_counter() - t0
            if res.mode in ("ddp", "fsdp", "manual"):
                devs = (
                    f"{len(res.devices)} x {res.devices[0]}" if len(set(res.devices)) == 1 else ", ".join(res.devices)
                )
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
                    checkpoint=res.final_checkpoint if out else None,
                    amp_dtype=str(amp_dtype(device_type)).replace("torch.", "") if cfg.amp else None,
                )
            )
    finally:
        tmp.cleanup()
    return BenchResult(rows=rows, skipped=skipped, out_dir=os.path.abspath(out) if out else None, notes=notes)


def bench(**kwargs: Any) -> list[BenchRow]:
    """The rows of :func:`run_bench` (same arguments)."""
    return run_bench(**kwargs).rows
