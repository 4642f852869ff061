"""Choose the freest GPU(s), take leases so concurrent jobs do not collide, wait for GPUs.

Nothing here imports torch.

Ranking (pure, :func:`rank_gpus`): among the devices visible to the caller, drop
MIG parents, GPUs whose memory is unavailable, GPUs leased by another job and
those failing ``min_free_mib`` / ``max_util`` / ``max_procs``; sort the rest by
free memory (to the GiB, so 0 MiB and 292 MiB of residue tie), then utilization,
then process count, then nvidia-smi index.  Used memory with no visible process
(a process in another container) counts as one process.

Leases: one file per GPU UUID in the lease directory (``$CKPTFIX_LEASE_DIR``,
else ``$XDG_RUNTIME_DIR/ckptfix-leases``, else ``$TMPDIR/ckptfix-leases-<uid>``, else
``/tmp/ckptfix-leases-<uid>``), created 0700 and refused when another user owns it or can
write to it; lease files are opened ``O_NOFOLLOW | O_CLOEXEC`` relative to the checked
directory and only rewritten once locked and known to hold a lease record.
A picker takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the file; a GPU whose file is
locked by someone else is leased.  A lease either *holds* the lock (for the life
of a command run under ``pick-gpu --``, or of the Python process that called
:func:`pick_gpu`), or writes an expiry time into the file and lets go of the
lock (``--lease SECONDS``: a lock cannot outlive the CLI process); a later
picker treats a file with an unexpired time as leased.  A lease the calling
process already holds (an earlier :func:`pick_gpu`) is its own: picking that GPU
again reuses it.  Leases coordinate the
jobs of one user on one machine; other users' jobs show up as used memory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, MutableMapping, Sequence

from ckptfix.errors import CudaAlreadyInitializedError, GpuWaitTimeoutError, NoGpuError, NoGpuFitsError, OutputError
from ckptfix.gpu.visible import GpuView, VisibleGpu

__all__ = [
    "Criteria",
    "Ranked",
    "Rejected",
    "Lease",
    "PickResult",
    "parse_size_mib",
    "rank_gpus",
    "lease_dir",
    "try_lease",
    "choose_and_lease",
    "selection_env",
    "DEFAULT_LEASE_SECONDS",
]

DEFAULT_LEASE_SECONDS = 120.0
_HELD: list["Lease"] = []  # leases held for the life of this Python process (pick_gpu in-process)


# ----------------------------------------------------------------------------- criteria and ranking


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1024.0,  # a bare number is GiB
    "b": 1 / 1024**2,
    "k": 1 / 1024, "kb": 1 / 1024, "kib": 1 / 1024,
    "m": 1.0, "mb": 1.0, "mib": 1.0,
    "g": 1024.0, "gb": 1024.0, "gib": 1024.0,
    "t": 1024.0**2, "tb": 1024.0**2, "tib": 1024.0**2,
}


def parse_size_mib(text: str | int | float) -> int:
    """``"10GiB" -> 10240``, ``"512MiB" -> 512``, ``"1.5G" -> 1536``; a bare number means GiB.

    Raises ValueError on anything else.
    """
    if isinstance(text, (int, float)):
        return int(text * 1024)
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 10GiB, 512MiB, 24G)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Criteria:
    n: int = 1
    min_free_mib: int | None = None
    max_util: int | None = None
    max_procs: int | None = None


@dataclass(frozen=True)
class Ranked:
    gpu: VisibleGpu
    rank: int  # 1 = best
    effective_procs: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        g = self.gpu
        return {
            "rank": self.rank,
            "id": g.id,
            "uuid": g.uuid,
            "smi_index": g.smi_index,
            "cuda_index": g.cuda_index,
            "pci_bus_id": g.pci_bus_id,
            "name": g.name,
            "memory_free_mib": g.memory_free_mib,
            "memory_total_mib": g.memory_total_mib,
            "utilization_pct": g.utilization_pct,
            "process_count": g.process_count,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Rejected:
    gpu: VisibleGpu
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"uuid": self.gpu.uuid, "smi_index": self.gpu.smi_index, "name": self.gpu.name, "reason": self.reason}

    def __str__(self) -> str:
        return f"GPU {self.gpu.smi_index} ({self.gpu.name or '?'}): {self.reason}"


def _gib(mib: int | None) -> str:
    return "?" if mib is None else f"{mib / 1024:.1f} GiB"


def _effective_procs(g: VisibleGpu) -> int:
    procs = g.process_count or 0
    if procs == 0 and (g.hidden_used_mib or 0) > 0:
        return 1  # memory in use by a process we cannot see (another container / PID namespace)
    return procs


def _sort_key(g: VisibleGpu) -> tuple[int, int, int, int]:
    free_gib = (g.memory_free_mib or 0) // 1024
    util = g.utilization_pct if g.utilization_pct is not None else 101
    return (-free_gib, util, _effective_procs(g), g.smi_index)


def _why_before(a: VisibleGpu, b: VisibleGpu | None) -> str:
    if b is None:
        return "the only candidate left"
    ka, kb = _sort_key(a), _sort_key(b)
    if ka[0] != kb[0]:
        return f"more free memory than the next candidate GPU {b.smi_index} ({_gib(a.memory_free_mib)} vs {_gib(b.memory_free_mib)})"
    if ka[1] != kb[1]:
        return f"same free GiB as GPU {b.smi_index}, lower utilization ({a.utilization_pct}% vs {b.utilization_pct}%)"
    if ka[2] != kb[2]:
        return f"same free GiB and utilization as GPU {b.smi_index}, fewer processes ({ka[2]} vs {kb[2]})"
    return f"ties with GPU {b.smi_index} on free GiB, utilization and processes; lower nvidia-smi index"


def rank_gpus(
    devices: Sequence[VisibleGpu], criteria: Criteria, *, leased: Mapping[str, str] | None = None
) -> tuple[list[Ranked], list[Rejected]]:
    """Filter and order candidates (pure).  ``leased`` maps a GPU id to who holds it."""
    leased = leased or {}
    ok: list[VisibleGpu] = []
    rejected: list[Rejected] = []
    for g in devices:
        procs = _effective_procs(g)
        if g.mig_device is not None:
            rejected.append(Rejected(g, "a MIG device: its memory and utilization are not reported, cannot rank it"))
        elif g.mig_enabled:
            rejected.append(Rejected(g, "MIG is enabled: CUDA cannot use the whole GPU (pick one of its MIG devices)"))
        elif g.memory_free_mib is None or g.memory_total_mib is None:
            why = dict(g.unavailable).get("memory.free") or dict(g.unavailable).get("memory.total") or "missing"
            rejected.append(Rejected(g, f"memory is unavailable ([{why}])"))
        elif g.id in leased:
            rejected.append(Rejected(g, f"leased by another job ({leased[g.id]})"))
        elif criteria.min_free_mib is not None and g.memory_free_mib < criteria.min_free_mib:
            rejected.append(Rejected(g, f"{_gib(g.memory_free_mib)} free < --min-free {_gib(criteria.min_free_mib)}"))
        elif criteria.max_util is not None and g.utilization_pct is None:
            rejected.append(Rejected(g, "utilization unavailable and --max-util was given"))
        elif criteria.max_util is not None and g.utilization_pct is not None and g.utilization_pct > criteria.max_util:
            rejected.append(Rejected(g, f"{g.utilization_pct}% utilization > --max-util {criteria.max_util}"))
        elif criteria.max_procs is not None and g.process_count is None:
            rejected.append(
                Rejected(
                    g, "process count unavailable (--query-compute-apps failed or timed out) and --max-procs was given"
                )
            )
        elif criteria.max_procs is not None and procs > criteria.max_procs:
            hidden = (
                f" ({_gib(g.hidden_used_mib)} used with no visible process: a process in another container)"
                if (g.process_count or 0) == 0
                else ""
            )
            rejected.append(Rejected(g, f"{procs} process(es) > --max-procs {criteria.max_procs}{hidden}"))
        else:
            ok.append(g)
    ok.sort(key=_sort_key)
    ranked = []
    for i, g in enumerate(ok):
        nxt = ok[i + 1] if i + 1 < len(ok) else None
        util = "?" if g.utilization_pct is None else f"{g.utilization_pct}%"
        hidden = (
            f", {_gib(g.hidden_used_mib)} used by processes not visible here"
            if (g.process_count or 0) == 0 and (g.hidden_used_mib or 0) > 0
            else ""
        )
        desc = f"{_gib(g.memory_free_mib)} free, {util} util, {g.process_count if g.process_count is not None else '?'} process(es){hidden}"
        ranked.append(Ranked(g, i + 1, _effective_procs(g), f"{desc}; {_why_before(g, nxt)}"))
    return ranked, rejected


# ----------------------------------------------------------------------------- leases

LEASE_TOKEN_ENV = "CKPTFIX_LEASE_TOKEN"
#: set by ``pick-gpu -- COMMAND``: the GPU ids whose lease COMMAND (and its children) hold through the inherited lock
LEASES_HELD_ENV = "CKPTFIX_LEASES_HELD"
_LEASE_SCHEMA = "ckptfix.lease/1"


def lease_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where GPU leases live: ``$CKPTFIX_LEASE_DIR``, else ``$XDG_RUNTIME_DIR/ckptfix-leases`` (when that
    directory exists), else ``$TMPDIR/ckptfix-leases-<uid>``, else ``/tmp/ckptfix-leases-<uid>``.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The directory (not created or checked here: :func:`try_lease` does both).
    """
    env = os.environ if env is None else env
    if env.get("CKPTFIX_LEASE_DIR"):
        return Path(env["CKPTFIX_LEASE_DIR"])
    if env.get("XDG_RUNTIME_DIR") and os.path.isdir(env["XDG_RUNTIME_DIR"]):
        return Path(env["XDG_RUNTIME_DIR"]) / "ckptfix-leases"
    tmp = env.get("TMPDIR")
    base = tmp if tmp and os.path.isabs(tmp) and os.path.isdir(tmp) else "/tmp"
    return Path(base) / f"ckptfix-leases-{os.getuid()}"


