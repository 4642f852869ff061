"""ckptfix: load any PyTorch checkpoint anywhere, fix it, convert it, and pick the right GPU.

Importing this package never imports torch, which is an optional dependency
(the ``torch`` extra, or ``pip install torch``): reading, scanning, renaming and converting
checkpoints and the GPU functions work without it; the functions that return
real tensors (``load_anywhere``, ``load_checkpoint``) import it when called and
raise :class:`ckptfix.errors.TorchMissingError` (exit code 14) when it is missing.

>>> from ckptfix import load_anywhere            # doctest: +SKIP
>>> sd = load_anywhere("model.pth")              # doctest: +SKIP
>>> model.load_state_dict(sd)                    # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptfix._torch import silence_numpy_warning
from ckptfix._version import __version__

silence_numpy_warning()

# public name -> module that defines it (imported on first use)
_LAZY = {
    "load_anywhere": "ckptfix.ops.load",
    "load_checkpoint": "ckptfix.ops.load",
    "LoadedCheckpoint": "ckptfix.ops.load",
    "inspect_checkpoint": "ckptfix.ops.inspect",
    "scan_checkpoint": "ckptfix.ops.inspect",
    "read_checkpoint": "ckptfix.formats",
    "detect_prefixes": "ckptfix.ops.prefixes",
    "strip_prefix": "ckptfix.ops.prefixes",
    "add_prefix": "ckptfix.ops.prefixes",
    "align_state_dict": "ckptfix.ops.prefixes",
    "strip_prefix_checkpoint": "ckptfix.ops.rewrite.keys",
    "add_prefix_checkpoint": "ckptfix.ops.rewrite.keys",
    "align_checkpoint": "ckptfix.ops.rewrite.keys",
    "convert_to_safetensors": "ckptfix.ops.convert",
    "convert_from_safetensors": "ckptfix.ops.convert",
    "sanitize_checkpoint": "ckptfix.ops.sanitize",
    "diff": "ckptfix.ops.diff",
    "DiffReport": "ckptfix.ops.diff",
    "OutputOptions": "ckptfix.files.outputs",
    "ConvertOptions": "ckptfix.ops.convert",
    "visible_gpus": "ckptfix.gpu",
    "pick_gpu": "ckptfix.gpu",
    "choose_gpus": "ckptfix.gpu",
}

__all__ = sorted(_LAZY) + ["__version__"]

# what type checkers see (`X as X`: an explicit re-export): the names of _LAZY (tests/test_public_api.py checks)
if TYPE_CHECKING:
    from ckptfix.files.outputs import OutputOptions as OutputOptions
    from ckptfix.formats import read_checkpoint as read_checkpoint
    from ckptfix.gpu import choose_gpus as choose_gpus
    from ckptfix.gpu import pick_gpu as pick_gpu
    from ckptfix.gpu import visible_gpus as visible_gpus
    from ckptfix.ops.convert import ConvertOptions as ConvertOptions
    from ckptfix.ops.convert import convert_from_safetensors as convert_from_safetensors
    from ckptfix.ops.convert import convert_to_safetensors as convert_to_safetensors
    from ckptfix.ops.diff import DiffReport as DiffReport
    from ckptfix.ops.diff import diff as diff
    from ckptfix.ops.inspect import inspect_checkpoint as inspect_checkpoint
    from ckptfix.ops.inspect import scan_checkpoint as scan_checkpoint
    from ckptfix.ops.load import LoadedCheckpoint as LoadedCheckpoint
    from ckptfix.ops.load import load_anywhere as load_anywhere
    from ckptfix.ops.load import load_checkpoint as load_checkpoint
    from ckptfix.ops.prefixes import add_prefix as add_prefix
    from ckptfix.ops.prefixes import align_state_dict as align_state_dict
    from ckptfix.ops.prefixes import detect_prefixes as detect_prefixes
    from ckptfix.ops.prefixes import strip_prefix as strip_prefix
    from ckptfix.ops.rewrite.keys import add_prefix_checkpoint as add_prefix_checkpoint
    from ckptfix.ops.rewrite.keys import align_checkpoint as align_checkpoint
    from ckptfix.ops.rewrite.keys import strip_prefix_checkpoint as strip_prefix_checkpoint
    from ckptfix.ops.sanitize import sanitize_checkpoint as sanitize_checkpoint


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckptfix' has no attribute {name!r}")
    if mod in (
        "ckptfix.formats",
        "ckptfix.ops.convert",
    ):  # read a folder: ckptfix.formats.layouts registers the checkpoint-N/
        importlib.import_module("ckptfix.formats.layouts")  # hint of formats.sniff (the others import it themselves)
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
