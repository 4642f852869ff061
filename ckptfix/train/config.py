"""The trainer's choices, defaults, configuration and result types (no torch import here).

Every choice the trainer offers (modes, models, devices, save styles and formats, all-reduce
algorithms) and every default (the fields of :class:`TrainConfig`) is defined here once; the
``ckptfix train`` options read them from here (:func:`default`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

MODES = ("single", "dp", "ddp", "manual", "fsdp")
DISTRIBUTED_MODES = ("ddp", "fsdp")  # launched through torchrun
MODELS = ("lenet", "resnet", "tutorial")
INITS = ("he", "tutorial")  # --model tutorial: He-scaled weights, or the tutorial's N(0, 0.01)
HPARAMS = ("lr", "momentum", "weight_decay")  # optimizer settings a resume can override
SAVE_STYLES = ("wrapped", "clean")
SAVE_FORMATS = ("pt", "dcp")
DEVICES = ("auto", "cpu", "cuda")
ALLREDUCES = ("ring", "naive")  # manual: the hand-written gradient all-reduce


def default_save_format(mode: str) -> str:
    """The save format of ``mode`` when none is given: ``dcp`` for fsdp (sharded), else ``pt``."""
    return "dcp" if mode == "fsdp" else "pt"


def process_group_backend(device_type: str) -> str:
    """The torch.distributed backend of ``ddp``/``fsdp`` runs: nccl on CUDA, gloo on CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


