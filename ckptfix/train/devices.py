"""Where a run executes: the device type, the autocast dtype and the process group's facts."""

from __future__ import annotations

import dataclasses

import torch

from ckptfix.errors import TrainingError


def resolve_device(device: str) -> str:
    """The device type a run uses: ``auto`` becomes ``cuda`` when CUDA is available, else ``cpu``.

    Raises:
        TrainingError: ``cuda`` was asked for and this torch build sees no CUDA device.
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise TrainingError(
            "--device cuda requested but CUDA is not available to this torch build "
            f"(torch {torch.__version__}); use --device cpu, or run `ckptfix doctor`"
        )
    return device


def amp_dtype(device: str) -> torch.dtype:
    """The autocast dtype of ``--amp``: float16 on CUDA, bfloat16 on CPU."""
    return torch.float16 if device == "cuda" else torch.bfloat16


@dataclasses.dataclass
class Dist:
    """Process-group facts (world_size 1 and rank 0 outside DDP/FSDP)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        """True when a process group is initialised (collectives are needed)."""
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that writes .pt files, the manifest and the log)."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (nothing to do without a process group)."""
        if self.enabled:
            torch.distributed.barrier()
