"""Folders that training frameworks write, as inputs: the detection and its handlers, in one namespace.

A user of transformers' ``Trainer``, accelerate or Lightning holds the *folder* the framework wrote
(``checkpoint-500/``, ``save_state``'s directory, a ModelParallel/FSDP directory), not a plain file.
The parts sit at the layer of what they do (docs/architecture.md), so that every import points down:

- :mod:`ckptfix.formats.layouts` (layer 3): the detection.  :func:`resolve` tells the layout from the names in
  the folder (nothing is unpickled to decide) and returns a :class:`Resolved`; :data:`LAYOUTS` holds one
  :class:`Layout` per layout (:func:`register` adds one); the other files' roles and summaries.
- :mod:`ckptfix.ops.inspect` (``inspect_folder``), :mod:`ckptfix.ops.scan` (a folder's every pickle) and
  :mod:`ckptfix.ops.load` (``load_folder``): the handlers of ``inspect``, ``scan`` and ``load_checkpoint``.
- :mod:`ckptfix.ops.convert.folders` (layer 4): ``convert FOLDER``.

This module only re-exports them (nothing in the package imports it): library users and the tests keep
one place to import from.  Nothing here imports torch.
"""

from __future__ import annotations

from ckptfix.formats.layouts import (
    LAYOUTS,
    FolderFile,
    Layout,
    Resolved,
    check_inside,
    checkpoint_subfolders,
    describe_file,
    describe_files,
    identify_object,
    lightning_meta,
    optimizer_summary,
    register,
    resolve,
)
from ckptfix.formats.roles import SIDECAR_ROLES, WEIGHT_NAMES, file_role, is_sidecar_name
from ckptfix.ops.convert.folders import convert_folder, default_output, meta_extras
from ckptfix.ops.inspect import inspect_folder
from ckptfix.ops.load import load_folder

__all__ = [
    "LAYOUTS",
    "SIDECAR_ROLES",
    "WEIGHT_NAMES",
    "FolderFile",
    "Layout",
    "Resolved",
    "check_inside",
    "checkpoint_subfolders",
    "convert_folder",
    "default_output",
    "describe_file",
    "describe_files",
    "file_role",
    "identify_object",
    "inspect_folder",
    "is_sidecar_name",
    "lightning_meta",
    "load_folder",
    "meta_extras",
    "optimizer_summary",
    "register",
    "resolve",
]
