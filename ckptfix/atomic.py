"""Atomic file output: write to a temp file in the target directory, then rename into place.

A reader never sees a half-written file under the final name; an interrupted
write leaves the old file (or nothing) there.  With ``fsync=True`` the data and
the directory entry are flushed to disk before and after the rename, which is
what a rewrite that replaces the user's own file needs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from typing import BinaryIO, Callable, Iterator

from ckptfix.errors import OutputError


def _os_error(e: OSError, path: str) -> OutputError:
    if e.errno == errno.ENOSPC:
        return OutputError(f"{path}: no space left on the device; free space or write elsewhere with -o")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"{path}: permission denied ({e.strerror}); choose a writable location with -o")
    if e.errno == errno.ENOENT:
        return OutputError(f"{path}: the output directory does not exist; create it or choose another with -o")
    return OutputError(f"{path}: cannot write ({e.strerror or e})")


def fsync_dir(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path)) or "."
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def new_temp(path: str) -> tuple[int, str]:
    """(fd, name) of a temp file next to ``path``, with the mode the final file should have.

    mkstemp creates files 0600; the result gets the mode of the file it replaces, or the
    usual ``0666 & ~umask`` for a new file.
    """
    path = os.path.abspath(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                   dir=os.path.dirname(path))
    except OSError as e:
        raise _os_error(e, path) from None
    try:
        mode = os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.fchmod(fd, mode)
    return fd, tmp


@contextlib.contextmanager
def atomic_output(path: str, *, fsync: bool = False,
                  before_replace: Callable[[str], None] | None = None) -> Iterator[BinaryIO]:
    """``with atomic_output("out.pth") as f: f.write(...)`` -- renamed into place only on success.

    ``before_replace(temp_path)`` runs once the data is written (and fsynced), before the rename:
    it verifies the written file and may raise, in which case the temp file is removed and
    ``path`` is left as it was.
    """
    path = os.path.abspath(path)
    fd, tmp = new_temp(path)
    f = os.fdopen(fd, "w+b")
    try:
        try:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        finally:
            f.close()
        if before_replace is not None:
            before_replace(tmp)
        os.replace(tmp, path)
        if fsync:
            fsync_dir(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OutputError):
            raise
        raise _os_error(e, path) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def free_backup_name(path: str) -> str:
    cand = path + ".bak"
    i = 1
    while os.path.lexists(cand):
        cand = f"{path}.bak{i}"
        i += 1
    return cand


def make_backup(path: str) -> str:
    """Keep the current ``path`` as ``path.bak`` (a hard link when possible: instant, no copy)."""
    dst = free_backup_name(path)
    try:
        os.link(path, dst)
    except OSError:
        import shutil

        try:
            shutil.copy2(path, dst)
        except OSError as e:
            raise _os_error(e, dst) from None
    return dst
