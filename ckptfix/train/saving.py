"""How the trainer writes a checkpoint: ``torch.save`` files and DCP directories, atomically.

A ``.pt`` file goes through :func:`ckptfix.files.atomic.atomic_output` (fsynced temp file renamed
into place); a DCP directory is written by every rank into ``<final>.tmp`` and moved into
place by rank 0 with :func:`ckptfix.files.atomic.replace_directory`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from typing import Any

import torch

from ckptfix.files.atomic import atomic_output, replace_directory
from ckptfix.train.devices import Dist


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


def atomic_torch_save(obj: Any, path: str, *, legacy: bool = False) -> None:
    """``torch.save`` into a temp file next to ``path``, fsynced, renamed into place.

    Args:
        obj: What to save.
        path: The final file.
        legacy: Use the pre-1.6 format (``_use_new_zipfile_serialization=False``).

    Raises:
        OutputError: the file cannot be written.
    """
    with atomic_output(path, fsync=True) as f:
        if legacy:
            torch.save(obj, f, _use_new_zipfile_serialization=False)
        else:
            torch.save(obj, f)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a fsynced temp file renamed into place.

    Raises:
        OutputError: the file cannot be written.
    """
    with atomic_output(path, fsync=True) as f:
        f.write(text.encode("utf-8"))


def dcp_temp(final: str) -> str:
    """The directory every rank writes a DCP checkpoint into before it is moved to ``final``."""
    return final + ".tmp"


def save_dcp(payload: dict[str, Any], final: str, dist: Dist) -> None:
    """Save ``payload`` as a DCP directory at ``final``; collective when a process group is up.

    Every rank writes its shards into :func:`dcp_temp`; after a barrier rank 0 moves the
    complete directory into place; a last barrier keeps every rank until it is there.

    Raises:
        OutputError: the directory cannot be moved into place.
    """
    import torch.distributed.checkpoint as dcp

    tmp = dcp_temp(final)
    if dist.is_main and os.path.exists(tmp):
        shutil.rmtree(tmp)
    dist.barrier()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": yes it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(payload, checkpoint_id=tmp, no_dist=not dist.enabled)
    dist.barrier()
    if dist.is_main:
        replace_directory(tmp, final)
    dist.barrier()


def remove_outputs(paths: list[str]) -> None:
    """Remove files or directories (and their DCP temp directories), ignoring those that are gone."""
    for p in paths:
        for q in (p, dcp_temp(p)):
            with contextlib.suppress(OSError):
                if os.path.isdir(q):
                    shutil.rmtree(q)
                elif q == p:
                    os.remove(q)
