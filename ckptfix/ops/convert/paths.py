"""Output paths of a conversion: default names, shard names, checks before anything is read."""

from __future__ import annotations

import os
import re
from typing import Sequence

from ckptfix.display import already_exists, missing_directory, not_writable, output_is_input
from ckptfix.errors import OutputError
from ckptfix.files.atomic import new_temp, same_file

_PTH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".tar", ".pkl")


def default_output(src: str, suffix: str) -> str:
    """``<stem><suffix>`` next to ``src`` (``.pth``/``.safetensors``/``.index.json`` endings dropped).

    Args:
        src: the input file, index or directory.
        suffix: the new ending (``".safetensors"``, ``".pth"``).

    Returns:
        The path.
    """
    s = os.path.abspath(src).rstrip(os.sep)
    base = os.path.basename(s)
    if base.endswith(".index.json"):
        base = base[: -len(".index.json")]
    stem, ext = os.path.splitext(base)
    if ext.lower() in _PTH_SUFFIXES + (".safetensors",):
        base = stem
    return os.path.join(os.path.dirname(s), base + suffix)


def default_st_output(src: str) -> str:
    """``model.safetensors`` for a Hugging Face ``pytorch_model*.bin`` (or its index / folder).

    Anything else: ``<stem>.safetensors`` next to the input.

    Args:
        src: the input file, index or directory.

    Returns:
        The path.
    """
    s = os.path.abspath(src).rstrip(os.sep)
    if os.path.isdir(s):
        if os.path.isfile(os.path.join(s, "pytorch_model.bin.index.json")):
            return os.path.join(s, "model.safetensors")
        return default_output(src, ".safetensors")
    base = os.path.basename(s)
    if re.fullmatch(r"pytorch_model(-\d+-of-\d+)?\.bin(\.index\.json)?", base):
        return os.path.join(os.path.dirname(s), "model.safetensors")
    return default_output(src, ".safetensors")


def shard_names(dst: str, n: int) -> list[str]:
    """``stem-0000k-of-0000N.safetensors`` for each of ``n`` shards of ``dst``.

    Args:
        dst: the unsharded output name.
        n: the number of shards.

    Returns:
        The shard paths, in order.
    """
    d, base = os.path.split(dst)
    stem = base[: -len(".safetensors")] if base.endswith(".safetensors") else os.path.splitext(base)[0]
    return [os.path.join(d, f"{stem}-{i:05d}-of-{n:05d}.safetensors") for i in range(1, n + 1)]


def check_outputs(paths: Sequence[str], src: str, force: bool) -> None:
    """Refuse outputs that would lose data or cannot be written, before anything is read.

    Args:
        paths: the files to be written.
        src: the input.
        force: existing outputs may be replaced.

    Raises:
        OutputError: an output is the input, a directory, exists (without ``force``), or its
            directory is missing or not writable.
    """
    for p in paths:
        if same_file(p, src) or _is_part_of(p, src):
            raise OutputError(output_is_input(p))
        if os.path.isdir(p):
            raise OutputError(f"{p}: is a directory; pass a file name with -o")
        if p.endswith(("/", os.sep)):
            raise OutputError(f"{p}: names a directory (it ends with a slash); pass a file name with -o")
        if os.path.lexists(p) and not force:
            raise OutputError(already_exists(p))
        d = os.path.dirname(os.path.abspath(p))
        if not os.path.isdir(d):
            raise OutputError(missing_directory(d))
        if not os.access(d, os.W_OK):
            raise OutputError(not_writable(d))


def _is_part_of(p: str, src: str) -> bool:
    """Whether the existing file ``p`` is one the input is made of: a file inside the input folder (DCP, sharded,
    a framework's), or a shard or the index of a sharded input.  ``--force`` never replaces those."""
    if not os.path.lexists(p):
        return False
    real = os.path.realpath(p)
    if os.path.isdir(src):
        return real.startswith(os.path.realpath(src).rstrip(os.sep) + os.sep)
    if src.endswith(".index.json"):
        folder = os.path.realpath(os.path.dirname(os.path.abspath(src)))
        if os.path.dirname(real) != folder:
            return False
        try:
            from ckptfix.formats.sharded import load_index

            shards = {os.path.realpath(f) for f in load_index(src).shards.values()}
        except Exception:  # noqa: BLE001 - an unreadable index: any file beside it may be a shard
            return True
        return real in shards
    return False


def temp_for(final: str) -> str:
    """A new, empty temp file beside ``final`` (removed by the caller, or renamed over ``final``).

    Args:
        final: the output path.

    Returns:
        The temp file's path.
    """
    fd, tmp = new_temp(final)
    os.close(fd)
    return tmp
