"""Comparisons that prove the trainer right: restored weights reproduce the recorded probe output
bit for bit, and the hand-written data parallelism matches single-device training.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from ckptfix.train.models import build_model
from ckptfix.train.probe import probe_output, tensor_sha256
from ckptfix.train.resume import ALLOW_GLOBALS


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
            :func:`ckptfix.loading.load_checkpoint` (``model=`` aligns the keys).

    Returns:
        ``{"exact": bool, "max_abs_diff": float, "sha256_ok": bool}``.

    Raises:
        CkptfixError: the checkpoint cannot be loaded.
        RuntimeError: the weights do not fit the model (``load_state_dict``).
    """
    probe = entry["probe"]
    side = torch.load(os.path.join(out_dir, probe["file"]), map_location="cpu", weights_only=True)
    model = build_model(entry["model"], 0)
    if state_dict is None:
        from ckptfix.loading import load_checkpoint

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


def compare_manual_to_single(
    replicas: int = 2,
    *,
    out: str | None = None,
    **config: Any,
) -> dict[str, Any]:
    """Train ``single`` and ``manual`` (``replicas`` replicas) on the same batches and seed; compare weights.

    Args:
        replicas: Replicas of the manual run.
        out: Where both runs write (default: a temp directory, removed afterwards).
        **config: More :class:`~ckptfix.train.config.TrainConfig` fields (e.g. ``epochs=1``).

    Returns:
        ``{"max_abs_diff": float, "worst_key": str, "per_key": {...}, "replicas": int,
        "single": TrainResult, "manual": TrainResult, "out": str | None}``.

    Raises:
        TrainingError: a run fails.
    """
    from ckptfix.train.config import TrainConfig
    from ckptfix.train.entry import train

    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="ckptfix-manual-")
        out = tmp.name
    try:
        base = dict(config)
        base.setdefault("quiet", True)
        single = train(TrainConfig(mode="single", out=out, save_style="clean", name="cmp-single", **base))
        manual = train(
            TrainConfig(mode="manual", out=out, replicas=replicas, save_style="clean", name="cmp-manual", **base)
        )
        a = torch.load(single.final_checkpoint, map_location="cpu", weights_only=True)["model_state_dict"]
        b = torch.load(manual.final_checkpoint, map_location="cpu", weights_only=True)["model_state_dict"]
        per = {}
        for k in a:
            if a[k].is_floating_point():
                per[k] = float((a[k].double() - b[k].double()).abs().max())
        worst = max(per, key=lambda k: per[k])
        return {
            "max_abs_diff": per[worst],
            "worst_key": worst,
            "per_key": per,
            "replicas": replicas,
            "single": single,
            "manual": manual,
            "out": None if tmp else os.path.abspath(out),
        }
    finally:
        if tmp is not None:
            tmp.cleanup()
