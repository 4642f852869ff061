"""Pure parsers of nvidia-smi's output: ``--query-gpu`` / ``--query-compute-apps`` CSV, ``-L``, and failures.

Text in, typed records (:mod:`ckptfix.gpu.records`) out; nothing here runs anything.
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

import re
from typing import Sequence

from ckptfix.errors import (
    CkptfixError,
    DriverMismatchError,
    DriverNotLoadedError,
    GpuOutputError,
    GpuQueryError,
    NoGpuError,
)
from ckptfix.gpu.records import GpuProcess, MigDevice, SmiGpu

__all__ = [
    "GPU_FIELDS",
    "MID_GPU_FIELDS",
    "BASIC_GPU_FIELDS",
    "APP_FIELDS",
    "parse_value",
    "parse_number",
    "parse_csv",
    "parse_gpu_csv",
    "parse_apps_csv",
    "parse_list",
    "classify_failure",
    "first_lines",
]


# What we ask for.  Every field is one nvidia-smi has had since the R450 drivers
# except ``mig.mode.current``; a field a driver rejects is dropped and the rest asked again (smi.py).
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
# a field ("... is not a valid field to query") is asked again without only that field (BASIC_GPU_FIELDS when
# the message names none)
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

_KNOWN_HEADER_WORDS = (
    set(GPU_FIELDS)
    | set(APP_FIELDS)
    | set(_ALIASES)
    | {
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
)

_PLACEHOLDERS = {
    "N/A",
    "NOT SUPPORTED",
    "INSUFFICIENT PERMISSIONS",
    "UNKNOWN ERROR",
    "NOT FOUND",
    "ERR!",
    "GPU IS LOST",
}

# ----------------------------------------------------------------------------- value parsing


def parse_value(raw: str) -> tuple[str | None, str | None]:
    """Split one CSV cell into ``(value, placeholder)``; exactly one of them is ``None``.

    >>> parse_value(" 130013 MiB")
    ('130013 MiB', None)
    >>> parse_value("[Insufficient Permissions]")
    (None, 'Insufficient Permissions')
    >>> parse_value("N/A")
    (None, 'N/A')

    Returns:
        ``(value, None)`` or ``(None, placeholder)``.
    """
    s = raw.strip()
    if len(s) >= 2 and s[0] == "[" and s[-1] == "]":
        return None, s[1:-1].strip() or "empty"
    if s.upper() in _PLACEHOLDERS:
        return None, s
    if s == "":
        return None, "empty"
    return s, None


_NUM = r"^([-+]?\d+(?:\.\d*)?|[-+]?\.\d+)\s*([A-Za-z%/]*)$"


_TO_MIB = {
    "": 1.0,
    "mib": 1.0,
    "mb": 1.0,
    "m": 1.0,
    "gib": 1024.0,
    "gb": 1024.0,
    "g": 1024.0,
    "kib": 1 / 1024,
    "kb": 1 / 1024,
}


def parse_number(text: str | None, *, mib: bool = False) -> float | None:
    """``"130013 MiB" -> 130013.0``, ``"100 %" -> 100.0``, ``"11.17 W" -> 11.17``; junk -> None.

    With ``mib=True`` a unit other than MiB is converted to MiB.

    Args:
        text: a value from :func:`parse_value` (``None`` passes through).
        mib: convert a memory unit to MiB.

    Returns:
        The number, or ``None`` when it is not one (or has an unknown unit with ``mib``).
    """
    if text is None:
        return None
    m = re.match(_NUM, text.strip())
    if m is None:
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
    # "memory.total [MiB]" -> "memory.total"
    return re.sub(r"\s*\[[^\]]*\]\s*$", "", cell.strip()).strip().lower()


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

    Args:
        text: nvidia-smi's stdout.
        fields: the fields asked for, in order (the columns when there is no header).
        free_text: the column that may contain commas.
        aliases: header spellings -> canonical field names.
    """
    columns, lines, junk = _parse_csv_lines(text, fields, free_text=free_text, aliases=aliases)
    return columns, [cells for _, cells in lines], junk