def _lease_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", key) + ".lease"


def _lease_file(directory: Path, key: str) -> Path:
    return directory / _lease_name(key)


def _unsafe_dir(directory: Path, why: str) -> OutputError:
    return OutputError(
        f"refusing the GPU lease directory {directory}: {why}; another user could plant files in it. Fix: "
        f"`chmod 700 {directory}` if it is yours, else remove it (or set CKPTFIX_LEASE_DIR to a directory only "
        "you can write)"
    )


def open_lease_dir(directory: Path) -> int:
    """Create ``directory`` (mode 0700) if missing, check it like ssh checks ``~/.ssh``, and open it.

    Refused: a directory (or a symlink to one) not owned by the current user, and one that is group- or
    world-writable.  Lease files are then opened relative to the returned descriptor, so a directory
    swapped after the check is never used.

    Args:
        directory: the lease directory (see :func:`lease_dir`).

    Returns:
        An ``O_DIRECTORY | O_CLOEXEC`` descriptor; the caller closes it.

    Raises:
        OutputError: the directory cannot be created or opened, or is unsafe (exit code 9).
    """
    uid = os.getuid()
    try:
        if not os.path.lexists(directory):
            if not directory.parent.is_dir():
                os.makedirs(directory.parent, mode=0o700, exist_ok=True)
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


