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
from typing import Any, Collection

from ckptfix.errors import TrainingError
from ckptfix.train.config import TrainConfig


@dataclasses.dataclass
class BenchRow:
    """One row of the table: one training run."""

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
        """The row as a JSON-ready dict (without ``checkpoint`` when the files were not kept)."""
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
) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The rows the benchmark runs on ``device_type``, and the rows left out.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        nproc: Processes / replicas of the multi-device rows (default: GPU count, or 2 on CPU).
        base: TrainConfig fields every row gets.
        modes: Only rows of these modes (default: all, plus ddp+amp on CUDA).
        amp: Add a ``+amp`` row for every mode that supports it.
    """
    import torch

    base = dict(base or {})
    n = (nproc or max(1, torch.cuda.device_count())) if device_type == "cuda" else (nproc or 2)
    plain: list[tuple[str, dict[str, Any]]] = [
        ("single", dict(mode="single")),
        ("dp", dict(mode="dp")),
        ("manual", dict(mode="manual", replicas=n)),
        ("ddp", dict(mode="ddp", nproc=n)),
        ("fsdp", dict(mode="fsdp", nproc=n)),
    ]
    rows: list[tuple[str, dict[str, Any]]] = []
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
    """The table: its rows, the rows left out (why), where the checkpoints are, notes."""

    rows: list[BenchRow]
    skipped: list[str]
    out_dir: str | None  # where the checkpoints are (None: a removed temp dir)
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict (``bench``: the rows).

        Returns:
            ``{"bench", "skipped", "out_dir", "notes"}``.
        """
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
    """Run every benchmark row (see the module docstring).

    Args:
        out: Keep every row's checkpoints here (default: a temp directory, removed).
        device: ``auto``, ``cpu`` or ``cuda``.
        epochs: Epochs per row.
        nproc: Processes / replicas of the multi-device rows.
        quiet: No per-epoch progress.
        modes: Only rows of these modes.
        amp: Add ``+amp`` rows.
        **config: More :class:`TrainConfig` fields for every row.

    Raises:
        TrainingError: a row's configuration is invalid (before anything runs) or a run fails.
    """
    from ckptfix.train.devices import amp_dtype, resolve_device
    from ckptfix.train.entry import train

    device_type = resolve_device(device)
    rows_cfg, skipped = _plan(device_type, out, epochs, nproc, modes, amp, config)
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


def _plan(
    device_type: str,
    out: str | None,
    epochs: int,
    nproc: int | None,
    modes: tuple[str, ...] | None,
    amp: bool,
    config: dict[str, Any],
) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """(rows, rows left out); every row's options are checked before anything runs."""
    if device_type == "cpu":
        # one intra-op thread per process: "1 device" = 1 core, DDP with 2 ranks = 2 cores (like 1 vs 2 GPUs),
        # and no OpenMP spin-wait oversubscription when the machine is busy
        config.setdefault("threads", 1)
    rows_cfg, skipped = bench_configs(device_type, nproc, config, modes=modes, amp=amp)
    for _label, kw in rows_cfg:
        TrainConfig(out=out or ".", device=device_type, epochs=epochs, **kw).validate()
    return rows_cfg, skipped


def bench(**kwargs: Any) -> list[BenchRow]:
    """The rows of :func:`run_bench`.

    Raises:
        TrainingError: as :func:`run_bench`.
    """
    return run_bench(**kwargs).rows


#: options of ``ckptfix train`` that make no sense for the benchmark (every row is a fresh run)
NOT_FOR_BENCH = {"resume": "--resume", "name": "--name", "show_split": "--show-split", "replicas": "--replicas"}
#: fields of the training configuration every row inherits
_ROW_FIELDS = (
    "compile",
    "compile_backend",
    "save_style",
    "model",
    "batch_size",
    "lr",
    "momentum",
    "weight_decay",
    "seed",
    "train_samples",
    "test_samples",
    "data",
    "legacy_format",
    "namespace_args",
    "allreduce",
    "force",
)


def bench_options(cfg: TrainConfig, given: Collection[str]) -> dict[str, Any]:
    """:func:`run_bench`'s arguments for the options of ``ckptfix train --bench``.

    ``--mode``, ``--out`` and ``--save-format`` apply only when given (``given``): otherwise
    every mode runs, the files go to a temp directory, and each mode saves in its own format.
    """
    kw: dict[str, Any] = {f: getattr(cfg, f) for f in _ROW_FIELDS}
    if "save_format" in given:
        kw["save_format"] = cfg.save_format
    if cfg.threads:
        kw["threads"] = cfg.threads
    return dict(
        out=cfg.out if "out" in given else None,
        device=cfg.device,
        epochs=cfg.epochs,
        nproc=cfg.nproc,
        quiet=cfg.quiet,
        modes=(cfg.mode,) if "mode" in given else None,
        amp=cfg.amp,
        **kw,
    )


def check_bench_options(cfg: TrainConfig, given: Collection[str]) -> None:
    """Check the options of ``ckptfix train --bench`` before anything runs.

    Raises:
        TrainingError: an option is invalid or does not apply to the benchmark or to one of its rows.
    """
    cfg.validate()
    for name, flag in NOT_FOR_BENCH.items():
        if name in given:
            raise TrainingError(f"{flag} does not apply to --bench (every row is a fresh run with its own name)")
    from ckptfix.train.devices import resolve_device

    kw = bench_options(cfg, given)
    # whether CUDA is there is not a usage question: run_bench reports it when it runs
    device_type = "cuda" if cfg.device == "cuda" else resolve_device(cfg.device)
    for k in ("device", "quiet"):
        del kw[k]
    _plan(device_type, kw.pop("out"), kw.pop("epochs"), kw.pop("nproc"), kw.pop("modes"), kw.pop("amp"), kw)


def bench_from_config(cfg: TrainConfig, given: Collection[str]) -> BenchResult:
    """Run the benchmark with the options of ``ckptfix train --bench`` (see :func:`bench_options`).

    Raises:
        TrainingError: an option does not apply, or a run fails.
    """
    return run_bench(**bench_options(cfg, given))
