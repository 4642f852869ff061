"""The bundled trainer: real single / DataParallel / DDP / hand-written data-parallel runs
that produce the checkpoints ckptfix is about (``module.``, ``_orig_mod.``, DCP, legacy...).

>>> from ckptfix.train import TrainConfig, train            # doctest: +SKIP
>>> res = train(TrainConfig(mode="dp", out="runs"))         # doctest: +SKIP
>>> res.final_checkpoint, res.final_accuracy                # doctest: +SKIP

Importing this package does not import torch; :func:`train`, :func:`bench`,
:func:`compare_manual_to_single` and :func:`verify_probe` import it when called.
"""

from __future__ import annotations

from typing import Any

from ckptfix.train.config import MODES, SAVE_FORMATS, SAVE_STYLES, TrainConfig, TrainResult

__all__ = [
    "MODES",
    "SAVE_FORMATS",
    "SAVE_STYLES",
    "TrainConfig",
    "TrainResult",
    "train",
    "bench",
    "compare_manual_to_single",
    "verify_probe",
    "read_manifest",
]


def train(config: TrainConfig, **overrides: Any) -> TrainResult:
    """Run one training configuration; see :func:`ckptfix.train.trainer.train`."""
    from ckptfix.train.trainer import train as _train

    return _train(config, **overrides)


def bench(*args: Any, **kwargs: Any) -> Any:
    """Time single / dp / manual / ddp (and ddp+amp on CUDA); see :func:`ckptfix.train.bench.bench`."""
    from ckptfix.train.bench import bench as _bench

    return _bench(*args, **kwargs)


def compare_manual_to_single(*args: Any, **kwargs: Any) -> Any:
    """Train ``manual`` and ``single`` on the same batches.

    See :func:`ckptfix.train.manual.compare_manual_to_single`.
    """
    from ckptfix.train.manual import compare_manual_to_single as _cmp

    return _cmp(*args, **kwargs)


def verify_probe(*args: Any, **kwargs: Any) -> Any:
    """Prove a restored model matches a checkpoints.json entry; see :func:`ckptfix.train.trainer.verify_probe`."""
    from ckptfix.train.trainer import verify_probe as _verify

    return _verify(*args, **kwargs)


def read_manifest(*args: Any, **kwargs: Any) -> Any:
    """Read ``checkpoints.json``; see :func:`ckptfix.train.trainer.read_manifest`."""
    from ckptfix.train.trainer import read_manifest as _read

    return _read(*args, **kwargs)