def _open_lease_file(dfd: int, directory: Path, key: str) -> tuple[int, bool]:
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
            raise OutputError(
                f"GPU lease file {directory / name} is a symlink, which ckptfix never follows (someone planted "
                f"it): remove it (`rm {directory / name}`) and check who can write to {directory}"
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
            f"GPU lease file {directory / name} {why}: ckptfix will not write to it; remove it and check who "
            f"can write to {directory}"
        )
    return fd, created


@dataclass
class Lease:
    """A lease on one GPU.  ``fd`` is open (and flock'ed) while the lease is *held*."""

    key: str
    path: Path
    fd: int | None
    expires: float | None
    token: str | None = None

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
    try:
        info = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) and "key" in info and "pid" in info else None


def _start_time() -> int | None:
    """This process's start time in clock ticks since boot (Linux), so that a reused PID is not taken for us."""
    try:
        with open("/proc/self/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _is_this_process(info: dict[str, Any]) -> bool:
    """A record written by this very process (not another one with the same PID, host or container)."""
    return (info.get("pid") == os.getpid() and info.get("host") == os.uname().nodename
            and info.get("start") == _start_time())


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


def _not_a_lease(path: Path) -> OutputError:
    return OutputError(
        f"{path} is not a ckptfix lease file (it holds something else), so ckptfix will not overwrite it: move it "
        "away if it is yours, or set CKPTFIX_LEASE_DIR to a directory of your own"
    )


def try_lease(
    directory: Path,
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
    locked and holds a ckptfix lease record.

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
    path = _lease_file(directory, key)
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
    if info is None:
        os.close(fd)
        raise _not_a_lease(path)
    exp = info.get("expires")
    own = _is_this_process(info) or (token is not None and token != "" and info.get("token") == token)
    if isinstance(exp, (int, float)) and exp > now and not own:
        os.close(fd)
        return None, _describe(info)
    if seconds == 0:
        os.close(fd)
        return Lease(key, path, None, None, token), ""
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
    os.write(fd, json.dumps(record).encode())
    if seconds is None:
        return Lease(key, path, fd, None, token), ""
    os.close(fd)  # the expiry in the file is the lease now
    return Lease(key, path, None, expires, token), ""


@dataclass(frozen=True)
class Released:
    """One lease :func:`release_leases` looked at."""

    key: str
    released: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "released": self.released, "why": self.why}


def release_leases(directory: Path, *, token: str | None = None, now: float | None = None) -> list[Released]:
    """Give back timed leases (``pick-gpu --release``).

    With ``token`` only the leases taken with that token (this shell's ``pick-gpu --export``); without,
    every unexpired timed lease in ``directory`` (all of them are the current user's).  A lease held by a
    running command (locked) is never touched: it ends when the command does.

    Args:
        directory: the lease directory.
        token: only release leases carrying this token.
        now: the time (tests).

    Returns:
        One :class:`Released` per live lease found, released or not (and why).

    Raises:
        OutputError: the directory is unsafe or unusable (exit code 9).
    """
    now = time.time() if now is None else now
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
                    info = _read_info(fd) or {}
                    if not token or info.get("token") == token:
                        key = str(info.get("key", name[:-6]))
                        out.append(Released(key, False, f"held by a running command ({_describe(info)}): stop it"))
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
                out.append(Released(str(info.get("key")), True, f"was leased until {_describe(info)}"))
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    return out


def _held_lease(path: Path) -> Lease | None:
    """The lease on ``path`` this process holds for its lifetime (from an earlier pick_gpu()), if any."""
    for le in _HELD:
        if le.fd is not None and le.path == path:
            return le
    return None


def _lease_dir_error(directory: Path, e: OSError) -> OutputError:
    return OutputError(
        f"cannot take a GPU lease in {directory} ({e.strerror or e}): set CKPTFIX_LEASE_DIR to a writable local "
        "directory (file locks need a local filesystem)"
    )


# ----------------------------------------------------------------------------- choosing


@dataclass
class PickResult:
    """What :func:`choose_and_lease` / :func:`ckptfix.gpu.pick_gpu` chose."""

    chosen: list[Ranked]
    rejected: list[Rejected]
    env: dict[str, str]
    leases: list[Lease] = field(default_factory=list)
    view: GpuView | None = None
    waited_s: float = 0.0

    @property
    def ids(self) -> list[str]:
        return [r.gpu.id for r in self.chosen]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "ckptfix.pick-gpu/1",
            "CUDA_VISIBLE_DEVICES": self.env.get("CUDA_VISIBLE_DEVICES"),
            "CUDA_DEVICE_ORDER": self.env.get("CUDA_DEVICE_ORDER"),
            "chosen": [r.to_dict() for r in self.chosen],
            "rejected": [r.to_dict() for r in self.rejected],
            "leases": [lease.to_dict() for lease in self.leases],
            "waited_s": round(self.waited_s, 3),
            "warnings": list(self.view.warnings) if self.view else [],
        }


