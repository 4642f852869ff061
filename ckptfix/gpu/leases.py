"""GPU leases: one lock file per GPU so that concurrent pickers of one user do not collide.

Leases: one file per GPU UUID in the lease directory (``$CKPTFIX_LEASE_DIR``,
else ``$XDG_RUNTIME_DIR/ckptfix-leases``, else ``$TMPDIR/ckptfix-leases-<uid>``, else
``/tmp/ckptfix-leases-<uid>``), created 0700 and refused when another user owns it or can
write to it; lease files are opened ``O_NOFOLLOW | O_CLOEXEC`` relative to the checked
directory and only rewritten once locked and known to hold a lease record.
A picker takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the file; a GPU whose file is
locked by someone else is leased.  A lease either *holds* the lock (for the life
of a command run under ``pick-gpu --``, or of the Python process that called
:func:`ckptfix.gpu.pick_gpu`), or writes an expiry time into the file and lets go of the
lock (``--lease SECONDS``: a lock cannot outlive the CLI process); a later
picker treats a file with an unexpired time as leased.  A lease the calling
process already holds (an earlier :func:`ckptfix.gpu.pick_gpu`) is its own: picking that GPU
again reuses it.  Leases coordinate the jobs of one user on one machine; other users' jobs show up as
used memory.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from ckptfix.errors import OutputError

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "LEASE_TOKEN_ENV",
    "Lease",
    "Released",
    "lease_dir",
    "lease_file",
    "open_lease_dir",
    "try_lease",
    "release_leases",
    "held_lease",
    "is_held",
    "hold_for_process",
    "undo",
]

DEFAULT_LEASE_SECONDS = 120.0
_HELD: list[Lease] = []  # leases held for the life of this Python process (pick_gpu in-process)

LEASE_TOKEN_ENV = "CKPTFIX_LEASE_TOKEN"
#: set by ``pick-gpu -- COMMAND``: the GPU ids whose lease COMMAND (and its children) hold through the inherited lock
LEASES_HELD_ENV = "CKPTFIX_LEASES_HELD"
_LEASE_SCHEMA = "ckptfix.lease/1"

#: a path argument: a ``str`` or an ``os.PathLike`` (the lease paths this module returns are ``str``)
StrPath = Union[str, "os.PathLike[str]"]


def _dir(directory: StrPath) -> str:
    """``directory`` as :mod:`pathlib` spells it (no ``.`` components, no repeated or trailing slashes)."""
    return str(Path(directory))


def _join(directory: str, name: str) -> str:
    return str(Path(directory) / name)


def lease_dir(env: Mapping[str, str] | None = None) -> str:
    """Where GPU leases live: ``$CKPTFIX_LEASE_DIR``, else ``$XDG_RUNTIME_DIR/ckptfix-leases`` (when that
    directory exists), else ``$TMPDIR/ckptfix-leases-<uid>``, else ``/tmp/ckptfix-leases-<uid>``.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The directory (not created or checked here: :func:`try_lease` does both).
    """
    env = os.environ if env is None else env
    if env.get("CKPTFIX_LEASE_DIR"):
        return _dir(env["CKPTFIX_LEASE_DIR"])
    if env.get("XDG_RUNTIME_DIR") and os.path.isdir(env["XDG_RUNTIME_DIR"]):
        return _join(_dir(env["XDG_RUNTIME_DIR"]), "ckptfix-leases")
    tmp = env.get("TMPDIR")
    base = _dir(tmp) if tmp and os.path.isabs(tmp) and os.path.isdir(tmp) else "/tmp"
    return os.path.join(base, f"ckptfix-leases-{os.getuid()}")


_SAFE_NAME = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def _lease_name(key: str) -> str:
    """``key`` with every character but ASCII letters, digits, ``.``, ``_`` and ``-`` as ``_``, plus ``.lease``."""
    return "".join(c if c in _SAFE_NAME else "_" for c in key) + ".lease"


def lease_file(directory: StrPath, key: str) -> str:
    """The lease file of GPU ``key``."""
    return _join(_dir(directory), _lease_name(key))


def _unsafe_dir(directory: str, why: str) -> OutputError:
    return OutputError(
        f"refusing the GPU lease directory {directory}: {why}; another user could plant files in it. Fix: "
        f"`chmod 700 {directory}` if it is yours, else remove it (or set CKPTFIX_LEASE_DIR to a directory only "
        "you can write)"
    )


def open_lease_dir(directory: StrPath) -> int:
    """Create ``directory`` (mode 0700) if missing, check it like ssh checks ``~/.ssh``, and open it.

    Refused: a directory (or a symlink to one) not owned by the current user, and one that is group- or
    world-writable.  Lease files are then opened relative to the returned descriptor, so a directory
    swapped after the check is never used.

    Raises:
        OutputError: the directory cannot be created or opened, or is unsafe (exit code 9).
    """
    directory = _dir(directory)
    uid = os.getuid()
    try:
        if not os.path.lexists(directory):
            parent = os.path.dirname(directory) or "."
            if not os.path.isdir(parent):
                os.makedirs(parent, mode=0o700, exist_ok=True)
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                pass  # a concurrent picker made it: checked below like any other
        lst = os.lstat(directory)
        if os.path.islink(directory) and lst.st_uid != uid:
            raise _unsafe_dir(directory, f"it is a symlink owned by uid {lst.st_uid}, not you (uid {uid})")
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OutputError:
        raise
    except OSError as e:
        raise _lease_dir_error(directory, e) from None
    st = os.fstat(fd)
    problem = None
    if st.st_uid != uid:
        problem = f"it is owned by uid {st.st_uid}, not you (uid {uid})"
    elif st.st_mode & 0o022:
        problem = f"it is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem:
        os.close(fd)
        raise _unsafe_dir(directory, problem)
    return fd


def _open_lease_file(dfd: int, directory: str, key: str) -> tuple[int, bool]:
    """Open (or create) the lease file of ``key`` without following links; ``(fd, created)``."""
    name = _lease_name(key)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    created = False
    try:
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
            created = True
        except FileExistsError:
            fd = os.open(name, flags, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            path = _join(directory, name)
            raise OutputError(
                f"GPU lease file {path} is a symlink, which ckptfix never follows (someone planted "
                f"it): remove it (`rm {path}`) and check who can write to {directory}"
            ) from None
        raise _lease_dir_error(directory, e) from None
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif st.st_uid != os.getuid():
        why = f"is owned by uid {st.st_uid}, not you"
    elif st.st_nlink != 1:
        why = f"has {st.st_nlink} hard links (a link to another file?)"
    if why:
        os.close(fd)
        raise OutputError(
            f"GPU lease file {_join(directory, name)} {why}: ckptfix will not write to it; remove it and "
            f"check who can write to {directory}"
        )
    return fd, created


@dataclass
class Lease:
    """A lease on one GPU.  ``fd`` is open (and flock'ed) while the lease is *held*."""

    key: str
    path: str
    fd: int | None
    expires: float | None
    token: str | None = None
    warning: str | None = None  # e.g. the lease file was corrupt and was taken as stale

    def release(self) -> None:
        """Give the lease back now (a held lease: empty the file and drop the lock)."""
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None

    def to_dict(self) -> dict[str, Any]:
        """The lease in ``pick-gpu --json``."""
        return {"key": self.key, "path": str(self.path), "held": self.fd is not None, "expires": self.expires}


def _read_info(fd: int) -> dict[str, Any] | None:
    """The lease record in ``fd``: ``{}`` for an empty file, ``None`` for something that is not a lease."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 4097)
    except OSError:
        return None
    if not data.strip():
        return {}
    import json  # here, not at the top: pick-gpu's start-up when no lease is read

    try:
        info = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) and "key" in info and "pid" in info else None


def _peek(fd: int) -> str:
    """The start of a lease file's content, for a warning."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 41)
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    shown = repr(data[:40])[2:-1] + ("..." if len(data) > 40 else "")
    return f"{os.fstat(fd).st_size} bytes: {shown}"


def _start_time() -> int | None:
    """This process's start time in clock ticks since boot (Linux), so that a reused PID is not taken for us."""
    try:
        with open("/proc/self/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _is_this_process(info: dict[str, Any]) -> bool:
    """A record written by this very process (not another one with the same PID, host or container)."""
    return (
        info.get("pid") == os.getpid()
        and info.get("host") == os.uname().nodename
        and info.get("start") == _start_time()
    )


def _describe(info: dict[str, Any] | None) -> str:
    if info is None:
        return "a file that is not a ckptfix lease"
    who = f"pid {info.get('pid', '?')}"
    if _is_this_process(info):
        who = f"this process, {who}"
    if info.get("host"):
        who += f" on {info['host']}"
    exp = info.get("expires")
    if isinstance(exp, (int, float)):
        who += f", until {time.strftime('%H:%M:%S', time.localtime(exp))}"
    return who


def try_lease(
    directory: StrPath,
    key: str,
    seconds: float | None,
    *,
    now: float | None = None,
    token: str | None = None,
) -> tuple[Lease | None, str]:
    """Try to lease GPU ``key``.  ``seconds=None``: hold the lock (returned fd open, close-on-exec);
    ``seconds>0``: write an expiry and let go of the lock; ``seconds==0``: only check.

    A timed lease whose record carries the same non-empty ``token`` (``$CKPTFIX_LEASE_TOKEN``, exported by
    ``pick-gpu --export``) is the caller's own and is taken over.  Lease files are opened with
    ``O_NOFOLLOW | O_CLOEXEC``, created with ``O_EXCL``, and an existing file is only rewritten once it is
    locked (a regular file of the caller's, one link, in the private lease directory).  One that holds no lease
    record (a write cut short, stray bytes) is a stale lease: taken, with :attr:`Lease.warning` saying so.

    Args:
        directory: lease directory (created 0700; refused if another user owns it or can write to it).
        key: the GPU id (UUID or MIG UUID).
        seconds: lease length, see above.
        now: the time to compare expiries with (tests).
        token: the caller's lease token, if any.

    Returns:
        ``(lease, "")`` or ``(None, who_holds_it)``.

    Raises:
        OutputError: the directory or the lease file is unusable or unsafe (exit code 9).
    """
    directory = _dir(directory)
    path = lease_file(directory, key)
    dfd = open_lease_dir(directory)
    try:
        fd, _created = _open_lease_file(dfd, directory, key)
    finally:
        os.close(dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        info = _read_info(fd)
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return None, _describe(info) + " (running)"
        raise _lease_dir_error(directory, e) from None
    now = time.time() if now is None else now
    info = _read_info(fd)  # also when we created it: another picker may have locked, written and let go first
    warning = None
    if info is None:
        # we hold its lock in our private lease directory and it is no lease record (a write cut short by a full
        # disk or a crash, stray bytes): a stale lease, not a reason to block every picker until removed by hand
        warning = f"GPU lease file {path} was corrupt ({_peek(fd)}): taken as a stale lease" + (
            " and rewritten" if seconds != 0 else ""
        )
        info = {}
    exp = info.get("expires")
    own = _is_this_process(info) or (token is not None and token != "" and info.get("token") == token)
    if isinstance(exp, (int, float)) and exp > now and not own:
        os.close(fd)
        return None, _describe(info)
    if seconds == 0:
        os.close(fd)
        return Lease(key, path, None, None, token, warning), ""
    expires = None if seconds is None else now + seconds
    record = {
        "schema": _LEASE_SCHEMA,
        "key": key,
        "pid": os.getpid(),
        "host": os.uname().nodename,
        "start": _start_time(),
        "created": now,
        "expires": expires,
        "token": token,
    }
    os.ftruncate(fd, 0)  # locked, and ours: a new file or a ckptfix lease record
    os.lseek(fd, 0, os.SEEK_SET)
    import json

    os.write(fd, json.dumps(record).encode())
    if seconds is None:
        return Lease(key, path, fd, None, token, warning), ""
    os.close(fd)  # the expiry in the file is the lease now
    return Lease(key, path, None, expires, token, warning), ""


@dataclass(frozen=True)
class Released:
    """One lease :func:`release_leases` looked at."""

    key: str
    released: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        """One entry of ``pick-gpu --release --json``."""
        return {"key": self.key, "released": self.released, "why": self.why}


def release_leases(directory: StrPath, *, token: str | None = None, now: float | None = None) -> list[Released]:
    """Give back timed leases (``pick-gpu --release``).

    With ``token`` only the leases taken with that token (this shell's ``pick-gpu --export``); without,
    every unexpired timed lease in ``directory`` (all of them are the current user's).  A lease held by a
    running command (locked) is never touched: it ends when the command does.

    Args:
        directory: the lease directory.
        token: only release leases carrying this token.
        now: the time (tests).

    Raises:
        OutputError: the directory is unsafe or unusable (exit code 9).
    """
    now = time.time() if now is None else now
    directory = _dir(directory)
    if not os.path.lexists(directory):
        return []
    dfd = open_lease_dir(directory)
    out: list[Released] = []
    try:
        for name in sorted(os.listdir(dfd)):
            if not name.endswith(".lease"):
                continue
            try:
                fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    holder = _read_info(fd) or {}
                    if not token or holder.get("token") == token:
                        key = str(holder.get("key", name[:-6]))
                        out.append(Released(key, False, f"held by a running command ({_describe(holder)}): stop it"))
                    continue
                info = _read_info(fd)
                if not info:
                    continue
                exp = info.get("expires")
                if not isinstance(exp, (int, float)) or exp <= now:
                    continue
                if token and info.get("token") != token:
                    continue
                os.ftruncate(fd, 0)
                out.append(Released(str(info.get("key")), True, f"was leased by {_describe(info)}"))
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    return out


def held_lease(path: StrPath) -> Lease | None:
    """The lease on ``path`` this process holds for its lifetime (from an earlier pick_gpu()), if any.

    Returns:
        The held :class:`Lease`, or ``None``.
    """
    path = _dir(path)  # as lease_file spells it (pathlib paths compared equal however they were written)
    for le in _HELD:
        if le.fd is not None and le.path == path:
            return le
    return None


def _lease_dir_error(directory: str, e: OSError) -> OutputError:
    return OutputError(
        f"cannot take a GPU lease in {directory} ({e.strerror or e}): set CKPTFIX_LEASE_DIR to a writable local "
        "directory (file locks need a local filesystem)"
    )


def hold_for_process(leases: Sequence[Lease]) -> None:
    """Keep held leases open until this Python process exits.

    Args:
        leases: leases from :func:`try_lease`; those not holding a lock are ignored.
    """
    _HELD.extend(le for le in leases if le.fd is not None and not any(le is h for h in _HELD))


def is_held(lease: Lease) -> bool:
    """Whether ``lease`` is one this process holds for its lifetime (:func:`hold_for_process`).

    Returns:
        True if held for the process.
    """
    return any(lease is h for h in _HELD)


def undo(lease: Lease, *, lock_timeout: float = 2.0) -> None:
    """Give back a lease taken during a pick that then fell short.

    An expiry lease's file may be locked at this instant by another picker reading it (for
    microseconds: it sees our expiry and lets go), so wait up to ``lock_timeout`` for the lock
    rather than leave the GPU reserved until the expiry.
    """
    if lease.fd is not None:
        lease.release()
        return
    try:
        fd = os.open(lease.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return
    try:
        deadline = time.monotonic() + lock_timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES) or time.monotonic() >= deadline:
                    return  # it expires on its own
                time.sleep(0.005)
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and _is_this_process(_read_info(fd) or {}):
            os.ftruncate(fd, 0)
    except OSError:
        pass
    finally:
        os.close(fd)
