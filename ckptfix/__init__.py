"""ckptfix: load any PyTorch checkpoint anywhere, fix it, convert it, and pick the right GPU.

Importing this package never imports torch, which is an optional dependency
(``pip install "ckptfix[torch]"``): reading, scanning, renaming and converting
checkpoints and the GPU functions work without it; the functions that return
real tensors (``load_anywhere``, ``load_checkpoint``) import it when called and
raise :class:`ckptfix.errors.TorchMissingError` (exit code 14) when it is missing.

>>> from ckptfix import load_anywhere            # doctest: +SKIP
>>> sd = load_anywhere("model.pth")              # doctest: +SKIP
>>> model.load_state_dict(sd)                    # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

from ckptfix._torch import silence_numpy_warning

__version__ = "0.1.0"

silence_numpy_warning()

# public name -> module that defines it (imported on first use)
_LAZY = {
    "load_anywhere": "ckptfix.loading",
    "load_checkpoint": "ckptfix.loading",
    "LoadedCheckpoint": "ckptfix.loading",
    "inspect_checkpoint": "ckptfix.inspecting",
    "scan_checkpoint": "ckptfix.inspecting",
    "read_checkpoint": "ckptfix.formats",
    "detect_prefixes": "ckptfix.prefixes",
    "strip_prefix": "ckptfix.prefixes",
    "add_prefix": "ckptfix.prefixes",
    "align_state_dict": "ckptfix.prefixes",
    "strip_prefix_checkpoint": "ckptfix.rekey",
    "add_prefix_checkpoint": "ckptfix.rekey",
    "align_checkpoint": "ckptfix.rekey",
    "convert_to_safetensors": "ckptfix.convert",
    "convert_from_safetensors": "ckptfix.convert",
    "sanitize_checkpoint": "ckptfix.sanitize",
    "visible_gpus": "ckptfix.gpu",
    "pick_gpu": "ckptfix.gpu",
    "choose_gpus": "ckptfix.gpu",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckptfix' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