def selection_env(chosen: Sequence[VisibleGpu], *, by: str = "uuid") -> dict[str, str]:
    """The environment that makes CUDA see exactly ``chosen``, in that order.

    ``by="uuid"``: UUIDs (immune to CUDA's ordering); ``by="index"``: PCI-order indices (the
    numbering of ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, always set), which differ from nvidia-smi's
    index where nvidia-smi lists GPUs in another order.
    """
    if by == "index" or any(not g.uuid for g in chosen):
        ids = [
            g.mig_device.uuid if g.mig_device else str(g.smi_index if g.pci_index is None else g.pci_index)
            for g in chosen
        ]
    else:
        ids = [g.id for g in chosen]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def choose_and_lease(
    view: GpuView,
    criteria: Criteria,
    *,
    lease_seconds: float | None,
    directory: Path | None,
    by: str = "uuid",
    token: str | None = None,
) -> PickResult:
    """Rank, then lease the best ``criteria.n`` GPUs not leased by others.

    If fewer than ``n`` qualify, nothing stays leased and the result has fewer
    than ``n`` chosen (``rejected`` says why the others failed).  ``directory=None``
    disables leases; ``token`` makes timed leases carrying it the caller's own (see :func:`try_lease`).
    """
    ranked, rejected = rank_gpus(view.devices, criteria)
    got: list[tuple[Ranked, Lease | None]] = []
    for r in ranked:
        if len(got) == criteria.n:
            break
        if directory is None:
            got.append((r, None))
            continue
        mine = _held_lease(_lease_file(directory, r.gpu.id))
        if mine is not None:  # an earlier pick_gpu() in this process holds it: ours to use again
            got.append((r, mine))
            continue
        lease, holder = try_lease(directory, r.gpu.id, lease_seconds, token=token)
        if lease is None and holder.endswith("(running)") and r.gpu.id in os.environ.get(LEASES_HELD_ENV, "").split(","):
            got.append((r, None))  # pick-gpu -- COMMAND leased it for this very command
            continue
        if lease is None:
            if holder.startswith("this process, "):  # e.g. a Lease the caller took with try_lease()
                rejected.append(Rejected(r.gpu, f"already leased by this process ({holder[14:]})"))
            else:
                rejected.append(Rejected(r.gpu, f"leased by another job ({holder})"))
            continue
        got.append((r, lease))
    if len(got) < criteria.n:
        for _, lease in got:
            if lease is not None and not any(lease is h for h in _HELD):  # not one an earlier pick holds
                _undo(lease)
        chosen = [r for r, _ in got]
        return PickResult(chosen, rejected, {}, [], view)
    chosen = [Ranked(r.gpu, i + 1, r.effective_procs, r.reason) for i, (r, _) in enumerate(got)]
    leases = [lease for _, lease in got if lease is not None]
    return PickResult(chosen, rejected, selection_env([r.gpu for r in chosen], by=by), leases, view)


