"""The trainer's entry point: what ``ckptfix train`` (and :func:`ckptfix.train.train`) call.

:func:`train` runs ``single``, ``dp`` and ``manual`` in this process (:class:`~ckptfix.train.run.Run`)
and hands ``ddp`` / ``fsdp`` to :mod:`ckptfix.train.ddp`, which launches ``torchrun`` or, when this
process already is a torchrun worker, trains as that rank.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ckptfix.errors import TrainingError
from ckptfix.train import ddp
from ckptfix.train.config import DISTRIBUTED_MODES, TrainConfig, TrainResult


def check_not_under_torchrun(mode: str) -> None:
    """Refuse an in-process mode inside a torchrun job of several processes.

    Every process would train the same run and write the same files; the distributed modes
    are ``ddp`` and ``fsdp``.

    Raises:
        TrainingError: ``mode`` runs in one process and this is one of several torchrun workers.
    """
    world = os.environ.get("WORLD_SIZE", "1")
    if mode not in DISTRIBUTED_MODES and ddp.under_torchrun() and world.isdigit() and int(world) > 1:
        raise TrainingError(
            f"--mode {mode} runs in one process, but this is one of {world} torchrun workers: every worker would "
            "train the same run and write the same files; use --mode ddp or --mode fsdp under torchrun, or run "
            "without torchrun"
        )


def check_options(cfg: TrainConfig) -> None:
    """Check everything about ``cfg`` that can be checked before training: the options and where it runs.

    Raises:
        TrainingError: an option is invalid or does not apply here (a usage error: nothing ran).
    """
    cfg.validate()
    check_not_under_torchrun(cfg.mode)


def in_process_threads(cfg: TrainConfig) -> int | None:
    """The intra-op thread count of an in-process run: ``--threads``, else 1 on CPU, else torch's default.

    One thread per process on CPU, as the ddp workers and ``--bench`` use: these small models gain
    nothing from more, and under CPU contention (other jobs, shared CI machines) torch's default of
    one thread per core makes an epoch 10-20x slower (a dp epoch 42-95 s against 4.5 s).

    Returns:
        The thread count to set, or None to leave torch's (CUDA runs without ``--threads``).
    """
    if cfg.threads:
        return cfg.threads
    from ckptfix.train.devices import resolve_device

    return 1 if resolve_device(cfg.device) == "cpu" else None


def train(config: TrainConfig, **overrides: Any) -> TrainResult:
    """Run one training configuration and return its checkpoints and metrics.

    ``single``, ``dp`` and ``manual`` run in this process; ``ddp`` and ``fsdp``
    launch ``torchrun`` (``config.nproc`` workers, gloo on CPU / nccl on CUDA)
    unless this process already is a torchrun worker, in which case it trains
    as that rank (a rank other than 0 returns a result without checkpoints).

    Raises:
        TrainingError: the options are invalid or the run fails.
        CkptfixError: a ``--resume`` checkpoint or ``--data`` file cannot be read.
    """
    cfg = dataclasses.replace(config, **overrides) if overrides else config
    cfg.validate()
    if cfg.mode in DISTRIBUTED_MODES:
        if ddp.under_torchrun():
            return ddp.run_worker(cfg)
        return ddp.launch(cfg)
    check_not_under_torchrun(cfg.mode)
    import torch

    from ckptfix.train.run import Run

    threads = torch.get_num_threads()
    wanted = in_process_threads(cfg)
    if wanted:
        torch.set_num_threads(wanted)
    try:
        return Run(cfg).run()
    finally:
        torch.set_num_threads(threads)
