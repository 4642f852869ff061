"""One training run: build the model, resume, wrap it the way the mode does, train, evaluate, save.

:class:`Run` is the whole run for the in-process modes (``single``, ``dp``, ``manual``) and one
rank's share of a ``ddp`` / ``fsdp`` job (:mod:`ckptfix.train.ddp` starts those).  The mode's own
machinery lives beside it: the hand-written all-reduce in :mod:`ckptfix.train.manual`, the
sharded model in :mod:`ckptfix.train.fsdp`.  After every epoch it saves a realistic wrapper dict
(:mod:`ckptfix.train.saving`), the probe output (:mod:`ckptfix.train.probe`) and then the
``checkpoints.json`` entry (:mod:`ckptfix.train.manifest`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import nn

from ckptfix.errors import TrainingError
from ckptfix.train import data as _data
from ckptfix.train.config import DISTRIBUTED_MODES, HPARAMS, TrainConfig, TrainResult, process_group_backend
from ckptfix.train.devices import Dist, amp_dtype, resolve_device
from ckptfix.train.fsdp import FSDPState
from ckptfix.train.manifest import MANIFEST, check_outputs, update_manifest
from ckptfix.train.manual import ManualDataParallel
from ckptfix.train.models import build_model, has_batchnorm
from ckptfix.train.probe import probe_output, tensor_sha256
from ckptfix.train.resume import int_optimizer_keys, load_resume
from ckptfix.train.saving import atomic_torch_save, expected_prefix, remove_outputs, save_dcp

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


def _log_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Run:
    """One training run of ``cfg`` (a DDP rank, or the whole run for in-process modes)."""

    def __init__(self, cfg: TrainConfig, dist: Dist | None = None, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.dist = dist or Dist()
        self._log = log or _log_to_stderr
        self.device_type = resolve_device(cfg.device)
        self.out = os.path.abspath(cfg.out)
        self.name = cfg.run_name()
        self.manual: ManualDataParallel | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.sync_bn = False
        self.resumed_from: str | None = None
        self.resume_info: dict[str, Any] | None = None
        self.start_epoch = 1
        self._resume_ckpt: Any = None
        self.fsdp: FSDPState | None = None  # the FSDP helper (ckptfix.train.fsdp) in --mode fsdp
        self._epoch_files: list[str] = []  # this epoch's files, removed again if its save fails

    def log(self, msg: str) -> None:
        """Progress on stderr (rank 0 only; nothing with ``--quiet``)."""
        if not self.cfg.quiet and self.dist.is_main:
            self._log(msg)

    def warn(self, msg: str) -> None:
        """A warning: on stderr even with --quiet (rank 0 only)."""
        if self.dist.is_main:
            self._log(f"warning: {msg}")

    def _not_restored(self, what: str, why: str) -> None:
        assert self.resume_info is not None
        self.resume_info["not_restored"].append({"state": what, "reason": why})
        self.warn(f"--resume {self.cfg.resume}: {what} not restored: {why}")

    # -- setup ---------------------------------------------------------------

    def setup(self) -> None:
        """Load the data, build the model (resuming its weights), wrap it the way the mode does.

        Raises:
            TrainingError: ``--replicas`` names more GPUs than there are, or the resume fails.
            CkptfixError: the ``--data`` or ``--resume`` file cannot be read.
        """
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        if cfg.data == _data.DIGITS:
            self.dataset = _data.digits_dataset(cfg.seed)
        elif cfg.data:
            self.dataset = _data.load_dataset(cfg.data)
        else:
            self.dataset = _data.synthetic_dataset(cfg.seed, cfg.train_samples, cfg.test_samples)
        base = build_model(cfg.model, cfg.seed, init=cfg.init)
        if cfg.resume:
            self._resume_into(base)

        if cfg.mode == "manual":
            self._setup_manual(base)
        elif cfg.mode == "fsdp":
            self._setup_fsdp(base)
        else:
            self._setup_wrapped(base)
        if self._resume_ckpt is not None:
            self._resume_optimizer()

    def _setup_manual(self, base: nn.Module) -> None:
        """manual: ``--replicas`` copies of ``base`` (one per GPU, or all on the CPU)."""
        cfg = self.cfg
        n = cfg.replicas or (torch.cuda.device_count() if self.device_type == "cuda" else 2)
        if self.device_type == "cuda":
            if n > torch.cuda.device_count():
                raise TrainingError(f"--replicas {n} but only {torch.cuda.device_count()} CUDA device(s) are visible")
            devs = [torch.device("cuda", i) for i in range(n)]
        else:
            devs = [torch.device("cpu")] * n
        self.manual = ManualDataParallel(
            base, devs, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, all_reduce=cfg.allreduce
        )
        self.base = self.manual.replicas[0]
        self.wrapped = self.base
        self.optimizer = self.manual.optimizers[0]
        self.devices = [str(d) for d in devs]
        self.input_device = devs[0]

    def _setup_fsdp(self, base: nn.Module) -> None:
        """fsdp: ``base`` sharded over the process group."""
        cfg = self.cfg
        self.fsdp = FSDPState(cfg, self.dist, self.device_type, base)
        self.base = self.wrapped = self.fsdp.model
        self.optimizer = self.fsdp.optimizer
        self.devices = [str(self.fsdp.device)]
        self.input_device = self.fsdp.device

    def _setup_wrapped(self, base: nn.Module) -> None:
        """single / dp / ddp: ``base`` on its device, compiled if asked, wrapped the way the mode does."""
        cfg = self.cfg
        if cfg.mode == "ddp":
            if self.device_type == "cuda":
                dev = torch.device("cuda", self.dist.local_rank)
            else:
                dev = torch.device("cpu")
            if has_batchnorm(base):
                if self.device_type == "cuda":
                    base = nn.SyncBatchNorm.convert_sync_batchnorm(base)
                    self.sync_bn = True
                else:
                    self.log(
                        "note: SyncBatchNorm needs CUDA tensors; on CPU (gloo) each rank normalises with its own "
                        "batch statistics and DDP broadcasts rank 0's running statistics"
                    )
            self.devices = [str(dev)]
        elif cfg.mode == "dp":
            if self.device_type == "cuda":
                dev = torch.device("cuda", 0)
                self.devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
            else:
                dev = torch.device("cpu")
                self.devices = ["cpu"]
        else:
            dev = torch.device("cuda", 0) if self.device_type == "cuda" else torch.device("cpu")
            self.devices = [str(dev)]
        self.input_device = dev
        base = base.to(dev)
        self.base = base
        model: nn.Module = base
        if cfg.compile:
            model = cast(nn.Module, torch.compile(model, backend=cfg.compile_backend))
        if cfg.mode == "dp":
            model = nn.DataParallel(model)
        elif cfg.mode == "ddp":
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[self.dist.local_rank] if self.device_type == "cuda" else None
            )
        self.wrapped = model
        self.optimizer = torch.optim.SGD(
            self.wrapped.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
        if cfg.amp:
            self.scaler = torch.amp.GradScaler(self.device_type)

    def _resume_into(self, base: nn.Module) -> None:
        cfg = self.cfg
        assert cfg.resume is not None
        ckpt, fmt = load_resume(cfg, base)
        done = int(ckpt.get("epoch", 0) or 0)
        self.start_epoch = done + 1
        self._resume_ckpt = ckpt
        self.resumed_from = os.path.abspath(cfg.resume)
        self.resume_info = {
            "from": self.resumed_from,
            "format": fmt,
            "epoch": done,
            "restored": ["model"],
            "not_restored": [],
            "hyperparameters": {},
        }
        self.log(f"resumed {cfg.resume} (format {fmt}, epoch {done})")

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The run's optimizers (one per replica in manual mode, else one)."""
        if self.manual:
            return list(self.manual.optimizers)
        if self.fsdp is not None:
            return [self.fsdp.optimizer]
        return [self.optimizer]

    def _resume_optimizer(self) -> None:
        cfg = self.cfg
        ckpt = self._resume_ckpt
        info = self.resume_info
        assert info is not None
        opt_sd = ckpt.get("optimizer_state_dict")
        restored = False
        if isinstance(opt_sd, dict) and isinstance(opt_sd.get("state"), dict) and opt_sd.get("param_groups"):
            opt_sd = int_optimizer_keys(opt_sd)
            n_params = sum(len(g.get("params", ())) for g in opt_sd["param_groups"])
            want = sum(len(g["params"]) for g in self.optimizers()[0].param_groups)
            if n_params != want:
                self._not_restored("optimizer", f"it covers {n_params} parameters, the {cfg.model} model has {want}")
            else:
                try:
                    if self.fsdp is not None:
                        self.fsdp.load_optimizer(opt_sd)
                    else:
                        for opt in self.optimizers():
                            opt.load_state_dict(copy.deepcopy(opt_sd))
                except (ValueError, KeyError, RuntimeError) as e:
                    raise TrainingError(f"--resume {cfg.resume}: the optimizer state does not fit: {e}") from e
                restored = True
                info["restored"].append("optimizer")
        else:
            self._not_restored("optimizer", "the checkpoint has no optimizer_state_dict; momentum starts from zero")
        sc = ckpt.get("scaler_state_dict")
        if self.scaler is not None:
            if isinstance(sc, dict) and sc:
                self.scaler.load_state_dict(sc)
                info["restored"].append("scaler")
            else:
                self._not_restored("scaler", "the checkpoint has no scaler_state_dict (saved without --amp)")
        # Hyper-parameters: the checkpoint's (restored with the optimizer) unless given explicitly.
        groups = self.optimizers()[0].param_groups[0]
        for h in HPARAMS:
            given = getattr(cfg, h)
            before = groups.get(h) if restored else None
            if restored and h in cfg.explicit and before != given:
                for opt in self.optimizers():
                    for g in opt.param_groups:
                        g[h] = given
                self.log(
                    f"resume: --{h.replace('_', '-')} {given} given explicitly: used instead of the "
                    f"checkpoint's {before}"
                )
            elif restored and before != given:
                self.log(f"resume: {h} {before} from the checkpoint (pass --{h.replace('_', '-')} to change it)")
            info["hyperparameters"][h] = {
                "checkpoint": before,
                "used": self.optimizers()[0].param_groups[0].get(h),
                "explicit": h in cfg.explicit,
            }

    # -- data ----------------------------------------------------------------

    def train_loader(self, epoch: int) -> DataLoader[tuple[torch.Tensor, ...]]:
        """This epoch's batches: a seeded shuffle (ddp/fsdp: ``DistributedSampler`` with ``set_epoch``).

        Args:
            epoch: The epoch (1-based); each gets its own shuffle, the same on every rank.
        """
        from torch.utils.data import DataLoader, TensorDataset

        if not hasattr(self, "_train_ds"):
            x, y = self.dataset.train_tensors()
            self._train_ds = TensorDataset(x, y)
            if self.cfg.mode in DISTRIBUTED_MODES:
                from torch.utils.data.distributed import DistributedSampler

                self._sampler: DistributedSampler[Any] = DistributedSampler(
                    self._train_ds,
                    num_replicas=self.dist.world_size,
                    rank=self.dist.rank,
                    shuffle=True,
                    seed=self.cfg.seed,
                )
        sampler: Any
        if self.cfg.mode in DISTRIBUTED_MODES:
            self._sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
            sampler = self._sampler
        else:
            from torch.utils.data import RandomSampler

            g = torch.Generator().manual_seed(self.cfg.seed * 100003 + epoch)
            sampler = RandomSampler(self._train_ds, generator=g)
        return DataLoader(
            self._train_ds,
            batch_size=self.cfg.batch_size,
            sampler=sampler,
            pin_memory=self.device_type == "cuda",
        )

    # -- one step ------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The forward pass's autocast context (a no-op without ``--amp``)."""
        if not self.cfg.amp:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=amp_dtype(self.device_type))

    def step(self, x: torch.Tensor, y: torch.Tensor, show_split: bool) -> float:
        """One optimisation step on a batch."""
        if self.manual is not None:
            manual_loss = self.manual.step(x, y)
            if show_split:
                sizes = self.manual.last_split
                print(f"batch of {x.shape[0]} -> replicas: {', '.join(map(str, sizes))}", file=sys.stderr, flush=True)
            return manual_loss
        x = x.to(self.input_device, non_blocking=True)
        y = y.to(self.input_device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        if show_split:
            setattr(self.base, "show_split", True)  # noqa: B010 - the models print their split when set
        try:
            with self.autocast():
                out = self.wrapped(x)
                loss = F.cross_entropy(out, y)
        finally:
            setattr(self.base, "show_split", False)  # noqa: B010
        if show_split:
            print(f"Outside: input size {tuple(x.shape)}, output size {tuple(out.shape)}", file=sys.stderr, flush=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        return float(loss.detach())

    # -- evaluation ----------------------------------------------------------

    def evaluate(self) -> float:
        """Test accuracy of the current weights (over every rank's share in ddp)."""
        x, y = self.dataset.test_tensors()
        # ddp: each rank scores a strided share, then the counts are summed.  fsdp: every rank runs the
        # whole set (each forward all-gathers parameters, so all ranks must run the same batches).
        if self.cfg.mode == "ddp":
            x, y = x[self.dist.rank :: self.dist.world_size], y[self.dist.rank :: self.dist.world_size]
        m = self.base
        was = m.training
        m.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, x.shape[0], 256):
                xb = x[i : i + 256].to(self.input_device)
                correct += int((m(xb).argmax(1).cpu() == y[i : i + 256]).sum())
        m.train(was)
        counts = torch.tensor([correct, x.shape[0]], dtype=torch.float64)
        if self.dist.enabled and self.fsdp is None:
            counts = counts.to(self.input_device)
            torch.distributed.all_reduce(counts)
            counts = counts.cpu()
        return float(counts[0]) / max(float(counts[1]), 1.0)

    # -- saving --------------------------------------------------------------

    def _args_dict(self) -> dict[str, Any]:
        """The options as a plain dict, with the optimizer settings actually used (after a resume)."""
        d = self.cfg.to_dict()
        d["explicit"] = list(d["explicit"])
        g = self.optimizers()[0].param_groups[0]
        for h in HPARAMS:
            if h in g:
                d[h] = g[h]
        d["device_type"] = self.device_type
        d["world_size"] = self.dist.world_size
        return d

    def _args_object(self) -> Any:
        d = self._args_dict()
        return argparse.Namespace(**d) if self.cfg.namespace_args else d

    def save(self, epoch: int, accuracy: float) -> dict[str, Any] | None:
        """Save this epoch's checkpoint (rank 0 writes .pt; every rank writes its DCP shard) and probe.

        Returns:
            The epoch's ``checkpoints.json`` entry on rank 0; None on the other ranks.

        Raises:
            TrainingError: a key lacks the expected prefix (a bug in the trainer).
            OutputError: a file cannot be written.
        """
        cfg = self.cfg
        compiled = cfg.compile
        prefix = expected_prefix(cfg.mode, cfg.save_style, compiled)
        stem = f"{self.name}_epoch{epoch}"
        rel = stem + (".dcp" if cfg.save_format == "dcp" else ".pt")
        probe_rel = stem + ".probe.pt"
        self._epoch_files = [rel, probe_rel]  # removed again if this epoch's save fails
        if self.fsdp is not None:
            sd, probe_model = self.fsdp.save(epoch, os.path.join(self.out, rel), self._args_dict(), self._args_object())
        else:
            sd = self._save_unsharded(epoch, os.path.join(self.out, rel), prefix)
            probe_model = self.base
        top_keys = ["epoch", "model_state_dict", "optimizer_state_dict"]
        if self.scaler is not None:
            top_keys.append("scaler_state_dict")
        top_keys.append("args")
        if not self.dist.is_main:
            return None
        assert probe_model is not None  # rank 0 always has the full model

        out = probe_output(probe_model)
        probe_in = _data.probe_batch()
        atomic_torch_save(
            {"input": probe_in, "output": out, "seed": _data.PROBE_SEED, "threads": 1},
            os.path.join(self.out, probe_rel),
        )
        return self._manifest_entry(epoch, accuracy, rel, prefix, sd, top_keys, probe_rel, probe_in, out)

    def _save_unsharded(self, epoch: int, path: str, prefix: str) -> dict[str, Any]:
        """Save the wrapper dict of a single/dp/ddp/manual run (.pt on rank 0, or DCP); its model state dict."""
        cfg = self.cfg
        sd = (self.wrapped if cfg.save_style == "wrapped" else self.base).state_dict()
        bad = [k for k in sd if not k.startswith(prefix)]
        if bad:  # a bug in the trainer, not a user error
            raise TrainingError(f"internal: expected every key to start with {prefix!r}, got {bad[0]!r}")
        payload: dict[str, Any] = {
            "epoch": epoch,
            "model_state_dict": sd,
            "optimizer_state_dict": self.optimizer.state_dict(),
        }
        if self.scaler is not None:
            payload["scaler_state_dict"] = self.scaler.state_dict()
        payload["args"] = self._args_object()
        if cfg.save_format == "dcp":
            # args as a plain dict: DCP pickles non-tensor leaves; keep it readable without extra globals
            save_dcp({**payload, "args": self._args_dict()}, path, self.dist)
        else:
            if self.dist.is_main:
                atomic_torch_save(payload, path, legacy=cfg.legacy_format)
            self.dist.barrier()  # nobody goes on (or exits) before the file is complete
        return sd

    def _manifest_entry(
        self,
        epoch: int,
        accuracy: float,
        rel: str,
        prefix: str,
        sd: dict[str, Any],
        top_keys: list[str],
        probe_rel: str,
        probe_in: torch.Tensor,
        out: torch.Tensor,
    ) -> dict[str, Any]:
        """This epoch's ``checkpoints.json`` entry."""
        cfg = self.cfg
        return {
            "path": rel,
            "run": self.name,
            "mode": cfg.mode,
            "model": cfg.model,
            "device": self.device_type,
            "devices": self.devices if cfg.mode not in DISTRIBUTED_MODES else self._all_devices,
            "world_size": self.dist.world_size,
            "replicas": len(self.manual.replicas) if self.manual else (len(self.devices) if cfg.mode == "dp" else 1),
            "save_style": cfg.save_style,
            "save_format": cfg.save_format,
            "expected_prefix": prefix,
            "amp": cfg.amp,
            "amp_dtype": str(amp_dtype(self.device_type)).replace("torch.", "") if cfg.amp else None,
            "compile": cfg.compile,
            "compile_backend": cfg.compile_backend if cfg.compile else None,
            "legacy_format": cfg.legacy_format,
            "args_type": "namespace" if cfg.namespace_args else "dict",
            "sync_batchnorm": self.sync_bn,
            "epoch": epoch,
            "accuracy": accuracy,
            "keys": {"first": next(iter(sd)), "count": len(sd)},
            "top_level_keys": top_keys,
            "resumed_from": self.resumed_from,
            "resume": self.resume_info,
            "hyperparameters": {h: self._args_dict()[h] for h in ("lr", "momentum", "weight_decay", "batch_size")},
            "sharded": bool(self.fsdp is not None and cfg.save_format == "dcp"),
            "probe": {
                "file": probe_rel,
                "seed": _data.PROBE_SEED,
                "shape": list(probe_in.shape),
                "output_shape": list(out.shape),
                "output_sha256": tensor_sha256(out),
                "output": out.tolist(),
                "eval_mode": True,
                "dtype": "float32",
                "device": "cpu",
                "threads": 1,
            },
        }

    # -- the loop ------------------------------------------------------------

    def check_outputs(self) -> None:
        """Refuse (without ``--force``) to overwrite files that another run wrote in ``--out``.

        Re-running the same configuration (same run name, same resume source) replaces its own
        files; anything else -- a file of a run with another history, or a file not in
        ``checkpoints.json`` -- is kept.

        Raises:
            TrainingError: a file this run would write belongs to another run.
        """
        if self.cfg.force:
            return
        ext = ".dcp" if self.cfg.save_format == "dcp" else ".pt"
        paths = [
            rel
            for epoch in range(self.start_epoch, self.cfg.epochs + 1)
            for rel in (f"{self.name}_epoch{epoch}{ext}", f"{self.name}_epoch{epoch}.probe.pt")
        ]
        check_outputs(self.out, paths, self.name, self.resumed_from)

    def _record_epoch(self, entry: dict[str, Any]) -> str:
        """Add this epoch's entry to checkpoints.json (after its files are complete)."""
        return update_manifest(self.out, [entry])

    def _remove_epoch_files(self) -> None:
        if self.dist.is_main:
            remove_outputs([os.path.join(self.out, rel) for rel in self._epoch_files])

    def _announce(self) -> None:
        """The run's first progress lines: what trains where, and how --show-split splits a batch."""
        cfg = self.cfg
        where = (
            f"{self.dist.world_size} processes ({cfg.mode}, {process_group_backend(self.device_type)})"
            if cfg.mode in DISTRIBUTED_MODES
            else f"{len(self.manual.replicas)} replicas"
            if self.manual
            else ", ".join(self.devices)
        )
        self.log(
            f"[{self.name}] {cfg.model} on {where}: {self.dataset.source}, batch {cfg.batch_size}, "
            f"epochs {self.start_epoch}..{cfg.epochs}"
        )
        if cfg.show_split and cfg.mode == "dp":
            n_dev = len(self.devices) if self.device_type == "cuda" else 1
            if n_dev == 1:
                self.log(
                    f"--show-split: DataParallel has one device here ({self.devices[0]}), so it does not split: "
                    "every batch goes whole to that one replica (one 'In Model' line per batch)"
                )
            else:
                self.log(
                    f"--show-split: DataParallel scatters each batch over {n_dev} GPUs in chunks of "
                    "ceil(batch / GPUs) (torch.chunk); one 'In Model' line per replica"
                )
        elif cfg.show_split and self.manual is not None:
            self.log(
                f"--show-split: each batch is cut like nn.parallel.scatter (torch.chunk: chunks of "
                f"ceil(batch / {len(self.manual.replicas)}) samples)"
            )

    def _train_epoch(self, epoch: int) -> tuple[float, int, float]:
        """Train one epoch; (mean training loss over every rank, samples, seconds of the loop)."""
        cfg = self.cfg
        loader = self.train_loader(epoch)
        self.dist.barrier()
        t0 = time.perf_counter()
        loss_sum, seen = 0.0, 0
        for i, (x, y) in enumerate(loader):
            if cfg.show_split and self.dist.is_main and cfg.mode == "dp":
                print(f"batch {i + 1} (epoch {epoch}):", file=sys.stderr, flush=True)
            loss = self.step(x, y, show_split=cfg.show_split)
            loss_sum += loss * x.shape[0]
            seen += x.shape[0]
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        self.dist.barrier()
        seconds = time.perf_counter() - t0
        if self.manual:
            self.manual.check_in_sync()
        stats = torch.tensor([loss_sum, float(seen)], dtype=torch.float64)
        if self.dist.enabled:
            stats = stats.to(self.input_device)
            torch.distributed.all_reduce(stats)
            stats = stats.cpu()
        train_loss = float(stats[0]) / max(float(stats[1]), 1.0)
        samples = int(stats[1])
        return train_loss, samples, seconds

    def run(self) -> TrainResult:
        """Set up, then train, evaluate and save every epoch; ``checkpoints.json`` after each.

        A failure while saving an epoch removes that epoch's files, so no half-saved epoch is left.

        Returns:
            The checkpoints and metrics (rank 0's lists the checkpoints; other ranks' none).

        Raises:
            TrainingError: the setup or training fails, or ``--out`` holds another run's files.
            OutputError: a file cannot be written.
        """
        cfg = self.cfg
        os.makedirs(self.out, exist_ok=True)
        self.setup()
        self.check_outputs()
        if self.dist.enabled and cfg.mode in DISTRIBUTED_MODES:
            gathered: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(gathered, self.devices[0])
            self._all_devices = gathered
        else:
            self._all_devices = self.devices
        n_train = len(self.dataset.train_labels)
        self._announce()
        manifest = os.path.join(self.out, MANIFEST)
        entries: list[dict[str, Any]] = []
        epochs: list[dict[str, Any]] = []
        self.wrapped.train()
        if self.manual:
            self.manual.train()
        for epoch in range(self.start_epoch, cfg.epochs + 1):
            train_loss, samples, seconds = self._train_epoch(epoch)
            acc = self.evaluate()
            try:
                entry = self.save(epoch, acc)
                if entry is not None:
                    manifest = self._record_epoch(entry)  # the manifest last: every listed file is complete
            except BaseException:
                self._remove_epoch_files()  # no half-saved epoch left behind
                raise
            self._epoch_files = []
            if entry is not None:
                entries.append(entry)
            epochs.append(
                {"epoch": epoch, "train_loss": train_loss, "accuracy": acc, "seconds": seconds, "samples": samples}
            )
            self.log(
                f"[{self.name}] epoch {epoch}/{cfg.epochs}: loss {train_loss:.4f}  test acc {acc:.1%}  "
                f"{seconds:.2f}s  {samples / seconds:,.0f} samples/s" + (f"  -> {entry['path']}" if entry else "")
            )
        self.dist.barrier()
        result_entries = [dict(e, abs_path=os.path.join(self.out, e["path"])) for e in entries]
        timed = epochs[1:] if len(epochs) > 1 else epochs
        spe = sum(e["seconds"] for e in timed) / len(timed)
        return TrainResult(
            name=self.name,
            mode=cfg.mode,
            model=cfg.model,
            out_dir=self.out,
            manifest=manifest,
            device=self.device_type,
            devices=self._all_devices,
            world_size=self.dist.world_size,
            checkpoints=result_entries,
            epochs=epochs,
            start_epoch=self.start_epoch,
            sec_per_epoch=spe,
            samples_per_sec=(sum(e["samples"] for e in timed) / len(timed)) / spe if spe > 0 else 0.0,
            final_accuracy=epochs[-1]["accuracy"],
            train_samples=n_train,
            extra={"resumed_from": self.resumed_from, "resume": self.resume_info, "sync_batchnorm": self.sync_bn},
        )
