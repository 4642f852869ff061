"""Plain-text helpers shared by the library's reports and the CLI: tables and human sizes.  Pure, no click.

>>> print(table([["cuda:0", "H200"]], ["cuda", "name"]))
cuda    name
cuda:0  H200
>>> human_bytes(1536), gib(2048)
('1.5 KiB', '2.0')
"""

from __future__ import annotations

import re
from typing import Sequence

__all__ = ["table", "human_bytes", "gib", "parse_size"]


def human_bytes(n: int | float | None) -> str:
    """A byte count in binary units (``1536 -> "1.5 KiB"``, ``None -> "-"``).

    Args:
        n: bytes, or ``None`` for unknown.

    Returns:
        Whole bytes below 1 KiB, else one decimal in KiB, MiB, GiB or TiB.
    """
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def gib(mib: int | None) -> str:
    """MiB as GiB with one decimal, without unit (``2048 -> "2.0"``); ``None -> "-"``.

    Args:
        mib: a size in MiB, or ``None`` for unknown.
    """
    return "-" if mib is None else f"{mib / 1024:.1f}"


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A plain left-aligned text table, columns two spaces apart, no trailing blanks.

    Args:
        rows: the cells (printed with ``str``), one sequence per row, as many as ``header``.
        header: the column titles.
    """
    cols: list[Sequence[object]] = [header, *rows]
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=False)).rstrip()]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip())
    return "\n".join(lines)


#: the one size grammar of every option that takes a size: KB/MB/GB/TB (and K/M/G/T) are decimal, as disks and
#: Hugging Face's ``max_shard_size`` count; KiB/MiB/GiB/TiB binary
_UNITS = {
    "B": 1,
    **{p + s: 10 ** (3 * i) for i, p in enumerate("KMGT", 1) for s in ("", "B")},
    **{p + "IB": 2 ** (10 * i) for i, p in enumerate("KMGT", 1)},
}

#: what a size's error message shows
SIZE_HELP = "5GB = 5*10^9 bytes, 2GiB = 2*2^30 bytes"


def parse_size(text: str | int | float, *, bare: int = 1, minimum: int = 1) -> int:
    """A size in bytes: ``"5GB"`` -> 5_000_000_000, ``"2GiB"`` -> 2_147_483_648; a bare number is ``bare`` bytes each.

    Args:
        text: a number with an optional unit (B, KB, MB, GB, TB or K, M, G, T: decimal; KiB, MiB, GiB, TiB:
            binary; case-insensitive), or a number.
        bare: the unit of a number without one (1: bytes, as ``--max-shard-size`` reads it).
        minimum: the smallest size accepted.

    Raises:
        ValueError: not a size, or under ``minimum``.

    >>> parse_size("5GB"), parse_size("2MiB"), parse_size(512), parse_size("24", bare=2**30)
    (5000000000, 2097152, 512, 25769803776)
    """
    if isinstance(text, (int, float)):
        n = int(text * bare)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
        unit = m.group(2).upper() if m else ""
        if not m or (unit and unit not in _UNITS):
            raise ValueError(f"cannot read size {text!r}; write it like 5GB, 500MB, 2GiB ({SIZE_HELP})")
        n = int(float(m.group(1)) * (_UNITS[unit] if unit else bare))
    if n < minimum:
        raise ValueError(f"size {text!r} must be at least {minimum} bytes")
    return n