def _parse_csv_lines(
    text: str, fields: Sequence[str], *, free_text: str | None = None, aliases: dict[str, str] | None = None
) -> tuple[list[str], list[tuple[str, list[str]]], list[str]]:
    """:func:`parse_csv` keeping each row's line: ``(columns, [(line, cells)], junk)``."""
    aliases = _ALIASES if aliases is None else aliases
    columns = [aliases.get(f, f) for f in fields]
    rows: list[tuple[str, list[str]]] = []
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
            rows.append((line, cells))
    return columns, rows, junk


# ----------------------------------------------------------------------------- validating a --query-gpu row

_INT = r"[-+]?\d+"
_FLOAT = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_UINT = r"\d+"
_CAP = r"\d+\.\d+"
#: field -> (the number's pattern, the units nvidia-smi may print after it (lower case; "" = none), what it is)
_FIELD_FORMATS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "index": (_UINT, ("",), "a GPU index"),
    "memory.total": (_FLOAT, tuple(_TO_MIB), "a size in MiB"),
    "memory.used": (_FLOAT, tuple(_TO_MIB), "a size in MiB"),
    "memory.free": (_FLOAT, tuple(_TO_MIB), "a size in MiB"),
    "utilization.gpu": (_INT, ("", "%"), "a percentage"),
    "utilization.memory": (_INT, ("", "%"), "a percentage"),
    "temperature.gpu": (_FLOAT, ("", "c"), "degrees C"),
    "power.draw": (_FLOAT, ("", "w"), "watts"),
    "clocks.max.sm": (_INT, ("", "mhz"), "MHz"),
    "compute_cap": (_CAP, ("",), "a compute capability such as 8.0"),
}
#: fields nvidia-smi prints with a decimal point (``118.41 W``, ``8.0``): where a comma locale puts a comma
_FRACTIONAL = frozenset({"power.draw", "power.limit", "compute_cap"})
#: field -> (its pattern, its flags, what it is)
_OTHER_FORMATS: dict[str, tuple[str, int, str]] = {
    "uuid": (r"^(GPU|MIG)-[\w./-]+$", 0, "a GPU-/MIG- UUID"),
    "pci.bus_id": (r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$", 0, "a PCI bus id"),
    "mig.mode.current": (r"^(Enabled|Disabled)$", re.I, "Enabled or Disabled"),
    "driver_version": (r"^\d+(\.\d+)+$", 0, "a version such as 570.124.06"),
}


def _field_error(column: str, value: str) -> str | None:
    """Why ``value`` (not a placeholder) cannot be nvidia-smi's ``column``, or ``None`` when it can."""
    fmt = _FIELD_FORMATS.get(column)
    if fmt is not None:
        number, units, what = fmt
        m = re.match(rf"^({number})\s*([A-Za-z%]*)$", value)
        if m is None:
            return f"not {what}"
        if m.group(2).lower() not in units:
            return f"unit {m.group(2)!r} is not one nvidia-smi prints for {column} ({what})"
        return None
    other = _OTHER_FORMATS.get(column)
    if other is not None and not re.match(other[0], value, other[1]):
        return f"not {other[2]}"
    return None


def _row_errors(columns: Sequence[str], cells: Sequence[str]) -> list[tuple[str, str, str]]:
    """``[(column, value, why)]`` for each cell that does not fit its column, then memory that does not add up."""
    out: list[tuple[str, str, str]] = []
    values: dict[str, str] = {}
    for col, cell in zip(columns, cells, strict=True):
        v, _ = parse_value(cell)
        if v is None:
            continue
        values[col] = v
        why = _field_error(col, v)
        if why is not None:
            out.append((col, v, why))
    if out:
        return out
    total = parse_number(values.get("memory.total"), mib=True)
    for col in ("memory.used", "memory.free"):
        size = parse_number(values.get(col), mib=True)
        if total is not None and size is not None and size > total:
            out.append((col, values[col], f"larger than memory.total ({values['memory.total']})"))
    return out


def _decimal_comma_field(columns: Sequence[str], line: str) -> tuple[str, str] | None:
    """The column a decimal comma split in two (``118,41`` -> ``118`` and ``41``): ``(column, "118,41")``.

    Tries joining each pair of neighbouring digit cells; the answer is the one join after which the row has
    exactly the asked columns and every cell fits (``None`` when no single join explains the row).
    """
    raw = [c.strip() for c in line.split(",")]
    if len(raw) != len(columns) + 1:
        return None
    found: list[tuple[str, str]] = []
    for k in range(len(raw) - 1):
        if columns[k] not in _FRACTIONAL:  # the fields nvidia-smi prints with a fraction
            continue
        if not re.fullmatch(r"[-+]?\d+", raw[k]) or not re.fullmatch(r"\d+\s*[A-Za-z%]*", raw[k + 1]):
            continue
        joined = raw[:k] + [f"{raw[k]}.{raw[k + 1]}"] + raw[k + 2 :]
        if not _row_errors(columns, joined):
            found.append((columns[k], f"{raw[k]},{raw[k + 1]}"))
    return found[0] if len(found) == 1 else None


def _refuse_row(columns: Sequence[str], line: str, cells: Sequence[str] | None) -> GpuOutputError:
    """The error for a ``--query-gpu`` row that does not parse (it names the field)."""
    shown = line.strip() if len(line.strip()) <= 200 else line.strip()[:200] + "..."
    where = f"nvidia-smi --query-gpu printed a row ckptfix cannot read ({shown!r})"
    fix = (
        "nothing is picked from it; run `LC_ALL=C nvidia-smi --query-gpu=... --format=csv` to see the raw values, "
        "and report it if they look right"
    )
    comma = _decimal_comma_field(columns, line)
    if comma is not None:
        col, value = comma
        return GpuOutputError(
            f"{where}: field {col} is {value!r}, a decimal comma from a comma locale (which LC_ALL=C, set by "
            "ckptfix, did not override), so every later column is shifted; nothing is picked from it: check "
            f"`LC_ALL=C nvidia-smi --query-gpu={col} --format=csv` and report it"
        )
    n = len([c for c in line.split(",")])
    if cells is None or n != len(columns):
        got = f"{n} fields where {len(columns)} were asked ({', '.join(columns)})"
        if cells is not None:  # the name absorbed the extra fields, and something else no longer fits
            errs = _row_errors(columns, cells)
            if errs:
                col, value, why = errs[0]
                return GpuOutputError(f"{where}: {got}; read that way, field {col} is {value!r}: {why}; {fix}")
        return GpuOutputError(f"{where}: {got}; {fix}")
    col, value, why = _row_errors(columns, cells)[0]
    return GpuOutputError(f"{where}: field {col} is {value!r}: {why}; {fix}")


def _name_absorbed_a_number(name: str | None, line: str, ncols: int) -> bool:
    """The product name took in extra fields (a row with more fields than asked) and one of them is a bare number:
    not part of a name but a value split by a decimal comma, so the columns after it are shifted."""
    if name is None or len(line.split(",")) <= ncols:
        return False
    return any(re.fullmatch(r"[-+]?\d+(\.\d+)?\s*[A-Za-z%]*", part.strip()) for part in name.split(",")[1:])


def _is_gpu_line(line: str) -> bool:
    """A line that is meant as a GPU row (an index first, a GPU UUID in it), not a warning printed around them."""
    cells = [c.strip() for c in line.split(",")]
    return len(cells) > 2 and cells[0].isdigit() and any(c.startswith(("GPU-", "MIG-")) for c in cells)


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
    where warnings are the lines that were not data (e.g. a lost-GPU message).  Every GPU row is
    validated: its column count, and the number and unit of each field ckptfix reads; a row that does not
    fit is refused, naming the field (a decimal comma from a comma locale is named as such).

    Raises:
        GpuOutputError: a GPU row does not parse (exit code 28).
    """
    columns, rows, junk = _parse_csv_lines(text, fields, free_text="name")
    gpus: list[SmiGpu] = []
    warnings: list[str] = []
    for line in junk:
        if _is_gpu_line(line):
            raise _refuse_row(columns, line, None)
        warnings.append(line)
    for line, cells in rows:
        row = dict(zip(columns, cells, strict=True))
        if not _looks_like_gpu_row(row):
            warnings.append(", ".join(cells))
            continue
        if _row_errors(columns, cells) or _name_absorbed_a_number(row.get("name"), line, len(columns)):
            raise _refuse_row(columns, line, cells)
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
    """``"8.0"`` as ``(8, 0)``; anything else None."""
    m = re.match(r"^\s*(\d+)\.(\d+)\s*$", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_apps_csv(text: str, fields: Sequence[str] = APP_FIELDS) -> tuple[list[GpuProcess], list[str]]:
    """Parse ``--query-compute-apps`` output.  A header alone (or nothing) means no processes.

    Returns:
        ``(processes, warnings)``: warnings are the lines that were not process rows.
    """
    columns, rows, junk = parse_csv(text, fields, free_text="process_name", aliases=_APP_ALIASES)
    procs: list[GpuProcess] = []
    warnings = list(junk)
    for cells in rows:
        row = dict(zip(columns, cells, strict=True))
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


#: compiled on first use (re's cache): ``nvidia-smi -L`` runs only where a GPU has MIG enabled
_L_GPU = r"^\s*GPU\s+(\d+)\s*:\s*(.*?)\s*\(UUID:\s*(GPU-[^)\s]+)\s*\)"
_L_MIG = r"^\s*MIG\s+(\S+)\s+Device\s+(\d+)\s*:\s*\(UUID:\s*(MIG-[^)\s]+)\s*\)"


def parse_list(text: str) -> tuple[list[tuple[int, str, str]], list[MigDevice], list[str]]:
    """Parse ``nvidia-smi -L``: ``([(index, name, uuid)], [MigDevice], junk_lines)``.

    Whitespace-tolerant (real output pads MIG lines; rendered docs do not).

    Returns:
        ``(gpus, mig_devices, junk)``; each MIG device belongs to the GPU line above it.
    """
    gpus: list[tuple[int, str, str]] = []
    migs: list[MigDevice] = []
    junk: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = re.match(_L_GPU, line)
        if m:
            gpus.append((int(m.group(1)), m.group(2), m.group(3)))
            continue
        m = re.match(_L_MIG, line)
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


def first_lines(text: str, n: int = 2) -> str:
    """The first lines of some output, for an error message."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " / ".join(lines[:n])


def classify_failure(returncode: int, stdout: str, stderr: str = "") -> CkptfixError | None:
    """Map a failed (or empty) nvidia-smi run to the error a user should see, or None if unknown.

    Recognised: driver not loaded (rc 9), driver/library mismatch (rc 18), no
    devices (rc 6 / "No devices were found" / "No supported GPUs", rc 255),
    insufficient permissions (rc 4).

    Returns:
        The error to raise (with its fix), or ``None`` when the failure is not one of these.
    """
    text = f"{stdout}\n{stderr}"
    low = text.lower()
    if (
        "couldn't communicate with the nvidia driver" in low
        or "could not communicate with the nvidia driver" in low
        or returncode == 9
    ):
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
            f"the NVIDIA driver is loaded but reports no GPU ({first_lines(text) or f'rc {returncode}'}): "
            "check `dmesg` for the failed device or the GPUs granted to this container; otherwise run on CPU"
        )
    if "insufficient permissions" in low or returncode == 4:
        return GpuQueryError(
            "nvidia-smi: insufficient permissions to query the GPUs: run as a user allowed to access /dev/nvidia*"
        )
    return None
