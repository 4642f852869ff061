"""Run and parse ``nvidia-smi``: pure parser functions plus an injectable runner.

Nothing here imports torch.  The parsers take text and return typed records;
:func:`query` is the only function that runs anything, and it does so through a
*runner* (``argv, timeout -> RunResult``) so tests can replace the subprocess.

nvidia-smi output is messier than its man page suggests, and every case below
comes from a real sample (``tests/fixtures/nvidia-smi/samples``):

* placeholders instead of values: ``[N/A]``, bare ``N/A``, ``[Not Supported]``,
  ``[Insufficient Permissions]``, ``[Unknown Error]``, ``[Not Found]``;
* values with or without units (``130013 MiB`` / ``130013``, ``100 %``, ``11.17 W``);
* a header line (``memory.total [MiB]``) or none (``--format=csv,noheader``);
* product names with spaces (and, in principle, commas);
* a warning line printed *before* the normal output (a lost GPU);
* non-zero exit codes with usable output, and failures printed on stdout.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from ckptfix.errors import (CkptfixError, DriverMismatchError, DriverNotLoadedError, GpuQueryError, GpuToolingError,
                            NoGpuError)

__all__ = [
    "GPU_FIELDS",
    "MID_GPU_FIELDS",
    "BASIC_GPU_FIELDS",
    "APP_FIELDS",
    "DriverNotLoadedError",
    "DriverMismatchError",
    "GpuProcess",
    "MigDevice",
    "SmiGpu",
    "SmiSnapshot",
    "RunResult",
    "Runner",
    "parse_value",
    "parse_number",
    "parse_csv",
    "parse_gpu_csv",
    "parse_apps_csv",
    "parse_list",
    "classify_failure",
    "subprocess_runner",
    "query",
]


# What we ask for.  Every field is one nvidia-smi has had since the R450 drivers
# except ``mig.mode.current``; if a driver rejects a field we retry with BASIC.
BASIC_GPU_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "pci.bus_id",
    "name",
    "memory.total",
    "memory.used",
    "memory.free",
    "utilization.gpu",
    "driver_version",
)
MID_GPU_FIELDS: tuple[str, ...] = BASIC_GPU_FIELDS[:-1] + (
    "temperature.gpu",
    "power.draw",
    "mig.mode.current",
    "driver_version",
)
# compute_cap (R510+) and clocks.max.sm rank devices the way CUDA's FASTEST_FIRST does; a driver that rejects
# a field ("... is not a valid field to query") is asked again with MID_GPU_FIELDS, then BASIC_GPU_FIELDS
GPU_FIELDS: tuple[str, ...] = MID_GPU_FIELDS[:-1] + ("compute_cap", "clocks.max.sm", "driver_version")
APP_FIELDS: tuple[str, ...] = ("gpu_uuid", "pid", "process_name", "used_memory")

# header spellings -> canonical field names
_ALIASES = {
    "gpu_name": "name",
    "gpu_uuid": "uuid",
    "gpu_bus_id": "pci.bus_id",
    "used_gpu_memory": "used_memory",
    "mig.mode.current": "mig.mode.current",
}
_APP_ALIASES = {"used_gpu_memory": "used_memory", "uuid": "gpu_uuid", "name": "process_name"}

_KNOWN_HEADER_WORDS = set(GPU_FIELDS) | set(APP_FIELDS) | set(_ALIASES) | {
    "timestamp",
    "driver_version",
    "utilization.memory",
    "temperature.memory",
    "power.limit",
    "clocks.max.sm",
    "compute_cap",
    "fan.speed",
    "pid",
    "process_name",
}

_PLACEHOLDERS = {"N/A", "NOT SUPPORTED", "INSUFFICIENT PERMISSIONS", "UNKNOWN ERROR", "NOT FOUND", "ERR!", "GPU IS LOST"}


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class GpuProcess:
    """One row of ``--query-compute-apps``."""

    gpu_uuid: str | None
    pid: int | None
    name: str | None  # None for ``[Not Found]`` (a process in another PID namespace)
    used_memory_mib: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_uuid": self.gpu_uuid, "pid": self.pid, "name": self.name, "used_memory_mib": self.used_memory_mib}


@dataclass(frozen=True)
class MigDevice:
    """One MIG device line of ``nvidia-smi -L``."""

    uuid: str  # ``MIG-<uuid>`` (R470+) or legacy ``MIG-GPU-<uuid>/<gi>/<ci>``
    parent_uuid: str | None
    parent_index: int
    device_index: int
    profile: str  # e.g. ``1g.5gb`` or ``1c.3g.20gb``

    def to_dict(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "parent_uuid": self.parent_uuid,
            "parent_index": self.parent_index,
            "device_index": self.device_index,
            "profile": self.profile,
        }


@dataclass(frozen=True)
class SmiGpu:
    """One physical GPU as nvidia-smi reports it.  ``None`` means unavailable; why is in ``unavailable``."""

    index: int
    uuid: str | None = None
    pci_bus_id: str | None = None
    name: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    utilization_pct: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    mig_enabled: bool | None = None
    driver_version: str | None = None
    compute_cap: tuple[int, int] | None = None  # e.g. (9, 0); None: not reported (driver < R510) or N/A
    max_sm_clock_mhz: int | None = None
    unavailable: tuple[tuple[str, str], ...] = ()  # (field, placeholder text) pairs
    processes: tuple[GpuProcess, ...] | None = None  # None: not queried
    mig_devices: tuple[MigDevice, ...] = ()

    @property
    def process_count(self) -> int | None:
        return None if self.processes is None else len(self.processes)

    def unavailable_reason(self, fieldname: str) -> str | None:
        for f, why in self.unavailable:
            if f == fieldname:
                return why
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
            "name": self.name,
            "memory_total_mib": self.memory_total_mib,
            "memory_used_mib": self.memory_used_mib,
            "memory_free_mib": self.memory_free_mib,
            "utilization_pct": self.utilization_pct,
            "temperature_c": self.temperature_c,
            "power_w": self.power_w,
            "mig_enabled": self.mig_enabled,
            "driver_version": self.driver_version,
            "compute_cap": None if self.compute_cap is None else f"{self.compute_cap[0]}.{self.compute_cap[1]}",
            "max_sm_clock_mhz": self.max_sm_clock_mhz,
            "unavailable": dict(self.unavailable),
            "processes": None if self.processes is None else [p.to_dict() for p in self.processes],
            "mig_devices": [m.to_dict() for m in self.mig_devices],
        }


@dataclass(frozen=True)
class SmiSnapshot:
    """Everything one :func:`query` learned."""

    gpus: tuple[SmiGpu, ...]
    driver_version: str | None = None
    warnings: tuple[str, ...] = ()
    calls: int = 0
    processes_known: bool = False
    mig_listed: bool = False


@dataclass(frozen=True)
class RunResult:
    returncode: int
    stdout: str
    stderr: str = ""
    timed_out: bool = False  # only for an optional call (see :func:`_run_parallel`): it did not answer in time


Runner = Callable[[Sequence[str], float], RunResult]


# ----------------------------------------------------------------------------- value parsing


def parse_value(raw: str) -> tuple[str | None, str | None]:
    """Split one CSV cell into ``(value, placeholder)``; exactly one of them is ``None``.

    >>> parse_value(" 130013 MiB")
    ('130013 MiB', None)
    >>> parse_value("[Insufficient Permissions]")
    (None, 'Insufficient Permissions')
    >>> parse_value("N/A")
    (None, 'N/A')
    """
    s = raw.strip()
    if len(s) >= 2 and s[0] == "[" and s[-1] == "]":
        return None, s[1:-1].strip() or "empty"
    if s.upper() in _PLACEHOLDERS:
        return None, s
    if s == "":
        return None, "empty"
    return s, None


_NUM = re.compile(r"^([-+]?\d+(?:\.\d*)?|[-+]?\.\d+)\s*([A-Za-z%/]*)$")
_TO_MIB = {"": 1.0, "mib": 1.0, "mb": 1.0, "m": 1.0, "gib": 1024.0, "gb": 1024.0, "g": 1024.0, "kib": 1 / 1024, "kb": 1 / 1024}


def parse_number(text: str | None, *, mib: bool = False) -> float | None:
    """``"130013 MiB" -> 130013.0``, ``"100 %" -> 100.0``, ``"11.17 W" -> 11.17``; junk -> None.

    With ``mib=True`` a unit other than MiB is converted to MiB.
    """
    if text is None:
        return None
    m = _NUM.match(text.strip())
    if not m:
        return None
    try:
        v = float(m.group(1))
    except ValueError:
        return None
    if mib:
        factor = _TO_MIB.get(m.group(2).lower())
        if factor is None:
            return None
        v *= factor
    return v


def _as_int(text: str | None, *, mib: bool = False) -> int | None:
    v = parse_number(text, mib=mib)
    return None if v is None else int(round(v))


def _norm_header(cell: str) -> str:
    name = cell.strip()
    name = re.sub(r"\s*\[[^\]]*\]\s*$", "", name)  # "memory.total [MiB]" -> "memory.total"
    return name.strip().lower()


def _split_row(line: str, ncols: int, free_text: int | None) -> list[str] | None:
    cells = [c.strip() for c in line.split(",")]
    if len(cells) == ncols:
        return cells
    if len(cells) > ncols and free_text is not None:
        extra = len(cells) - ncols
        merged = ",".join(line.split(",")[free_text : free_text + extra + 1]).strip()
        return cells[:free_text] + [merged] + cells[free_text + extra + 1 :]
    return None


def parse_csv(
    text: str, fields: Sequence[str], *, free_text: str | None = None, aliases: dict[str, str] | None = None
) -> tuple[list[str], list[list[str]], list[str]]:
    """Parse ``--format=csv`` output with or without a header.

    Returns ``(columns, rows, junk)``: the column names (from the header if there
    is one, else ``fields``), the rows that have exactly that many cells (a
    ``free_text`` column such as a product name absorbs extra commas), and the
    non-empty lines that are neither (warnings printed around the data).
    """
    aliases = _ALIASES if aliases is None else aliases
    columns = [aliases.get(f, f) for f in fields]
    rows: list[list[str]] = []
    junk: list[str] = []
    header_seen = False
    for line in text.splitlines():
        if not line.strip():
            continue
        first = _norm_header(line.split(",", 1)[0])
        if not header_seen and not rows and first in _KNOWN_HEADER_WORDS:
            columns = [aliases.get(_norm_header(c), _norm_header(c)) for c in line.split(",")]
            header_seen = True
            continue
        ft = columns.index(free_text) if free_text in columns else None
        cells = _split_row(line, len(columns), ft)
        if cells is None:
            junk.append(line.strip())
        else:
            rows.append(cells)
    return columns, rows, junk


def _looks_like_gpu_row(row: dict[str, str]) -> bool:
    idx = row.get("index")
    if idx is not None:
        v, na = parse_value(idx)
        if v is not None and not v.isdigit():
            return False
    uuid = row.get("uuid")
    if uuid is not None:
        v, na = parse_value(uuid)
        if v is not None and not (v.startswith("GPU-") or v.startswith("MIG-")):
            return False
    return True


def parse_gpu_csv(text: str, fields: Sequence[str] = GPU_FIELDS) -> tuple[list[SmiGpu], list[str]]:
    """Parse ``--query-gpu`` output into :class:`SmiGpu` records (no processes yet).

    Rows without an ``index`` column are numbered in order.  Returns ``(gpus, warnings)``
    where warnings are the lines that were not data (e.g. a lost-GPU message).
    """
    columns, rows, junk = parse_csv(text, fields, free_text="name")
    gpus: list[SmiGpu] = []
    warnings = list(junk)
    for cells in rows:
        row = dict(zip(columns, cells))
        if not _looks_like_gpu_row(row):
            warnings.append(", ".join(cells))
            continue
        values: dict[str, str | None] = {}
        unavailable: list[tuple[str, str]] = []
        for col, cell in row.items():
            v, na = parse_value(cell)
            values[col] = v
            if na is not None:
                unavailable.append((col, na))
        idx = _as_int(values.get("index"))
        total = _as_int(values.get("memory.total"), mib=True)
        used = _as_int(values.get("memory.used"), mib=True)
        free = _as_int(values.get("memory.free"), mib=True)
        if free is None and "memory.free" not in row and total is not None and used is not None:
            free = max(total - used, 0)
        if used is None and "memory.used" not in row and total is not None and free is not None:
            used = max(total - free, 0)
        util = _as_int(values.get("utilization.gpu"))
        mig = values.get("mig.mode.current")
        pci = values.get("pci.bus_id")
        gpus.append(
            SmiGpu(
                index=len(gpus) if idx is None else idx,
                uuid=values.get("uuid"),
                pci_bus_id=pci,
                name=values.get("name"),
                memory_total_mib=total,
                memory_used_mib=used,
                memory_free_mib=free,
                utilization_pct=util,
                temperature_c=parse_number(values.get("temperature.gpu")),
                power_w=parse_number(values.get("power.draw")),
                mig_enabled=None if mig is None else mig.strip().lower() == "enabled",
                driver_version=values.get("driver_version"),
                compute_cap=_compute_cap(values.get("compute_cap")),
                max_sm_clock_mhz=_as_int(values.get("clocks.max.sm")),
                unavailable=tuple(unavailable),
            )
        )
    return gpus, warnings


def _compute_cap(text: str | None) -> tuple[int, int] | None:
    m = re.match(r"^\s*(\d+)\.(\d+)\s*$", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_apps_csv(text: str, fields: Sequence[str] = APP_FIELDS) -> tuple[list[GpuProcess], list[str]]:
    """Parse ``--query-compute-apps`` output.  A header alone (or nothing) means no processes."""
    columns, rows, junk = parse_csv(text, fields, free_text="process_name", aliases=_APP_ALIASES)
    procs: list[GpuProcess] = []
    warnings = list(junk)
    for cells in rows:
        row = dict(zip(columns, cells))
        uuid, _ = parse_value(row.get("gpu_uuid", ""))
        pid_text, _ = parse_value(row.get("pid", ""))
        if uuid is not None and not (uuid.startswith("GPU-") or uuid.startswith("MIG-")):
            warnings.append(", ".join(cells))
            continue
        if pid_text is not None and not pid_text.isdigit():
            warnings.append(", ".join(cells))
            continue
        name, _ = parse_value(row["process_name"]) if "process_name" in row else (None, None)
        mem, _ = parse_value(row["used_memory"]) if "used_memory" in row else (None, None)
        procs.append(
            GpuProcess(
                gpu_uuid=uuid,
                pid=None if pid_text is None else int(pid_text),
                name=name,
                used_memory_mib=_as_int(mem, mib=True),
            )
        )
    return procs, warnings


_L_GPU = re.compile(r"^\s*GPU\s+(\d+)\s*:\s*(.*?)\s*\(UUID:\s*(GPU-[^)\s]+)\s*\)")
_L_MIG = re.compile(r"^\s*MIG\s+(\S+)\s+Device\s+(\d+)\s*:\s*\(UUID:\s*(MIG-[^)\s]+)\s*\)")


def parse_list(text: str) -> tuple[list[tuple[int, str, str]], list[MigDevice], list[str]]:
    """Parse ``nvidia-smi -L``: ``([(index, name, uuid)], [MigDevice], junk_lines)``.

    Whitespace-tolerant (real output pads MIG lines; rendered docs do not).
    """
    gpus: list[tuple[int, str, str]] = []
    migs: list[MigDevice] = []
    junk: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _L_GPU.match(line)
        if m:
            gpus.append((int(m.group(1)), m.group(2), m.group(3)))
            continue
        m = _L_MIG.match(line)
        if m and gpus:
            parent_index, _, parent_uuid = gpus[-1]
            migs.append(
                MigDevice(
                    uuid=m.group(3),
                    parent_uuid=parent_uuid,
                    parent_index=parent_index,
                    device_index=int(m.group(2)),
                    profile=m.group(1),
                )
            )
            continue
        junk.append(line.strip())
    return gpus, migs, junk


# ----------------------------------------------------------------------------- failures


def _first_lines(text: str, n: int = 2) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " / ".join(lines[:n])


def classify_failure(returncode: int, stdout: str, stderr: str = "") -> CkptfixError | None:
    """Map a failed (or empty) nvidia-smi run to the error a user should see, or None if unknown.

    Recognised: driver not loaded (rc 9), driver/library mismatch (rc 18), no
    devices (rc 6 / "No devices were found" / "No supported GPUs", rc 255),
    insufficient permissions (rc 4).
    """
    text = f"{stdout}\n{stderr}"
    low = text.lower()
    if "couldn't communicate with the nvidia driver" in low or "could not communicate with the nvidia driver" in low or returncode == 9:
        return DriverNotLoadedError(
            "nvidia-smi cannot talk to the NVIDIA driver (driver not loaded): load it (`sudo modprobe nvidia`), "
            "reboot after a driver install, or in a container run with `--gpus all`; otherwise run on CPU"
        )
    if "version mismatch" in low or returncode == 18:
        m = re.search(r"NVML library version:\s*([\w.]+)", text)
        lib = f" (NVML library {m.group(1)})" if m else ""
        return DriverMismatchError(
            f"NVIDIA driver/library version mismatch{lib}: the driver was upgraded but the old kernel module is "
            "still loaded; reboot (or reload the nvidia kernel modules); until then run on CPU"
        )
    if (
        "no devices were found" in low
        or "no supported gpus were found" in low
        or "unable to determine the number of gpus" in low
        or returncode == 6
    ):
        return NoGpuError(
            f"the NVIDIA driver is loaded but reports no GPU ({_first_lines(text) or f'rc {returncode}'}): "
            "check `dmesg` for the failed device or the GPUs granted to this container; otherwise run on CPU"
        )
    if "insufficient permissions" in low or returncode == 4:
        return GpuQueryError(
            "nvidia-smi: insufficient permissions to query the GPUs: run as a user allowed to access /dev/nvidia*"
        )
    return None


# ----------------------------------------------------------------------------- running


def find_nvidia_smi(env: dict[str, str] | None = None) -> str:
    """The nvidia-smi to run: ``$CKPTFIX_NVIDIA_SMI`` or the one on ``PATH``."""
    env = os.environ if env is None else env
    explicit = env.get("CKPTFIX_NVIDIA_SMI")
    if explicit:
        return explicit
    found = _which("nvidia-smi", env.get("PATH", os.defpath))
    if not found:
        raise GpuToolingError(
            "nvidia-smi not found on PATH: no NVIDIA driver is installed here; run on CPU or install the driver"
        )
    return found


def _which(name: str, path: str) -> str | None:
    """``shutil.which`` without importing shutil (and its compression modules) on the fast path."""
    for d in path.split(os.pathsep):
        cand = os.path.join(d or ".", name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def subprocess_runner(argv: Sequence[str], timeout: float) -> RunResult:
    """Run one command; map a missing/unrunnable binary and a timeout to ckptfix errors."""
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, errors="replace")
    except FileNotFoundError:
        raise GpuToolingError(
            f"{argv[0]} not found: no NVIDIA driver is installed here; run on CPU or install the driver"
        ) from None
    except PermissionError:
        raise GpuToolingError(f"{argv[0]} cannot be executed (permission denied)") from None
    except subprocess.TimeoutExpired:
        raise GpuQueryError(
            f"nvidia-smi did not answer within {timeout:g}s (a hung GPU or driver?): check `dmesg`, or retry"
        ) from None
    return RunResult(p.returncode, p.stdout or "", p.stderr or "")


def _run_parallel(cmds: list[list[str]], timeout: float, optional: frozenset[int] = frozenset()) -> list[RunResult]:
    """Start several commands at once and wait for all (saves a whole nvidia-smi start-up).

    A command whose position is in ``optional`` that does not answer in time is killed and
    reported as ``RunResult(-1, "", "", timed_out=True)``; any other timeout raises.
    """
    procs: list[subprocess.Popen[str]] = []
    try:
        for argv in cmds:
            try:
                procs.append(
                    subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
                )
            except FileNotFoundError:
                raise GpuToolingError(
                    f"{argv[0]} not found: no NVIDIA driver is installed here; run on CPU or install the driver"
                ) from None
            except PermissionError:
                raise GpuToolingError(f"{argv[0]} cannot be executed (permission denied)") from None
        deadline = time.monotonic() + timeout
        out: list[RunResult] = []
        for p in procs:
            try:
                so, se = p.communicate(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                if len(out) in optional:
                    p.kill()  # reaped below
                    for f in (p.stdout, p.stderr):
                        if f is not None:
                            f.close()
                    out.append(RunResult(-1, "", "", timed_out=True))
                    continue
                raise GpuQueryError(
                    f"nvidia-smi did not answer within {timeout:g}s (a hung GPU or driver?): check `dmesg`, or retry"
                ) from None
            out.append(RunResult(p.returncode, so or "", se or ""))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _gpu_argv(smi: str, fields: Sequence[str]) -> list[str]:
    return [smi, f"--query-gpu={','.join(fields)}", "--format=csv,nounits"]


def _apps_argv(smi: str) -> list[str]:
    return [smi, f"--query-compute-apps={','.join(APP_FIELDS)}", "--format=csv,nounits"]


def query(
    *,
    runner: Runner | None = None,
    timeout: float = 10.0,
    processes: bool = True,
    mig: bool | None = None,
    env: dict[str, str] | None = None,
) -> SmiSnapshot:
    """Ask nvidia-smi about the machine: one ``--query-gpu`` call, plus
    ``--query-compute-apps`` (run concurrently) when ``processes``, plus ``-L``
    only when a GPU has MIG enabled (or ``mig=True``).

    Raises:
        GpuToolingError: nvidia-smi is missing or cannot be run (exit 20).
        NoGpuError: no devices (21); DriverNotLoadedError (26); DriverMismatchError (27).
        GpuQueryError: nvidia-smi failed otherwise or timed out (25).  Only the ``--query-gpu``
            call raises: a failed or hung ``--query-compute-apps`` leaves every process count
            unknown (``None``, ``processes_known=False``) with a warning saying why.
    """
    env = os.environ if env is None else env
    smi = find_nvidia_smi(env) if runner is None else "nvidia-smi"
    warnings: list[str] = []
    calls = 0

    def run_many(cmds: list[list[str]], optional: frozenset[int] = frozenset()) -> list[RunResult]:
        nonlocal calls
        calls += len(cmds)
        if runner is None:
            return _run_parallel(cmds, timeout, optional)
        out: list[RunResult] = []
        for i, c in enumerate(cmds):
            try:
                out.append(runner(c, timeout))
            except GpuQueryError:  # a runner's timeout
                if i not in optional:
                    raise
                out.append(RunResult(-1, "", "", timed_out=True))
        return out

    fields: tuple[str, ...] = GPU_FIELDS
    cmds = [_gpu_argv(smi, fields)] + ([_apps_argv(smi)] if processes else [])
    if mig:  # known up front (CUDA_VISIBLE_DEVICES names MIG devices): list them in the same round
        cmds.append([smi, "-L"])
    # the process list is optional: if it hangs or fails, process counts become unknown (a warning)
    results = run_many(cmds, frozenset({1}) if processes else frozenset())
    gres = results[0]
    while fields != BASIC_GPU_FIELDS and gres.returncode != 0:
        said = (gres.stdout + gres.stderr).lower()
        if "not a valid field" not in said:
            break
        # an older driver: without compute_cap (< R510) and maybe without mig.mode.current (named first if so)
        fields = MID_GPU_FIELDS if fields == GPU_FIELDS and "mig.mode.current" not in said else BASIC_GPU_FIELDS
        gres = run_many([_gpu_argv(smi, fields)])[0]
    gpus, junk = parse_gpu_csv(gres.stdout, fields)
    if not gpus:
        err = classify_failure(gres.returncode, gres.stdout, gres.stderr)
        if err is not None:
            raise err
        if gres.returncode == 0 and not (gres.stdout + gres.stderr).strip():
            raise NoGpuError("nvidia-smi lists no GPU: there is no usable NVIDIA GPU here; run on CPU")
        raise GpuQueryError(
            f"nvidia-smi exited with code {gres.returncode} and printed nothing usable: "
            f"{_first_lines(gres.stdout + chr(10) + gres.stderr) or '(no output)'}; run `nvidia-smi` to see why"
        )
    warnings.extend(f"nvidia-smi: {j}" for j in junk)
    if gres.returncode != 0:
        warnings.append(f"nvidia-smi exited with code {gres.returncode} but printed usable output")
    for line in gres.stderr.splitlines():
        if line.strip() and f"nvidia-smi: {line.strip()}" not in warnings:
            warnings.append(f"nvidia-smi: {line.strip()}")

    processes_known = False
    by_uuid: dict[str, list[GpuProcess]] = {}
    if processes:
        ares = results[1]
        procs, ajunk = parse_apps_csv(ares.stdout)
        if not ares.timed_out and (ares.returncode == 0 or procs):
            processes_known = True
            for p in procs:
                by_uuid.setdefault(p.gpu_uuid or "", []).append(p)
        else:
            if ares.timed_out:
                why = f"did not answer within {timeout:g}s"
            else:
                said = _first_lines(ares.stdout + "\n" + ares.stderr, 1)
                why = f"failed (code {ares.returncode}{': ' + said if said else ''})"
            warnings.append(
                f"nvidia-smi --query-compute-apps {why}: process counts unknown (? in the table, null in --json); "
                "pick-gpu --max-procs rejects every GPU until it answers; check `nvidia-smi` and `dmesg`, or retry"
            )

    mig_devices: dict[str, list[MigDevice]] = {}
    mig_listed = False
    if mig or (mig is None and any(g.mig_enabled for g in gpus)):
        lres = results[-1] if mig else run_many([[smi, "-L"]])[0]
        _, migs, _ = parse_list(lres.stdout)
        mig_listed = lres.returncode == 0 or bool(migs)
        for m in migs:
            mig_devices.setdefault(m.parent_uuid or "", []).append(m)

    listed = {g.uuid for g in gpus if g.uuid}
    for u, plist in sorted(by_uuid.items()):
        if u not in listed:
            pids = ", ".join(str(p.pid) for p in plist[:5]) + (", ..." if len(plist) > 5 else "")
            warnings.append(
                f"nvidia-smi lists {len(plist)} compute process(es) (pid {pids}) on {u or 'a GPU without UUID'}, "
                "which --query-gpu did not list (a GPU it could not read?): they are not counted; check "
                "`nvidia-smi` and `dmesg`"
            )
    out: list[SmiGpu] = []
    for g in gpus:
        procs_here: tuple[GpuProcess, ...] | None = None
        if processes_known:
            procs_here = tuple(by_uuid.get(g.uuid or "\0", ())) if g.uuid else None
        migs_here = tuple(mig_devices.get(g.uuid or "\0", ()))
        out.append(_replace(g, processes=procs_here, mig_devices=migs_here))
    driver = next((g.driver_version for g in out if g.driver_version), None)
    return SmiSnapshot(
        gpus=tuple(out),
        driver_version=driver,
        warnings=tuple(warnings),
        calls=calls,
        processes_known=processes_known,
        mig_listed=mig_listed,
    )


def _replace(g: SmiGpu, **kw: Any) -> SmiGpu:
    return replace(g, **kw)