@dataclass
class TrainConfig:
    """Everything a training run needs.  Every field maps to a ``ckptfix train`` option."""

    mode: str = "single"  # single | dp | ddp | manual | fsdp
    model: str = "lenet"  # lenet | resnet | tutorial
    init: str = "he"  # --model tutorial: he (N(0, sqrt(2/fan_in))) | tutorial (N(0, 0.01): ~500 steps at chance)
    out: str = "ckptfix-train"  # output directory (created)
    epochs: int = 2  # total epochs (a resumed run continues up to this number)
    batch_size: int = 64  # single/dp/manual: the whole batch; ddp: per process
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    nproc: int | None = None  # ddp/fsdp: processes to launch (default: GPU count, or 2 on CPU)
    replicas: int | None = None  # manual: replicas (default: GPU count, or 2 on CPU)
    allreduce: str = "ring"  # manual: ring | naive (hand-written all-reduce)
    amp: bool = False  # CUDA: fp16 autocast + GradScaler; CPU: bf16 autocast (+ GradScaler, saved)
    compile: bool = False  # torch.compile the model (keys gain _orig_mod.)
    compile_backend: str = "eager"  # light backend so CPU runs take seconds; "inductor" for the real thing
    save_style: str = "wrapped"  # wrapped: wrapper's state dict (prefixes); clean: unwrapped module's
    # pt: torch.save file; dcp: torch.distributed.checkpoint directory.  None: dcp for fsdp (sharded), else pt
    save_format: str | None = None
    legacy_format: bool = False  # torch.save(..., _use_new_zipfile_serialization=False)
    namespace_args: bool = False  # store "args" as argparse.Namespace (breaks weights_only loading)
    resume: str | None = None  # checkpoint to resume from (any mode/format ckptfix can load)
    data: str | None = None  # .pt/.npz data file instead of the synthetic set
    train_samples: int = 2048  # synthetic set sizes
    test_samples: int = 512
    show_split: bool = False  # dp: print per-replica batch sizes (first batch of each epoch)
    name: str | None = None  # file name stem; default derived from the options
    threads: int | None = None  # torch.set_num_threads for in-process modes (None: 1 on CPU, torch's on CUDA)
    quiet: bool = False  # no progress on stderr
    # On --resume: the optimizer settings (of HPARAMS) the user gave explicitly.  They override the
    # checkpoint's param_groups after loading; the others keep the checkpoint's values.
    explicit: tuple[str, ...] = ()
    force: bool = False  # overwrite files another run (other history) wrote in --out

    def __post_init__(self) -> None:
        if self.save_format is None:
            self.save_format = default_save_format(self.mode)

    def run_name(self) -> str:
        """The file-name stem: ``--name``, or derived from the options (``ddp-amp-clean``).

        A resumed run without ``--name`` is ``<derived>-resumed-from-<checkpoint stem>``, so it never
        writes over the files of the run it continues, nor mixes two histories under one name.
        """
        if self.name:
            return self.name
        base = self._derived_name()
        if self.resume:
            import os

            stem = os.path.basename(os.path.normpath(self.resume))
            for ext in (".pt", ".pth", ".bin", ".dcp", ".safetensors", ".ckpt"):
                if stem.endswith(ext):
                    stem = stem[: -len(ext)]
                    break
            base += f"-resumed-from-{stem}"
        return base

    def _derived_name(self) -> str:
        parts = [self.mode]
        if self.model != "lenet":
            parts.append(self.model)
        if self.init != "he":
            parts.append(f"init-{self.init}")
        if self.amp:
            parts.append("amp")
        if self.compile:
            parts.append("compile")
        if self.save_style != "wrapped":
            parts.append(self.save_style)
        if self.save_format != default_save_format(self.mode):
            parts.append(str(self.save_format))
        if self.legacy_format:
            parts.append("legacy")
        if self.namespace_args:
            parts.append("nsargs")
        return "-".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The fields as JSON (what a torchrun worker reads back with :meth:`from_dict`)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        """A configuration from :meth:`to_dict`'s output; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "explicit" in kw:
            kw["explicit"] = tuple(kw["explicit"] or ())
        return cls(**kw)

    def validate(self) -> None:
        """Check the options and their combinations.

        Raises:
            TrainingError: an option is out of range or does not apply (the message names it).
        """
        from ckptfix.errors import TrainingError

        def bad(msg: str) -> None:
            raise TrainingError(msg)

        if self.mode not in MODES:
            bad(f"unknown mode {self.mode!r}; choose one of: {', '.join(MODES)}")
        if self.model not in MODELS:
            bad(f"unknown model {self.model!r}; choose one of: {', '.join(MODELS)}")
        if self.init not in INITS:
            bad(f"unknown init {self.init!r}; choose he or tutorial")
        if self.init != "he" and self.model != "tutorial":
            bad("--init applies to --model tutorial (the other models use torch's layer defaults)")
        if self.device not in DEVICES:
            bad(f"unknown device {self.device!r}; choose one of: {', '.join(DEVICES)}")
        if self.save_style not in SAVE_STYLES:
            bad(f"unknown save style {self.save_style!r}; choose wrapped or clean")
        if self.save_format not in SAVE_FORMATS:
            bad(f"unknown save format {self.save_format!r}; choose pt or dcp")
        if self.epochs < 1:
            bad("--epochs must be at least 1")
        if self.batch_size < 1:
            bad("--batch-size must be at least 1")
        if not self.lr > 0:
            bad("--lr must be positive")
        if self.momentum < 0 or self.weight_decay < 0:
            bad("--momentum and --weight-decay must be >= 0")
        unknown = [h for h in self.explicit if h not in HPARAMS]
        if unknown:
            bad(f"explicit hyper-parameters must be among {', '.join(HPARAMS)}, got {unknown[0]!r}")
        if self.train_samples < 1 or self.test_samples < 1:
            bad("--train-samples and --test-samples must be at least 1")
        if self.nproc is not None and self.nproc < 1:
            bad("--nproc must be at least 1")
        if self.replicas is not None and self.replicas < 1:
            bad("--replicas must be at least 1")
        if self.nproc is not None and self.mode not in DISTRIBUTED_MODES:
            bad("--nproc only applies to --mode ddp or fsdp (use --replicas for manual)")
        if self.replicas is not None and self.mode != "manual":
            bad("--replicas only applies to --mode manual")
        if self.mode == "manual" and (self.amp or self.compile):
            bad("manual mode is the plain teaching algorithm; use --amp/--compile with single, dp or ddp")
        if self.allreduce not in ALLREDUCES:
            bad(f"unknown all-reduce {self.allreduce!r}; choose ring or naive")
        if self.save_format == "dcp" and self.legacy_format:
            bad("--legacy-format applies to torch.save files; it cannot be combined with --save-format dcp")
        if self.show_split and self.mode not in ("dp", "manual"):
            bad("--show-split only applies to --mode dp or manual (the modes that split a batch in one process)")
        if self.mode == "fsdp" and (self.compile or self.amp):
            bad("--compile and --amp are not supported with --mode fsdp; use single, dp or ddp for them")


@dataclass
class TrainResult:
    """What a run produced: its checkpoints (as listed in checkpoints.json) and metrics."""

    name: str
    mode: str
    model: str
    out_dir: str
    manifest: str  # path of checkpoints.json
    device: str
    devices: list[str]
    world_size: int
    checkpoints: list[dict[str, Any]]  # the checkpoints.json entries of this run, plus "abs_path"
    epochs: list[dict[str, Any]]  # per epoch: epoch, train_loss, accuracy, seconds, samples
    start_epoch: int  # first epoch trained (1 unless resumed)
    sec_per_epoch: float
    samples_per_sec: float
    final_accuracy: float
    train_samples: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final_checkpoint(self) -> str:
        """The absolute path of the last checkpoint this run wrote."""
        path: str = self.checkpoints[-1]["abs_path"]
        return path

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain (JSON-ready) dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainResult":
        """A result from :meth:`to_dict`'s output; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def default(name: str) -> object:
    """The default of the :class:`TrainConfig` field ``name`` (what ``ckptfix train`` shows).

    Returns:
        Its default value.

    Raises:
        KeyError: there is no such field.
    """
    for f in dataclasses.fields(TrainConfig):
        if f.name == name:
            return f.default
    raise KeyError(name)
