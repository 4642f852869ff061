"""A harness that proves the trainer right: the hand-written data parallelism (``ckptfix train --mode
manual``) matches single-device training on the same batches and seed.

Not shipped in the wheel (it trains two models to compare them); the tests and
docs/sections/train.md use it from here.  Proving a restored model exact is
:func:`ckptfix.train.verify_probe`, which ships.

    python benchmarks/train_compare.py [REPLICAS]
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch


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


if __name__ == "__main__":
    import sys

    r = compare_manual_to_single(int(sys.argv[1]) if len(sys.argv) > 1 else 2, epochs=1)
    print(f"manual ({r['replicas']} replicas) vs single: max |dw| = {r['max_abs_diff']:.3g} at {r['worst_key']}")
