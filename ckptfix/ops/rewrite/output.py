"""Where a rewrite writes, and writing it atomically: temp file, check, backup, rename."""

from __future__ import annotations

import os
from typing import Any, Callable

from ckptfix.display import already_exists, output_is_input
from ckptfix.errors import OutputError
from ckptfix.files.atomic import atomic_output, make_backup, same_file
from ckptfix.files.outputs import OutputOptions, refuse_misnamed
from ckptfix.formats.base import Format


def default_output(src: str, suffix: str, fmt_out: str) -> str:
    """``<stem>.<suffix><ext>`` next to ``src`` (``.safetensors`` for safetensors output).

    Args:
        src: the input.
        suffix: the inserted word (``"fixed"``).
        fmt_out: the output format.

    Returns:
        The path.
    """
    base, ext = os.path.splitext(src)
    if fmt_out == Format.SAFETENSORS:
        ext = ".safetensors"
    return f"{base}.{suffix}{ext or '.pt'}"


def _stem(path: str | None) -> str:
    return os.path.splitext(path or "")[0]


def prepare_output(src: str, outputs: OutputOptions, *, fmt_out: str, notes: list[str]) -> tuple[str, bool]:
    """(the path to write, whether to fsync) for a rewrite of ``src``; refuses outputs that would lose data.

    With ``in_place`` the file a symlink points to is the target (the link stays a link) and fsync is
    on by default; a hard-linked input gets a note (its other names keep the old contents).

    Args:
        src: the input.
        outputs: ``output``, ``in_place``, ``force``, ``suffix`` (the default name ``<stem>.<suffix><ext>``)
            and ``fsync`` (None: on for ``in_place``).
        fmt_out: the output format, for the default name's extension.
        notes: the report's notes, appended to.

    Returns:
        ``(path, fsync)``.

    Raises:
        OutputError: the output is the input (without ``in_place``), a directory, or exists without ``force``.
    """
    output, force, suffix, fsync = outputs.output, outputs.force, outputs.suffix or "fixed", outputs.fsync
    if outputs.in_place:
        dst = os.path.realpath(src)
        links = os.stat(dst).st_nlink
        if links > 1:
            notes.append(
                f"{src} had {links} hard links; the other names still hold the old contents "
                "(an atomic replace gives this name a new file)"
            )
        return dst, True if fsync is None else bool(fsync)
    dst = output or default_output(src, suffix, fmt_out)
    if same_file(dst, src):
        raise OutputError(output_is_input(dst, in_place="replace it"))
    if fmt_out == Format.SAFETENSORS:
        fix = (
            f"a rewrite keeps the input's format: name it {_stem(output)}.safetensors, "
            f"or write a torch file with ckptfix convert {src} --to pt"
        )
    else:
        fix = (
            f"a rewrite keeps the input's format: name it {_stem(output)}.pt, "
            f"or write safetensors with ckptfix convert {src} -o {output}"
        )
    refuse_misnamed(output, "safetensors" if fmt_out == Format.SAFETENSORS else "torch", fix)
    if os.path.isdir(dst) or dst.endswith(("/", os.sep)):
        what = "is a directory" if os.path.isdir(dst) else "names a directory (it ends with a slash)"
        raise OutputError(
            f"{dst} {what}; pass a file name with -o (e.g. "
            f"{os.path.join(dst, os.path.basename(default_output(src, suffix, fmt_out)))})"
        )
    if os.path.exists(dst) and not force:
        raise OutputError(already_exists(dst))
    return dst, bool(fsync)


def write_atomic(
    dst: str,
    write: Callable[[Any], None],
    check: Callable[[str], None] | None,
    *,
    fsync: bool,
    backup_of: str | None = None,
) -> str | None:
    """Write ``dst`` through a temp file: ``write(f)``, then ``check(temp_path)``, then the backup, then the rename.

    Args:
        dst: the final path.
        write: writes the content to the open temp file.
        check: verifies the written temp file (raises to stop the rename), or None.
        fsync: flush file and directory around the rename.
        backup_of: keep this file as ``<path>.bak`` just before it is replaced (``--in-place``).

    Returns:
        The backup path, or None.

    Raises:
        OutputError: the file cannot be written or renamed; whatever ``write`` or ``check`` raise
            (then nothing is renamed and no backup made).
    """
    made: list[str] = []

    def before_replace(tmp: str) -> None:
        if check is not None:
            check(tmp)
        if backup_of is not None:
            made.append(make_backup(backup_of))

    with atomic_output(dst, fsync=fsync, before_replace=before_replace) as f:
        write(f)
    return made[0] if made else None
