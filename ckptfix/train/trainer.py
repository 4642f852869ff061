"""The common training loop, checkpoint saving, ``checkpoints.json`` and the probe batch.

:func:`train` runs ``single``, ``dp`` and ``manual`` in this process and hands
``ddp`` to :mod:`ckptfix.train.ddp` (which launches ``torchrun``, or runs as a
worker when already under ``torchrun``).  Every mode goes through
:class:`Run`: build the model from the seed, optionally resume through
:func:`ckptfix.loading.load_checkpoint`, wrap it the way the mode does, train,
evaluate, and save a realistic wrapper dict after every epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import ckptfix
from ckptfix.errors import TrainingError
from ckptfix.train import data as _data
from ckptfix.train.config import TrainConfig, TrainResult
from ckptfix.train.models import build_model, has_batchnorm

MANIFEST = "checkpoints.json"
MANIFEST_VERSION = 1


# --------------------------------------------------------------------------- helpers


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise TrainingError(
            "--device cuda requested but CUDA is not available to this torch build "
            f"(torch {torch.__version__}); use --device cpu, or run `ckptfix doctor`"
        )
    return device


def amp_dtype(device: str) -> torch.dtype:
    return torch.float16 if device == "cuda" else torch.bfloat16


def _log_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def atomic_torch_save(obj: Any, path: str, *, legacy: bool = False) -> None:
    """``torch.save`` into a temp file next to ``path`` (:mod:`ckptfix.atomic`), fsynced, renamed into place."""
    from ckptfix.atomic import atomic_output

    with atomic_output(path, fsync=True) as f:
        if legacy:
            torch.save(obj, f, _use_new_zipfile_serialization=False)
        else:
            torch.save(obj, f)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a fsynced temp file renamed into place."""
    from ckptfix.atomic import atomic_output

    with atomic_output(path, fsync=True) as f:
        f.write(text.encode("utf-8"))


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a CPU tensor in C order (native byte order), without numpy."""
    import ctypes

    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's float32 bytes (C order, native little-endian)."""
    return hashlib.sha256(tensor_bytes(t.detach().to("cpu", torch.float32))).hexdigest()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def probe_output(model: nn.Module, probe: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits on the probe batch: a CPU float32 copy, eval mode, one intra-op thread.

    One thread makes the summation order fixed, so the same weights give the
    same bits on the same machine (the basis of the bit-exact restoration check).
    """
    if probe is None:
        probe = _data.probe_batch()
    m = copy.deepcopy(model).to("cpu", torch.float32).eval()
    if hasattr(m, "show_split"):
        m.show_split = False
    with _one_thread(), torch.no_grad():
        return m(probe).detach().clone()


def unwrap(module: nn.Module) -> nn.Module:
    """Peel DataParallel/DDP (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    while True:
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        else:
            return module


def expected_prefix(mode: str, save_style: str, compiled: bool) -> str:
    """The key prefix a checkpoint of this configuration has.

    Wrapped DP/DDP saves gain ``module.``; ``torch.compile`` adds ``_orig_mod.``
    inside it (the model is compiled first and then wrapped, as nanoGPT does),
    giving ``module._orig_mod.``.  ``clean`` saves have no prefix.
    """
    if save_style == "clean":
        return ""
    p = "module." if mode in ("dp", "ddp") else ""
    if compiled:
        p += "_orig_mod."
    return p


# --------------------------------------------------------------------------- manifest


def read_manifest(out_dir: str) -> dict[str, Any]:
    """Read ``out_dir/checkpoints.json`` (or the file itself); an empty manifest when absent."""
    path = out_dir if out_dir.endswith(".json") else os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return {"version": MANIFEST_VERSION, "checkpoints": []}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _update_manifest(out_dir: str, entries: list[dict[str, Any]]) -> str:
    """Add ``entries`` to checkpoints.json (replacing entries with the same path); atomic."""
    path = os.path.join(out_dir, MANIFEST)
    man = read_manifest(out_dir)
    new_paths = {e["path"] for e in entries}
    kept = [e for e in man.get("checkpoints", []) if e.get("path") not in new_paths]
    man = {
        "version": MANIFEST_VERSION,
        "generator": f"ckptfix {ckptfix.__version__} train",
        "torch": torch.__version__,
        "checkpoints": kept + entries,
    }
    atomic_write_text(path, json.dumps(man, indent=2) + "\n")
    return path


def verify_probe(
    entry: dict[str, Any],
    out_dir: str,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Prove that weights restore the model exactly: rebuild it, run the probe, compare.

    ``entry`` is one ``checkpoints.json`` entry, ``out_dir`` the directory holding
    the manifest.  Without ``state_dict`` the checkpoint is loaded through
    :func:`ckptfix.loading.load_checkpoint` (``model=`` aligns the keys).
    Returns ``{"exact": bool, "max_abs_diff": float, "sha256_ok": bool}``.
    """
    probe = entry["probe"]
    side = torch.load(os.path.join(out_dir, probe["file"]), map_location="cpu", weights_only=True)
    model = build_model(entry["model"], 0)
    if state_dict is None:
        from ckptfix.loading import load_checkpoint

        lc = load_checkpoint(
            os.path.join(out_dir, entry["path"]), map_location="cpu", model=model, allow_globals=_ALLOW_GLOBALS
        )
        state_dict = lc.state_dict
    model.load_state_dict(state_dict)
    got = probe_output(model, side["input"])
    want = side["output"]
    return {
        "exact": bool(torch.equal(got, want)),
        "max_abs_diff": float((got.double() - want.double()).abs().max()),
        "sha256_ok": tensor_sha256(got) == probe["output_sha256"],
    }


# argparse.Namespace is what `args` becomes with --namespace-args: harmless, so resume allows it.
_ALLOW_GLOBALS = (argparse.Namespace,)


def int_optimizer_keys(opt_sd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with integer parameter ids, as ``Optimizer.load_state_dict`` needs.

    A DCP checkpoint hands the optimizer's ``state`` back keyed by strings (``'0'`` .. ``'7'``):
    ``load_state_dict`` would keep those *next to* the real entries and the momentum would be lost.
    String ids (in ``state`` and in each param group's ``params``) become ints again; the
    tensors are not copied.
    """

    def as_id(k: Any) -> Any:
        return int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k

    out = dict(opt_sd)
    out["state"] = {as_id(k): v for k, v in (opt_sd.get("state") or {}).items()}
    groups = []
    for g in opt_sd.get("param_groups") or []:
        g = dict(g)
        if "params" in g:
            g["params"] = [as_id(p) for p in g["params"]]
        groups.append(g)
    out["param_groups"] = groups
    return out


def load_resume(cfg: TrainConfig, base: nn.Module) -> tuple[dict[str, Any], str]:
    """Load ``cfg.resume`` into ``base`` (weights only) and check it can continue; returns (checkpoint dict, format).

    Also the launcher's pre-flight check for ``ddp``/``fsdp``, so a bad ``--resume`` is one
    ``Error:`` line before torchrun starts.  Raises :class:`TrainingError` when the weights do not
    fit the model or the checkpoint already has ``cfg.epochs`` epochs.
    """
    from ckptfix.loading import load_checkpoint

    lc = load_checkpoint(cfg.resume, map_location="cpu", model=base, allow_globals=_ALLOW_GLOBALS)
    try:
        base.load_state_dict(lc.state_dict)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainingError(f"--resume {cfg.resume}: weights do not fit the {cfg.model} model: {first}") from e
    ckpt = lc.checkpoint if isinstance(lc.checkpoint, dict) else {}
    done = int(ckpt.get("epoch", 0) or 0)
    if done >= cfg.epochs:
        raise TrainingError(
            f"--resume {cfg.resume}: the checkpoint already has {done} epoch(s) and --epochs is {cfg.epochs}; "
            f"pass --epochs {done + 1} or more to train further"
        )
    return ckpt, str(getattr(lc, "format", "?"))


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Dist:
    """Process-group facts (world_size 1 and rank 0 outside DDP)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()


class Run:
    """One training run of ``cfg`` (a DDP rank, or the whole run for in-process modes)."""

    def __init__(self, cfg: TrainConfig, dist: Dist | None = None, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.dist = dist or Dist()
        self._log = log or _log_to_stderr
        self.device_type = resolve_device(cfg.device)
        self.out = os.path.abspath(cfg.out)
        self.name = cfg.run_name()
        self.manual = None
        self.scaler = None
        self.sync_bn = False
        self.resumed_from: str | None = None
        self.resume_info: dict[str, Any] | None = None
        self.start_epoch = 1
        self._resume_ckpt: Any = None
        self.fsdp = None  # the FSDP helper (ckptfix.train.fsdp) in --mode fsdp

    def log(self, msg: str) -> None:
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
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.dataset = (
            _data.load_dataset(cfg.data)
            if cfg.data
            else _data.synthetic_dataset(cfg.seed, cfg.train_samples, cfg.test_samples)
        )
        base = build_model(cfg.model, cfg.seed)
        if cfg.resume:
            self._resume_into(base)

        if cfg.mode == "manual":
            n = cfg.replicas or (torch.cuda.device_count() if self.device_type == "cuda" else 2)
            if self.device_type == "cuda":
                if n > torch.cuda.device_count():
                    raise TrainingError(
                        f"--replicas {n} but only {torch.cuda.device_count()} CUDA device(s) are visible"
                    )
                devs = [torch.device("cuda", i) for i in range(n)]
            else:
                devs = [torch.device("cpu")] * n
            from ckptfix.train.manual import ManualDataParallel

            self.manual = ManualDataParallel(
                base, devs, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, all_reduce=cfg.allreduce
            )
            self.base = self.manual.replicas[0]
            self.wrapped = self.base
            self.optimizer = self.manual.optimizers[0]
            self.devices = [str(d) for d in devs]
            self.input_device = devs[0]
        elif cfg.mode == "fsdp":
            from ckptfix.train.fsdp import FSDPState

            self.fsdp = FSDPState(self, base)
        else:
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
                model = torch.compile(model, backend=cfg.compile_backend)
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
        if self._resume_ckpt is not None:
            self._resume_optimizer()

    def _resume_into(self, base: nn.Module) -> None:
        cfg = self.cfg
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
        for h in ("lr", "momentum", "weight_decay"):
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

    def train_loader(self, epoch: int) -> Any:
        from torch.utils.data import DataLoader, TensorDataset

        if not hasattr(self, "_train_ds"):
            x, y = self.dataset.train_tensors()
            self._train_ds = TensorDataset(x, y)
            if self.cfg.mode in ("ddp", "fsdp"):
                from torch.utils.data.distributed import DistributedSampler

                self._sampler = DistributedSampler(
                    self._train_ds,
                    num_replicas=self.dist.world_size,
                    rank=self.dist.rank,
                    shuffle=True,
                    seed=self.cfg.seed,
                )
        if self.cfg.mode in ("ddp", "fsdp"):
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

    def autocast(self) -> Any:
        if not self.cfg.amp:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=amp_dtype(self.device_type))

    def step(self, x: torch.Tensor, y: torch.Tensor, show_split: bool) -> float:
        if self.manual is not None:
            loss = self.manual.step(x, y)
            if show_split:
                sizes = self.manual.last_split
                print(f"batch of {x.shape[0]} -> replicas: {', '.join(map(str, sizes))}", file=sys.stderr, flush=True)
            return loss
        x = x.to(self.input_device, non_blocking=True)
        y = y.to(self.input_device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        if show_split:
            self.base.show_split = True
        try:
            with self.autocast():
                out = self.wrapped(x)
                loss = F.cross_entropy(out, y)
        finally:
            self.base.show_split = False
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
        return float(counts[0] / max(counts[1], 1))

    # -- saving --------------------------------------------------------------

    def _args_dict(self) -> dict[str, Any]:
        """The options as a plain dict, with the optimizer settings actually used (after a resume)."""
        d = self.cfg.to_dict()
        d["explicit"] = list(d["explicit"])
        g = self.optimizers()[0].param_groups[0]
        for h in ("lr", "momentum", "weight_decay"):
            if h in g:
                d[h] = g[h]
        d["device_type"] = self.device_type
        d["world_size"] = self.dist.world_size
        return d

    def _args_object(self) -> Any:
        d = self._args_dict()
        return argparse.Namespace(**d) if self.cfg.namespace_args else d

    def save(self, epoch: int, accuracy: float) -> dict[str, Any] | None:
        """Save this epoch's checkpoint (rank 0 writes .pt; every rank writes its DCP shard); return its entry."""
        cfg = self.cfg
        compiled = cfg.compile
        prefix = expected_prefix(cfg.mode, cfg.save_style, compiled)
        stem = f"{self.name}_epoch{epoch}"
        rel = stem + (".dcp" if cfg.save_format == "dcp" else ".pt")
        probe_rel = stem + ".probe.pt"
        self._epoch_files = [rel, probe_rel]  # removed again if this epoch's save fails
        if self.fsdp is not None:
            sd, probe_model = self.fsdp.save(epoch, os.path.join(self.out, rel))
        else:
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
                self._save_dcp(payload, os.path.join(self.out, rel))
            else:
                if self.dist.is_main:
                    atomic_torch_save(payload, os.path.join(self.out, rel), legacy=cfg.legacy_format)
                self.dist.barrier()  # nobody goes on (or exits) before the file is complete
            probe_model = self.base
        top_keys = ["epoch", "model_state_dict", "optimizer_state_dict"]
        if self.scaler is not None:
            top_keys.append("scaler_state_dict")
        top_keys.append("args")
        if not self.dist.is_main:
            return None

        out = probe_output(probe_model)
        probe_in = _data.probe_batch()
        atomic_torch_save(
            {"input": probe_in, "output": out, "seed": _data.PROBE_SEED, "threads": 1},
            os.path.join(self.out, probe_rel),
        )
        return {
            "path": rel,
            "run": self.name,
            "mode": cfg.mode,
            "model": cfg.model,
            "device": self.device_type,
            "devices": self.devices if cfg.mode not in ("ddp", "fsdp") else self._all_devices,
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

    def _save_dcp(self, payload: dict[str, Any], final: str) -> None:
        import torch.distributed.checkpoint as dcp

        tmp = final + ".tmp"
        if self.dist.is_main and os.path.exists(tmp):
            shutil.rmtree(tmp)
        self.dist.barrier()
        # args as a plain dict: DCP pickles non-tensor leaves; keep it readable without extra globals
        payload = dict(payload)
        payload["args"] = self._args_dict()
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": yes it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(payload, checkpoint_id=tmp, no_dist=not self.dist.enabled)
        self.dist.barrier()
        if self.dist.is_main:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
        self.dist.barrier()

    # -- the loop ------------------------------------------------------------

    def check_outputs(self) -> None:
        """Refuse (without ``--force``) to overwrite files that another run wrote in ``--out``.

        Re-running the same configuration (same run name, same resume source) replaces its own
        files, as before; anything else -- a file of a run with another history, or a file not in
        ``checkpoints.json`` -- is kept.
        """
        if self.cfg.force:
            return
        man = read_manifest(self.out)
        by_path = {e.get("path"): e for e in man.get("checkpoints", [])}
        ext = ".dcp" if self.cfg.save_format == "dcp" else ".pt"
        for epoch in range(self.start_epoch, self.cfg.epochs + 1):
            for rel in (f"{self.name}_epoch{epoch}{ext}", f"{self.name}_epoch{epoch}.probe.pt"):
                if not os.path.exists(os.path.join(self.out, rel)):
                    continue
                e = by_path.get(rel) or by_path.get(rel.replace(".probe.pt", ext))
                if e is not None and e.get("run") == self.name and e.get("resumed_from") == self.resumed_from:
                    continue
                other = (
                    (f"run {e.get('run')!r}" + (f" resumed from {e['resumed_from']}" if e.get("resumed_from") else ""))
                    if e
                    else "something not listed in checkpoints.json"
                )
                raise TrainingError(
                    f"{os.path.join(self.out, rel)} exists and was written by {other}; choose another --name or "
                    "--out, or pass --force to overwrite it"
                )

    def _record_epoch(self, entry: dict[str, Any]) -> str:
        """Add this epoch's entry to checkpoints.json (after its files are complete)."""
        return _update_manifest(self.out, [entry])

    def _remove_epoch_files(self) -> None:
        if not self.dist.is_main:
            return
        for rel in getattr(self, "_epoch_files", []):
            p = os.path.join(self.out, rel)
            with contextlib.suppress(OSError):
                if os.path.isdir(p):
                    shutil.rmtree(p)
                else:
                    os.remove(p)
            with contextlib.suppress(OSError):
                if os.path.isdir(p + ".tmp"):
                    shutil.rmtree(p + ".tmp")

    def run(self) -> TrainResult:
        cfg = self.cfg
        os.makedirs(self.out, exist_ok=True)
        self.setup()
        self.check_outputs()
        if self.dist.enabled and cfg.mode in ("ddp", "fsdp"):
            gathered: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(gathered, self.devices[0])
            self._all_devices = gathered
        else:
            self._all_devices = self.devices
        n_train = len(self.dataset.train_labels)
        where = (
            f"{self.dist.world_size} processes ({cfg.mode}, {'nccl' if self.device_type == 'cuda' else 'gloo'})"
            if cfg.mode in ("ddp", "fsdp")
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
        elif cfg.show_split and cfg.mode == "manual":
            self.log(
                f"--show-split: each batch is cut like nn.parallel.scatter (torch.chunk: chunks of "
                f"ceil(batch / {len(self.manual.replicas)}) samples)"
            )
        manifest = os.path.join(self.out, MANIFEST)
        entries: list[dict[str, Any]] = []
        epochs: list[dict[str, Any]] = []
        self.wrapped.train()
        if self.manual:
            self.manual.train()
        for epoch in range(self.start_epoch, cfg.epochs + 1):
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
            train_loss = float(stats[0] / max(stats[1], 1))
            samples = int(stats[1])
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


def check_not_under_torchrun(mode: str) -> None:
    """Refuse an in-process mode inside a torchrun job of several processes.

    Every process would train the same run and write the same files; the distributed modes
    are ``ddp`` and ``fsdp``.  Raises :class:`TrainingError`.
    """
    from ckptfix.train import ddp

    world = os.environ.get("WORLD_SIZE", "1")
    if ddp.under_torchrun() and world.isdigit() and int(world) > 1:
        raise TrainingError(
            f"--mode {mode} runs in one process, but this is one of {world} torchrun workers: every worker would "
            "train the same run and write the same files; use --mode ddp or --mode fsdp under torchrun, or run "
            "without torchrun"
        )


def train(config: TrainConfig, **overrides: Any) -> TrainResult:
    """Run one training configuration and return its checkpoints and metrics.

    ``single``, ``dp`` and ``manual`` run in this process; ``ddp`` and ``fsdp``
    launch ``torchrun`` (``config.nproc`` workers, gloo on CPU / nccl on CUDA)
    unless this process already is a torchrun worker, in which case it trains
    as that rank.  Raises :class:`ckptfix.errors.TrainingError` on failure.
    """
    cfg = dataclasses.replace(config, **overrides) if overrides else config
    cfg.validate()
    from ckptfix.train import ddp

    if cfg.mode in ("ddp", "fsdp"):
        if ddp.under_torchrun():
            return ddp.run_worker(cfg)
        return ddp.launch(cfg)
    check_not_under_torchrun(cfg.mode)
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return Run(cfg).run()
    finally:
        torch.set_num_threads(threads)
