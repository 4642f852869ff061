"""Atomic file output: write to a temp file in the target directory, then rename into place.

A reader never sees a half-written file under the final name; an interrupted
write leaves the old file (or nothing) there.  With ``fsync=True`` the data and
the directory entry are flushed to disk before and after the rename, which is
what a rewrite that replaces the user's own file needs.

Temp files are named ``.<name>.ckptfix-XXXXXXXX.tmp`` and held under an exclusive ``flock``
while written; one left by a process that was killed is removed by the next ckptfix run that
writes in the same directory (:func:`clean_stale_temps`).  In-place rewrites keep at most two
backups (:func:`make_backup`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import tempfile
import threading
import time
from typing import BinaryIO, Callable, Iterator

from ckptfix.errors import OutputError
from ckptfix.files import pins


def output_error(e: OSError, path: str) -> OutputError:
    """The typed error of a failed write of ``path``: what went wrong (no space, permission, read-only, a missing
    folder) and the fix, as one line (exit 9).

    Args:
        e: what the write (or create, rename) raised; an :class:`OutputError` is returned as it is.
        path: the output it was for.
    """
    from ckptfix.display import cannot_create, missing_directory, permission_denied, shown_path

    if isinstance(e, OutputError):  # already says what went wrong
        return e
    if e.errno == errno.ENOSPC:
        return OutputError(f"{shown_path(path)}: no space left on the device; free space or write elsewhere with -o")
    if e.errno in (errno.EACCES, errno.EPERM):
        return OutputError(permission_denied(path))
    if e.errno == errno.EROFS:
        return OutputError(f"{shown_path(path)}: read-only file system; -o to choose a writable location")
    if e.errno == errno.ENOENT:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            return OutputError(missing_directory(parent))
        return OutputError(cannot_create(path))
    return OutputError(f"{shown_path(path)}: cannot write ({e.strerror or e})")


def fsync_dir(path: str) -> None:
    """Flush the directory holding ``path`` to disk, so a rename into it survives a crash (best effort)."""
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


#: temp files are ``.<final name>.ckptfix-<8 random chars>.tmp`` next to the output
TEMP_MARK = ".ckptfix-"
_TEMP_RE = re.compile(r"\.(?P<final>.+)\.ckptfix-[a-z0-9_]{8}\.tmp")
#: a temp file younger than this is never removed (its writer may be between creating and locking it)
STALE_AFTER_S = 10.0

#: temp path -> a descriptor holding ``flock(LOCK_EX)`` on it while this process may write it
_locks: dict[str, int] = {}
_locks_mutex = threading.Lock()


def _lock_temp(tmp: str) -> None:
    """Hold an exclusive flock on ``tmp`` (on its own descriptor) until it is renamed or removed."""
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return
    with _locks_mutex:
        _locks[tmp] = fd


def release_temp(tmp: str | None = None) -> None:
    """Drop the lock on ``tmp`` (after it was renamed or removed); with ``None``, on every temp that is gone.

    Locks are also released when the process exits, which is what makes a left-over temp file
    recognisable as stale (see :func:`clean_stale_temps`).

    Args:
        tmp: the temp file from :func:`new_temp`, or ``None`` for every locked temp that no longer exists.
    """
    with _locks_mutex:
        names = [tmp] if tmp is not None else [t for t in _locks if not os.path.lexists(t)]
        fds = [_locks.pop(t) for t in names if t in _locks]
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def clean_stale_temps(directory: str, *, now: float | None = None) -> list[str]:
    """Remove ckptfix temp files in ``directory`` left by a process that died while writing.

    A file is removed only when all of these hold: its name is exactly ckptfix's temp naming
    (``.<name>.ckptfix-XXXXXXXX.tmp``), it is a regular file owned by this user, it is older than
    :data:`STALE_AFTER_S`, and an exclusive ``flock`` on it succeeds at once -- every ckptfix writer
    holds that lock until it renames or removes its temp, so a lock that can be taken means its
    writer is gone.

    Args:
        directory: where to look (an unreadable directory is skipped).
        now: the current time (default ``time.time()``), for the age test.
    """
    release_temp()
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not _TEMP_RE.fullmatch(name):
            continue
        path = os.path.join(directory, name)
        with _locks_mutex:
            if path in _locks:
                continue  # ours, still being written
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or now - st.st_mtime < STALE_AFTER_S:
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            cur = os.lstat(path)
            if (cur.st_dev, cur.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def new_temp(path: str) -> tuple[int, str]:
    """(fd, name) of a temp file next to ``path``, with the mode the final file should have.

    The temp file is created 0600; the result gets the mode of the file it replaces, or the
    usual ``0666 & ~umask`` for a new file.  The temp file is locked (``flock``) until it is
    renamed or removed, and stale temps of dead writers in the same directory are removed first.

    Returns:
        ``(fd, temp_path)``; the caller closes ``fd`` and calls :func:`release_temp` when done.

    Raises:
        OutputError: the temp file cannot be created (no space, permission denied, no such directory).
    """
    path = os.path.abspath(path)
    clean_stale_temps(os.path.dirname(path))
    try:
        fd, tmp = tempfile.mkstemp(".tmp", f".{os.path.basename(path)}{TEMP_MARK}", os.path.dirname(path))
    except OSError as e:
        raise output_error(e, path) from None
    _lock_temp(tmp)
    try:
        mode = os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.fchmod(fd, mode)
    return fd, tmp


def same_file(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` are the same file: one path, a symlink to it, or a hard link (same inode).

    Returns:
        ``False`` also when either does not exist.
    """
    try:
        return os.path.realpath(a) == os.path.realpath(b) or os.path.samefile(a, b)
    except OSError:
        return False


