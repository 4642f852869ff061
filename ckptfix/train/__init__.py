"""The bundled trainer: real single / DataParallel / DDP / FSDP / hand-written data-parallel runs
that produce the checkpoints ckptfix is about (``module.``, ``_orig_mod.``, DCP, legacy...).

>>> from ckptfix.train import TrainConfig, train            # doctest: +SKIP
>>> res = train(TrainConfig(mode="dp", out="runs"))         # doctest: +SKIP
>>> res.final_checkpoint, res.final_accuracy                # doctest: +SKIP

The modules, bottom up: :mod:`~ckptfix.train.config` (choices, defaults, options; no torch),
:mod:`~ckptfix.train.data`, :mod:`~ckptfix.train.models`, :mod:`~ckptfix.train.devices`,
:mod:`~ckptfix.train.probe`, :mod:`~ckptfix.train.saving`, :mod:`~ckptfix.train.manifest`
(``checkpoints.json``), :mod:`~ckptfix.train.resume` (and :func:`verify_probe`); the modes' machinery
:mod:`~ckptfix.train.manual` and :mod:`~ckptfix.train.fsdp`; :mod:`~ckptfix.train.run` (one run);
:mod:`~ckptfix.train.ddp` (torchrun launcher and worker); :mod:`~ckptfix.train.entry` (what
``ckptfix train`` calls); :mod:`~ckptfix.train.bench` (``ckptfix train --bench``) and :mod:`~ckptfix.train.demo` on top.
The harness comparing ``manual`` with ``single`` training is ``benchmarks/train_compare.py``
(not in the wheel).

Importing this package does not import torch; :func:`train`, :func:`bench` and
:func:`verify_probe` import it when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptfix.train.config import MODES, SAVE_FORMATS, SAVE_STYLES, TrainConfig, TrainResult

if TYPE_CHECKING:
    from ckptfix.train.bench import BenchRow

__all__ = [
    "MODES",
    "SAVE_FORMATS",
    "SAVE_STYLES",
    "TrainConfig",
    "TrainResult",
    "train",
    "bench",
    "verify_probe",
    "read_manifest",
]


def train(config: TrainConfig, **overrides: Any) -> TrainResult:
    """Run one training configuration; see :func:`ckptfix.train.entry.train`.

    Raises:
        TrainingError: the options are invalid or the run fails.
    """
    from ckptfix.train.entry import train as _train

    return _train(config, **overrides)


def bench(**kwargs: Any) -> list[BenchRow]:
    """Time single / dp / manual / ddp / fsdp (+amp); see :func:`ckptfix.train.bench.bench`.

    Raises:
        TrainingError: a row's options are invalid or a run fails.
    """
    from ckptfix.train.bench import bench as _bench

    return _bench(**kwargs)


def verify_probe(entry: dict[str, Any], out_dir: str, state_dict: Any = None) -> dict[str, Any]:
    """Prove a restored model matches a checkpoints.json entry; see :func:`ckptfix.train.resume.verify_probe`.

    Args:
        entry: One ``checkpoints.json`` entry.
        out_dir: The directory holding the manifest.
        state_dict: The weights to check (default: the entry's checkpoint, loaded).

    Raises:
        CkptfixError: the checkpoint cannot be loaded.
    """
    from ckptfix.train.resume import verify_probe as _verify

    return _verify(entry, out_dir, state_dict)


def read_manifest(out_dir: str) -> dict[str, Any]:
    """Read ``checkpoints.json``; see :func:`ckptfix.train.manifest.read_manifest`.

    Returns:
        The manifest (an empty one when absent).

    Raises:
        OSError: the file cannot be read.
    """
    from ckptfix.train.manifest import read_manifest as _read

    return _read(out_dir)
