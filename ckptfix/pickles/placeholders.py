"""Empty placeholder tensors whose real shapes the same file records: a partitioned checkpoint.

DeepSpeed ZeRO-3 saves ``zero_pp_rank_R_mp_rank_00_model_states.pt`` with every partitioned parameter
of ``module`` as a 0-element tensor; the values live in the optimizer partitions beside it
(``*_optim_states.pt``) and ``param_shapes`` (a list of ``{name: torch.Size}``, one per parameter
group) records the real shapes.  Converting or renaming such a file writes a useless checkpoint of
empty tensors, so ``convert`` / ``strip-prefix`` / ``add-prefix`` / ``align`` refuse it
(:class:`~ckptfix.errors.PartitionedCheckpointError`, exit 17) and ``inspect`` warns, naming the
command that consolidates the partitions.  Torch-free: shapes are read from the restricted reader's
``torch.Size`` placeholders as well as from real ``torch.Size`` objects.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from ckptfix.errors import PartitionedCheckpointError
from ckptfix.pickles import Stub, is_tensor_like

#: the keys that record the real shapes (DeepSpeed writes ``param_shapes``; ``frozen_param_shapes``
#: holds those of frozen parameters)
SHAPE_KEYS = ("param_shapes", "frozen_param_shapes")


def _shape(v: Any) -> tuple[int, ...] | None:
    if isinstance(v, Stub):
        args = v.args if hasattr(v, "args") else ()
        v = args[0] if len(args) == 1 else None
    if isinstance(v, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) for d in v):
        return tuple(v)
    return None


def recorded_shapes(obj: Any) -> dict[str, tuple[int, ...]]:
    """``name -> shape`` from the checkpoint's ``param_shapes`` (a mapping, or a list of them), if any.

    Args:
        obj: the whole checkpoint.

    Returns:
        The recorded shapes (empty when the checkpoint records none).
    """
    out: dict[str, tuple[int, ...]] = {}
    if not isinstance(obj, Mapping):
        return out
    for key in SHAPE_KEYS:
        groups = obj.get(key)
        if isinstance(groups, Mapping):
            groups = [groups]
        if not isinstance(groups, (list, tuple)):
            continue
        for g in groups[:10_000]:
            if not isinstance(g, Mapping):
                continue
            for name, v in list(g.items())[:1_000_000]:
                s = _shape(v)
                if isinstance(name, str) and s is not None:
                    out[name] = s
    return out


def _numel(t: Any) -> int | None:
    n = getattr(t, "numel", None)
    if callable(n):
        try:
            return int(n())
        except Exception:  # noqa: BLE001 - a placeholder that cannot say: not an empty placeholder
            return None
    return n if isinstance(n, int) else None


def empty_placeholders(obj: Any, sd: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Tensors of ``sd`` with 0 elements whose shape recorded in ``obj`` has elements.

    Args:
        obj: the whole checkpoint (where ``param_shapes`` sits).
        sd: its state dict.

    Returns:
        ``(name, recorded shape)`` of each such placeholder, in state-dict order.
    """
    shapes = recorded_shapes(obj)
    if not shapes:
        return []
    found = []
    for k, t in sd.items():
        if not is_tensor_like(t) or _numel(t) != 0:
            continue
        name = str(k)
        s = shapes.get(name)
        if s is None and name.startswith("module."):
            s = shapes.get(name[len("module.") :])
        if s is not None and math.prod(s) > 0:
            found.append((name, s))
    return found


def consolidate_hint(path: str) -> str:
    """The command that consolidates the partitioned checkpoint ``path`` belongs to."""
    d = os.path.dirname(os.path.abspath(os.fspath(path))) or "."
    return f"ckptfix convert {d} -o model.safetensors"


def describe(path: str, found: list[tuple[str, tuple[int, ...]]], total: int) -> str:
    """One sentence: how many placeholders, one example, and the consolidating command."""
    name, shape = found[0]
    return (
        f"{len(found)} of {total} tensor(s) are empty placeholders of a partitioned (DeepSpeed ZeRO-3) "
        f"checkpoint: {name!r} holds 0 elements but param_shapes records {list(shape)}; the values live "
        f"in the optimizer partitions beside it. Consolidate them first: {consolidate_hint(path)}"
    )


def check_not_partitioned(path: str, obj: Any, sd: Mapping[str, Any], command: str) -> None:
    """Refuse a checkpoint whose parameters are partitioned placeholders (before anything is written).

    Args:
        path: the input (for the message and the hint).
        obj: the whole checkpoint.
        sd: its state dict.
        command: what was asked (``convert``, ``strip-prefix`` ...).

    Raises:
        PartitionedCheckpointError: some tensors are empty placeholders of recorded non-empty shapes.
    """
    found = empty_placeholders(obj, sd)
    if found:
        total = sum(1 for v in sd.values() if is_tensor_like(v))
        raise PartitionedCheckpointError(f"{path}: {command} refused: {describe(path, found, total)}")