#: every output this process finished (renamed into place), oldest first: what an interrupted
#: command kept (the CLI names them after Ctrl-C).
FINISHED: list[str] = []


def note_finished(path: str) -> None:
    """Record that ``path`` was completely written and renamed into place (see :data:`FINISHED`)."""
    FINISHED.append(os.path.abspath(path))


@contextlib.contextmanager
def atomic_output(
    path: str, *, fsync: bool = False, before_replace: Callable[[str], None] | None = None
) -> Iterator[BinaryIO]:
    """``with atomic_output("out.pth") as f: f.write(...)`` -- renamed into place only on success.

    ``before_replace(temp_path)`` runs once the data is written (and fsynced), before the rename:
    it verifies the written file and may raise, in which case the temp file is removed and
    ``path`` is left as it was.

    Args:
        path: the final file.
        fsync: flush the data before the rename and the directory after it.
        before_replace: a check of the written temp file, run before the rename.

    Raises:
        OutputError: the temp file cannot be created, written or renamed (the message says why).
        Exception: whatever the ``with`` body or ``before_replace`` raises; the temp file is removed.
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
        pins.check_unchanged()
        os.replace(tmp, path)
        note_finished(path)
        if fsync:
            fsync_dir(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OutputError):
            raise
        raise output_error(e, path) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        release_temp(tmp)


#: ``FICLONE`` (``_IOW(0x94, 9, int)``): share the source's extents copy-on-write (btrfs, XFS, bcachefs ...)
def copy_file_data(src: str, dst: str, *, fsync: bool = False) -> None:
    """Copy ``src`` to the new file ``dst`` without ever sharing storage the way a hard link does.

    A reflink (``FICLONE``) where the file system supports it (instant; the blocks are shared
    copy-on-write, so a later write to either file leaves the other intact), otherwise an in-kernel
    copy (``copy_file_range``, falling back per call to ``sendfile`` and to read/write).  The cost
    stays near ``cp``'s.  ``dst`` must not exist (``O_EXCL``); it gets ``src``'s permission bits.

    Raises:
        OSError: either file cannot be opened, read or written (``dst`` is removed again).
    """
    sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(sfd)
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, stat.S_IMODE(st.st_mode) or 0o644)
        try:
            from ckptfix.files.fileio import copy_file_data as copy_fd  # reflink, else in-kernel, per-call fallbacks

            copy_fd(sfd, dfd)
            if fsync:
                os.fsync(dfd)
        except BaseException:
            os.close(dfd)
            with contextlib.suppress(OSError):
                os.unlink(dst)
            raise
        os.close(dfd)
    finally:
        os.close(sfd)


def backup_name(path: str) -> str:
    """Where :func:`make_backup` keeps ``path``: ``path.bak`` if free, else ``path.bak1`` (replaced).

    So ``.bak`` holds the file as it was before the first in-place rewrite and ``.bak1`` as it was
    before the latest one; backups never pile up beyond those two.
    """
    first = path + ".bak"
    return first if not os.path.lexists(first) else path + ".bak1"


def make_backup(path: str) -> str:
    """Keep the current ``path`` as a backup (a hard link when possible: instant, no copy).

    The link is safe because it is made just before ``path`` itself is *replaced* by a rename: from
    then on the backup is the only name of the old inode and the new ``path`` shares nothing with it.
    Never link an output that lives on beside its input (see :func:`copy_file_data`).

    The first backup is ``path.bak`` and is never replaced; later ones go to ``path.bak1``,
    replacing the previous ``.bak1`` atomically.

    Raises:
        OutputError: the backup cannot be written.
    """
    dst = backup_name(path)
    fd, tmp = new_temp(dst)
    os.close(fd)
    try:
        os.unlink(tmp)
        try:
            os.link(path, tmp)
        except OSError:
            import shutil

            shutil.copy2(path, tmp)
        os.replace(tmp, dst)
        note_finished(dst)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise output_error(e, dst) from None
    finally:
        release_temp(tmp)
    return dst


def replace_directory(tmp: str, path: str, *, fsync: bool = True) -> None:
    """Move the complete directory ``tmp`` to ``path``, replacing a directory already there.

    The old ``path`` is first renamed aside (next to it), so ``path`` is at every moment either
    the old directory or the new one, never a mix; the old one is removed afterwards.  Every file
    in ``tmp`` should already be written and closed.

    Raises:
        OutputError: a rename fails (``path`` is left as it was).
    """
    import shutil

    path = os.path.abspath(path)
    old = None
    try:
        pins.check_unchanged()
        if os.path.lexists(path):
            name = os.path.basename(path)
            old = tempfile.mkdtemp(prefix=f".{name}{TEMP_MARK}", suffix=".old", dir=os.path.dirname(path))
            os.rename(path, os.path.join(old, "d"))
        try:
            os.replace(tmp, path)
        except OSError:
            if old is not None:
                os.rename(os.path.join(old, "d"), path)
            raise
        note_finished(path)
        if fsync:
            fsync_dir(path)
    except OSError as e:
        raise output_error(e, path) from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