def _undo(lease: Lease, *, lock_timeout: float = 2.0) -> None:
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


def explain_shortfall(result: PickResult, criteria: Criteria) -> str:
    """One line: how many qualify and why each other GPU does not."""
    n_ok = len(result.chosen)
    head = f"need {criteria.n} GPU(s), {n_ok} qualif{'ies' if n_ok == 1 else 'y'}"
    lines = [str(r) for r in result.rejected]
    return head + (": " + "; ".join(lines) if lines else "")


def pick(
    get_view: Callable[[], GpuView],
    criteria: Criteria,
    *,
    lease_seconds: float | None,
    directory: Path | None,
    wait: float = 0.0,
    interval: float = 10.0,
    by: str = "uuid",
    on_wait: Callable[[str], None] | None = None,
    token: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> PickResult:
    """Query, choose, and (with ``wait``) retry every ``interval`` seconds until enough GPUs qualify.

    Raises:
        NoGpuError: CUDA would see no GPU at all (e.g. ``CUDA_VISIBLE_DEVICES=""``).
        NoGpuFitsError: not enough GPUs qualify and ``wait`` is 0.
        GpuWaitTimeoutError: still not enough after ``wait`` seconds.
    """
    if criteria.n < 1:
        raise ValueError("n must be at least 1")
    start = clock()
    while True:
        view = get_view()
        if not view.devices:
            cvd = view.cuda_visible_devices
            detail = (
                f"nvidia-smi sees {len(view.physical)} GPU(s) but CUDA_VISIBLE_DEVICES={cvd!r} hides all of them"
                if view.physical
                else "nvidia-smi lists no GPU"
            )
            raise NoGpuError(f"{detail}: unset or fix CUDA_VISIBLE_DEVICES (see `ckptfix gpus`), or run on CPU")
        if len(view.devices) < criteria.n:
            raise NoGpuFitsError(
                f"asked for {criteria.n} GPU(s) but only {len(view.devices)} are visible to this process: "
                "ask for fewer, or widen CUDA_VISIBLE_DEVICES"
            )
        result = choose_and_lease(view, criteria, lease_seconds=lease_seconds, directory=directory, by=by, token=token)
        if len(result.chosen) >= criteria.n:
            result.waited_s = clock() - start
            return result
        why = explain_shortfall(result, criteria)
        elapsed = clock() - start
        if wait <= 0:
            raise NoGpuFitsError(f"no GPU fits the request ({why}); relax the filters or use --wait SECONDS")
        if elapsed >= wait:
            raise GpuWaitTimeoutError(
                f"waited {elapsed:.0f}s and GPUs still do not qualify ({why}); raise --wait or relax the filters"
            )
        if on_wait is not None:
            short = why.split(":", 1)[0]  # the per-GPU reasons come with the final error
            on_wait(f"waiting for GPUs ({short}, {elapsed:.0f}s of {wait:g}s); next check in {interval:g}s")
        sleep(max(0.0, min(interval, wait - elapsed)))


def apply_env(result: PickResult, environ: MutableMapping[str, str]) -> None:
    environ.update(result.env)


def hold_for_process(leases: Sequence[Lease]) -> None:
    """Keep held leases open until this Python process exits."""
    _HELD.extend(le for le in leases if le.fd is not None and not any(le is h for h in _HELD))


def check_cuda_not_initialized() -> None:
    """Raise if CUDA is already initialised here (then ``CUDA_VISIBLE_DEVICES`` can no longer take effect).

    Raises:
        CudaAlreadyInitializedError: with the route that initialised it and the fix (exit code 24).
    """
    from ckptfix.gpu.visible import cuda_init_route

    route = cuda_init_route()
    if route is not None:
        raise CudaAlreadyInitializedError(
            f"CUDA is already initialised in this process ({route}), so setting CUDA_VISIBLE_DEVICES now has no "
            "effect: call pick_gpu() before any torch.cuda call (torch.cuda.is_available() included), or run "
            "`ckptfix pick-gpu -- python ...` instead"
        )
