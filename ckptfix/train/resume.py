"""``--resume``: loading a checkpoint of any mode or format into the model, and its optimizer state;
:func:`verify_probe`: proving that weights restored from a checkpoint reproduce the recorded probe output."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch import nn

from ckptfix.errors import TrainingError
from ckptfix.train.config import TrainConfig
from ckptfix.train.models import build_model
from ckptfix.train.probe import probe_output, tensor_sha256

# argparse.Namespace is what `args` becomes with --namespace-args: harmless, so resume allows it.
ALLOW_GLOBALS = (argparse.Namespace,)


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
    """Load ``cfg.resume`` into ``base`` (weights only) and check the run can continue from it.

    Also the launcher's pre-flight check for ``ddp``/``fsdp``, so a bad ``--resume`` is one
    ``Error:`` line before torchrun starts.

    Returns:
        (the checkpoint's top-level dict, or ``{}`` for a bare state dict; its format name).

    Raises:
        TrainingError: the weights do not fit the model, or the checkpoint already has
            ``cfg.epochs`` epochs.
        CkptfixError: the checkpoint cannot be read (its own error class).
    """
    from ckptfix.ops.load import load_checkpoint

    assert cfg.resume is not None
    lc = load_checkpoint(cfg.resume, map_location="cpu", model=base, allow_globals=ALLOW_GLOBALS)
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


def verify_probe(
    entry: dict[str, Any],
    out_dir: str,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Prove that weights restore the model exactly: rebuild it, run the probe, compare.

    Args:
        entry: One ``checkpoints.json`` entry.
        out_dir: The directory holding the manifest (entries' paths are relative to it).
        state_dict: The weights to check; without it the entry's checkpoint is loaded through
            :func:`ckptfix.ops.load.load_checkpoint` (``model=`` aligns the keys).

    Raises:
        CkptfixError: the checkpoint cannot be loaded.
        RuntimeError: the weights do not fit the model (``load_state_dict``).
    """
    probe = entry["probe"]
    side = torch.load(os.path.join(out_dir, probe["file"]), map_location="cpu", weights_only=True)
    model = build_model(entry["model"], 0)
    if state_dict is None:
        from ckptfix.ops.load import load_checkpoint

        lc = load_checkpoint(
            os.path.join(out_dir, entry["path"]), map_location="cpu", model=model, allow_globals=ALLOW_GLOBALS
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
